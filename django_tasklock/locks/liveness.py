"""Liveness records: how a contender on another host tells a dead holder from
a paused or busy one.

Every process that takes a lock while ``TASKLOCK['LIVENESS']`` is set keeps a
record, ``tasklock-alive:<host>:<process>``, beside its locks: on each server
of the store it took a lock on (the primary, on Redis), stored for
``LIVENESS`` seconds and written again every tenth of that (at most every
second) by a daemon thread per server, so a server that stalls delays only the
records on it. Its tokens say so (``-s`` after the process identity), so a
contender never judges a holder by a record it never promised to keep (an
older version, ``LIVENESS = None``, or a store that cannot keep records beside
its locks). A contender on another host that meets a held lock reads the record
its token names on the lock's own server, through the lock backend, whose
reads raise on failure: gone means the holder showed no sign of life for
``LIVENESS`` seconds, and its locks are free; a read that fails tells nothing
(see ``recovery``).

What it costs: per process and server it took a lock on, one thread and one
write every ``min(1, LIVENESS / 10)`` seconds, for the life of the process (S
round trips a beat for a pool of S servers); an acquire pays a round trip only
when the record beside its lock is overdue (the first lock of a process on
that server, or a thread that has not run for three periods). The holder
learns of a record that may have lapsed through ``Lock.check()`` (``lost``),
as for a lock whose expiry ran out.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import socket
import threading
import time
from typing import TYPE_CHECKING, Final

from django.core.cache import close_caches
from django.core.signals import setting_changed

from ..backends import backend_for, close_thread_connections
from ..conf import settings
from ..exceptions import LockConfigurationError
from ..keys import RECORD_PREFIX, record_id
from ..tokens import this_process
from .loss import report_lost
from .roster import Entry, Roster

if TYPE_CHECKING:
    from ..backends import LockBackend
    from ..backends.capabilities import KeepsRecords
    from .acquisition import Acquisition

__all__ = [
    "RECORD_PREFIX",
    "Record",
    "Records",
    "forget_records",
    "leave",
    "note_queued",
    "record_beside",
    "record_for",
    "record_id",
]

logger = logging.getLogger(__name__)


class Records:
    """This process's liveness records in the store of one cache alias: one
    ``Record`` per server a lock of it went to, and its roster."""

    def __init__(
        self, alias: str, bound: float, places: list[object], keyed: bool = False
    ) -> None:
        self.alias, self.bound = alias, bound
        #: Whether the store keeps a record beside each lock (a cluster): its
        #: records then tell, per lock, until when the one beside it is sure.
        self.keyed = keyed
        self.id = record_id(socket.gethostname(), this_process())
        #: What this process holds, listed for the lock console (``roster``).
        self.roster = Roster(self.id, alias)
        self._guard = threading.Lock()
        self._stop = threading.Event()
        self._lister: threading.Thread | None = None
        self._trouble = False
        self.at: dict[object, Record] = {}
        #: The record of a store whose locks are all on one server (or one
        #: primary), found without asking the lock's key where it goes.
        self.single: Record | None = None
        #: The record whose thread keeps the roster too.
        self.keeper: Record | None = None
        if places:
            self.keeper = self.beside(places[0])
            if len(places) == 1:
                self.single = self.keeper

    def beside(self, place: object) -> Record:
        """The record at ``place`` (a server of the store), made if new."""
        record = self.at.get(place)
        if record is None:
            with self._guard:
                record = self.at.get(place)
                if record is None:
                    record = self.at[place] = Record(self, place)
        return record

    @property
    def held(self) -> dict[int, Acquisition]:
        """Every lock taken with one of these records, by object id."""
        merged: dict[int, Acquisition] = {}
        for record in list(self.at.values()):
            merged.update(record.held)
        return merged

    def start(self) -> None:
        """Start the keeper's thread (which keeps the roster's running) and
        the roster's, unless they run."""
        if self.keeper is not None:
            self.keeper.start()
            self.start_roster()

    def start_roster(self) -> None:
        """Start the thread that keeps the roster, unless it runs. It is a
        thread of its own: the roster's slot may be on any server of the store,
        and a server that stalls must never hold up a record's renewal on
        another one."""
        with self._guard:
            thread = self._lister
            if (thread is None or not thread.is_alive()) and not self._stop.is_set():
                self._lister = threading.Thread(
                    target=self._list,
                    name=f"tasklock-roster-{self.alias}",
                    daemon=True,
                )
                self._lister.start()

    def _list(self) -> None:
        every = min(1.0, self.bound / 10)
        try:
            while not self._stop.wait(every):
                try:
                    backend = backend_for(self.alias)
                except Exception:  # the alias is gone: the keeper starts us again
                    return
                # Listing is no safety matter: nothing it does stops the beat.
                try:
                    self.roster.beat(self, backend)
                except backend.errors:
                    pass  # the store's trouble: the records' writes tell of it
                except Exception:
                    if not self._trouble:
                        self._trouble = True
                        logger.exception(
                            "Failed listing the locks of %r (logged once)", self.id
                        )
        finally:
            close_thread_connections()
            close_caches()

    def stop(self, *, delete: bool) -> None:
        """Stop renewing; with ``delete``, remove the records and the roster
        slot, so that other hosts judge this process gone at once (it is on
        its way out)."""
        self._stop.set()
        records = list(self.at.values())
        for record in records:
            record.stop()
        with self._guard:
            lister = self._lister
        if lister is not None and lister is not threading.current_thread():
            lister.join(timeout=5)
        if not delete:
            return
        backend = backend_for(self.alias)
        for record in records:
            try:
                kept_by(backend).delete_record(record.place, self.id)
            except backend.errors:
                logger.warning("Could not delete liveness record %r", self.id)
        try:
            self.roster.leave(backend)
        except backend.errors:
            logger.warning("Could not delete the roster slot of %r", self.id)


