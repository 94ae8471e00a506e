"""The roster: what each process holds, kept in the store so that the admin's
lock console can list held locks without scanning the cache.

A shared production memcached or Redis holds millions of unrelated keys and
neither can list the keys of one kind. So every process that keeps a liveness
record (``liveness``) also keeps one roster slot, ``tasklock-roster:<n>`` for
``n`` below ``SLOTS``, claimed with ``add`` when its record is first written.
The slot holds what the process holds in that store: its locks (semaphore slots
and a worker's call locks included) and the queued marks it published, with
the task name, arguments and task id where they are known. More than ``CHUNK``
entries spill into ``tasklock-roster:<n>:<i>`` items.

What it costs: nothing on an acquire or a release. The liveness thread, once a
beat, reads its slot back (one ``get``) and compares the held locks with those
written last (a set comparison in memory); it rewrites the slot only when they
changed, when the slot nears its expiry (one ``set_many`` of about 150 bytes per
entry, in the round trip that writes the record), or when the slot is no longer
its own: gone (a restarted or flushed store, an eviction) or claimed by another
process since. It then claims a slot again and writes it at that beat, so what
a process holds is listed again within a beat of a restart; a slot another
process took is never written over, nor deleted at exit. Listing costs one
``get_many`` of the ``SLOTS`` slot keys and one of the spilled chunks, however
large the cache.

A slot outlives its process for as long as any lock it lists may: a SIGKILLed
worker's locks stay listed (with their holder judged dead) until they are
taken or expire. A process that exits deletes its slot.
"""

from __future__ import annotations

import json
import logging
import math
import socket
import time
from typing import TYPE_CHECKING, Any, Final, NamedTuple, Protocol

from ..keys import ROSTER_PREFIX, ROSTER_SLOTS

if TYPE_CHECKING:
    from ..backends import LockBackend


class _Record(Protocol):
    """What the roster reads of its process's liveness record
    (``liveness.Record``)."""

    @property
    def bound(self) -> float: ...

    @property
    def held(self) -> dict[int, Any]: ...


__all__ = [
    "CHUNK",
    "ROSTER_PREFIX",
    "SLOTS",
    "Entry",
    "Roster",
    "describe_call",
    "note_run",
    "read_roster",
    "slot_key",
]

logger = logging.getLogger(__name__)

#: How many processes one store's roster lists.
SLOTS: Final = ROSTER_SLOTS
#: Entries per roster item (memcached keeps items up to 1 MB by default).
CHUNK: Final = 2000
#: Queued marks listed per process, at most (the newest).
MARKS: Final = 8000
#: Arguments are shown up to this many characters.
ARGS_SHOWN: Final = 200


def slot_key(slot: int, chunk: int = 0) -> str:
    return f"{ROSTER_PREFIX}{slot}" if chunk == 0 else f"{ROSTER_PREFIX}{slot}:{chunk}"


class Entry(NamedTuple):
    """A lock or mark one process listed, as the roster stores it."""

    #: The lock id, and what it is: ``"lock"``, ``"slot"`` (a semaphore's) or
    #: ``"queued"`` (a mark a ``.delay()`` wrote).
    lock_id: str
    kind: str
    #: The task name (or, for a plain ``Lock``, its id) and its arguments as
    #: ``repr`` shows them ("" when not known).
    task: str
    args: str
    #: The task id of the call, if any.
    call_id: str | None
    #: Wall-clock time (Unix) it was taken or published.
    since: float
    #: True if a heartbeat renews it.
    renews: bool


def _shown(value: object) -> str:
    # An argument's repr() is user code (a model's __str__ may read a deleted
    # row): it may raise, and listing must never fail for it.
    try:
        return repr(value)
    except Exception as exc:
        return f"<{type(value).__name__}: repr() raised {type(exc).__name__}>"


def describe_call(args: Any, kwargs: Any) -> str:
    """A call's arguments as the console shows them, at most ``ARGS_SHOWN``
    characters; never raises for an argument whose ``repr()`` does."""
    parts = [_shown(arg) for arg in args]
    parts += [f"{key}={_shown(value)}" for key, value in dict(kwargs).items()]
    shown = ", ".join(parts)
    if len(shown) > ARGS_SHOWN:
        shown = shown[: ARGS_SHOWN - 1] + "…"
    return shown


def run_about(run: Any) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
    """``(task name, args, kwargs)`` of a run (``runs.Run``), without the
    bound task or context its first argument is."""
    args = run.args[1:] if run.bound and run.args else run.args
    return run.name, args, run.kwargs


def _describe(about: Any) -> tuple[str, str]:
    """(task name, arguments) of a run (``runs.Run``) or a ``(name, args,
    kwargs)`` triple."""
    if about is None:
        return "", ""
    name, args, kwargs = about if isinstance(about, tuple) else run_about(about)
    return name, describe_call(args, kwargs)


