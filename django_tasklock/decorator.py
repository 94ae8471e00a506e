"""``@single_instance``: one run at a time per task and arguments.

The decorator checks its options, makes the lock id of each call (task name and
the digest of its arguments) and hands each call to its mode: decorator ->
integrations (which framework runs the call) -> mode -> policies -> ``Lock``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast, overload

from .arguments import KeySpec, binder, call_digest, check_key
from .declared import name_alias
from .exceptions import InvalidArgumentType
from .integrations import install, starter
from .integrations.celery.park import install_park
from .modes import mode_for
from .modes.asynchronous import arun, refuse_async
from .options import ModeName, OnContention, OnDuplicate, OnParkFull, Options
from .runs import current_lock, retry_unbound
from .targets import lock_id_for, refuse_task_object

if TYPE_CHECKING:
    from .locks import OnLost
    from .modes import Mode
    from .runs import Run

    Begin = Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Run]

__all__ = ["current_lock", "lock_id_for", "single_instance"]

F = TypeVar("F", bound=Callable[..., Any])


@overload
def single_instance(func: F, /) -> F: ...


@overload
def single_instance(
    func: None = None,
    /,
    *,
    key: KeySpec = None,
    expire: float | None = None,
    on_contention: OnContention | None = None,
    timeout: float | None = None,
    on_timeout: Literal["skip", "raise"] = "skip",
    countdown: float | None = None,
    cache: str | None = None,
    renew: bool | None = None,
    max_hold: float | None = None,
    on_lost: OnLost = "warn",
    limit: int | None = None,
    mode: ModeName = "while_running",
    on_duplicate: OnDuplicate = "join",
    queue_expire: float | None = None,
    park: int | None = None,
    on_park_full: OnParkFull = "refuse",
) -> Callable[[F], F]: ...


def single_instance(
    func: F | None = None,
    /,
    *,
    key: KeySpec = None,
    expire: float | None = None,
    on_contention: OnContention | None = None,
    timeout: float | None = None,
    on_timeout: Literal["skip", "raise"] = "skip",
    countdown: float | None = None,
    cache: str | None = None,
    renew: bool | None = None,
    max_hold: float | None = None,
    on_lost: OnLost = "warn",
    limit: int | None = None,
    mode: ModeName = "while_running",
    on_duplicate: OnDuplicate = "join",
    queue_expire: float | None = None,
    park: int | None = None,
    on_park_full: OnParkFull = "refuse",
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
    ``on_timeout`` (``"skip"`` or ``"raise"``); ``"park"`` (a Celery task)
    parks the call beside its lock, at most ``park`` (default 100) in arrival
    order, each sent again with its task id when a run of its lock ends;
    ``on_park_full`` (``"refuse"``, ``"drop_oldest"``, ``"replace"``) says who
    leaves a full line (see the docs, Parking calls). ``cache``: a CACHES alias.

    ``renew`` (default ``TASKLOCK["RENEW"]``) keeps the lock alive with a
    heartbeat while the body runs, so ``expire`` can be short. ``max_hold``
    (seconds) caps how long the lock lasts; for a Celery task it defaults to the
    task's hard ``time_limit`` (from the call, the task or ``task_time_limit``)
    plus two seconds, so a lock ends about when the worker kills the run. ``on_lost="raise"`` makes
    ``current_lock().check()`` raise ``LockLost`` once the lock is found lost;
    ``current_lock().fence`` is the run's fencing token.

    ``limit`` (an int): at most that many runs at once per lock id instead of
    one, through a ``Semaphore`` of that many slots (``current_lock()`` is then
    the Semaphore); the contention policies apply when every slot is held.

    A body that raises, or calls ``self.retry()``, has released the lock before
    the retry is sent, so a retry never meets its own lock.

    On an ``async def`` function the wrapper is async too: the lock is taken,
    waited for and released on the event loop, and held while the body is
    awaited. ``retry`` and the modes that publish are refused there (they need
    a sync task).
    """
    options = Options(
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
        mode=mode,
        on_duplicate=on_duplicate,
        queue_expire=queue_expire,
        park=park,
        on_park_full=on_park_full,
    )
    if func is None:
        return lambda function: _decorate(function, options)
    if not callable(func):
        raise InvalidArgumentType(
            "single_instance takes the function to decorate, or keyword options only: "
            f"@single_instance(key=...), not @single_instance({func!r})."
        )
    return _decorate(func, options)


def _decorate(func: F, options: Options) -> F:
    refuse_task_object(func, "single_instance")
    mode = mode_for(options)
    if mode.publishes:
        install()
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
    check_key(func, options.key, signature)
    bind_plain, bind_unbound = binder(signature), binder(unbound_signature)
    if options.on_contention == "retry" and not takes_self:
        raise InvalidArgumentType(retry_unbound(func.__qualname__))
    if options.on_contention == "park":
        install_park(options.cache)
    plain_name = f"{func.__module__}.{func.__qualname__}"
    if options.cache is not None:
        name_alias(options.cache, plain_name)

    def lock_id(
        name: str, bound: bool, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> str:
        arguments = (bind_unbound if bound else bind_plain)(args, kwargs)
        return f"{name}-lock-{call_digest(name, arguments, options.key)}"

    begin = starter(func, options, lock_id, plain_name, mode.publishes)
    if inspect.iscoroutinefunction(func):
        refuse_async(plain_name, options)
    wrapper = _wrap(func, mode, begin)

    # Celery reads the signature (getfullargspec) to check a call's arguments
    # when it is sent; give it the function's, not (*args, **kwargs).
    wrapper.__signature__ = signature  # type: ignore[attr-defined]
    wrapper._tasklock_lock_id = lock_id  # type: ignore[attr-defined]
    wrapper._tasklock_name = plain_name  # type: ignore[attr-defined]
    wrapper._tasklock_options = options  # type: ignore[attr-defined]
    wrapper._tasklock_mode = mode  # type: ignore[attr-defined]
    return cast(F, wrapper)


def _wrap(func: Callable[..., Any], mode: Mode, begin: Begin) -> Callable[..., Any]:
    """The wrapper over ``func``: each call begun (``begin``) and run by its
    mode; awaited, on the event loop, for an ``async def`` function."""
    if inspect.iscoroutinefunction(func):

        @functools.wraps(func)
        async def awaited(*args: Any, **kwargs: Any) -> Any:
            return await arun(mode, begin(awaited, args, kwargs))

        return awaited
    on_run = mode.on_run

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return on_run(begin(wrapper, args, kwargs))

    return wrapper