class Record:
    """This process's liveness record on one server (``place``) of a store:
    written beside the locks it vouches for, so a contender reads it where it
    reads the lock."""

    def __init__(self, records: Records, place: object) -> None:
        self.records, self.place = records, place
        self.alias, self.bound, self.id = records.alias, records.bound, records.id
        self.every = min(1.0, self.bound / 10)
        self.timeout = math.ceil(self.bound)
        #: monotonic: after this, the next acquire writes the record itself.
        self.due = 0.0
        #: monotonic: until then the store is sure to keep the record.
        self.valid_until = 0.0
        #: How many times the record was written.
        self.beats = 0
        #: monotonic: when a write last found the record possibly lapsed.
        self.lapsed_at = 0.0
        #: Where records live beside each lock (a cluster), per lock key: until
        #: when the record beside it is sure, and when a write last found it
        #: possibly lapsed. A write that carries no lock's key (before the
        #: first take, or when none is held) vouches for none, so these, not
        #: ``valid_until`` and ``lapsed_at``, tell of such a store's locks.
        self.by_key: dict[str, tuple[float, float]] | None = (
            {} if records.keyed else None
        )
        self._guard = threading.Lock()
        self._stop = records._stop
        self._thread: threading.Thread | None = None
        self._failing = False
        self._trouble: set[str] = set()
        # The thread's backend (its own connection), as last used.
        self._backend: LockBackend | None = None
        #: The locks taken with this record, by id: put back after a restart
        #: (``reassert``); those no longer held are dropped at the next beat.
        self.held: dict[int, Acquisition] = {}
        #: Those whose put back met another take at the last beat.
        self.met: set[Acquisition] = set()
        self.roster = records.roster

    def write(self, backend: LockBackend) -> None:
        """Write the record now (one round trip, on its server); raises
        ``backend.errors``."""
        sent = time.monotonic()
        before = self.valid_until
        value = f"{time.time():.3f}"
        until = sent + backend.shortest_life(self.timeout)
        beside = backend.records_beside
        if beside is not None:  # a cluster: beside each lock held
            keys = [acq.key for acq in list(self.held.values())]
            beside.write_records_beside(self.id, value, self.timeout, keys)
            self._renewed_beside(keys, until)
        else:
            kept_by(backend).write_record(self.place, self.id, value, self.timeout)
        done = time.monotonic()
        if 0.0 < before <= done:
            # The record may have lapsed before this write reached its server
            # (the process was paused, the server away, or the write slow: a
            # client's own retries, a thread starved after ``sent``): locks
            # taken before now may have been taken from this process, and
            # stay reported lost though the record is back.
            self.lapsed_at = done
        self.valid_until = until
        self.due = sent + 3 * self.every
        self.beats += 1

    def _renewed_beside(self, keys: list[str], until: float) -> None:
        """The record written beside the locks at ``keys``, sure until
        ``until``: each one's that had run out before the write reached it
        may have lapsed (its lock is then reported lost); the keys of locks
        no longer held are forgotten."""
        by_key = self.by_key
        if by_key is None:
            return
        done = time.monotonic()
        with self._guard:
            for key in keys:
                before, lapsed = by_key.get(key, _NEVER_KEPT)
                if 0.0 < before <= done:
                    lapsed = done
                by_key[key] = (max(before, until), lapsed)
            # (A hold is listed before its take is noted here: ``took``.)
            held = {acq.key for acq in list(self.held.values())}
            for key in [key for key in by_key if key not in held]:
                del by_key[key]

    def took(self, key: str, sent_at: float, backend: LockBackend) -> float:
        """A take of the lock at ``key``, sent at ``sent_at``, wrote this
        record beside it in the same step (where records live beside each
        lock): sure from then for the record's life. Returns until when the
        record beside it is sure now (``valid_until`` where the record is one
        per server, and the take wrote none)."""
        by_key = self.by_key
        if by_key is None:
            return self.valid_until
        until = sent_at + backend.shortest_life(self.timeout)
        with self._guard:
            before, lapsed = by_key.get(key, _NEVER_KEPT)
            sure_until = max(before, until)
            by_key[key] = (sure_until, lapsed)
        return sure_until

    def kept_for(self, key: str) -> tuple[float, float]:
        """For the lock at ``key``: until when contenders find the record
        beside it (monotonic), and when a write last found it there possibly
        lapsed (0.0: never); the record's own where it is one per server."""
        by_key = self.by_key
        if by_key is None:
            return self.valid_until, self.lapsed_at
        return by_key.get(key, _NEVER_KEPT)

    def ensure(self, backend: LockBackend) -> bool:
        """Before a lock is taken: the record written and its thread running.
        False if the server would not take the record: the lock is then taken
        with a token that promises none (and so lasts until it expires, as
        without records), and the lock's own command reports the store's
        trouble. Never waits on the thread, whose write may hang on a server
        that stopped answering."""
        self.start()
        if self is not self.records.keeper:
            self.records.start()  # the roster's thread lists this lock
        if time.monotonic() < self.due:
            return True
        try:
            self.write(backend)
        except backend.errors:
            return False
        return True

    def start(self) -> None:
        """Start the thread that writes the record every beat, unless it
        runs."""
        with self._guard:
            thread = self._thread
            # (Again if it stopped: its alias was gone for a while, in tests.)
            if (thread is None or not thread.is_alive()) and not self._stop.is_set():
                self._thread = threading.Thread(
                    target=self._run,
                    name=f"tasklock-liveness-{self.alias}",
                    daemon=True,
                )
                self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.every):
                try:
                    backend = backend_for(self.alias)
                except Exception:  # the alias or its settings are gone
                    logger.exception(
                        "Stopped renewing liveness record %r in cache %r",
                        self.id,
                        self.alias,
                    )
                    # The next acquire here writes the record itself, and
                    # starts a thread again.
                    self.due = 0.0
                    return
                self._renew(backend)
        finally:
            close_thread_connections()
            close_caches()
            if self._backend is not None:
                self._backend.cache.close()

    def _renew(self, backend: LockBackend) -> None:
        previous = self._backend
        if backend is not previous:
            # The settings changed (tests): the old cache object goes, closed.
            self._backend = backend
            if previous is not None:
                previous.cache.close()
        if self._stop.is_set():
            return
        try:
            self.write(backend)
            if self.held:
                reassert(self, backend)
        except backend.errors as exc:
            if not self._failing:
                logger.warning(
                    "Could not renew liveness record %r in cache %r on %s "
                    "(%s: %s); contenders on other hosts may take this "
                    "process's locks there %.0fs after its last renewal, and "
                    "they are reported lost here then.",
                    self.id,
                    self.alias,
                    self.place,
                    type(exc).__name__,
                    exc,
                    self.bound,
                )
            self._failing = True
        except Exception:  # a bug of ours must not stop the beat
            self._once("renewal", f"renewing liveness record {self.id!r}")
        else:
            self._failing = False
        if self is self.records.keeper:
            self.records.start_roster()  # (again, if it stopped)

    def _once(self, kind: str, doing: str) -> None:
        if kind not in self._trouble:
            self._trouble.add(kind)
            logger.exception(
                "Failed %s (logged once; the liveness record is still renewed)",
                doing,
            )

    def stop(self) -> None:
        """Stop renewing (``Records.stop``)."""
        self._stop.set()
        self.valid_until = self.due = 0.0
        with self._guard:  # not between an ensure's making and starting it
            if self.by_key is not None:
                self.by_key.clear()
            thread = self._thread
        if (
            thread is not None
            and thread.is_alive()
            and thread is not threading.current_thread()
        ):
            thread.join(timeout=5)


