"""Park and promote: ``@single_instance(on_contention="park")``.

A call that finds every slot of its lock taken (one, or ``limit=N``) is not
dropped, retried blindly nor left holding a worker: it is *parked*. Its
message is stored beside the lock, its id joins the end of the lock's park
line (at most ``park=M`` long), and the worker moves on. When a run of that
lock ends it *promotes* the head of the line: the parked message is sent to
the broker again, with the same task id, so the caller's ``AsyncResult``
gets the result of the run it asked for.

Everything the line knows is one item in the lock's own store, changed only
by a compare-and-set (``peek`` then ``replace``/``acquire``/``release`` on
the item read): the parked calls in arrival order, the calls promoted and
not yet started, the calls started, and the ids of calls that ended. So:

- **at most N run at once**: runs hold the lock's slots as every mode's do
  (crash recovery included); the line only decides who is sent;
- **a call runs once**: a delivery starts only by moving its id from parked
  or promoted to started in one compare-and-set, and a delivery whose id
  ended is dropped;
- **a parked call is never lost**: its message is deleted only when it
  starts, or when it is told it was dropped; a promoted call that does not
  start within ``PROMOTE_GRACE`` goes back to the head, and a sweep in every
  worker promotes whenever a slot is free and calls are parked (the slot of
  a dead holder frees within the crash-recovery time, as for any lock).

The order is the order of arrival among the calls that parked; a call that
arrives while calls are parked or promoted parks behind them even if it
found a slot, so none is overtaken by newcomers. Under races (a slot freed
by crash recovery, two sweeps) a promoted call may find no slot: it goes
back to the head of the line.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, TypeVar

from .calls import store, store_error
from .exceptions import LockBackendError
from .locks import Lock
from .semaphores import Semaphore, slot_id

if TYPE_CHECKING:
    from collections.abc import Callable

    from .backends import LockBackend

__all__ = [
    "DECLARED",
    "PARKED_SUFFIX",
    "PROMOTE_GRACE",
    "REGISTRY_ID",
    "Line",
    "ParkLine",
    "Registry",
    "Verdict",
]

logger = logging.getLogger(__name__)

#: Appended to a lock id for its park line's item; the message of a parked
#: call is under ``<lock id>-parked:<task id>``.
PARKED_SUFFIX: Final = "-parked"
#: The item that lists every lock id with a park line in a store (what the
#: workers' sweeps look at).
REGISTRY_ID: Final = "tasklock-park-lines"
#: The CACHES aliases of the parking tasks declared in this process (None:
#: ``TASKLOCK["CACHE"]``): the stores whose park lines its worker sweeps and
#: its console lists.
DECLARED: set[str | None] = set()
#: How long a promoted call may take to start before a sweep puts it back
#: at the head of its line (its message sent again; a copy that starts
#: later finds the call started or ended, and is dropped).
PROMOTE_GRACE: Final = 60.0
#: How many ended calls' ids a line keeps at most (copies of their messages
#: are dropped), beyond those ended within the line's life.
_DONE_KEPT: Final = 1000
#: Compare-and-set tries before a change of a line gives up (a store error).
_TRIES: Final = 100

T = TypeVar("T")


class Verdict:
    """What a delivery of a call of a parking lock does (``ParkLine.start``)."""

    RUN: Final = "run"  # run it: it started (or it is not the line's)
    PARK: Final = "park"  # park it behind the calls waiting
    DROP: Final = "drop"  # a copy of a call that started or ended


@dataclass
class Line:
    """The state of one park line, as stored (JSON)."""

    #: Parked calls in arrival order: ``[task id, parked at, ticket, the id
    #: of the call that left the full line for it ("" if none)]``.
    parked: list[list[Any]] = field(default_factory=list)
    #: Promoted calls not started yet: task id -> ``[promoted at, by]``.
    promoted: dict[str, list[Any]] = field(default_factory=dict)
    #: Started calls of the line: task id -> the token of the slot it holds.
    running: dict[str, str] = field(default_factory=dict)
    #: Calls of the line that ended (or were dropped): task id -> at.
    done: dict[str, float] = field(default_factory=dict)
    #: How many calls joined the end of the line so far: a call's ticket,
    #: its place in arrival order.
    tickets: int = 0

    @classmethod
    def load(cls, value: object) -> Line:
        if value is None:
            return cls()
        data = _loads(value)
        return cls(data["q"], data["p"], data["r"], data["d"], data["n"])

    def dump(self) -> str:
        data: dict[str, Any] = {"q": self.parked, "p": self.promoted}
        data.update(r=self.running, d=self.done, n=self.tickets)
        return json.dumps(data, separators=(",", ":"))

    @property
    def waiting(self) -> bool:
        """Whether calls are parked or promoted: a newcomer parks behind them."""
        return bool(self.parked or self.promoted)

    def ids(self) -> list[str]:
        return [entry[0] for entry in self.parked]

    def leave(self, call_id: str) -> None:
        """``call_id`` no longer parked nor promoted."""
        self.promoted.pop(call_id, None)
        self.parked = [e for e in self.parked if e[0] != call_id]

    def end(self, call_id: str, now: float, life: float) -> None:
        """``call_id`` ended (or left): kept among the ended, the oldest of
        those forgotten past the line's life or ``_DONE_KEPT``."""
        self.running.pop(call_id, None)
        self.leave(call_id)
        self.done[call_id] = now
        kept = sorted(self.done.items(), key=lambda item: item[1])
        kept = [(c, at) for c, at in kept if at > now - life][-_DONE_KEPT:]
        self.done = dict(kept)


