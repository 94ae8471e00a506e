"""The worker's side: a call that ends without finishing its body frees its
locks (a revoked or expired call; a retry ``autoretry_for`` did not send; a
call whose pool process died)."""

from __future__ import annotations

from typing import Any

from ...calls import call_of, store
from ...locks.liveness import leave
from ...locks.recovery import judge
from ...logs import module_logger
from ...semaphores import slot_id
from ...targets import spec_of

__all__ = [
    "free_call",
    "handed_to_autoretry",
    "on_failure",
    "on_postrun",
    "on_revoked",
    "on_shutdown",
]

# Logged under 'django_tasklock.calls' before: that name keeps working (see logs).
logger = module_logger(__name__, "django_tasklock.calls")


# Calls whose lock a failing run handed over to the retry Celery's autoretry_for
# is about to send: task id -> (the lock ids to free, their cache alias). A
# call whose retry is not sent after all (its state is not RETRY) frees them at
# task_postrun.
_handed: dict[str, tuple[tuple[str, ...], str | None]] = {}


def handed_to_autoretry(task_id: str, left: tuple[str, ...], cache: str | None) -> None:
    _handed[task_id] = (left, cache)


def on_postrun(task_id: str | None = None, state: str | None = None, **_: Any) -> None:
    if task_id is None:
        return
    entry = _handed.pop(task_id, None)
    if entry is None or state == "RETRY":
        return
    left, cache = entry
    free_call(left, cache, task_id, running=False)


def on_revoked(sender: Any = None, request: Any = None, **_: Any) -> None:
    """A revoked (or expired) call frees its lock when a worker drops it."""
    spec = spec_of(sender) if sender is not None else None
    if spec is None or request is None or not request.id:
        return
    try:
        lock_id = spec.lock_id(
            spec.name,
            spec.bound,
            tuple(request.args or ()),
            dict(request.kwargs or {}),
        )
    except (TypeError, ValueError):
        return
    left = spec.mode.left_by(lock_id, running=True)
    free_call(left, spec.options.cache, request.id, running=True)


def free_call(
    left: tuple[str, ...], cache: str | None, task_id: str, *, running: bool
) -> None:
    """Remove the locks of ``left`` (the mode's ``left_by``) that still name
    call ``task_id``; a running call's only with ``running`` (its process is
    gone, a terminated revoke)."""
    backend, _alias = store(cache)
    for the_id in left:
        key = backend.keys_for(the_id)[0]
        try:
            peek = backend.peek(key)
            holder = None if peek is None else call_of(peek.value)
            if peek is None or holder is None or holder[1] != task_id:
                continue
            if holder[0] == "running" and not running:
                continue
            if backend.release(key, peek.hold, peek.value):
                logger.info(
                    "Freed lock %r of call %s, which ended without finishing.",
                    the_id,
                    task_id,
                )
        except backend.errors:
            logger.exception(
                "Could not free lock %r of call %s; it expires on its own",
                the_id,
                task_id,
            )


def on_failure(
    sender: Any = None,
    task_id: str | None = None,
    exception: BaseException | None = None,
    args: Any = None,
    kwargs: Any = None,
    **_: Any,
) -> None:
    """In the worker's main process: a call whose pool process died (Celery's
    ``WorkerLostError``, or its hard time limit) frees the locks, marks and
    semaphore slots of that call whose holder is dead, at once, rather than at
    the next contender. A holder still alive (a child not killed yet) keeps
    them."""
    # (Celery's pool package, imported here: a signal of a worker, which has
    # it; django_tasklock imports without Celery installed.)
    from billiard.exceptions import TimeLimitExceeded, WorkerLostError

    if not isinstance(exception, (WorkerLostError, TimeLimitExceeded)):
        return
    spec = spec_of(sender, any_mode=True) if sender is not None else None
    if spec is None or task_id is None:
        return
    try:
        lock_id = spec.lock_id(
            spec.name, spec.bound, tuple(args or ()), dict(kwargs or {})
        )
    except (TypeError, ValueError):
        return
    options = spec.options
    ids = set(spec.mode.lock_ids(lock_id))
    if options.limit:
        ids.update(slot_id(lock_id, slot) for slot in range(options.limit))
    backend, _alias = store(options.cache)
    for the_id in sorted(ids):
        key = backend.keys_for(the_id)[0]
        try:
            peek = backend.peek(key)
            if peek is None:
                continue
            alive, why = judge(peek.value, backend, key)
            if alive is False and backend.release(key, peek.hold, peek.value):
                logger.warning(
                    "Freed lock %r of call %s, whose pool process died: %s.",
                    the_id,
                    task_id,
                    why,
                )
        except backend.errors:
            logger.exception(
                "Could not free lock %r of call %s; the next contender frees it",
                the_id,
                task_id,
            )


def on_shutdown(**_: Any) -> None:
    """A pool process or worker on its way out (``worker_process_shutdown``,
    ``worker_shutdown``): release what it still holds and delete its liveness
    records, so that no lock of it waits for a contender's judgement."""
    leave()