#: What a record beside no lock at a key vouches for there.
_NEVER_KEPT: Final = (0.0, 0.0)


def kept_by(backend: LockBackend) -> KeepsRecords:
    """Where ``backend``'s store keeps liveness records (a record is made only
    for a store that keeps them)."""
    kept = backend.records
    if kept is None:
        raise LockConfigurationError(
            f"{backend.describe('')} keeps no liveness records"
        )
    return kept


_records: dict[str, Records] = {}
_records_guard = threading.Lock()


def record_for(alias: str, bound: float, backend: LockBackend | None = None) -> Records:
    """This process's records in ``alias``'s store, for a bound of ``bound`` s
    (``backend``: the calling thread's for ``alias``, if it has it at hand)."""
    records = _records.get(alias)
    if records is not None and records.bound == bound:
        return records
    with _records_guard:
        records = _records.get(alias)
        if records is None or records.bound != bound:
            if records is not None:
                records.stop(delete=False)
            if backend is None:
                # (The protocol as the settings say: this thread's backend
                # serves its next lock too.)
                backend = backend_for(alias)
            kept = backend.records
            places = [] if kept is None else kept.record_places()
            keyed = backend.records_beside is not None
            records = _records[alias] = Records(alias, bound, places, keyed)
    return records


def reassert(record: Record, backend: LockBackend) -> None:
    """Put back the locks of this process that a new run of their store (a
    memcached restart, a cluster failover, a promoted PostgreSQL standby)
    emptied, while their holders still hold
    them by their own clock, so that a contender after the restart's grace
    period (``RESTART_GRACE``) finds them held. A lock not there at two beats
    in a row, and not put back, is reported lost: gone for another reason
    (evicted, flushed, released by force, lost in a failover this process
    has not learnt of), or another take standing where the put back was
    tried (a cluster contender's take within the grace is given back once it
    reads the promotion, so the first meeting is not yet a loss). Its holder
    is then told at its next ``check()``, renewing or not. One read of the
    held keys per beat (per server holding them); raises ``backend.errors``."""
    held = _still_held(record)
    if not held:
        return
    # Read every beat: a restarted server's dead connection fails here, and
    # the next beat's connection learns the server's new run.
    keys = [acq.key for acq in held]
    values = backend.values_many(keys)
    if values == [acq.token for acq in held] and not record.met:
        return
    told = backend.restarts
    now = time.monotonic()
    for acq, key, value in zip(held, keys, values, strict=True):
        if value == acq.token:
            record.met.discard(acq)
            continue
        if value is not None:  # another take: given back within a beat?
            _met_another(record, acq, "renewing its liveness record")
            continue
        restarted = None if told is None else told.restarted_at(key)
        if (
            told is None
            or restarted is None
            or restarted < acq.acquired_at - _RUN_SLACK
        ):
            # Not the doing of a restart known here (or taken on the new run
            # and gone since): lost if still gone at the next beat, by when a
            # restart not learnt yet is.
            _met_another(record, acq, "renewing its liveness record")
            continue
        with acq.guard:
            left = acq.valid_until - now
            if acq.hold is None or left <= 0:
                continue
            hold = told.reassert(key, acq.token, left)
            if hold is None:
                _met_another(record, acq, "put back after a restart")
                continue
            acq.hold = hold
            record.met.discard(acq)
        logger.info(
            "Put lock %r back on its store's new run (a restart or a failover; "
            "%.0fs left)",
            acq.lock_id,
            left,
        )


