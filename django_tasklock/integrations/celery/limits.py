"""A Celery call refused by its rate limit, sent again for its own turn
(``on_limit="retry"``, ``policies.limits``)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from ...exceptions import RateLimited
from ...logs import module_logger
from .host import task_class

if TYPE_CHECKING:
    from collections.abc import Callable

    from ...limits.limiter import Admission, RateLimiter

__all__ = ["sender_over_limit"]

# Logged under "django_tasklock.limits" before: that name keeps working (logs).
logger = module_logger(__name__, "django_tasklock.limits")


def sender_over_limit(
    args: tuple[Any, ...],
) -> Callable[[RateLimiter, Admission], Any] | None:
    """How a refused call with these arguments is sent again: the bound task
    its first argument is, run by a worker; None for anything else (a task
    called directly or eagerly has no message to send again)."""
    task = args[0] if args else None
    celery_task = task_class()
    if celery_task is None or not isinstance(task, celery_task):
        return None
    request = getattr(task, "request", None)
    if request is None or request.called_directly or request.is_eager:
        return None
    return functools.partial(send_again, task)


def send_again(task: Any, limiter: RateLimiter, admission: Admission) -> Any:
    """Send the call again, for its own turn in the queue of refused calls
    (``RateLimiter.turn``: a backlog is spread at the limit's pace, not all
    sent for the moment the refusal named): a new message with the same task
    id, arguments and retry count. The call's state is set to ``RETRY`` before
    the message goes, and this run ends with Celery's ``Ignore``, which stores
    nothing: the state a later run stores is never written over by this one's
    (Celery's ``Retry`` would write ``RETRY`` after the message went, and a
    run of it quick enough to have finished by then kept that state for
    good)."""
    from celery.exceptions import Ignore

    request = task.request
    countdown = limiter.turn(admission.retry_after)
    _note_retry(task, request, RateLimited(limiter.limit_id, countdown))
    again = task.signature_from_request(
        request, countdown=countdown, retries=request.retries
    )
    again.apply_async()
    logger.info(
        "Sent %s[%s] again to run in %.2fs: over rate limit %r",
        getattr(task, "name", "?"),
        request.id,
        countdown,
        limiter.limit_id,
    )
    raise Ignore()


def _note_retry(task: Any, request: Any, reason: RateLimited) -> None:
    """Store the ``RETRY`` state of a call about to be sent again, where the
    task stores states (as Celery's own retry would); a result backend that
    fails here is logged, and the call is sent again all the same."""
    if getattr(task, "ignore_result", False) and not getattr(
        task, "store_errors_even_if_ignored", False
    ):
        return
    try:
        task.backend.mark_as_retry(request.id, reason, request=request)
    except Exception:
        logger.warning(
            "Could not store the RETRY state of %s[%s]; it is sent again anyway",
            getattr(task, "name", "?"),
            request.id,
            exc_info=True,
        )
