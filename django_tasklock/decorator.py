"""``@single_instance``: one run at a time per task and arguments."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import sys
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, Literal, NoReturn, TypeVar, cast, overload

from .arguments import KeySpec, binder, call_digest
from .backends import backend_for
from .calls import (
    DUPLICATE_POLICIES,
    MODES,
    call_of,
    handed_to_autoretry,
    queue_life,
    queue_lock_id,
    queued,
    running_result_id,
    started,
    store_error,
)
from .conf import (
    CONTENTION_POLICIES,
    TIMEOUT_POLICIES,
    settings,
    validate_bool,
    validate_choice,
    validate_expire,
    validate_seconds,
)
from .exceptions import LockBackendError, LockNotAcquired
from .locks import ON_LOST_POLICIES, Lock, OnLost
from .registry import name_alias
from .semaphores import Semaphore, validate_limit
from .tokens import holder_alive

__all__ = ["current_lock", "lock_id_for", "single_instance"]

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])
Policy = Literal["skip", "raise", "retry", "wait"]
Mode = Literal["while_running", "until_finished", "until_started", "coalesce"]
OnDuplicate = Literal["join", "raise", "replace"]

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


def _celery_tasks_here(state: Any) -> bool:
    """False when no Celery task runs in this thread (nothing to look up); True
    when one may.

    ``get_current_task()`` costs a raised and caught exception when the stack
    is empty, more than the rest of a lock id; Celery's thread-local stack keeps
    an entry per thread only while something is pushed, which is cheap to ask.
    Any other make of stack is simply asked.
    """
    local = getattr(getattr(state, "_task_stack", None), "_local", None)
    storage = getattr(local, "__storage__", None)
    if type(storage) is not dict:
        return True
    return local.__ident_func__() in storage  # type: ignore[union-attr]


def _current_celery_task(wrapper: Callable[..., Any]) -> Any:
    """The Celery task whose run() is ``wrapper``, if one is executing it."""
    state = sys.modules.get("celery._state")
    if state is None or not _celery_tasks_here(state):
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
                # An until_finished call's lock is handed to the retry as it is
                # sent (see calls), never freed in between.
                if not getattr(lock, "hands_over", False):
                    lock.release_quietly()
                break
        return original(*args, **kwargs)

    retry._tasklock_releases = True  # type: ignore[attr-defined]
    task.retry = retry


class _TaskLock(Lock):
    """A Lock that remembers which task instance and call hold it."""

    task: Any = None
    #: The task id of the worker's call holding it, if any.
    call_id: str | None = None
    #: True when a retry takes the lock over as it is sent (until_finished).
    hands_over = False


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
    mode: Mode = "while_running",
    on_duplicate: OnDuplicate = "join",
    queue_expire: float | None = None,
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
    mode: Mode = "while_running",
    on_duplicate: OnDuplicate = "join",
    queue_expire: float | None = None,
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
    validate_choice(mode, name="mode", choices=MODES)
    validate_choice(on_duplicate, name="on_duplicate", choices=DUPLICATE_POLICIES)
    if queue_expire is not None:
        validate_expire(queue_expire, name="queue_expire")
    if mode != "while_running" and limit not in (None, 1):
        raise TypeError(
            f"limit= works with mode='while_running' only, not mode={mode!r}: a call "
            "is pending under one lock id. Drop limit=, or the mode."
        )
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
        mode=mode,
        on_duplicate=on_duplicate,
        queue_expire=queue_expire,
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
    mode: str = "while_running"
    on_duplicate: str = "join"
    queue_expire: float | None = None


def _decorate(func: F, options: _Options) -> F:
    if options.mode != "while_running":
        from .calls import install

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
    _check_key(func, options.key, signature)
    bind_plain, bind_unbound = binder(signature), binder(unbound_signature)
    if options.on_contention == "retry" and not takes_self:
        raise TypeError(_retry_unbound(func.__qualname__))
    plain_name = f"{func.__module__}.{func.__qualname__}"
    if options.cache is not None:
        name_alias(options.cache, plain_name)

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
        oid = max_hold = request = None
        if task is not None:
            oid = getattr(getattr(task, "app", None), "oid", None)
            max_hold = _time_limit(task)
            request = getattr(task, "request", None)
        if options.max_hold is not None:
            max_hold = options.max_hold
        call_id: str | None = (
            request.id
            if request is not None and not request.called_directly and request.id
            else None
        )
        mode = options.mode
        if call_id is None and mode != "while_running" and task is None:
            # django.tasks: its context, or the task_started signal, names it.
            context = args[0] if bound else None
            call_id = (
                context.task_result.id if context is not None else running_result_id()
            )
        if call_id is not None and mode == "until_started":
            run_lock = _TaskLock(
                f"{the_id}-run-{call_id}",
                expire=options.expire,
                cache=options.cache,
                oid=oid,
                renew=options.renew,
                max_hold=max_hold,
                on_lost=options.on_lost,
            )
            run_lock.owner += "#" + call_id
            return _run_started(
                func, args, kwargs, the_id, call_id, options, name, task, run_lock
            )
        # One slot (limit 1) is a Lock; more are a Semaphore's.
        kind: Callable[..., _TaskLock | _TaskSemaphore] = _TaskLock
        if options.limit is not None and options.limit != 1:
            kind = functools.partial(_TaskSemaphore, limit=options.limit)
        lock = kind(
            the_id,
            expire=options.expire,
            cache=options.cache,
            oid=oid,
            renew=options.renew,
            max_hold=max_hold,
            on_lost=options.on_lost,
        )
        if isinstance(lock, _TaskLock) and call_id is not None:
            # The token names the call, for a second delivery of its message
            # and for ``tasklock status``.
            lock.owner += "#" + call_id
            lock.call_id = call_id
            if mode == "until_finished":
                lock._take_over = queued(call_id)
                lock.hands_over = True
        lock.task = task
        policy = options.on_contention or settings.ON_CONTENTION
        if policy == "retry" and (task is None or not bound):
            # Refused before the lock is tried: a duplicate that met the lock
            # could no longer be retried, and would be lost.
            raise TypeError(_retry_unbound(name))
        if call_id is not None and mode == "coalesce":
            policy = "wait"  # a pending call is never dropped: it waits its turn
        if call_id is None:
            acquired = _acquire(lock, policy, options)
        else:
            # A worker's call: a lock held by this very call is a second
            # delivery of its message, told apart before any wait.
            acquired = lock.acquire()
            if not acquired:
                verdict = _redelivery(lock, call_id, name)
                if verdict is _DROP:
                    return _dropped(task)
                if verdict is _DEFER:
                    return _defer(task, lock, name)
                if verdict is _FREED or policy == "wait":
                    acquired = _acquire(lock, policy, options)
        if not acquired:
            if call_id is not None:
                if mode == "coalesce" and task is not None:
                    return _send_again(task, lock, options, name)
                if mode == "coalesce":  # django.tasks: no way to send it again
                    raise LockNotAcquired(lock.lock_id)
            return _contended(lock, policy, options, name, task, bound)
        if call_id is not None and mode == "coalesce":
            _leave_queue(lock, call_id, options)
        if task is not None:
            _releasing_retry(task)
        reset = _held.set((*_held.get(), lock))
        try:
            return func(*args, **kwargs)
        except BaseException as exc:
            handing = isinstance(lock, _TaskLock) and lock.hands_over
            if handing and _will_autoretry(task, exc):
                _hand_to_autoretry(lock, task, options)  # type: ignore[arg-type]
            raise
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


def _retry_unbound(name: str) -> str:
    return (
        f"on_contention='retry' needs a bound Celery task, but {name} runs without "
        "one (no Celery task as its first argument, 'self'), so a duplicate could "
        "not be retried and would be lost. Use @app.task(bind=True) with "
        "def f(self, ...), or another on_contention."
    )


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


def lock_mode_for(target: Callable[..., Any], /) -> str:
    """The ``mode=`` of ``target``'s ``@single_instance``."""
    function, _name, _bound = _decorated(target)
    mode: str = function._tasklock_options.mode
    return mode


