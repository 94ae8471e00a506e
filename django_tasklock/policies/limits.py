"""What a run over its rate limit gets: ``on_limit``.

``retry`` (the default) sends the call again for its own turn in the limit's
queue of refused calls, through the integration that runs it (a Celery
worker's call; anything else cannot be sent again, and raises); ``raise``
raises ``RateLimited``; ``wait`` waits for an admission up to a timeout, then
raises; ``skip`` returns None and logs at INFO. Beside the contention and
duplicate policies: each chooses, the call (``Over``) carries it out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from ..conf import settings
from ..exceptions import RateLimited
from ..logs import module_logger

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..limits.limiter import Admission, RateLimiter

__all__ = ["ON_LIMIT", "LimitPolicy", "Over"]

# Logged under "django_tasklock.limits" before: that name keeps working (logs).
logger = module_logger(__name__, "django_tasklock.limits")


class Over:
    """A run refused by its rate limit, as the policy sees it."""

    __slots__ = ("admission", "limiter", "proceed", "send_again", "timeout")

    def __init__(
        self,
        limiter: RateLimiter,
        admission: Admission,
        proceed: Callable[[Admission], Any],
        send_again: Callable[[RateLimiter, Admission], Any] | None,
        timeout: float | None,
    ) -> None:
        #: The limit and the refusal (``retry_after``: when to come back).
        self.limiter, self.admission = limiter, admission
        #: Runs the body under an admission got later (``wait``).
        self.proceed = proceed
        #: The integration's way to send the call again for a turn; None when
        #: it cannot be (a plain call, a task called directly or eagerly).
        self.send_again = send_again
        #: ``wait``'s timeout (None: ``TASKLOCK['WAIT_TIMEOUT']``).
        self.timeout = timeout

    def refused(self, retry_after: float | None = None) -> RateLimited:
        after = self.admission.retry_after if retry_after is None else retry_after
        return RateLimited(self.limiter.limit_id, after)


class LimitPolicy:
    """Skip: the run ends with None, logged at INFO."""

    def over(self, call: Over) -> Any:
        logger.info(
            "Skipped a call under rate limit %r: over the limit, next admission "
            "in %.2fs",
            call.limiter.limit_id,
            call.admission.retry_after,
        )
        return None

    async def aover(self, call: Over) -> Any:
        """``over``, awaited (an ``async def`` function's call; its
        ``proceed`` returns an awaitable)."""
        return self.over(call)


class Raise(LimitPolicy):
    def over(self, call: Over) -> Any:
        raise call.refused()


class Wait(LimitPolicy):
    def over(self, call: Over) -> Any:
        waited = call.limiter.wait(_timeout(call))
        if not waited:
            raise call.refused(waited.retry_after)
        return call.proceed(waited)

    async def aover(self, call: Over) -> Any:
        waited = await call.limiter.aadmit(timeout=_timeout(call))
        if not waited:
            raise call.refused(waited.retry_after)
        return await call.proceed(waited)


def _timeout(call: Over) -> float:
    return settings.WAIT_TIMEOUT if call.timeout is None else call.timeout


class Retry(LimitPolicy):
    def over(self, call: Over) -> Any:
        if call.send_again is None:  # nothing can send it again: never lost
            raise call.refused()
        return call.send_again(call.limiter, call.admission)


#: The policies by name: ``on_limit``.
ON_LIMIT: Final[dict[str, LimitPolicy]] = {
    "retry": Retry(),
    "raise": Raise(),
    "wait": Wait(),
    "skip": LimitPolicy(),
}
