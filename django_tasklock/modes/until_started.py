"""``until_started``: a call holds its lock from ``.delay()`` until a worker
starts it (a debounce).

Published: as ``until_finished``. Run: the call's mark becomes
``started:<task id>``, which a newer ``.delay()`` may replace, so one new call
can be queued while this one runs. The run itself holds a lock of its own,
``<lock id>-run-<task id>``, named after the call: a second delivery of the
message (which a newer call's mark no longer shows) meets it and is dropped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..calls import Marks
from ..conf import settings
from ..keys import RUN_MARK
from ..locks.roster import note_run
from ..logs import module_logger
from ..runs import DEFER, DROP, FREED, held
from .base import Mode

if TYPE_CHECKING:
    from ..backends import LockBackend
    from ..locks import Lock
    from ..runs import Run

__all__ = ["UntilStarted", "dropped"]

# Logged under 'django_tasklock.decorator' before: that name keeps working (see logs).
logger = module_logger(__name__, "django_tasklock.decorator")


class UntilStarted(Mode):
    name = "until_started"

    def may_replace(
        self,
        holder: tuple[str, str] | None,
        value: object,
        backend: LockBackend,
        key: str,
    ) -> bool:
        # A call that has started does not count: a new one may be queued.
        if holder is not None and holder[0] == "started":
            return True
        return super().may_replace(holder, value, backend, key)

    def on_run(self, run: Run) -> Any:
        call_id = run.call_id
        if call_id is None:  # called directly: as while_running
            return super().on_run(run)
        run_lock = run.lock = self.make_lock(run, f"{run.lock_id}{RUN_MARK}{call_id}")
        if not run_lock.acquire():
            verdict = run.host.verdict(run, run_lock)
            if verdict is DEFER:
                return run.host.defer(run, run_lock)
            if verdict is not FREED or not run_lock.acquire():
                return dropped(run, run_lock, verdict)
        note_run(run_lock, run)
        # current_lock() is the run's lock, and a self.retry() frees it before
        # the retry is sent (its copy would look like a second delivery).
        run.host.guard_retry(run)
        reset = held.set((*held.get(), run))
        try:
            return self._marked(run, call_id)
        finally:
            held.reset(reset)
            run_lock.release_quietly()

    def _marked(self, run: Run, call_id: str) -> Any:
        """Run the body with the call marked started under the call's lock id."""
        marks = Marks(run.options.cache, run.lock_id)
        expire = run.options.expire
        mark = marks.start(
            call_id, expire if expire is not None else settings.LOCK_EXPIRE
        )
        try:
            return run.body()
        finally:
            marks.clear(mark, "Could not clear the started mark of lock %r")


def dropped(run: Run, run_lock: Lock, verdict: object) -> Any:
    """End a second delivery whose run lock another delivery of its call
    holds (said, unless the verdict said it already)."""
    if verdict is not DROP:
        logger.warning(
            "Dropped a second delivery of %s[%s]: that call is already running "
            "(lock %r).",
            run.name,
            run.call_id,
            run_lock.lock_id,
        )
    return run.host.drop(run)