def note_run(lock: Any, run: Any) -> None:
    """Note that ``run`` (a ``runs.Run``) took ``lock`` (a ``Lock``; a
    ``Semaphore`` names its slots' run itself), in the roster of the record
    the lock was taken with; nothing when it keeps none (nothing would list
    it). Neither the run nor the lock is kept (a kept Lock would cost every
    later call new allocations), nor an attribute added to the Lock (a dict of
    its own): one tuple, one dict store."""
    acq = getattr(lock, "_acq", None)
    if acq is not None and acq.record is not None:
        # run_about(run), inlined: called, an @single_instance call took
        # 0.2-0.5 % more instructions (make bench-cpu), which that row's
        # 2 % budget has no room for.
        args = run.args[1:] if run.bound and run.args else run.args
        acq.record.roster.runs[id(lock)] = (acq.token, (run.name, args, run.kwargs))


def entry_of(acq: Any, wall_offset: float, runs: dict[int, Any]) -> Entry:
    """The roster entry of a hold (``acquisition.Acquisition``) of this process."""
    lock = acq.lock  # (None once released, meanwhile: listed without its call)
    about = getattr(lock, "about", None)
    if about is None:
        noted = runs.get(id(lock))
        if noted is not None and noted[0] == acq.token:
            about = noted[1]
    task, args = _describe(about)
    slot = getattr(lock, "slot_of", None)
    return Entry(
        lock_id=acq.lock_id,
        kind="lock" if slot is None else "slot",
        task=task or (slot or acq.lock_id),
        args=args,
        # (A semaphore's slot names no call in its token: its run does.)
        call_id=getattr(lock, "call_id", None) or getattr(about, "call_id", None),
        since=acq.acquired_at + wall_offset,
        renews=getattr(lock, "_heartbeat", None) is not None,
    )


class Mark(NamedTuple):
    """A queued mark this process published, listed until it expires."""

    entry: Entry
    #: monotonic: when the store drops it at the latest.
    until: float


