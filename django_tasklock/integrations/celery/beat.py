"""Celery beat, highly available: run it on several hosts, one sends.

    celery -A proj beat -S django_tasklock.integrations.celery.beat:LeaderScheduler

or, with django-celery-beat's schedules in the database,
``-S django_tasklock.integrations.celery.beat_db:LeaderDatabaseScheduler``.

Every beat process asks for the leadership of its app's beat
(``Leadership("celery-beat-<app name>")``); only the leader's ticks send, the
others stand by and take over when it dies (within ``TASKLOCK["LIVENESS"]``
plus a poll) or is paused past its liveness.

Each periodic run is sent at most once, across a change of leader too. The
time an entry last ran is kept in the lock store as well as in the leader's
own schedule file, under ``tasklock-beat:<app>:<entry>``; a run is sent only
by the beat that moves it, in one conditional write, from the time of the run
before it to the time of this one. A leader that sent a run and died before
its schedule file was saved, or a paused leader that wakes up and sends what
it thought due, finds the stored time moved on and sends nothing; a new
leader starts from the stored times: a run that fell due while no leader was
up is sent once, late, as Celery's own beat sends a missed run, or skipped
(recorded, not sent) for the entries ``TASKLOCK["BEAT_MISSED"]`` says so of.
If the store cannot be reached, nothing is sent: the run is skipped (at most
once), logged.
"""

from __future__ import annotations

import datetime
import logging
import time
from typing import Any

from celery.beat import PersistentScheduler, ScheduleEntry

from ...calls import store
from ...conf import settings
from ...leader import Leadership

__all__ = ["FENCE", "RUN", "LeaderMixin", "LeaderScheduler"]

logger = logging.getLogger(__name__)

#: How long the store keeps an entry's last run time (30 days, memcached's
#: longest relative expiry): an entry idle longer starts again from its own.
KEEP = 30 * 86400
#: The message headers of a periodic run: the run's time (ms since the epoch,
#: the one stored; the same run never has two) and the sending leader's fence.
RUN = "tasklock_beat_run"
FENCE = "tasklock_beat_fence"


def _ms(when: datetime.datetime) -> int:
    return round(when.timestamp() * 1000)


def _at(ms: int, like: datetime.datetime) -> datetime.datetime:
    """``ms`` as a datetime of the same kind as ``like`` (aware or naive)."""
    if like.tzinfo is None:
        return datetime.datetime.fromtimestamp(ms / 1000)
    return datetime.datetime.fromtimestamp(ms / 1000, tz=datetime.timezone.utc)