def _decorated(target: Callable[..., Any]) -> tuple[Any, str, bool]:
    """The ``@single_instance`` wrapper inside ``target``, the task name its lock
    ids start with, and whether its first argument is left out of them."""
    func = getattr(target, "func", None)
    # A django.tasks Task:
    if hasattr(target, "module_path") and hasattr(func, "_tasklock_lock_id"):
        return func, target.module_path, getattr(target, "takes_context", False)
    # autoretry_for replaces a task's run with a plain function over the
    # original bound method, kept as _orig_run.
    run = getattr(target, "_orig_run", None) or getattr(target, "run", None)
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
    task: Any,
    bound: bool,
) -> Any:
    if policy == "wait":
        policy = options.on_timeout
    if policy == "skip" and _in_canvas(task):
        # A chain's next link, a group's result or a chord's callback would get
        # None as if this run had succeeded: fail it visibly instead.
        logger.info(
            "%s is part of a chain, group or chord and lock %r is held by another "
            "run: failing it with LockNotAcquired instead of skipping it",
            name,
            lock.lock_id,
        )
        policy = "raise"
    if policy == "raise":
        raise LockNotAcquired(lock.lock_id)
    if policy == "retry":
        if not bound:
            raise TypeError(_retry_unbound(name))
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
        return task.retry(countdown=countdown)
    logger.info("Skipped %s: lock %r is held by another run", name, lock.lock_id)
    return None


