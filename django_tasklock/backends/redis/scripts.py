"""The Lua scripts of the Redis stores, as ``Script`` objects: each one's
text and SHA1. A backend runs one by its SHA and sends it whole where the
server lacks it (a restart, a failover, SCRIPT FLUSH): the sync backends
through their client (redis-py's or valkey-py's, ``RedisBackend._script``),
the client for loops with the same commands on its pipelined connection
(``AsyncRedis._run``)."""

from __future__ import annotations

import hashlib

__all__ = [
    "ACQUIRE",
    "ACQUIRE_IN_LINE",
    "EXTEND",
    "FENCE",
    "LEAVE_LINE",
    "PUT_BACK",
    "RELEASE",
    "REPLACE",
    "TAKE_OVER",
    "Script",
    "script_of",
    "wake_key",
]


class Script:
    """A Lua script: ``text`` and its ``sha``."""

    __slots__ = ("sha", "text")

    def __init__(self, text: str) -> None:
        self.text = text
        self.sha = hashlib.sha1(text.encode()).hexdigest()

    def after(self, first: str) -> Script:
        """This script with the Lua ``first`` run before it, in the same step."""
        return Script(first + self.text)


# A lock's waiting line (``locks.line``): the blocking acquires refused it,
# in the order they came, kept beside the lock in its hash slot (every key
# here carries the lock key's hash tag, or the lock key as one). The line is a
# sorted set of waiter ids scored by their arrival (the server's clock, in
# ms); beside it each waiter's ``:alive:`` mark, which the waiter renews with
# every try and which expires soon after a waiter that died; and its
# ``:wake:`` list, which a release pushes to and the waiter blocks on. The
# first waiter whose mark is there has the turn: a free lock is refused to
# everybody else. A waiter that died is passed over once its mark expires.
# The line never decides who holds the lock, only who may take it when free.
_LINE = """
local function line_of(key)
    local open = string.find(key, "{", 1, true)
    if open then
        local close = string.find(key, "}", open + 1, true)
        if close and close > open + 1 then
            return string.sub(key, open, close) .. "tasklock-line:" .. key
        end
    end
    return "{" .. key .. "}tasklock-line"
end
local function head_of(line)
    for _ = 1, 16 do
        local first = redis.call("zrange", line, 0, 0)[1]
        if not first then
            return nil
        end
        if redis.call("exists", line .. ":alive:" .. first) == 1 then
            return first
        end
        redis.call("zrem", line, first)
        redis.call("del", line .. ":wake:" .. first)
    end
    return nil
end
-- Wake the waiter whose turn it is (its own list, on which it blocks).
local function wake_head(line)
    local head = head_of(line)
    if head then
        local wake = line .. ":wake:" .. head
        redis.call("del", wake)
        redis.call("rpush", wake, "1")
        redis.call("pexpire", wake, 10000)
    end
end
"""
# Take the lock, unless a waiter in its line has the turn. One that already
# holds this very token was taken by an earlier run of this script whose
# reply was lost (redis-py retries a command whose connection dropped): it is
# ours, and is renewed rather than refused.
ACQUIRE = Script(
    _LINE
    + """
local held = redis.call("get", KEYS[1])
if held then
    if held ~= ARGV[1] then
        return 0
    end
    redis.call("pexpire", KEYS[1], ARGV[2])
    return 1
end
if head_of(line_of(KEYS[1])) then
    return 0
end
redis.call("set", KEYS[1], ARGV[1], "PX", ARGV[2])
return 1
"""
)
# Put back a live holder's lock a failover lost: as ACQUIRE, the line aside
# (the lock was this holder's all along).
PUT_BACK = Script("""
local held = redis.call("get", KEYS[1])
if held and held ~= ARGV[1] then
    return 0
end
redis.call("set", KEYS[1], ARGV[1], "PX", ARGV[2])
return 1
""")
# A waiter's try (ARGV[3]: its id, ARGV[4]: how long its mark lasts, in ms):
# 1 if it took the lock (and left the line); else it is in the line (added
# in arrival order the first time, its mark renewed) and the reply is minus
# how long to wait at most, in ms, before it tries again: the lock's time
# left, or, the lock free and another waiter's turn, its mark's life.
ACQUIRE_IN_LINE = Script(
    _LINE
    + """
local line = line_of(KEYS[1])
local waiter = ARGV[3]
local held = redis.call("get", KEYS[1])
if held == ARGV[1] then
    redis.call("pexpire", KEYS[1], ARGV[2])
    return 1
end
local head = nil
if not held then
    head = head_of(line)
end
if not held and (head == nil or head == waiter) then
    redis.call("set", KEYS[1], ARGV[1], "PX", ARGV[2])
    redis.call("zrem", line, waiter)
    redis.call("del", line .. ":alive:" .. waiter, line .. ":wake:" .. waiter)
    return 1
end
local clock = redis.call("time")
local now = clock[1] * 1000 + math.floor(clock[2] / 1000)
redis.call("zadd", line, "NX", now, waiter)
redis.call("set", line .. ":alive:" .. waiter, "1", "PX", ARGV[4])
redis.call("pexpire", line, 2 * ARGV[4])
local left = tonumber(ARGV[4])
if held then
    left = redis.call("pttl", KEYS[1])
    if left < 0 then  -- no expiry (written by other code): its mark's life
        left = tonumber(ARGV[4])
    end
end
return -math.max(left, 1)
"""
)
# A waiter that gives up leaves the line; the next one is woken if the lock
# is free (it may have been this one's turn).
LEAVE_LINE = Script(
    _LINE
    + """
local line = line_of(KEYS[1])
redis.call("zrem", line, ARGV[1])
redis.call("del", line .. ":alive:" .. ARGV[1], line .. ":wake:" .. ARGV[1])
if redis.call("exists", KEYS[1]) == 0 then
    wake_head(line)
end
return 1
"""
)
# Draw a fencing token, only while the lock still holds this token; a missing
# counter starts again from the floor: the later of the client's clock when it
# sent the call (ARGV[2], in microseconds) and the server's now, so a client
# paused between reading its clock and sending cannot restart the counter
# below a fence drawn meanwhile.
FENCE = Script("""
if redis.call("get", KEYS[1]) ~= ARGV[1] then
    return false
end
local last = redis.call("get", KEYS[2])
if last and not tonumber(last) then
    return redis.error_reply("the fencing counter " .. KEYS[2] .. " holds something "
        .. "that is not a number; some other code wrote to that key. Delete it (it "
        .. "restarts from the clock); no fence was drawn, and the lock is still held")
end
local fence
if last then
    fence = redis.call("incr", KEYS[2])
else
    local clock = redis.call("time")
    fence = math.max(tonumber(ARGV[2]), clock[1] * 1000000 + clock[2])
    redis.call("set", KEYS[2], string.format("%d", fence))
end
redis.call("expire", KEYS[2], ARGV[3])
return fence
""")
# Release, and wake the waiter whose turn it is now.
RELEASE = Script(
    _LINE
    + """
if redis.call("get", KEYS[1]) ~= ARGV[1] then
    return 0
end
redis.call("del", KEYS[1])
local line = line_of(KEYS[1])
wake_head(line)
return 1
"""
)
EXTEND = Script("""
if redis.call("get", KEYS[1]) == ARGV[1] then
    return redis.call("pexpire", KEYS[1], ARGV[2])
end
return 0
""")
REPLACE = Script("""
if redis.call("get", KEYS[1]) == ARGV[1] then
    redis.call("set", KEYS[1], ARGV[2], "PX", ARGV[3])
    return 1
end
return 0
""")
# Take the lock from the queued call whose mark is ARGV[1], or if free; one that
# holds this very token already was taken by a run whose reply was lost.
TAKE_OVER = Script("""
local held = redis.call("get", KEYS[1])
if held and held ~= ARGV[1] and held ~= ARGV[2] then
    return 0
end
redis.call("set", KEYS[1], ARGV[2], "PX", ARGV[3])
return 1
""")


def wake_key(key: str, waiter: str) -> str:
    """The list ``waiter`` blocks on in the line of the lock at ``key`` (as
    the scripts' ``line_of`` names it: in the lock's hash slot)."""
    open_at = key.find("{")
    if open_at >= 0:
        close_at = key.find("}", open_at + 1)
        if close_at > open_at + 1:
            return f"{key[open_at : close_at + 1]}tasklock-line:{key}:wake:{waiter}"
    return f"{{{key}}}tasklock-line:wake:{waiter}"


#: Other scripts of the package's (rate limits'), by text, made once each.
_made: dict[str, Script] = {}


def script_of(text: str) -> Script:
    """The ``Script`` of the Lua ``text``, made the first time it is asked."""
    made = _made.get(text)
    if made is None:
        if len(_made) >= 256:
            _made.clear()
        made = _made[text] = Script(text)
    return made