def _still_held(record: Record) -> list[Acquisition]:
    """The holds ``record`` vouches for that are neither released nor lost;
    the others are forgotten."""
    if record.met:
        record.met = {a for a in record.met if a.hold is not None and not a.lost}
    held = []
    for ident, acq in list(record.held.items()):
        if acq.hold is None or acq.lost:
            record.held.pop(ident, None)
        else:
            held.append(acq)
    return held


def _met_another(record: Record, acq: Acquisition, doing: str) -> None:
    """The lock of ``acq`` was not its holder's at this beat (gone, or
    another take where it was put back). The first time is remembered; the
    second, a beat later, reports it lost."""
    if acq not in record.met:
        record.met.add(acq)
        logger.debug("Lock %r is not there for its holder yet", acq.lock_id)
        return
    record.met.discard(acq)
    with acq.guard:
        if acq.hold is not None:  # (not released meanwhile)
            report_lost(acq, doing)


#: How far the start of a server's run, as this process estimates it, may be
#: off: memcached's uptime counts whole seconds, and runs up to 3 s ahead.
_RUN_SLACK: Final = 4.0


def record_beside(
    alias: str,
    bound: float | None,
    backend: LockBackend,
    key: str,
    now: float | None = None,
) -> Record | None:
    """This process's record beside the lock at ``key`` in ``alias``'s store,
    found with no round trip: None if ``bound`` (``TASKLOCK['LIVENESS']``)
    is None or the store cannot keep one there. Written (``Record.ensure``)
    before a lock is taken when ``now >= record.due``: given ``now``, it is
    written here then, and None returned if the server would not take it
    (the lock is then left to its expiry: tokens that promise no record)."""
    if bound is None:
        return None
    records = _records.get(alias)
    if records is None or records.bound != bound:
        records = record_for(alias, bound, backend)
    record = records.single
    if record is None:
        if records.keeper is None:  # records cannot be kept beside locks here
            return None
        record = records.beside(kept_by(backend).record_place(key))
    if now is not None and now >= record.due and not record.ensure(backend):
        return None
    return record