def _in_canvas(task: Any) -> bool:
    """True if this run of ``task`` is a member of a chain, group or chord."""
    request = getattr(task, "request", None)
    if request is None or getattr(request, "called_directly", True):
        return False
    return bool(
        getattr(request, "callbacks", None)
        or getattr(request, "chain", None)
        or getattr(request, "chord", None)
        or getattr(request, "group", None)
    )


# -- the worker's side of the enqueue-time modes (see calls) ------------------------


def _ignore() -> BaseException:
    from celery.exceptions import Ignore

    ignore: BaseException = Ignore()
    return ignore


def _dropped(task: Any) -> None:
    """End a second delivery: Celery's Ignore (no state is stored for it), or
    None under django.tasks."""
    if task is not None:
        raise _ignore()


#: What a call finds when the lock it meets names the call itself.
_DROP, _FREED, _DEFER = object(), object(), object()
#: The longest a copy whose run's host cannot be asked is put back for.
MAX_DEFER = 3600.0


def _redelivery(lock: Lock | Semaphore, call_id: str, name: str) -> object:
    """What to do with a call whose lock is held, if the holder is this very
    call (its message delivered again); None if it is not.

    ``_DROP``: the run holding it is alive, so this copy must not run beside it.
    ``_FREED``: the run's process on this host is gone (killed, out of memory;
    Celery redelivers with ``task_reject_on_worker_lost``): its lock was
    removed, owner-checked, and this copy may take it. ``_DEFER``: the run is
    on another host, whose processes cannot be looked at from here: the copy
    goes back to the broker until the lock would have expired.
    """
    if not isinstance(lock, Lock):
        return None  # a Semaphore's slots do not name the call
    backend, key = lock._backend()
    try:
        peek = backend.peek(key)
    except backend.errors:
        return None
    holder = None if peek is None else call_of(peek.value)
    if peek is None or holder is None or holder[1] != call_id:
        return None
    if holder[0] == "queued":
        return None  # its own queued mark: taken over by the acquire
    alive = holder_alive(peek.value)
    if alive is None:
        return _DEFER
    if alive:
        logger.warning(
            "Dropped a second delivery of %s[%s]: that call is already running "
            "(lock %r). The broker delivered its message again (a visibility "
            "timeout or acks_late redelivery).",
            name,
            call_id,
            lock.lock_id,
        )
        return _DROP
    try:
        freed = backend.release(key, peek.hold, peek.value)
    except backend.errors:
        freed = False
    logger.warning(
        "%s[%s] was delivered again after the process running it (%s) died; %s",
        name,
        call_id,
        peek.value,
        "its lock was removed and this copy runs"
        if freed
        else "its lock changed meanwhile, and this copy takes its chances",
    )
    return _FREED


def _defer(task: Any, lock: Lock | Semaphore, name: str) -> Any:
    """A copy of a call running on another host: sent back to the broker until
    the lock would have expired, so a run that died there is not lost; it runs
    then if nothing holds the lock (never beside the first run)."""
    if task is None or not isinstance(lock, Lock):
        raise LockNotAcquired(lock.lock_id)  # django.tasks: no way to send it again
    try:
        left = lock.ttl()
    except LockBackendError:
        left = None
    countdown = min(MAX_DEFER, (left if left is not None else 0.0) + 1.0)
    logger.warning(
        "%s[%s] was delivered again while lock %r names its run on another host, "
        "whose process cannot be looked at from here; sent again with a countdown "
        "of %.0fs (the lock's time left), to run then if the lock is free.",
        name,
        task.request.id,
        lock.lock_id,
        countdown,
    )
    _send_back(task, countdown)


def _send_back(task: Any, countdown: float) -> NoReturn:
    """Put this very call (same task id) back on the broker, and end this run
    of it without a state of its own (Celery's Ignore)."""
    task.signature_from_request(task.request, countdown=countdown).apply_async()
    raise _ignore()