def _change(
    cache: str | None,
    lock_id: str,
    life: float,
    doing: str,
    change: Callable[[object], tuple[str | None, T]],
) -> T:
    """Apply ``change`` to the item of ``lock_id`` as stored (its value, None
    where there is none), atomically: it gives the new value (None: leave
    it) and what to return. Tried again on the item as changed by another
    process meanwhile. Raises ``LockBackendError``."""
    backend, _alias = store(cache)
    key = backend.keys_for(lock_id)[0]
    try:
        for _ in range(_TRIES):
            peek = backend.peek(key)
            text, result = change(None if peek is None else peek.value)
            if text is None:
                return result
            if peek is None:
                if backend.acquire(key, text, life) is not None:
                    return result
            elif backend.replace(key, peek.hold, peek.value, text, life) is not None:
                return result
    except backend.errors as exc:
        raise store_error(backend, lock_id, doing, exc) from exc
    raise LockBackendError(
        f"Could not {doing}: its item changed under each of {_TRIES} tries",
        lock_id=lock_id,
        store=backend.describe(key),
    )


class Registry:
    """The lock ids with a park line in the store of ``cache``, each with its
    limit and its line's life: what the workers' sweeps look at."""

    #: How long the list lasts without a change.
    LIFE: Final = 30 * 86400

    def __init__(self, cache: str | None) -> None:
        self.cache = cache

    def read(self) -> dict[str, list[float]]:
        return _change(
            self.cache,
            REGISTRY_ID,
            self.LIFE,
            "read the park lines",
            lambda value: (None, _loads(value)),
        )

    def add(self, lock_id: str, limit: int, life: float) -> None:
        def add(value: object) -> tuple[str | None, None]:
            lines = _loads(value)
            if lines.get(lock_id) == [limit, life]:
                return None, None
            lines[lock_id] = [limit, life]
            return _dumps(lines), None

        _change(self.cache, REGISTRY_ID, self.LIFE, "list a park line", add)

    def remove(self, lock_id: str) -> None:
        def remove(value: object) -> tuple[str | None, None]:
            lines = _loads(value)
            return (_dumps(lines) if lines.pop(lock_id, None) else None), None

        _change(self.cache, REGISTRY_ID, self.LIFE, "unlist a park line", remove)


def _loads(value: object) -> dict[str, Any]:
    if value is None:
        return {}
    loaded: dict[str, Any] = json.loads(value if isinstance(value, str) else str(value))
    return loaded


def _dumps(data: object) -> str:
    return json.dumps(data, separators=(",", ":"))


