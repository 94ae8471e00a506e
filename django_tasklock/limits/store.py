"""A rate limit's state in the lock store: one item per limit id.

A store that runs scripts (Redis: ``LockBackend.scripts``) runs each
kind's Lua script (one round trip, on the store's own clock). Every other store
(memcached's meta and classic protocols, pylibmc, LocMem) reads the item and
writes it back only if nobody changed it in between: ``peek``, then
``add`` when it is absent or ``replace`` (a compare-and-swap on its CAS id)
when present, on the client's wall clock. A write that loses the race reads
again; each loss means another process's admission went through.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from .kinds import LUA_NOW, Verdict

if TYPE_CHECKING:
    from ..backends.aio.base import AsyncBackend
    from ..backends.base import LockBackend
    from .kinds import Kind

__all__ = ["KeptChanging", "aadmit", "admit", "pause", "read", "reset"]

#: Compare-and-swap rounds before an admission gives up: each lost round is
#: another process's admission, so this many means a store that keeps changing
#: the item for some other reason.
MAX_ROUNDS = 1000

# Pause a limit of either kind: its second field is the time admissions resume.
_PAUSE = (
    """
local until_ms, period, tag = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
"""
    + LUA_NOW
    + """local state = redis.call("get", KEYS[1])
local fields = {}
if state then
    for field in string.gmatch(state, "%S+") do fields[#fields + 1] = field end
    if fields[1] ~= tag or not tonumber(fields[2]) then
        return redis.error_reply("the rate limit's key " .. KEYS[1] .. " holds " ..
            "something that is not its state; some other code wrote to it. " ..
            "Delete the key (the limit starts again empty)")
    end
else
    fields = {tag, "0"}
    if tag == "s" then fields[3] = tostring(now) end
end
local resume = now + until_ms
if tonumber(fields[2]) > resume then resume = tonumber(fields[2]) end
fields[2] = string.format("%d", resume)
local ttl = redis.call("pttl", KEYS[1])
local wanted = resume - now + period + 1000
if ttl > wanted then wanted = ttl end
redis.call("set", KEYS[1], table.concat(fields, " "), "PX", wanted)
return resume - now
"""
)


#: Milliseconds every rate limit's clock is moved forward by: the client's
#: and, in Lua, the store's. 0 but in a test that moves its clock
#: (``django_tasklock.testing``: ``Isolation.advance``); never set otherwise.
shift_ms = 0

# The scripts with the store's clock moved by their last argument, by text.
_shifted: dict[str, str] = {}


def now_ms() -> int:
    """The client's wall clock in whole milliseconds (shared across hosts)."""
    return time.time_ns() // 1_000_000 + shift_ms


def _script(lua: str, args: tuple[object, ...]) -> tuple[str, tuple[object, ...]]:
    """``lua`` and its arguments, or, while a test moves the clock, the same
    script reading the store's clock moved by a last argument."""
    if not shift_ms:
        return lua, args
    shifted = _shifted.get(lua)
    if shifted is None:
        moved = LUA_NOW + "now = now + tonumber(ARGV[#ARGV])\n"
        shifted = _shifted[lua] = lua.replace(LUA_NOW, moved)
    return shifted, (*args, shift_ms)


def admit(backend: LockBackend, key: str, kind: Kind) -> Verdict:
    """One admission; raises ``backend.errors`` (and ValueError for a key that
    holds something else)."""
    scripts = backend.scripts
    if scripts is not None:
        lua, args = _script(kind.lua, kind.args())
        return _scripted(scripts.script(lua, (key,), *args))
    for _ in range(MAX_ROUNDS):
        peek = backend.peek(key)
        verdict = kind.decide(None if peek is None else peek.value, now_ms())
        if verdict.state is None:
            return verdict
        if peek is None:
            written = backend.acquire(key, verdict.state, verdict.ttl)
        else:
            written = backend.replace(
                key, peek.hold, peek.value, verdict.state, verdict.ttl
            )
        if written is not None:
            return verdict
    raise _kept_changing(key)


async def aadmit(store: AsyncBackend, key: str, kind: Kind) -> Verdict:
    """``admit``, awaited on the loop's async backend ``store``: the script, or
    the read and compare-and-swap rounds, are its round trips."""
    if store.sync.scripts is not None:
        lua, args = _script(kind.lua, kind.args())
        return _scripted(await store.script(lua, (key,), *args))
    for _ in range(MAX_ROUNDS):
        peek = await store.peek(key)
        verdict = kind.decide(None if peek is None else peek.value, now_ms())
        if verdict.state is None:
            return verdict
        if peek is None:
            written = await store.acquire(key, verdict.state, verdict.ttl)
        else:
            written = await store.replace(
                key, peek.hold, peek.value, verdict.state, verdict.ttl
            )
        if written is not None:
            return verdict
    raise _kept_changing(key)


def _scripted(reply: Any) -> Verdict:
    """The verdict a kind's Lua script answered."""
    admitted, at, retry_ms, paused = reply
    return Verdict(bool(admitted), int(at), int(retry_ms) / 1000, None, 0, bool(paused))


class KeptChanging(Exception):
    """A rate limit's item changed under every one of ``MAX_ROUNDS`` tries in
    a row (other writers' contention, or other code writing to it): the
    limiter reports it as the store's failure, a ``LockBackendError``."""


def _kept_changing(key: str) -> KeptChanging:
    return KeptChanging(
        f"the rate limit's item {key!r} changed under {MAX_ROUNDS} admissions in a "
        "row without one going through"
    )


def pause(backend: LockBackend, key: str, kind: Kind, seconds: float) -> float:
    """Stop admissions for ``seconds`` (a longer pause already set stays);
    the seconds until admissions resume."""
    scripts = backend.scripts
    if scripts is not None:
        lua, args = _script(_PAUSE, (round(seconds * 1000), kind.period, kind.tag))
        left = scripts.script(lua, (key,), *args)
        return int(left) / 1000
    for _ in range(MAX_ROUNDS):
        peek = backend.peek(key)
        now = now_ms()
        state, ttl = kind.pause(None if peek is None else peek.value, now, seconds)
        if peek is None:
            written = backend.acquire(key, state, ttl)
        else:
            written = backend.replace(key, peek.hold, peek.value, state, ttl)
        if written is not None:
            return (kind.parse(state)[0] - now) / 1000
    raise KeptChanging(f"the rate limit's item {key!r} kept changing under a pause")


def read(backend: LockBackend, key: str) -> tuple[object, int] | None:
    """The stored state and the clock to judge it by (ms); None if none."""
    scripts = backend.scripts
    if scripts is not None:
        raw = scripts.raw(key)
        if raw is None:
            return None
        seconds, micro = scripts.script("return redis.call('time')", (key,))
        return raw, int(seconds) * 1000 + int(micro) // 1000 + shift_ms
    peek = backend.peek(key)
    return None if peek is None else (peek.value, now_ms())


def reset(backend: LockBackend, key: str) -> bool:
    """Forget the limit's state (its admissions and any pause); True if it had one."""
    scripts = backend.scripts
    if scripts is not None:
        return bool(scripts.script("return redis.call('del', KEYS[1])", (key,)))
    peek = backend.peek(key)
    if peek is None:
        return False
    return backend.release(key, peek.hold, peek.value)