def _send_again(task: Any, lock: Lock | Semaphore, options: _Options, name: str) -> Any:
    """coalesce: the running call outlasted the wait; this pending call goes
    back to the broker (same task id, still pending) instead of being dropped."""
    countdown = (
        options.countdown if options.countdown is not None else settings.RETRY_COUNTDOWN
    )
    logger.info(
        "%s[%s] waited for lock %r in vain; sent again with a countdown of %ss",
        name,
        task.request.id,
        lock.lock_id,
        countdown,
    )
    _send_back(task, countdown)


def _leave_queue(lock: Lock | Semaphore, call_id: str, options: _Options) -> None:
    """coalesce: the call runs now; a call made from here on is a new one."""
    backend, _key = lock._backend()  # type: ignore[union-attr]
    key = backend.keys_for(queue_lock_id(lock.lock_id, "coalesce"))[0]
    try:
        backend.discard(key, queued(call_id))
    except backend.errors:
        logger.exception(
            "Could not clear the pending mark of call %s; calls made during this "
            "run join it until it expires",
            call_id,
        )


def _will_autoretry(task: Any, exc: BaseException) -> bool:
    """True if Celery's ``autoretry_for`` is about to retry ``task`` for ``exc``."""
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


def _hand_to_autoretry(lock: _TaskLock, task: Any, options: _Options) -> None:
    """Keep the call's lock across the retry ``autoretry_for`` sends next."""
    retry_kwargs = getattr(task, "retry_kwargs", None) or {}
    delay = max(
        float(retry_kwargs.get("countdown") or 0),
        float(getattr(task, "default_retry_delay", 0) or 0),
        float(getattr(task, "retry_backoff_max", 0) or 0)
        if getattr(task, "retry_backoff", False)
        else 0.0,
    )
    assert lock.call_id is not None
    try:
        if lock.hand_over(
            queued(lock.call_id), queue_life(options.queue_expire, delay)
        ):
            handed_to_autoretry(lock.call_id, lock.lock_id, options)
    except LockBackendError:
        logger.exception("Could not keep lock %r for the retry", lock.lock_id)


def _run_started(
    func: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    lock_id: str,
    call_id: str,
    options: _Options,
    name: str,
    task: Any,
    run_lock: _TaskLock,
) -> Any:
    """until_started: mark the call started (a new call may be queued from now
    on) and run the body. The call-wide lock is free for a newer call while it
    runs; ``run_lock``, named after this call, tells a second delivery of its
    message (which a newer call's mark no longer shows) from a new call."""
    if not run_lock.acquire():
        verdict = _redelivery(run_lock, call_id, name)
        if verdict is _DEFER:
            return _defer(task, run_lock, name)
        if verdict is not _FREED or not run_lock.acquire():
            if verdict is not _DROP:
                logger.warning(
                    "Dropped a second delivery of %s[%s]: that call is already "
                    "running (lock %r).",
                    name,
                    call_id,
                    run_lock.lock_id,
                )
            return _dropped(task)
    # current_lock() is the run's lock, and a self.retry() frees it before the
    # retry is sent (its copy would look like a second delivery).
    run_lock.task = task
    if task is not None:
        _releasing_retry(task)
    reset = _held.set((*_held.get(), run_lock))
    try:
        return _run_marked(func, args, kwargs, lock_id, call_id, options)
    finally:
        _held.reset(reset)
        run_lock.release_quietly()


def _run_marked(
    func: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    lock_id: str,
    call_id: str,
    options: _Options,
) -> Any:
    alias = options.cache or settings.CACHE
    backend = backend_for(alias, protocol=settings.MEMCACHED_PROTOCOL)
    key = backend.keys_for(lock_id)[0]
    mark = started(call_id)
    expire = options.expire if options.expire is not None else settings.LOCK_EXPIRE
    try:
        peek = backend.peek(key)
        if peek is not None and peek.value == queued(call_id):
            backend.replace(key, peek.hold, peek.value, mark, expire)
        elif peek is None:
            backend.acquire(key, mark, expire)
    except backend.errors as exc:
        raise store_error(backend, lock_id, "mark the call started", exc) from exc
    try:
        return func(*args, **kwargs)
    finally:
        try:
            backend.discard(key, mark)
        except backend.errors:
            logger.exception("Could not clear the started mark of lock %r", lock_id)
