"""A ``@single_instance`` run inside a Celery task: finding the task, and what
Celery can do for the run (retry, Ignore, send again, time limits, canvas).

Nothing here imports Celery until a task runs: a task's class and the current
task are looked up in ``sys.modules``.
"""

from __future__ import annotations

import functools
import sys
from typing import TYPE_CHECKING, Any, NoReturn

from ...calls import queue_life, queued
from ...exceptions import LockBackendError, LockNotAcquired
from ...foreign import CELERY_STATE, celery_task_stack
from ...locks import Lock
from ...logs import module_logger
from ...runs import Host, held
from ..redelivery import defer_for, verdict
from .worker import handed_to_autoretry

if TYPE_CHECKING:
    from collections.abc import Callable

    from ...runs import Run
    from ...semaphores import Semaphore

__all__ = ["CELERY", "CeleryHost", "current_task", "task_class"]

# Logged under 'django_tasklock.decorator' before: that name keeps working (see logs).
logger = module_logger(__name__, "django_tasklock.decorator")

#: Seconds a lock capped by a Celery time limit lasts beyond that limit.
TIME_LIMIT_MARGIN = 2.0


def task_class() -> type | None:
    """Celery's Task class, if Celery was imported; else None (nothing is a task)."""
    module = sys.modules.get("celery.app.task")
    return getattr(module, "Task", None) if module is not None else None


# Celery's task stack storage and its thread-ident function, once read: they
# are made with the stack and never change (asked on every decorated call).
_stack: list[Any] = []


def _tasks_here(state: Any) -> bool:
    """False when no Celery task runs in this thread (nothing to look up); True
    when one may.

    ``get_current_task()`` costs a raised and caught exception when the stack
    is empty, more than the rest of a lock id; Celery's thread-local stack keeps
    an entry per thread only while something is pushed, which is cheap to ask.
    Any other make of stack is simply asked.
    """
    if _stack:
        return _stack[1]() in _stack[0]
    found = celery_task_stack(state)
    if found is None:
        return True
    _stack[:] = found
    return found[1]() in found[0]


def current_task(wrapper: Callable[..., Any]) -> Any:
    """The Celery task whose run() is ``wrapper``, if one is executing it."""
    state = sys.modules.get(CELERY_STATE)
    if state is None:
        return None
    # _tasks_here()'s answer once the stack is known, inlined: called, an
    # @single_instance call took 0.4 % more instructions (make bench-cpu),
    # past that row's 2 % budget.
    if _stack:
        if _stack[1]() not in _stack[0]:
            return None
    elif not _tasks_here(state):
        return None
    task = state.get_current_task()
    run = getattr(task, "run", None)
    return task if getattr(run, "__func__", run) is wrapper else None


def time_limit(task: Any) -> float | None:
    """The hard time limit the worker enforces on this run of ``task``, if any."""
    limits = getattr(getattr(task, "request", None), "timelimit", None)
    hard = limits[0] if limits else None
    if not hard:
        hard = getattr(task, "time_limit", None)
    if not hard:
        conf = getattr(getattr(task, "app", None), "conf", None)
        hard = getattr(conf, "task_time_limit", None)
    if isinstance(hard, bool) or not isinstance(hard, (int, float)) or hard <= 0:
        return None
    # Two seconds more: the worker kills the run at the limit, counted from
    # before the lock was taken, and memcached (whole seconds, on a clock that
    # may tick late) may end a lock up to two seconds early; the lock must not
    # go while the run may still be writing.
    return float(hard) + TIME_LIMIT_MARGIN


def _ignore() -> BaseException:
    from celery.exceptions import Ignore

    ignore: BaseException = Ignore()
    return ignore


