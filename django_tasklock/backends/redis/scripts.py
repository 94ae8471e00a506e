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
    "EXTEND",
    "FENCE",
    "RELEASE",
    "REPLACE",
    "TAKE_OVER",
    "Script",
    "script_of",
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


# Take the lock. One that already holds this very token was taken by an earlier
# run of this script whose reply was lost (redis-py retries a command whose
# connection dropped): it is ours, and is renewed rather than refused.
ACQUIRE = Script("""
local held = redis.call("get", KEYS[1])
if held then
    if held ~= ARGV[1] then
        return 0
    end
    redis.call("pexpire", KEYS[1], ARGV[2])
    return 1
end
redis.call("set", KEYS[1], ARGV[1], "PX", ARGV[2])
return 1
""")
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
RELEASE = Script("""
if redis.call("get", KEYS[1]) == ARGV[1] then
    return redis.call("del", KEYS[1])
end
return 0
""")
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
