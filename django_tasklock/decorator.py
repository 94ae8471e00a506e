"""``@single_instance``: one run at a time per task and arguments."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import sys
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, Literal, TypeVar, cast, overload

from .arguments import KeySpec, binder, call_digest
from .conf import (
    CONTENTION_POLICIES,
    TIMEOUT_POLICIES,
    settings,
    validate_bool,
    validate_choice,
    validate_expire,
    validate_seconds,
)
from .exceptions import LockNotAcquired
from .locks import ON_LOST_POLICIES, Lock, OnLost
from .semaphores import Semaphore, validate_limit

__all__ = ["current_lock", "lock_id_for", "single_instance"]

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])
Policy = Literal["skip", "raise", "retry", "wait"]

#: Seconds a lock capped by a Celery time limit lasts beyond that limit.
TIME_LIMIT_MARGIN = 1.0

# The locks of the single_instance runs in progress in this context (thread,
# greenlet or asyncio task), innermost last: current_lock() is the last, and a
# task's self.retry() releases the innermost run of that task, the one calling it.
_held: ContextVar[tuple[Lock | Semaphore, ...]] = ContextVar(
    "tasklock_held", default=()
)


def _celery_task_class() -> type | None:
    # Celery stays optional: if it was never imported, nothing here is a task.
    module = sys.modules.get("celery.app.task")
    return getattr(module, "Task", None) if module is not None else None


def _is_django_task_context(value: object) -> bool:
    module = sys.modules.get("django.tasks.base")
    context_class = getattr(module, "TaskContext", None)
    return context_class is not None and isinstance(value, context_class)


def _current_celery_task(wrapper: Callable[..., Any]) -> Any:
    """The Celery task whose run() is ``wrapper``, if one is executing it."""
    state = sys.modules.get("celery._state")
    if state is None:
        return None
    task = state.get_current_task()
    run = getattr(task, "run", None)
    return task if getattr(run, "__func__", run) is wrapper else None


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
        for lock in reversed(_held.get()):
            if getattr(lock, "task", None) is task:
                lock.release_quietly()
                break
        return original(*args, **kwargs)

    retry._tasklock_releases = True  # type: ignore[attr-defined]
    task.retry = retry


class _TaskLock(Lock):
    """A Lock that remembers which task instance holds it."""

    task: Any = None


class _TaskSemaphore(Semaphore):
    """A Semaphore that remembers which task instance holds a slot."""

    task: Any = None


@overload
def single_instance(func: F, /) -> F: ...


@overload
def single_instance(
    func: None = None,
    /,
    *,
    key: KeySpec = None,
    expire: float | None = None,
    on_contention: Policy | None = None,
    timeout: float | None = None,
    on_timeout: Literal["skip", "raise"] = "skip",
    countdown: float | None = None,
    cache: str | None = None,
    renew: bool | None = None,
    max_hold: float | None = None,
    on_lost: OnLost = "warn",
    limit: int | None = None,
) -> Callable[[F], F]: ...


def single_instance(
    func: F | None = None,
    /,
    *,
    key: KeySpec = None,
    expire: float | None = None,
    on_contention: Policy | None = None,
    timeout: float | None = None,
    on_timeout: Literal["skip", "raise"] = "skip",
    countdown: float | None = None,
    cache: str | None = None,
    renew: bool | None = None,
    max_hold: float | None = None,
    on_lost: OnLost = "warn",
    limit: int | None = None,
) -> F | Callable[[F], F]:
    """Run the decorated task (or function) at most once at a time per arguments.

    Put it under Celery's decorator::

        @app.task(bind=True)
        @single_instance
        def import_feed(self, feed_url): ...

        @app.task(bind=True)
        @single_instance(key="feed_url", expire=300, on_contention="retry")
        def refresh(self, feed_url, force=False): ...

    The lock id is ``"<task name>-lock-<md5 hex>"``: the task name is ``self.name``
    for bound tasks, the Celery task's name for unbound ones and
    ``module.qualname`` for plain functions; the digest covers the call's
    arguments bound to the signature with defaults applied (the bound task left
    out), so the key does not change when the message goes through JSON.

    ``key``: an argument name, a list of names, or a callable taking the call's
    arguments and returning a str. With one argument name whose value is a str,
    the digest is the MD5 of that str, the cookbook's own lock id.
    ``expire``: seconds (default ``TASKLOCK["LOCK_EXPIRE"]``).
    ``on_contention`` (default ``TASKLOCK["ON_CONTENTION"]``, ``"skip"``):
    ``"skip"`` returns None and logs at INFO; ``"raise"`` raises
    ``LockNotAcquired``; ``"retry"`` calls ``self.retry(countdown=countdown)`` of a
    bound Celery task (its own ``max_retries`` apply); ``"wait"`` waits up to
    ``timeout`` seconds (default ``TASKLOCK["WAIT_TIMEOUT"]``), then does
    ``on_timeout`` (``"skip"`` or ``"raise"``). ``cache``: a CACHES alias.

    ``renew`` (default ``TASKLOCK["RENEW"]``) keeps the lock alive with a
    heartbeat while the body runs, so ``expire`` can be short. ``max_hold``
    (seconds) caps how long the lock lasts; for a Celery task it defaults to the
    task's hard ``time_limit`` (from the call, the task or ``task_time_limit``)
    plus a second, so a lock ends about when the worker kills the run. ``on_lost="raise"`` makes
    ``current_lock().check()`` raise ``LockLost`` once the lock is found lost;
    ``current_lock().fence`` is the run's fencing token.

    ``limit`` (an int): at most that many runs at once per lock id instead of
    one, through a ``Semaphore`` of that many slots (``current_lock()`` is then
    the Semaphore); the contention policies apply when every slot is held.

    A body that raises, or calls ``self.retry()``, has released the lock before
    the retry is sent, so a retry never meets its own lock.
    """
    if expire is not None:
        validate_expire(expire)
    if on_contention is not None:
        validate_choice(
            on_contention, name="on_contention", choices=CONTENTION_POLICIES
        )
    if timeout is not None:
        validate_seconds(timeout, name="timeout")
    if countdown is not None:
        validate_seconds(countdown, name="countdown", allow_zero=True)
    validate_choice(on_timeout, name="on_timeout", choices=TIMEOUT_POLICIES)
    if renew is not None:
        validate_bool(renew, name="renew")
    if max_hold is not None:
        validate_seconds(max_hold, name="max_hold")
    if limit is not None:
        validate_limit(limit)
    validate_choice(on_lost, name="on_lost", choices=ON_LOST_POLICIES)
    options = _Options(
        key=key,
        expire=expire,
        on_contention=on_contention,
        timeout=timeout,
        on_timeout=on_timeout,
        countdown=countdown,
        cache=cache,
        renew=renew,
        max_hold=max_hold,
        on_lost=on_lost,
        limit=limit,
    )
    if func is None:
        return lambda function: _decorate(function, options)
    if not callable(func):
        raise TypeError(
            "single_instance takes the function to decorate, or keyword options only: "
            f"@single_instance(key=...), not @single_instance({func!r})."
        )
    return _decorate(func, options)


@dataclasses.dataclass(frozen=True)
class _Options:
    """The decorator's options, validated, as given (None: read TASKLOCK)."""

    key: KeySpec
    expire: float | None
    on_contention: Policy | None
    timeout: float | None
    on_timeout: str
    countdown: float | None
    cache: str | None
    renew: bool | None
    max_hold: float | None
    on_lost: OnLost
    limit: int | None