class Roster:
    """One process's roster slot in one store (kept by its ``Record``)."""

    def __init__(self, record_id: str, alias: str) -> None:
        self.record_id, self.alias = record_id, alias
        #: The slot claimed (None: none yet; -1: every slot was taken).
        self.slot: int | None = None
        self.chunks = 0
        #: The tokens of the locks written last (by object id), and the marks.
        self.listed: dict[int, str | None] = {}
        self.marks: dict[str, Mark] = {}
        #: What took the locks listed here: ``(token, (task name, args,
        #: kwargs))`` by lock id (``note_run``), forgotten at the first beat
        #: after their release.
        self.runs: dict[int, tuple[str | None, Any]] = {}
        #: How many marks and noted runs were written last.
        self.counts_listed = (0, 0)
        #: Wall clock: when the slot must be written again at the latest.
        self.renew_by = 0.0
        self.full_warned = False
        #: How many times the slot was found gone or taken, and claimed again.
        self.reclaimed = 0

    def note_mark(self, key: str, entry: Entry, life: float) -> None:
        """Remember a mark this process published (listed at the next beat);
        at most ``MARKS`` per process, the oldest dropped first."""
        marks = self.marks
        marks.pop(key, None)
        marks[key] = Mark(entry, time.monotonic() + life)
        if len(marks) > MARKS:
            del marks[next(iter(marks))]

    def beat(self, record: _Record, backend: LockBackend) -> None:
        """Rewrite the slot if what is held changed or it nears its expiry;
        raises ``backend.errors``."""
        now = time.monotonic()
        marks = self.marks
        for key in [key for key, mark in marks.items() if mark.until <= now]:
            del marks[key]
        held = record.held
        wall = time.time()
        # Tokens, not objects: one Lock object may be taken again, and a new
        # one may be made where a released one was.
        tokens = {ident: acq.token for ident, acq in list(held.items())}
        runs = self.runs
        for ident in [ident for ident in runs if ident not in tokens]:
            runs.pop(ident, None)
        if self.slot is not None and self.slot >= 0 and not self._still_ours(backend):
            self._lost_slot()
        if (
            self.slot is not None
            and tokens == self.listed
            and (len(marks), len(runs)) == self.counts_listed
            and wall < self.renew_by
        ):
            return
        if self.slot is None:
            self.slot = self._claim(backend)
        if self.slot < 0:
            return
        holds = list(held.values())
        offset = wall - now
        entries = [entry_of(acq, offset, runs) for acq in holds if acq.hold is not None]
        entries += [mark.entry for mark in marks.values()]
        # As long as any lock it lists may live, at least three records' worth.
        lives = [acq.valid_until - now + 1 for acq in holds]
        lives += [mark.until - now for mark in marks.values()]
        timeout = math.ceil(max([3 * record.bound, *lives]) + record.bound)
        self._write(backend, entries, timeout)
        self.listed = tokens
        self.counts_listed = (len(marks), len(runs))
        self.renew_by = wall + max(timeout - 2 * record.bound, 1.0)

    def _write(self, backend: LockBackend, entries: list[Entry], timeout: int) -> None:
        assert self.slot is not None
        chunks = [entries[i : i + CHUNK] for i in range(0, len(entries), CHUNK)] or [[]]
        head = {
            "record": self.record_id,
            "alias": self.alias,
            "host": socket.gethostname(),
            "chunks": len(chunks),
            "entries": chunks[0],  # (JSON writes an Entry as a list)
        }
        items = {slot_key(self.slot): json.dumps(head, separators=(",", ":"))}
        for i, chunk in enumerate(chunks[1:], start=1):
            items[slot_key(self.slot, i)] = json.dumps(chunk, separators=(",", ":"))
        backend.items.write_many(items, timeout)
        if self.chunks > len(chunks):
            backend.items.delete_many(
                [slot_key(self.slot, i) for i in range(len(chunks), self.chunks)]
            )
        self.chunks = len(chunks)

    def _still_ours(self, backend: LockBackend) -> bool:
        """Whether the store still keeps this process's slot, written by it
        (or claimed and not yet written); raises ``backend.errors``."""
        assert self.slot is not None
        key = slot_key(self.slot)
        head = _load(backend.items.read_many([key]).get(key))
        if not isinstance(head, dict):
            return False
        # ("{}": claimed by this process, whose first write failed.)
        return head.get("record") == self.record_id or (not head and self.chunks == 0)

    def _lost_slot(self) -> None:
        """Forget a slot the store no longer keeps for this process: never
        written again nor deleted (it may be another process's now)."""
        logger.info(
            "Roster slot %s of %r in cache %r was gone or taken (the store "
            "restarted, was flushed or evicted it): listing its locks again",
            self.slot,
            self.record_id,
            self.alias,
        )
        self.slot, self.chunks, self.listed = None, 0, {}
        self.reclaimed += 1

    def _claim(self, backend: LockBackend) -> int:
        """Take a free slot (``add``): the first free one this process sees."""
        taken = backend.items.read_many([slot_key(slot) for slot in range(SLOTS)])
        for slot in range(SLOTS):
            if slot_key(slot) in taken:
                continue
            if backend.items.add(slot_key(slot), "{}", 60):
                return slot
        if not self.full_warned:
            logger.warning(
                "All %d roster slots of this store are taken: the lock console "
                "does not list the locks of process %r",
                SLOTS,
                self.record_id,
            )
            self.full_warned = True
        return -1

    def leave(self, backend: LockBackend) -> None:
        """Delete the slot, if it is still this process's (the process is on
        its way out); raises ``backend.errors``."""
        if self.slot is not None and self.slot >= 0 and self._still_ours(backend):
            backend.items.delete_many(
                [slot_key(self.slot, i) for i in range(max(self.chunks, 1))]
            )
        self.slot, self.listed = None, {}


class Listing(NamedTuple):
    """Every entry a store's roster lists, with its holder."""

    #: ``(record id, host, alias, rows)`` for each process: ``alias`` is the
    #: CACHES alias it wrote through (another alias may name the same store);
    #: each row is an ``Entry``'s fields, in order (made into one by whoever
    #: shows it: a page shows fifty of 100,000).
    entries: list[tuple[str, str, str, list[list[Any]]]]
    #: Whether every slot was in use.
    full: bool


def read_roster(backend: LockBackend) -> Listing:
    """What every process lists in ``backend``'s store: two reads (one round
    trip per server each; the second only if an item spilled); raises
    ``backend.errors``."""
    heads = backend.items.read_many([slot_key(slot) for slot in range(SLOTS)])
    spilled: list[str] = []
    parsed: list[tuple[int, dict[str, Any]]] = []
    for key, text in heads.items():
        head = _load(text)
        if not isinstance(head, dict) or "record" not in head:
            continue  # being claimed
        slot = int(key.removeprefix(ROSTER_PREFIX))
        parsed.append((slot, head))
        spilled += [slot_key(slot, i) for i in range(1, int(head.get("chunks", 1)))]
    more = backend.items.read_many(spilled) if spilled else {}
    entries = []
    for slot, head in parsed:
        rows: list[Any] = list(head.get("entries", []))
        for i in range(1, int(head.get("chunks", 1))):
            rows.extend(_load(more.get(slot_key(slot, i))) or [])
        rows = [row for row in rows if isinstance(row, list) and len(row) == 7]
        record, host, alias = head["record"], head["host"], head.get("alias", "")
        entries.append((record, host, alias, rows))
    return Listing(entries, len(heads) >= SLOTS)


def _load(text: object) -> Any:
    if not isinstance(text, str):
        return None
    try:
        return json.loads(text)
    except ValueError:
        return None
