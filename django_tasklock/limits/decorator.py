"""``@rate_limited``: at most N runs of a task per period, across every worker.

A run is admitted as it starts. One over the limit is never dropped silently:
by default the call is sent again for its own turn (not in a tight loop, not all
at the moment the refusal names, and not counted against the task's
``max_retries``); ``raise``,
``wait`` (up to a timeout, then raise) and ``skip`` (logged at INFO) are there
when asked for.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any, Literal, TypeVar, cast

from django.core.exceptions import ImproperlyConfigured

from ..arguments import KeySpec, binder, call_digest, check_key
from ..conf import LIMIT_POLICIES, settings
from ..exceptions import InvalidArgument, InvalidArgumentType
from ..integrations import sender_over_limit
from ..policies.limits import ON_LIMIT, Over
from ..rates import RateSpec, parse_rate
from ..targets import refuse_task_object
from .limiter import Admission, RateLimiter, make_kind

__all__ = ["current_admission", "rate_limited"]

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])
OnLimit = Literal["retry", "raise", "wait", "skip"]

_admitted: contextvars.ContextVar[Admission | None] = contextvars.ContextVar(
    "tasklock_admission", default=None
)


def current_admission() -> Admission | None:
    """Inside a ``@rate_limited`` body: the admission that let this run start
    (its ``at`` is when the limit counted it); None elsewhere."""
    return _admitted.get()


def rate_limited(
    rate: RateSpec | None = None,
    *,
    name: str | None = None,
    key: KeySpec = None,
    kind: str | None = None,
    burst: int | None = None,
    on_limit: OnLimit | None = None,
    timeout: float | None = None,
    cache: str | None = None,
) -> Callable[[F], F]:
    """Admit at most ``rate`` runs of the decorated task per period.

    ``rate``: ``"10/m"``, ``"100/30s"``, ``(10, 60)``; omitted, the named limit
    ``TASKLOCK["RATE_LIMITS"][name]``. ``name``: share one limit between tasks
    (one partner API's quota); default, the function's dotted path. ``key``:
    one limit per value of these arguments (an argument name, a list of names
    or a callable, as ``@single_instance``'s ``key``); default, one limit for
    every call. ``kind``: ``"window"`` or ``"smooth"`` (see ``RateLimiter``).

    ``on_limit`` (default ``TASKLOCK["ON_LIMIT"]``, ``"retry"``): ``"retry"``
    sends the call again for its own turn in the limit's queue of refused
    calls (a bound Celery task; its ``max_retries`` are not spent); ``"raise"`` raises
    ``RateLimited``; ``"wait"`` waits up to ``timeout`` seconds (default
    ``TASKLOCK["WAIT_TIMEOUT"]``) and then raises; ``"skip"`` returns None and
    logs at INFO.

    On an ``async def`` function the wrapper is async: admitted (and waited
    for) on the event loop; ``"retry"`` cannot send it again and raises.
    """
    _check_options(rate, name, on_limit, kind, burst)

    def decorate(func: F) -> F:
        refuse_task_object(func, "rate_limited")
        limits, signature = _declare(
            func, name, (rate, kind, burst, cache), key, on_limit
        )
        limiter_for = limits.for_call
        if inspect.iscoroutinefunction(func):
            awaited = _awaited(func, limiter_for, on_limit, timeout)
            awaited.__signature__ = signature  # type: ignore[attr-defined]
            awaited._tasklock_rate_limit = limiter_for  # type: ignore[attr-defined]
            return cast(F, awaited)

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            limiter = limiter_for(args, kwargs)
            admission = limiter.admit()
            if admission:
                return _admitted_run(func, args, kwargs, admission)
            # Over the limit: the policy chooses, the integration sends again.
            policy = ON_LIMIT[on_limit or settings.ON_LIMIT]
            proceed = functools.partial(_admitted_run, func, args, kwargs)
            over = Over(limiter, admission, proceed, sender_over_limit(args), timeout)
            return policy.over(over)

        wrapper.__signature__ = signature  # type: ignore[attr-defined]
        wrapper._tasklock_rate_limit = limiter_for  # type: ignore[attr-defined]
        return cast(F, wrapper)

    return decorate


def _awaited(
    func: Callable[..., Any],
    limiter_for: Callable[[tuple[Any, ...], dict[str, Any]], RateLimiter],
    on_limit: OnLimit | None,
    timeout: float | None,
) -> Callable[..., Any]:
    """The wrapper over an ``async def`` function: admitted, and waited for
    (``on_limit="wait"``), on the event loop. Nothing can send its call again:
    over the limit, ``retry`` raises ``RateLimited`` as for a plain call."""

    @functools.wraps(func)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        limiter = limiter_for(args, kwargs)
        admission = await limiter.aadmit()
        if admission:
            return await _admitted_await(func, args, kwargs, admission)
        policy = ON_LIMIT[on_limit or settings.ON_LIMIT]
        proceed = functools.partial(_admitted_await, func, args, kwargs)
        return await policy.aover(Over(limiter, admission, proceed, None, timeout))

    return wrapper


def _admitted_run(
    func: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    admission: Admission,
) -> Any:
    """Run ``func`` as admitted by ``admission`` (``current_admission()``)."""
    token = _admitted.set(admission)
    try:
        return func(*args, **kwargs)
    finally:
        _admitted.reset(token)


async def _admitted_await(
    func: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    admission: Admission,
) -> Any:
    """``_admitted_run`` of an ``async def`` function, awaited."""
    token = _admitted.set(admission)
    try:
        return await func(*args, **kwargs)
    finally:
        _admitted.reset(token)


def _declare(
    func: Callable[..., Any],
    name: str | None,
    spec: tuple[Any, ...],
    key: KeySpec,
    on_limit: OnLimit | None,
) -> tuple[_Limits, inspect.Signature]:
    """The limits of ``func`` (``spec``: rate, kind, burst, cache), checked
    against its signature and declared (``DECLARED``), and its signature."""
    signature = inspect.signature(func)
    parameters = list(signature.parameters.values())
    takes_self = bool(parameters) and parameters[0].kind in (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
    )
    check_key(func, key, signature)
    if on_limit == "retry" and inspect.iscoroutinefunction(func):
        raise InvalidArgumentType(
            f"on_limit='retry' on {func.__qualname__}, an async def function: "
            "nothing can send a call of it again (Celery runs sync tasks), so a "
            "call over the limit would be lost. Use 'raise', 'wait' or 'skip'."
        )
    if on_limit == "retry" and not takes_self:
        raise InvalidArgumentType(
            f"on_limit='retry' needs a bound Celery task, but {func.__qualname__} "
            "takes no 'self', so a call over the limit could not be sent again "
            "and would be lost. Use @app.task(bind=True), or another on_limit."
        )
    limits = _Limits(
        name or f"{func.__module__}.{func.__qualname__}",
        spec,
        key,
        binder(signature),
        parameters[0].name if takes_self else None,
    )
    limits.module = func.__module__
    DECLARED[limits.base] = limits
    return limits, signature


def _task_of(args: tuple[Any, ...]) -> Any:
    """The bound task a call was given as its first argument; None if none."""
    first = args[0] if args else None
    if hasattr(first, "request") and callable(getattr(first, "retry", None)):
        return first
    return None


def _check_options(
    rate: RateSpec | None,
    name: str | None,
    on_limit: object,
    kind: str | None,
    burst: int | None,
) -> None:
    """Refuse at decoration what would fail at the first call (in a worker):
    a rate, kind, burst or count the limit cannot keep. A named limit's own
    entries are checked by ``manage.py check`` (E021) and at the first call."""
    if rate is None and name is None:
        raise InvalidArgumentType(
            'rate_limited needs a rate ("10/m"), a name=, or both.'
        )
    if rate is not None:
        parsed = parse_rate(rate)
        chosen = kind
        if chosen is None:
            try:
                chosen = settings.RATE_KIND
            except ImproperlyConfigured:  # settings not ready: E021 checks it
                chosen = "smooth"
        make_kind(parsed, chosen, parsed.count if burst is None else burst)
    if on_limit is not None and on_limit not in LIMIT_POLICIES:
        raise InvalidArgument(
            f"on_limit must be one of {', '.join(LIMIT_POLICIES)}, not {on_limit!r}."
        )


#: Every ``@rate_limited`` of this process, by its name (the lock console
#: lists them).
DECLARED: dict[str, _Limits] = {}


def declared_limit(limit_id: str) -> _Limits | None:
    """The ``@rate_limited`` whose limit ``limit_id`` is: by its name, or for
    a keyed limit's ``<name>-<digest>`` the longest declared name it extends;
    None if none is."""
    limits = DECLARED.get(limit_id)
    if limits is None:
        names = [name for name in DECLARED if limit_id.startswith(name + "-")]
        limits = DECLARED[max(names, key=len)] if names else None
    return limits


class _Limits:
    """The limiters of one decorated function, by limit id (its calls' keys)."""

    def __init__(
        self,
        base: str,
        given: tuple[RateSpec | None, str | None, int | None, str | None],
        key: KeySpec,
        bind: Callable[[tuple[Any, ...], dict[str, Any]], dict[str, Any]],
        self_name: str | None,
    ) -> None:
        self.base, self.given, self.key = base, given, key
        self.bind, self.self_name = bind, self_name
        #: The module of the decorated function (checks look at installed
        #: apps' tasks modules only).
        self.module = ""
        self.limiters: dict[str, RateLimiter] = {}

    def for_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> RateLimiter:
        limit_id = self.base
        if self.key is not None:
            arguments = self.bind(args, kwargs)
            if self.self_name is not None and _task_of(args) is not None:
                arguments.pop(self.self_name, None)
            limit_id = f"{self.base}-{call_digest(self.base, arguments, self.key)}"
        # A named limit is looked up on every call (one dict read), so that a
        # change of TASKLOCK['RATE_LIMITS'] makes a new limiter.
        seen = limit_id
        if self.given[0] is None:
            seen = f"{limit_id} {settings.named_rate(self.base)}"
        limiter = self.limiters.get(seen)
        if limiter is None:
            limiter = self._make(limit_id)
            if len(self.limiters) < 1024:
                self.limiters[seen] = limiter
        return limiter

    def _make(self, limit_id: str) -> RateLimiter:
        # What the decorator was given wins over the named limit's entries.
        rate, kind, burst, cache = self.given
        named = settings.named_rate(self.base) if rate is None else {}
        if rate is None and not named:
            raise InvalidArgument(
                f'rate_limited(name={self.base!r}) has no rate: pass one ("10/m") '
                f"or define TASKLOCK['RATE_LIMITS'][{self.base!r}]."
            )
        return RateLimiter(
            limit_id,
            rate if rate is not None else named["rate"],
            kind=kind or named.get("kind"),
            burst=burst if burst is not None else named.get("burst"),
            cache=cache or named.get("cache"),
        )