def _decorate(func: F, options: _Options) -> F:
    signature = inspect.signature(func)
    parameters = list(signature.parameters.values())
    first = parameters[0] if parameters else None
    takes_self = first is not None and first.kind in (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
    )
    unbound_signature = (
        signature.replace(parameters=parameters[1:]) if takes_self else signature
    )
    _check_key(func, options.key, signature)
    bind_plain, bind_unbound = binder(signature), binder(unbound_signature)
    if options.on_contention == "retry" and not takes_self:
        raise TypeError(
            f"on_contention='retry' needs a bound Celery task, but {func.__qualname__} "
            "takes no 'self' argument. Use @app.task(bind=True) and def "
            f"{func.__name__}(self, ...), or another on_contention."
        )
    plain_name = f"{func.__module__}.{func.__qualname__}"

    def lock_id(
        name: str, bound: bool, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> str:
        arguments = (bind_unbound if bound else bind_plain)(args, kwargs)
        return f"{name}-lock-{call_digest(name, arguments, options.key)}"

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        task_class = _celery_task_class()
        bound = (
            task_class is not None and bool(args) and isinstance(args[0], task_class)
        )
        task = args[0] if bound else _current_celery_task(wrapper)
        name = task.name if task is not None else plain_name
        if not bound and args and _is_django_task_context(args[0]):
            # Django's @task(takes_context=True) passes its TaskContext first.
            bound, name = True, args[0].task_result.task.module_path
        the_id = lock_id(name, bound, args[1:] if bound else args, kwargs)
        lock_options: dict[str, Any] = {
            "expire": options.expire,
            "cache": options.cache,
            "oid": getattr(getattr(task, "app", None), "oid", None),
            "renew": options.renew,
            "max_hold": options.max_hold
            if options.max_hold is not None
            else _time_limit(task),
            "on_lost": options.on_lost,
        }
        lock: Lock | Semaphore
        if options.limit is None or options.limit == 1:
            lock = _TaskLock(the_id, **lock_options)
        else:
            lock = _TaskSemaphore(the_id, options.limit, **lock_options)
        lock.task = task
        policy = options.on_contention or settings.ON_CONTENTION
        if not _acquire(lock, policy, options):
            return _contended(lock, policy, options, name, task if bound else None)
        if task is not None:
            _releasing_retry(task)
        reset = _held.set((*_held.get(), lock))
        try:
            return func(*args, **kwargs)
        finally:
            _held.reset(reset)
            lock.release_quietly()

    # Celery reads the signature (getfullargspec) to check a call's arguments
    # when it is sent; give it the function's, not (*args, **kwargs).
    wrapper.__signature__ = signature  # type: ignore[attr-defined]
    wrapper._tasklock_lock_id = lock_id  # type: ignore[attr-defined]
    wrapper._tasklock_name = plain_name  # type: ignore[attr-defined]
    wrapper._tasklock_options = options  # type: ignore[attr-defined]
    return cast(F, wrapper)


def current_lock() -> Lock | Semaphore | None:
    """The lock of the innermost ``@single_instance`` body running in this thread.

    For its ``fence`` (pass it with writes) and ``check()`` (between steps of
    long work); None outside such a body.
    """
    locks = _held.get()
    return locks[-1] if locks else None


def _time_limit(task: Any) -> float | None:
    """The hard time limit the worker enforces on this run of ``task``, if any."""
    if task is None:
        return None
    limits = getattr(getattr(task, "request", None), "timelimit", None)
    hard = limits[0] if limits else None
    if not hard:
        hard = getattr(task, "time_limit", None)
    if not hard:
        conf = getattr(getattr(task, "app", None), "conf", None)
        hard = getattr(conf, "task_time_limit", None)
    if isinstance(hard, bool) or not isinstance(hard, (int, float)) or hard <= 0:
        return None
    # A second more: the worker kills the run at the limit, counted from before
    # the lock was taken, and memcached (whole seconds) may end a lock up to a
    # second early; the lock must not go while the run may still be writing.
    return float(hard) + TIME_LIMIT_MARGIN


def lock_id_for(target: Callable[..., Any], /, *args: Any, **kwargs: Any) -> str:
    """The lock id a call of ``target`` with these arguments would use.

    ``target`` is a ``@single_instance`` function, or a Celery or Django task
    built on one (pass the arguments as for ``delay()``/``enqueue()``, without
    ``self`` or the context). The id is the same for every spelling of one call,
    and for its arguments after a JSON round trip.
    """
    function, name, bound = _decorated(target)
    result: str = function._tasklock_lock_id(name, bound, args, kwargs)
    return result


def lock_cache_for(target: Callable[..., Any], /) -> str | None:
    """The ``cache=`` alias ``target``'s ``@single_instance`` names, if any."""
    function, _name, _bound = _decorated(target)
    cache: str | None = function._tasklock_options.cache
    return cache


def _decorated(target: Callable[..., Any]) -> tuple[Any, str, bool]:
    """The ``@single_instance`` wrapper inside ``target``, the task name its lock
    ids start with, and whether its first argument is left out of them."""
    func = getattr(target, "func", None)
    # A django.tasks Task:
    if hasattr(target, "module_path") and hasattr(func, "_tasklock_lock_id"):
        return func, target.module_path, getattr(target, "takes_context", False)
    run = getattr(target, "run", None)
    if run is not None and hasattr(target, "name"):  # a Celery task
        function = getattr(run, "__func__", run)
        if hasattr(function, "_tasklock_lock_id"):
            return function, target.name, inspect.ismethod(run)
    if not hasattr(target, "_tasklock_lock_id"):
        raise TypeError(f"{target!r} is not decorated with @single_instance.")
    return target, target._tasklock_name, False  # type: ignore[attr-defined]


def _check_key(
    func: Callable[..., Any], key: KeySpec, signature: inspect.Signature
) -> None:
    if key is None or callable(key):
        return
    names = [key] if isinstance(key, str) else key
    if (
        not isinstance(names, (list, tuple))
        or not names
        or not all(isinstance(name, str) for name in names)
    ):
        raise TypeError(
            f"key= must be an argument name, a list of names or a callable, not {key!r}."
        )
    known = signature.parameters
    for name in names:
        if name not in known:
            raise ValueError(
                f"key= names {name!r}, which is not an argument of {func.__qualname__}; "
                f"its arguments are: {', '.join(known) or '(none)'}."
            )


def _acquire(lock: Lock | Semaphore, policy: str, options: _Options) -> bool:
    if policy != "wait":
        return lock.acquire()
    timeout = options.timeout if options.timeout is not None else settings.WAIT_TIMEOUT
    return lock.acquire(blocking=True, timeout=timeout)


def _contended(
    lock: Lock | Semaphore,
    policy: str,
    options: _Options,
    name: str,
    bound_task: Any,
) -> Any:
    if policy == "wait":
        policy = options.on_timeout
    if policy == "raise":
        raise LockNotAcquired(lock.lock_id)
    if policy == "retry":
        if bound_task is None:
            raise TypeError(
                f"on_contention='retry' needs a bound Celery task; {name} was called "
                "without one. Use @app.task(bind=True), or another on_contention."
            )
        countdown = (
            options.countdown
            if options.countdown is not None
            else settings.RETRY_COUNTDOWN
        )
        logger.info(
            "Retrying %s in %ss: lock %r is held by another run",
            name,
            countdown,
            lock.lock_id,
        )
        return bound_task.retry(countdown=countdown)
    logger.info("Skipped %s: lock %r is held by another run", name, lock.lock_id)
    return None