class CeleryHost(Host):
    """A run inside a Celery task (``run.task``)."""

    def prepare(self, run: Run, task: Any) -> None:
        """Make ``run`` one of ``task``: its app's oid, its time limit (the
        lock's max_hold unless the decorator set one), its call."""
        run.host, run.task = self, task
        run.oid = getattr(getattr(task, "app", None), "oid", None)
        max_hold = run.options.max_hold
        run.max_hold = max_hold if max_hold is not None else time_limit(task)
        request = getattr(task, "request", None)
        if request is not None and not request.called_directly and request.id:
            run.call_id = request.id

    def verdict(self, run: Run, lock: Lock | Semaphore) -> object:
        return verdict(run, lock)

    def drop(self, run: Run) -> NoReturn:
        """End a second delivery with Ignore: no state is stored for it."""
        raise _ignore()

    def defer(self, run: Run, lock: Lock | Semaphore) -> NoReturn:
        if not isinstance(lock, Lock):
            raise LockNotAcquired(lock.lock_id)
        self._send_back(run, defer_for(run, lock))

    def send_back(self, run: Run, lock: Lock | Semaphore, countdown: float) -> NoReturn:
        if getattr(run.task.request, "is_eager", False):
            # Sent back, an eager call would run again at once, in place, and
            # wait again: it fails instead, visibly (its mode clears its mark).
            raise LockNotAcquired(
                lock.lock_id,
                f"{run.name}[{run.call_id}] waited for it in vain, and a call run "
                "in place (eagerly, or by apply()) cannot be sent back to wait "
                "for its turn as a worker's is.",
            )
        self._send_back(run, countdown)

    def _send_back(self, run: Run, countdown: float) -> NoReturn:
        """Put this very call (same task id) back on the broker, and end this
        run of it without a state of its own (Celery's Ignore)."""
        task = run.task
        task.signature_from_request(task.request, countdown=countdown).apply_async()
        raise _ignore()

    def retry(self, run: Run, countdown: float) -> Any:
        return run.task.retry(countdown=countdown)

    def in_canvas(self, run: Run) -> bool:
        request = getattr(run.task, "request", None)
        if request is None or getattr(request, "called_directly", True):
            return False
        return bool(
            getattr(request, "callbacks", None)
            or getattr(request, "chain", None)
            or getattr(request, "chord", None)
            or getattr(request, "group", None)
        )

    def guard_retry(self, run: Run) -> None:
        _releasing_retry(run.task)

    def will_retry(self, run: Run, exc: BaseException) -> bool:
        """True if ``autoretry_for`` is about to retry the task for ``exc``."""
        task = run.task
        autoretry_for = tuple(getattr(task, "autoretry_for", ()) or ())
        if not autoretry_for or not isinstance(exc, autoretry_for):
            return False
        from celery.exceptions import Ignore, Retry

        dont = tuple(getattr(task, "dont_autoretry_for", ()) or ())
        if isinstance(exc, (Ignore, Retry, *dont)):
            return False
        retry_kwargs = getattr(task, "retry_kwargs", None) or {}
        max_retries = retry_kwargs.get("max_retries", task.max_retries)
        return max_retries is None or task.request.retries < max_retries

    def hand_to_retry(self, run: Run, lock: Lock, left: tuple[str, ...]) -> None:
        """Keep the call's lock across the retry ``autoretry_for`` sends next."""
        task = run.task
        retry_kwargs = getattr(task, "retry_kwargs", None) or {}
        delay = max(
            float(retry_kwargs.get("countdown") or 0),
            float(getattr(task, "default_retry_delay", 0) or 0),
            float(getattr(task, "retry_backoff_max", 0) or 0)
            if getattr(task, "retry_backoff", False)
            else 0.0,
        )
        assert lock.call_id is not None
        options = run.options
        try:
            if lock.hand_over(
                queued(lock.call_id), queue_life(options.queue_expire, delay)
            ):
                handed_to_autoretry(lock.call_id, left, options.cache)
        except LockBackendError:
            logger.exception("Could not keep lock %r for the retry", lock.lock_id)

    def park(self, run: Run, lock: Lock | Semaphore) -> Any:
        from .park import park

        return park(run, lock)

    def park_started(self, run: Run, lock: Lock | Semaphore) -> None:
        from .park import started

        started(run, lock)

    def park_ended(self, run: Run, lock: Lock | Semaphore) -> None:
        from .park import ended

        ended(run, lock)


def _releasing_retry(task: Any) -> None:
    """Make ``task.retry`` drop the lock of the running body before it sends the
    retry (a retried message may otherwise meet its own run's lock)."""
    if getattr(task.retry, "_tasklock_releases", False):
        return
    original = task.retry

    @functools.wraps(original)
    def retry(*args: Any, **kwargs: Any) -> Any:
        # Only the run that retries: an outer run of the same task in this thread
        # (it called the task directly, or apply()) keeps its lock.
        for run in reversed(held.get()):
            if run.task is task:
                # An until_finished call's lock is handed to the retry as it is
                # sent (see publish), never freed in between.
                if not run.hands_over and run.lock is not None:
                    run.lock.release_quietly()
                break
        return original(*args, **kwargs)

    retry._tasklock_releases = True  # type: ignore[attr-defined]
    task.retry = retry


#: The host of every run inside a Celery task.
CELERY = CeleryHost()
