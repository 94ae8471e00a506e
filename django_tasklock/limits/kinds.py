"""The two kinds of rate limit, as pure functions of a stored state and a clock,
and the same algorithms in Lua for Redis, which runs them on its own clock.

Times are whole milliseconds. A state is one short text per limit id:

``window``
    ``"w <paused-until> <t1> <t2> ..."``: the admissions of the last period, oldest
    first. An admission at ``now`` is allowed while fewer than ``count`` of them
    are later than ``now - period``, so any two admissions ``count`` apart are at
    least ``period`` apart: at most ``count`` in any period of that length.
``smooth``
    ``"s <paused-until> <tat>"``: GCRA (the generic cell rate algorithm) with a
    theoretical arrival time ``tat``. Admissions come at one per ``interval``
    (``period / count``) on average, and up to ``burst`` at once after a quiet
    spell: an admission at ``now`` is allowed while ``tat - now <= (burst - 1) *
    interval``, and then ``tat = max(tat, now) + interval``.

A clock that reads earlier than the last admission stored (another host's) is
taken as that admission's time, so the stored times never go back.

Beside a limit's state, ``Turns`` keeps the queue of calls it refused and that
are sent again (``on_limit="retry"``): ``"q 0 <next>"``, the first free turn.
A refused call takes the turn ``max(next, now + retry_after)`` and moves
``next`` one ``period / count`` on, so a backlog is sent again spread at the
limit's pace, in the order it was refused, instead of all for the same moment.
A turn is no admission: the call is admitted (or refused again) when it comes.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, ClassVar, Final, NamedTuple

if TYPE_CHECKING:
    from ..rates import Rate

__all__ = ["KINDS", "LUA_NOW", "Kind", "Smooth", "Turns", "Verdict", "Window"]


def rounding(burst: int, interval: float) -> float:
    """The ms a smooth limit allows over its tolerance for its stored times'
    rounding. They are kept to a thousandth of a ms, each admission rounding
    its theoretical arrival time by up to half of one: a burst within one
    millisecond (the clock's own step) found its last call over by the
    rounding and refused it ("3/20s" admitted 2 of 3). A burst's worth of
    half-thousandths is allowed (``burst`` / 2 microseconds, far below the
    clock's millisecond), never half an interval or more (the Lua script says
    the same)."""
    return min(burst * 0.0005, interval / 2)


#: Lua: ``now``, the store's clock in whole milliseconds, by which every
#: script of a limit judges.
LUA_NOW: Final = """local clock = redis.call("time")
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
"""


class Verdict(NamedTuple):
    """One admission's outcome: ``admitted``; ``at``, the time it was judged at
    (ms); ``retry_after``, seconds until an admission could be allowed (0 when
    admitted); ``state`` to store and its ``ttl`` in seconds (None when refused:
    nothing is written); ``paused``, whether a pause refused it."""

    admitted: bool
    at: int
    retry_after: float
    state: str | None
    ttl: float
    paused: bool = False


class Kind:
    """What a kind of limit stores and decides."""

    name: ClassVar[str]
    tag: ClassVar[str]
    #: The same decision as ``decide`` in Lua, for Redis: KEYS[1] the state's
    #: key; ARGV count, period (ms), burst. Returns {admitted, at, retry_after
    #: (ms), paused}.
    lua: ClassVar[str]

    def __init__(self, rate: Rate, burst: int) -> None:
        self.rate, self.burst = rate, burst
        self.period = round(rate.period * 1000)

    def args(self) -> tuple[float, ...]:
        return self.rate.count, self.period, self.burst

    def parse(self, state: object) -> tuple[int, list[float]]:
        """The pause and the numbers of a stored state; ValueError for another
        kind's or something else's."""
        if not isinstance(state, (str, bytes)):
            raise ValueError(f"not a rate-limit state: {state!r}")
        text = state.decode() if isinstance(state, bytes) else state
        fields = text.split()
        if len(fields) < 2 or fields[0] != self.tag:
            raise ValueError(f"not a {self.name} rate-limit state: {text[:60]!r}")
        return int(fields[1]), [float(field) for field in fields[2:]]

    def decide(self, state: object, now: int) -> Verdict:
        raise NotImplementedError

    def pause(self, state: object, now: int, seconds: float) -> tuple[str, float]:
        """The state with admissions paused until ``now + seconds``, and its ttl."""
        paused, numbers = (0, []) if state is None else self.parse(state)
        until = max(paused, now + math.ceil(seconds * 1000))
        return self.render(until, numbers), self.ttl(until, now, numbers)

    #: How a number of the state is written (whole ms, or ms to the microsecond).
    number: ClassVar[str] = "{:.0f}"

    def render(self, paused: int, numbers: list[float]) -> str:
        return " ".join([self.tag, str(paused), *map(self.number.format, numbers)])

    def ttl(self, paused: int, now: int, numbers: list[float]) -> float:
        """Seconds the state must live: until nothing in it matters any more,
        plus two seconds: memcached's whole second, and one for its clock,
        which ticks once a second and late on a busy server (an item stored
        while a tick is late can go that much early)."""
        last = max([paused, *numbers], default=now)
        return max(last - now, 0) / 1000 + self.period / 1000 + 2

    def describe(self, state: object, now: int) -> dict[str, object]:
        """What ``tasklock status`` shows of a state."""
        raise NotImplementedError


class Window(Kind):
    """At most ``count`` admissions in any period of ``period`` seconds."""

    name = "window"
    tag = "w"
    lua = (
        """
local count, period = tonumber(ARGV[1]), tonumber(ARGV[2])
"""
        + LUA_NOW
        + """local state = redis.call("get", KEYS[1])
local paused, times = 0, {}
if state then
    local fields = {}
    for field in string.gmatch(state, "%S+") do fields[#fields + 1] = field end
    if fields[1] ~= "w" or not tonumber(fields[2]) then
        return redis.error_reply("the rate limit's key " .. KEYS[1] .. " holds " ..
            "something that is not a window state; some other code wrote to it. " ..
            "Delete the key (the limit starts again empty)")
    end
    paused = tonumber(fields[2])
    for i = 3, #fields do times[#times + 1] = tonumber(fields[i]) end
end
if #times > 0 and times[#times] > now then now = times[#times] end
if paused > now then return {0, now, paused - now, 1} end
local kept = {}
for _, t in ipairs(times) do
    if t > now - period then kept[#kept + 1] = t end
end
while #kept > count do table.remove(kept, 1) end
if #kept >= count then
    return {0, now, kept[#kept - count + 1] + period - now, 0}
end
kept[#kept + 1] = now
local parts = {"w", tostring(paused)}
for _, t in ipairs(kept) do parts[#parts + 1] = string.format("%d", t) end
local last = math.max(paused, now)
redis.call("set", KEYS[1], table.concat(parts, " "), "PX", last - now + period + 1000)
return {1, now, 0, 0}
"""
    )

    def decide(self, state: object, now: int) -> Verdict:
        paused, times = (0, []) if state is None else self.parse(state)
        if times and times[-1] > now:
            now = int(times[-1])
        if paused > now:
            return Verdict(False, now, (paused - now) / 1000, None, 0, True)
        count, period = self.rate.count, self.period
        kept = [t for t in times if t > now - period][-count:]
        if len(kept) >= count:
            return Verdict(False, now, (kept[-count] + period - now) / 1000, None, 0)
        kept.append(now)
        return Verdict(
            True, now, 0.0, self.render(paused, kept), self.ttl(paused, now, kept)
        )

    def describe(self, state: object, now: int) -> dict[str, object]:
        paused, times = (0, []) if state is None else self.parse(state)
        if times and times[-1] > now:
            now = int(times[-1])
        recent = [t for t in times if t > now - self.period]
        left = max(self.rate.count - len(recent), 0)
        free_in = 0.0
        if left == 0 and recent:
            free_in = (recent[-self.rate.count] + self.period - now) / 1000
        return {
            "admitted in the last period": len(recent),
            "left in this period": left,
            "next admission in": max(free_in, (paused - now) / 1000, 0.0),
            "paused for": max((paused - now) / 1000, 0.0),
        }


class Smooth(Kind):
    """GCRA: one admission per ``interval`` on average, bursts up to ``burst``."""

    name = "smooth"
    tag = "s"
    number = "{:.3f}"
    lua = (
        """
local count, period, burst = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local interval = period / count
local tolerance = (burst - 1) * interval + math.min(burst * 0.0005, interval / 2)
"""
        + LUA_NOW
        + """local state = redis.call("get", KEYS[1])
local paused, tat = 0, now
if state then
    local fields = {}
    for field in string.gmatch(state, "%S+") do fields[#fields + 1] = field end
    if fields[1] ~= "s" or not tonumber(fields[2]) or not tonumber(fields[3]) then
        return redis.error_reply("the rate limit's key " .. KEYS[1] .. " holds " ..
            "something that is not a smooth state; some other code wrote to it. " ..
            "Delete the key (the limit starts again empty)")
    end
    paused, tat = tonumber(fields[2]), tonumber(fields[3])
    if fields[4] and tonumber(fields[4]) > now then now = tonumber(fields[4]) end
end
if paused > now then return {0, now, paused - now, 1} end
if tat < now then tat = now end
if tat - now > tolerance then
    return {0, now, math.ceil(tat - tolerance - now), 0}
end
tat = tat + interval
local last = math.max(paused, tat)
redis.call("set", KEYS[1], string.format("s %d %.3f %d", paused, tat, now), "PX",
    math.ceil(last - now) + period + 1000)
return {1, now, 0, 0}
"""
    )

    def decide(self, state: object, now: int) -> Verdict:
        paused, numbers = (0, [now]) if state is None else self.parse(state)
        tat = numbers[0] if numbers else now
        # The last admission's time (stored after tat): a clock behind it (a
        # step back, another host's) judges at that time.
        if len(numbers) > 1 and numbers[1] > now:
            now = int(numbers[1])
        if paused > now:
            return Verdict(False, now, (paused - now) / 1000, None, 0, True)
        interval = self.period / self.rate.count
        tolerance = (self.burst - 1) * interval + rounding(self.burst, interval)
        tat = max(tat, now)
        if tat - now > tolerance:
            return Verdict(False, now, math.ceil(tat - tolerance - now) / 1000, None, 0)
        tat += interval
        return Verdict(
            True,
            now,
            0.0,
            self.render(paused, [tat, now]),
            self.ttl(paused, now, [tat]),
        )

    def describe(self, state: object, now: int) -> dict[str, object]:
        paused, numbers = (0, []) if state is None else self.parse(state)
        interval = self.period / self.rate.count
        tat = max(numbers[0] if numbers else now, now)
        tolerance = (self.burst - 1) * interval + rounding(self.burst, interval)
        room = math.floor((tolerance - (tat - now)) / interval) + 1
        return {
            "burst left": max(min(room, self.burst), 0),
            "next admission in": max(
                (tat - tolerance - now) / 1000, (paused - now) / 1000, 0.0
            ),
            "paused for": max((paused - now) / 1000, 0.0),
        }


class Turns(Kind):
    """The turns of refused calls sent again (see the module's docstring):
    ``decide`` always grants one, ``at`` the turn and ``retry_after`` the
    seconds until it."""

    name = "turns"
    tag = "q"
    number = "{:.3f}"
    lua = (
        """
local interval, after = tonumber(ARGV[1]), tonumber(ARGV[2])
"""
        + LUA_NOW
        + """local turn = now + after
local state = redis.call("get", KEYS[1])
if state then
    local fields = {}
    for field in string.gmatch(state, "%S+") do fields[#fields + 1] = field end
    local queued = tonumber(fields[3])
    if fields[1] == "q" and queued and queued > turn then turn = queued end
end
redis.call("set", KEYS[1], string.format("q 0 %.3f", turn + interval), "PX",
    math.ceil(turn + interval - now) + 1000)
return {1, turn, math.ceil(turn - now), 0}
"""
    )

    def __init__(self, rate: Rate, after: float) -> None:
        super().__init__(rate, 1)
        self.interval = self.period / rate.count
        self.after = max(math.ceil(after * 1000), 0)

    def args(self) -> tuple[float, ...]:
        return self.interval, self.after

    def decide(self, state: object, now: int) -> Verdict:
        queued = 0.0
        if state is not None:
            try:
                numbers = self.parse(state)[1]
            except ValueError:
                numbers = []  # not a queue: start one
            queued = numbers[0] if numbers else 0.0
        turn = max(queued, now + self.after)
        nxt = turn + self.interval
        return Verdict(
            True,
            round(turn),
            math.ceil(turn - now) / 1000,
            self.render(0, [nxt]),
            max(nxt - now, 0) / 1000 + 1,
        )

    def describe(self, state: object, now: int) -> dict[str, object]:
        numbers = [] if state is None else self.parse(state)[1]
        return {
            "queue ends in": max((numbers[0] - now) / 1000, 0.0) if numbers else 0.0
        }


#: The kinds by name: ``kind=`` and ``TASKLOCK["RATE_KIND"]``.
KINDS: Final[dict[str, type[Kind]]] = {kind.name: kind for kind in (Window, Smooth)}