class LeaderMixin:
    """What makes a Celery beat scheduler one of several: mix it in before the
    scheduler class (see ``LeaderScheduler``)."""

    leadership: Leadership
    _synced: int | None = None
    _reserved: ScheduleEntry

    def setup_schedule(self) -> None:
        super().setup_schedule()  # type: ignore[misc]
        app: Any = self.app  # type: ignore[attr-defined]
        self.leadership = Leadership(f"celery-beat-{app.main or 'celery'}").start()

    def tick(self, *args: Any, **kwargs: Any) -> float:
        leadership = self.leadership
        if not leadership.is_leader:
            max_interval: float = self.max_interval  # type: ignore[attr-defined]
            return min(leadership.poll, max_interval)
        if self._synced != leadership.fence:
            self._sync()
            self._synced = leadership.fence
        return float(super().tick(*args, **kwargs))  # type: ignore[misc]

    def _key(self, name: str) -> str:
        app: Any = self.app  # type: ignore[attr-defined]
        return f"tasklock-beat:{app.main or 'celery'}:{name}"

    def _sync(self) -> None:
        """On becoming leader: start each entry from the time it last ran by
        any leader, if later than this beat's own."""
        backend, _alias = store(None)
        schedule: dict[str, ScheduleEntry] = self.schedule  # type: ignore[attr-defined]
        for name, entry in schedule.items():
            key = backend.keys_for(self._key(name))[0]
            try:
                peek = backend.peek(key)
            except backend.errors:
                logger.exception("Could not read when %s last ran", name)
                continue
            if peek is None:
                continue
            stored = int(str(peek.value))
            # An entry that never ran here (django-celery-beat keeps None
            # until its rows are synced) takes the stored time too.
            last = entry.last_run_at
            if last is None or stored > _ms(last):
                entry.last_run_at = _at(stored, last or entry.default_now())
                model = getattr(entry, "model", None)  # django-celery-beat's
                if model is not None:
                    model.last_run_at = entry.last_run_at
        self._heap = None  # rebuilt from the times read

    def reserve(self, entry: ScheduleEntry) -> ScheduleEntry:
        # The entry of the run about to be sent: its time is this run's.
        reserved: ScheduleEntry = super().reserve(entry)  # type: ignore[misc]
        self._reserved = reserved
        return reserved

    def apply_entry(self, entry: ScheduleEntry, producer: Any = None) -> None:
        missed = self._missed(entry)
        run = self._claim(entry)
        if run is None:
            return
        if missed is not None:
            logger.info(
                "Skipped %s: its run fell due %.1fs before this beat became "
                "leader, while no beat led (TASKLOCK['BEAT_MISSED'] says skip "
                "it); the next is due a period from now",
                entry.name,
                missed,
            )
            return
        fence = self.leadership.fence
        if fence is None:
            # Paused or starved past its liveness between its look at the
            # leadership and the claim: a newer leader may be sending, and
            # this run, recorded, is skipped rather than sent beside it.
            logger.warning(
                "Not sent %s: this beat lost its leadership while recording "
                "the run (the run is skipped)",
                entry.name,
            )
            return
        options = entry.options
        headers = {**(options.get("headers") or {}), RUN: run, FENCE: fence}
        entry.options = {**options, "headers": headers}
        try:
            super().apply_entry(entry, producer=producer)  # type: ignore[misc]
        finally:
            entry.options = options

    def _missed(self, entry: ScheduleEntry) -> float | None:
        """For an entry whose missed runs are skipped: how long before this
        beat became leader its run fell due, if it did (while no beat led);
        else None."""
        since = self.leadership.since
        last = entry.last_run_at
        if since is None or last is None or settings.beat_missed(entry.name) != "skip":
            return None
        overdue = -entry.schedule.remaining_estimate(last).total_seconds()
        before = since - (time.time() - overdue)
        return before if before > 0 else None

    def _claim(self, entry: ScheduleEntry) -> int | None:
        """Move the entry's stored time from its run before to this run's
        (``reserve()`` made it): this run's time (ms) if this beat moved it,
        and sends; else None. An entry that does not know its run before
        (never ran here) never moves a stored time: it starts again from
        it."""
        now = self._reserved.last_run_at
        before = _ms(entry.last_run_at) if entry.last_run_at is not None else None
        backend, _alias = store(None)
        key = backend.keys_for(self._key(entry.name))[0]
        value = str(_ms(now))
        try:
            peek = backend.peek(key)
            if peek is None:
                claimed = backend.acquire(key, value, KEEP) is not None
            elif before is not None and int(str(peek.value)) <= before:
                claimed = (
                    backend.replace(key, peek.hold, peek.value, value, KEEP) is not None
                )
            else:
                claimed = False
        except backend.errors:
            logger.exception(
                "Not sent %s: could not record its run in the lock store (a run "
                "is sent only once it is recorded, so that no other beat sends it)",
                entry.name,
            )
            return None
        if not claimed:
            logger.warning(
                "Not sent %s: another beat sent this run already (it was leader "
                "before this one)",
                entry.name,
            )
            self._heap = None  # start again from the stored times
            self._synced = None
            return None
        return int(value)

    def close(self) -> None:
        leadership = getattr(self, "leadership", None)
        if leadership is not None:
            leadership.stop()
        super().close()  # type: ignore[misc]


class LeaderScheduler(LeaderMixin, PersistentScheduler):  # type: ignore[misc]
    """Celery's default scheduler (``PersistentScheduler``), one of several."""