class ParkLine:
    """The park line of ``lock_id`` in the store of ``cache``: each method
    one compare-and-set of its item, read through this thread's backend.
    Raises ``LockBackendError`` where the store cannot answer."""

    def __init__(self, lock_id: str, cache: str | None, life: float) -> None:
        self.lock_id, self.cache, self.life = lock_id, cache, max(life, 1.0)

    def _backend(self) -> tuple[LockBackend, str]:
        backend, _alias = store(self.cache)
        return backend, backend.keys_for(self.lock_id + PARKED_SUFFIX)[0]

    def _message_key(self, backend: LockBackend, call_id: str) -> str:
        return backend.keys_for(f"{self.lock_id}{PARKED_SUFFIX}:{call_id}")[0]

    def read(self) -> Line:
        return self.change("read its park line", lambda line: (False, line))

    def change(self, doing: str, change: Callable[[Line], tuple[bool, T]]) -> T:
        """Apply ``change`` to the line as stored, atomically: it edits the
        line in place and says whether to write it, and what to return."""

        def edit(value: object) -> tuple[str | None, T]:
            line = Line.load(value)
            write, result = change(line)
            return (line.dump() if write else None), result

        return _change(self.cache, self.lock_id + PARKED_SUFFIX, self.life, doing, edit)

    # -- the messages of parked calls -------------------------------------------------

    def keep_message(self, call_id: str, message: str) -> None:
        """Keep the message of ``call_id`` for the line's life; one kept
        before (the call parked, was promoted, and parks again) stays."""
        backend, _key = self._backend()
        key = self._message_key(backend, call_id)
        try:
            backend.acquire(key, message, self.life)
        except backend.errors as exc:
            raise store_error(backend, self.lock_id, "park the call", exc) from exc

    def message(self, call_id: str) -> str | None:
        backend, _key = self._backend()
        key = self._message_key(backend, call_id)
        try:
            peek = backend.peek(key)
        except backend.errors as exc:
            raise store_error(backend, self.lock_id, "read a parked call", exc) from exc
        return None if peek is None else str(peek.value)

    def forget_message(self, call_id: str) -> None:
        backend, _key = self._backend()
        key = self._message_key(backend, call_id)
        try:
            peek = backend.peek(key)
            if peek is not None:
                backend.release(key, peek.hold, peek.value)
        except backend.errors:
            logger.exception(
                "Could not delete parked call %s of %r", call_id, self.lock_id
            )

    # -- the steps of a call --------------------------------------------------------
    #
    # Each change is written so that applying it again to the line it wrote
    # changes nothing and answers the same: a store may report a write it
    # made as not made (memcached's classic protocol reads the item back
    # after its ``cas``, and another process may have changed it by then),
    # and the change is then tried again on the line as it is now.

    def start(self, call_id: str, token: str, alive: Callable[[str], bool]) -> str:
        """A delivery of ``call_id`` holds a slot (``token``): run it, park it
        behind the calls waiting, or drop it as a copy (a ``Verdict``).
        ``alive(token)``: whether a started run of it still holds its slot
        (a copy delivered while it runs is dropped; after its run died, the
        copy runs it again, as Celery's ``acks_late`` would)."""

        def decide(line: Line) -> tuple[bool, str]:
            if call_id in line.done:
                return False, Verdict.DROP
            if call_id in line.running:
                started = line.running[call_id]
                if started == token:
                    return False, Verdict.RUN  # (this very change, written)
                if alive(started):
                    return False, Verdict.DROP
                line.running[call_id] = token
                return True, Verdict.RUN
            if call_id in line.promoted or call_id in line.ids():
                line.leave(call_id)
                line.running[call_id] = token
                return True, Verdict.RUN
            return False, Verdict.PARK if line.waiting else Verdict.RUN

        return self.change("start a parked call", decide)

    def park(
        self, call_id: str, limit: int, full: str, at_head: bool
    ) -> tuple[str, int] | None:
        """Put ``call_id`` in the line (its message kept before): at the end,
        or back at the head (``at_head``: a promoted call that found no slot).
        Where the line holds ``limit`` calls, ``full`` says who leaves:
        ``"refuse"`` this call (``ParkFull`` is the caller's), ``"drop_oldest"``
        the head, ``"replace"`` the youngest parked. Returns the id of the
        call that left ("" where none did; this call's own where refused) and
        this call's ticket (0 back at the head); None if this call started or
        ended meanwhile (a copy: dropped)."""
        now = time.time()

        def join(line: Line) -> tuple[bool, tuple[str, int] | None]:
            if call_id in line.done or call_id in line.running:
                return False, None
            if at_head:
                if line.parked[:1] and line.parked[0][0] == call_id:
                    return False, ("", 0)
                line.leave(call_id)
                line.parked.insert(0, [call_id, now, 0, ""])
                return True, ("", 0)
            for entry in line.parked:
                if entry[0] == call_id:  # parked before: by this very change
                    return False, (entry[3], entry[2])
            if call_id in line.promoted:
                return False, ("", 0)  # promoted meanwhile: sent, not lost
            left = ""
            if len(line.parked) >= limit:
                if full == "refuse":
                    return False, (call_id, 0)
                left = line.parked.pop(0 if full == "drop_oldest" else -1)[0]
                line.end(left, now, self.life)
            line.tickets += 1
            line.parked.append([call_id, now, line.tickets, left])
            return True, (left, line.tickets)

        return self.change("park the call", join)

    def ended(self, call_id: str) -> tuple[bool, bool]:
        """``call_id`` ended (its run, or its stay in the line): whether it
        was the line's (a call that never parked: nothing written), and
        whether calls wait in the line (parked or promoted) now."""
        now = time.time()

        def end(line: Line) -> tuple[bool, tuple[bool, bool]]:
            if call_id in line.done:
                return False, (True, line.waiting)
            ours = (
                call_id in line.running
                or call_id in line.promoted
                or call_id in line.ids()
            )
            if ours:
                line.end(call_id, now, self.life)
            return ours, (ours, line.waiting)

        return self.change("end a parked call", end)

    def promote(self, free: int) -> list[str]:
        """Move as many parked calls to promoted as ``free`` slots exceed the
        calls already promoted (first those promoted in vain for longer than
        ``PROMOTE_GRACE``, back at the head); the ids to send."""
        now = time.time()
        promoter = secrets.token_hex(6)

        def pick(line: Line) -> tuple[bool, list[str]]:
            mine = [c for c, (_at, by) in line.promoted.items() if by == promoter]
            if mine:
                return False, mine  # (this very change, written)
            stale = [
                c for c, (at, _by) in line.promoted.items() if at < now - PROMOTE_GRACE
            ]
            for call_id in reversed(stale):
                del line.promoted[call_id]
                line.parked.insert(0, [call_id, now, 0, ""])
            room = max(0, free - len(line.promoted))
            chosen = [entry[0] for entry in line.parked[:room]]
            if not chosen and not stale:
                return False, []
            line.parked = line.parked[len(chosen) :]
            line.promoted.update((call_id, [now, promoter]) for call_id in chosen)
            return True, chosen

        return self.change("promote a parked call", pick)

    def forget_dead_runs(self, held: Callable[[], list[object | None]]) -> int:
        """End the started calls whose slot is no longer theirs (a run that
        died, whose message was not delivered again): how many. ``held()``
        reads what the slots hold, once per try, and only where calls run."""
        now = time.time()

        def sweep(line: Line) -> tuple[bool, int]:
            if not line.running:
                return False, 0
            holding = set(held())
            dead = [c for c, token in line.running.items() if token not in holding]
            for call_id in dead:
                line.end(call_id, now, self.life)
            return bool(dead), len(dead)

        return self.change("sweep a park line", sweep)

    # -- the slots, and sending the next calls ----------------------------------------

    def held(self, limit: int) -> Callable[[], list[object | None]]:
        """A reader of what the ``limit`` slots of the lock hold now (one
        read each call, their keys made at the first; a store error raises
        ``LockBackendError``)."""
        lock_id = self.lock_id
        found: list[tuple[LockBackend, list[str]]] = []

        def read() -> list[object | None]:
            if not found:
                backend, _key = self._backend()
                ids = (
                    [lock_id]
                    if limit == 1
                    else [slot_id(lock_id, s) for s in range(limit)]
                )
                found.append((backend, [backend.keys_for(i)[0] for i in ids]))
            backend, keys = found[0]
            try:
                return backend.values_many(keys)
            except backend.errors as exc:
                raise store_error(backend, lock_id, "read its slots", exc) from exc

        return read

    def alive(self, limit: int) -> Callable[[str], bool]:
        """``alive(token)``: whether a slot of the lock still holds ``token``
        (one read of the slots, made only when asked)."""
        held = self.held(limit)
        return lambda token: token in held()

    def sweep(self, limit: int, send: Callable[[str, str], None]) -> int:
        """What a worker's sweep does for this line: the started calls whose
        run died ended, then ``kick``. How many were sent."""
        self.forget_dead_runs(self.held(limit))
        return self.kick(limit, send)

    def kick(self, limit: int, send: Callable[[str, str], None]) -> int:
        """Send as many parked calls as slots are free beyond those promoted:
        the free slots are taken (so a dead holder's is recovered as any
        lock's is), counted and let go, then the heads are promoted and
        ``send(call id, message)`` sends each. How many were sent."""
        taken: list[Lock | Semaphore] = []
        try:
            for _ in range(limit):
                slot: Lock | Semaphore = (
                    Lock(self.lock_id, cache=self.cache, expire=30)
                    if limit == 1
                    else Semaphore(self.lock_id, limit, cache=self.cache, expire=30)
                )
                if not slot.acquire():
                    break
                taken.append(slot)
            chosen = self.promote(len(taken))
        finally:
            for slot in taken:
                slot.release_quietly()
        sent = 0
        for call_id in chosen:
            message = self.message(call_id)
            if message is None:
                logger.error(
                    "Parked call %s of %r has no message left (its item expired "
                    "or was evicted): it is lost",
                    call_id,
                    self.lock_id,
                )
                self.ended(call_id)
                continue
            send(call_id, message)
            sent += 1
        return sent