def note_queued(alias: str, key: str, entry: Entry, life: float) -> None:
    """List a queued mark this process just wrote (under ``key``, for ``life``
    seconds at most) in its roster, for the lock console, within a beat;
    nothing when ``TASKLOCK['LIVENESS']`` is None."""
    bound = settings.LIVENESS
    if bound is None:
        return
    records = record_for(alias, bound)
    # The roster's thread writes the roster at its next beat: nothing is
    # written from the publishing thread (which may be gone by then, its
    # connections with it).
    records.start()
    records.roster.note_mark(key, entry, life)


def forget_records(*, delete: bool = False) -> None:
    """Stop every record of this process (``delete``: and remove them)."""
    with _records_guard:
        records = list(_records.values())
        _records.clear()
    for group in records:
        group.stop(delete=delete)


def leave() -> int:
    """On the way out of a process (a worker's shutdown, interpreter exit):
    release every lock it still holds, owner-checked, and delete its liveness
    records, so that nobody waits for them. Returns how many were released."""
    released = 0
    for records in list(_records.values()):
        for acq in list(records.held.values()):
            lock = acq.lock
            if acq.hold is not None and not acq.lost and lock is not None:
                lock.release_quietly()
                released += acq.hold is None
    forget_records(delete=True)
    if released:
        logger.info("Released %d lock(s) on the way out of this process", released)
    return released


def _after_fork() -> None:
    # A forked child is a new process: its records are its own, written when it
    # first takes a lock; the parent's threads do not exist here.
    global _records_guard
    _records.clear()
    _records_guard = threading.Lock()


def _caches_changed(*, setting: str, **_: object) -> None:
    # CACHES changed under the records (override_settings, in tests): the
    # servers they were written to may be gone, or another store's now.
    if setting == "CACHES":
        forget_records()


setting_changed.connect(_caches_changed)
os.register_at_fork(after_in_child=_after_fork)
atexit.register(leave)
