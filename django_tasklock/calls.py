"""A call's lock from ``.delay()`` to its end: the enqueue-time modes of
``@single_instance`` (see README, Stopping duplicates at ``.delay()``).

A call is published with its lock taken: the store holds ``queued:<task id>``
under the call's lock id. A worker starting that task id takes the lock over in
one conditional write, storing its run's token, which names the task id too
(``...@host#<task id>:pid:...``). So every message is matched to one call, and
a copy of a message delivered twice (a broker's redelivery) finds its own call
already running and is dropped.

Every way a Celery task reaches the broker goes through ``Celery.send_task``:
``delay()``, ``apply_async()``, canvas members, ``send_task()`` by name, beat
and ``retry()``. That one method is wrapped, once per process, when the first
task with an enqueue-time mode is decorated; a task without one costs a dict
lookup there. Celery itself is imported only then.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
import uuid
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Final, NamedTuple

from . import pending
from .backends import LockBackend, Peek, backend_for
from .conf import MAX_EXPIRE, settings
from .exceptions import AlreadyQueued, LockBackendError, LockUsageError
from .locks import Lock
from .signals import call_deduplicated
from .tokens import token_owner

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = [
    "DUPLICATE_POLICIES",
    "MODES",
    "QUEUE_SUFFIX",
    "call_of",
    "install",
    "queue_lock_id",
    "queued",
]

logger = logging.getLogger(__name__)

#: ``while_running``: the lock is taken when the body starts (the default).
#: ``until_finished``: from ``.delay()`` until the call is over.
#: ``until_started``: from ``.delay()`` until a worker starts it (debounce).
#: ``coalesce``: one pending call plus one running.
MODES: Final = ("while_running", "until_finished", "until_started", "coalesce")
#: What a duplicate ``.delay()`` gets: the pending call's result, an
#: ``AlreadyQueued`` exception, or its place (the pending call is revoked).
DUPLICATE_POLICIES: Final = ("join", "raise", "replace")
#: Appended to the lock id of a ``coalesce`` task for its pending call's lock.
QUEUE_SUFFIX: Final = "-queued"

_QUEUED: Final = "queued:"
_STARTED: Final = "started:"
# Options that make a message part of a canvas: its links belong to it, so it
# is never merged into another call.
_CANVAS: Final = ("link", "link_error", "chord", "group_id", "chain")
# How often a publish looks again when the lock changes hands under it.
_TRIES: Final = 5
# The call being sent again runs in another thread or process.
_ELSEWHERE: Final = object()


def queued(task_id: str) -> str:
    """The value stored for a call that is published and not yet started."""
    return _QUEUED + task_id


def started(task_id: str) -> str:
    """The value an ``until_started`` call leaves when a worker starts it."""
    return _STARTED + task_id


def call_of(value: object) -> tuple[str, str] | None:
    """``(state, task id)`` of the call a stored value names: ``"queued"``,
    ``"started"`` or ``"running"``; None for any other value (a lock taken
    outside a worker, or by other code)."""
    if not isinstance(value, str):
        return None
    if value.startswith(_QUEUED):
        return "queued", value[len(_QUEUED) :]
    if value.startswith(_STARTED):
        return "started", value[len(_STARTED) :]
    owner = token_owner(value)
    if owner is None:
        return None
    _name, sep, task_id = owner[0].partition("#")
    return ("running", task_id) if sep and task_id else None


def queue_lock_id(lock_id: str, mode: str) -> str:
    """The lock id a pending call of ``mode`` is held under."""
    return lock_id + QUEUE_SUFFIX if mode == "coalesce" else lock_id


def queue_life(queue_expire: float | None, delay: float = 0.0) -> float:
    """Seconds a pending call's lock lasts: its countdown or ETA, plus
    ``queue_expire`` (default ``TASKLOCK['QUEUE_EXPIRE']``)."""
    allowance = queue_expire if queue_expire is not None else settings.QUEUE_EXPIRE
    return min(max(delay, 0.0) + allowance, MAX_EXPIRE)


class Spec(NamedTuple):
    """What the publish hook needs of a decorated task."""

    lock_id: Callable[[str, bool, tuple[Any, ...], dict[str, Any]], str]
    name: str
    bound: bool
    options: Any  # decorator._Options


def spec_of(task: Any) -> Spec | None:
    """The enqueue-time spec of a Celery task; None for any other task."""
    from .decorator import _decorated

    try:
        function, name, bound = _decorated(task)
    except TypeError:
        return None
    options = function._tasklock_options
    if options.mode == "while_running":
        return None
    return Spec(function._tasklock_lock_id, name, bound, options)


def _store(options: Any) -> tuple[LockBackend, str]:
    alias: str = options.cache or settings.CACHE
    return backend_for(alias, protocol=settings.MEMCACHED_PROTOCOL), alias


def store_error(
    backend: LockBackend, lock_id: str, doing: str, exc: BaseException
) -> LockBackendError:
    return LockBackendError(
        f"Could not {doing}: {type(exc).__name__}: {exc}",
        lock_id=lock_id,
        store=backend.describe(backend.keys_for(lock_id)[0]),
    )


# -- publishing ---------------------------------------------------------------------


def _delay(app: Any, countdown: object, eta: object) -> float:
    """Seconds until the message may run."""
    if isinstance(countdown, (int, float)) and not isinstance(countdown, bool):
        return float(countdown)
    if isinstance(eta, str):
        eta = datetime.datetime.fromisoformat(eta)
    if isinstance(eta, datetime.datetime):
        now = app.now() if eta.tzinfo is not None else datetime.datetime.now()
        return (eta - now).total_seconds()
    return 0.0


class _Publish:
    """One ``send_task`` of a task with an enqueue-time mode."""

    def __init__(
        self,
        original: Callable[..., Any],
        app: Any,
        spec: Spec,
        task: Any,
        name: str,
        call: tuple[Any, ...],
        options: dict[str, Any],
    ) -> None:
        self.original, self.app, self.spec, self.task = original, app, spec, task
        self.name = name
        self.args, self.kwargs, self.countdown, self.eta, self.given_id = call
        self.options = options
        self.mode: str = spec.options.mode
        self.lock_id = spec.lock_id(
            spec.name, spec.bound, tuple(self.args or ()), dict(self.kwargs or {})
        )
        self.queue_id = queue_lock_id(self.lock_id, self.mode)
        self.backend, self.alias = _store(spec.options)
        self.key = self.backend.keys_for(self.queue_id)[0]
        self.task_id: str = self.given_id or str(uuid.uuid4())
        self.value = queued(self.task_id)
        self.life = queue_life(
            spec.options.queue_expire, _delay(app, self.countdown, self.eta)
        )

    def send(self) -> Any:
        for _ in range(_TRIES):
            try:
                outcome = self._claim()
            except self.backend.errors as exc:
                raise self._unknown_fate(exc) from exc
            if outcome is not None:
                return outcome()
        raise LockBackendError(
            f"The lock changed hands {_TRIES} times while this call was being sent; "
            "nothing was sent. Send it again",
            lock_id=self.queue_id,
            store=self.backend.describe(self.key),
        )

    def _unknown_fate(self, exc: BaseException) -> LockBackendError:
        """The error for a store call that failed while writing this call's
        mark. The write may still be carried out (a store paused past the
        client's timeout, a reply lost): the mark would then name a call no
        broker ever saw, and identical calls would join it. Nothing was sent,
        so it is removed, owner-checked, as soon as the store answers."""
        if not self.backend.lost_with_store(exc):
            pending.watch(
                self.queue_id,
                self.alias,
                settings.MEMCACHED_PROTOCOL,
                self.key,
                self.value,
            )
        return store_error(self.backend, self.queue_id, "take the call's lock", exc)

    def _claim(self) -> Callable[[], Any] | None:
        """What to do, once the store has been asked; None: ask again."""
        backend, key, value = self.backend, self.key, self.value
        if backend.acquire(key, value, self.life) is not None:
            return self._publish
        peek = backend.peek(key)
        if peek is None:
            return None  # released in between
        holder = call_of(peek.value)
        if holder is not None and holder[1] == self.task_id:
            # The same call sent again: its own retry, or a re-publish.
            handed = self._hand_over(peek, running=holder[0] == "running")
            if handed is _ELSEWHERE:
                # Sent again while it runs in another thread or process: that
                # run keeps its lock, and this copy is dropped when it starts.
                return self._publish_unclaimed
            if handed is None:
                return None
            return self._publish
        if holder is not None and holder[0] == "started":
            # until_started: a call that has started does not count.
            if backend.replace(key, peek.hold, peek.value, value, self.life) is None:
                return None
            return self._publish
        if self.given_id is not None or any(self.options.get(o) for o in _CANVAS):
            logger.info(
                "Sent %s[%s] although call %s holds lock %r: a call with a task id "
                "of its own or with canvas links is never merged into another; it "
                "takes the lock when it starts.",
                self.name,
                self.task_id,
                holder[1] if holder else "(unknown)",
                self.queue_id,
            )
            return self._publish_unclaimed
        outcome: Callable[[], Any] = self._duplicate(holder, peek)
        return outcome

    def _hand_over(self, peek: Peek, *, running: bool) -> object:
        """Make the lock this message's: the new hold, None if it changed in
        between, or ``_ELSEWHERE`` if the call runs elsewhere."""
        # The running call retrying itself holds the lock in this thread: it
        # hands it over, so its heartbeat stops and it does not report a loss.
        from .decorator import _held

        for lock in reversed(_held.get()):
            if (
                isinstance(lock, Lock)
                and getattr(lock, "call_id", None) == self.task_id
                and lock.lock_id == self.queue_id
            ):
                return True if lock.hand_over(self.value, self.life) else None
        if running:
            return _ELSEWHERE
        return self.backend.replace(
            self.key, peek.hold, peek.value, self.value, self.life
        )

    def _call_original(self) -> Any:
        return self.original(
            self.app,
            self.name,
            self.args,
            self.kwargs,
            self.countdown,
            self.eta,
            self.task_id,
            **self.options,
        )

    def _publish_unclaimed(self) -> Any:
        return self._call_original()

    def _publish(self, restore: Peek | None = None) -> Any:
        try:
            return self._call_original()
        except BaseException:
            self._roll_back(restore)
            raise

    def _roll_back(self, restore: Peek | None) -> None:
        """The publish failed: nothing was sent, so nothing may stay locked."""
        backend = self.backend
        try:
            if restore is not None:
                hold = backend.peek(self.key)
                if hold is not None and hold.value == self.value:
                    backend.replace(
                        self.key, hold.hold, hold.value, str(restore.value), self.life
                    )
                    return
            backend.discard(self.key, self.value)
        except backend.errors as exc:
            self._unknown_fate(exc)

    def _duplicate(self, holder: tuple[str, str] | None, peek: Peek) -> Any:
        holder_id = None if holder is None else holder[1]
        policy = self.spec.options.on_duplicate
        if holder is None:
            # Held by a run outside any worker (a direct call), or by other
            # code: there is no call to join.
            if policy == "raise":
                self._announce(holder_id, "raised")
                raise AlreadyQueued(None, self.queue_id)
            logger.info(
                "Sent %s[%s]: lock %r is held outside a task call (%r), so there "
                "is no pending call to join; it takes the lock when it starts.",
                self.name,
                self.task_id,
                self.queue_id,
                peek.value,
            )
            return self._publish_unclaimed
        assert holder_id is not None
        if policy == "replace" and holder[0] == "queued":
            return lambda: self._replace(holder_id, peek)
        if policy == "raise":
            self._announce(holder_id, "raised")
            raise AlreadyQueued(holder_id, self.queue_id)
        self._announce(holder_id, "joined")
        result_cls = self.options.get("result_cls") or self.app.AsyncResult
        return lambda: result_cls(holder_id)

    def _replace(self, holder_id: str, peek: Peek) -> Any:
        backend = self.backend
        try:
            replaced = backend.replace(
                self.key, peek.hold, peek.value, self.value, self.life
            )
        except backend.errors as exc:
            raise self._unknown_fate(exc) from exc
        if replaced is None:
            return self.send()  # it changed meanwhile: look again
        result = self._publish(restore=peek)
        # Only once this call is out. Should the revoke not reach a worker, the
        # pending call meets the newer call's lock when it starts, and its
        # on_contention decides (skipped by default).
        try:
            self.app.control.revoke(holder_id)
        except Exception:
            logger.warning(
                "Could not revoke call %s, replaced by %s under lock %r; when it "
                "starts it meets the newer call's lock (see on_contention).",
                holder_id,
                self.task_id,
                self.queue_id,
                exc_info=True,
            )
        self._announce(holder_id, "replaced")
        return result

    def _announce(self, holder_id: str | None, action: str) -> None:
        logger.info(
            "Not sent %s[%s] as a call of its own: call %s is pending or running "
            "under lock %r (mode %s); %s.",
            self.name,
            self.task_id,
            holder_id,
            self.queue_id,
            self.mode,
            {
                "joined": "the caller got that call's result",
                "raised": "AlreadyQueued raised",
                "replaced": "that call was revoked and this one sent in its place",
            }[action],
        )
        if call_deduplicated.receivers:
            call_deduplicated.send_robust(
                self.task,
                lock_id=self.queue_id,
                task_id=holder_id,
                new_id=self.task_id,
                mode=self.mode,
                action=action,
            )


_installed: list[bool] = []
_install_lock = threading.Lock()


def _specs(app: Any) -> dict[str, Spec | None]:
    specs: dict[str, Spec | None] | None = app.__dict__.get("_tasklock_specs")
    if specs is None:
        specs = app.__dict__["_tasklock_specs"] = {}
    return specs


def _spec_for(app: Any, name: str, task: Any) -> tuple[Spec | None, Any]:
    specs = _specs(app)
    spec = specs.get(name, False)
    if spec is not False:
        return spec, task  # type: ignore[return-value]
    if task is None:
        try:
            task = app.tasks.get(name)
        except RuntimeError:  # not finalized, and autofinalize is off
            return None, None
    found = None if task is None else spec_of(task)
    if task is not None:
        specs[name] = found
    return found, task


def install() -> None:
    """Wrap ``Celery.send_task`` and ``django.tasks``' ``Task.enqueue``, and
    connect the signals of either side, once per process."""
    if _installed:
        return
    with _install_lock:
        if _installed:
            return
        _install_celery()
        _install_django_tasks()
        _installed.append(True)


def _install_celery() -> None:
    try:
        from celery import Celery, signals
    except ImportError:  # Celery is optional: django.tasks only
        return
    original = Celery.send_task

    def send_task(
        self: Any,
        name: str,
        args: Any = None,
        kwargs: Any = None,
        countdown: Any = None,
        eta: Any = None,
        task_id: Any = None,
        *more: Any,
        **options: Any,
    ) -> Any:
        spec, task = (
            (None, None) if more else _spec_for(self, name, options.get("task_type"))
        )
        if spec is None:
            return original(
                self, name, args, kwargs, countdown, eta, task_id, *more, **options
            )
        call = (args, kwargs, countdown, eta, task_id)
        return _Publish(original, self, spec, task, name, call, options).send()

    send_task.__wrapped__ = original  # type: ignore[attr-defined]
    send_task.__doc__ = original.__doc__
    Celery.send_task = send_task
    signals.task_revoked.connect(
        _on_revoked, weak=False, dispatch_uid="django_tasklock.revoked"
    )
    signals.task_postrun.connect(
        _on_postrun, weak=False, dispatch_uid="django_tasklock.postrun"
    )


# -- django.tasks (Django 6+) ---------------------------------------------------------

#: The pending mark of the enqueue in progress in this thread: (backend, key,
#: placeholder value, life). The backend's task_enqueued signal names the new
#: result's id, which replaces the placeholder before the task can start.
_enqueuing: ContextVar[tuple[LockBackend, str, str, float] | None] = ContextVar(
    "tasklock_enqueuing", default=None
)
#: The id of the django.tasks result whose task this thread runs (task_started).
_running_result: ContextVar[str | None] = ContextVar(
    "tasklock_running_result", default=None
)
# How long a duplicate waits for an enqueue in progress to learn its result id.
_ENQUEUING_WAIT: Final = 5.0
_ENQUEUING_PREFIX: Final = "enqueuing-"


def running_result_id() -> str | None:
    """The django.tasks result id of the task this thread runs, if any."""
    return _running_result.get()


def _install_django_tasks() -> None:
    try:
        from django.tasks import base as tasks_base
        from django.tasks import signals as task_signals
    except ImportError:  # Django < 6
        return
    original = tasks_base.Task.enqueue

    def enqueue(self: Any, *args: Any, **kwargs: Any) -> Any:
        spec = spec_of(self)
        if spec is None:
            return original(self, *args, **kwargs)
        return _enqueue_django(original, self, spec, args, kwargs)

    async def aenqueue(self: Any, *args: Any, **kwargs: Any) -> Any:
        from asgiref.sync import sync_to_async

        if spec_of(self) is None:
            return await original_async(self, *args, **kwargs)
        return await sync_to_async(enqueue)(self, *args, **kwargs)

    original_async = tasks_base.Task.aenqueue
    enqueue.__wrapped__ = original  # type: ignore[attr-defined]
    tasks_base.Task.enqueue = enqueue  # type: ignore[method-assign]
    tasks_base.Task.aenqueue = aenqueue  # type: ignore[method-assign]
    task_signals.task_enqueued.connect(
        _on_enqueued, weak=False, dispatch_uid="django_tasklock.enqueued"
    )
    task_signals.task_started.connect(
        _on_started, weak=False, dispatch_uid="django_tasklock.started"
    )
    task_signals.task_finished.connect(
        _on_finished, weak=False, dispatch_uid="django_tasklock.finished"
    )


def _on_enqueued(sender: Any = None, task_result: Any = None, **_: Any) -> None:
    enqueuing = _enqueuing.get()
    if enqueuing is None or task_result is None:
        return
    backend, key, placeholder, life = enqueuing
    peek = backend.peek(key)
    if peek is not None and peek.value == placeholder:
        backend.replace(key, peek.hold, peek.value, queued(task_result.id), life)


def _on_started(sender: Any = None, task_result: Any = None, **_: Any) -> None:
    if task_result is not None:
        _running_result.set(task_result.id)


def _on_finished(sender: Any = None, task_result: Any = None, **_: Any) -> None:
    _running_result.set(None)


def _enqueue_django(
    original: Callable[..., Any],
    task: Any,
    spec: Spec,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    options = spec.options
    if options.on_duplicate == "replace":
        raise LockUsageError(
            f"on_duplicate='replace' needs Celery's revoke; {spec.name} is a "
            "django.tasks task. Use 'join' or 'raise'."
        )
    lock_id = spec.lock_id(spec.name, spec.bound, args, kwargs)
    queue_id = queue_lock_id(lock_id, options.mode)
    backend, _alias = _store(options)
    key = backend.keys_for(queue_id)[0]
    life = queue_life(options.queue_expire)
    placeholder = queued(_ENQUEUING_PREFIX + str(uuid.uuid4()))
    waited_since = None
    while True:
        try:
            claimed = backend.acquire(key, placeholder, life) is not None
            peek = None if claimed else backend.peek(key)
        except backend.errors as exc:
            raise store_error(backend, queue_id, "take the call's lock", exc) from exc
        if claimed:
            return _enqueue_claimed(
                original, task, backend, key, placeholder, life, args, kwargs
            )
        holder = None if peek is None else call_of(peek.value)
        if peek is None:
            continue
        if holder is not None and holder[0] == "started":
            if backend.replace(key, peek.hold, peek.value, placeholder, life):
                return _enqueue_claimed(
                    original, task, backend, key, placeholder, life, args, kwargs
                )
            continue
        if holder is not None and holder[1].startswith(_ENQUEUING_PREFIX):
            # Another thread's enqueue, whose result id is not known yet.
            now = time.monotonic()
            waited_since = waited_since or now
            if now - waited_since < _ENQUEUING_WAIT:
                time.sleep(0.005)
                continue
        return _django_duplicate(task, spec, queue_id, holder)


def _enqueue_claimed(
    original: Callable[..., Any],
    task: Any,
    backend: LockBackend,
    key: str,
    placeholder: str,
    life: float,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    reset = _enqueuing.set((backend, key, placeholder, life))
    try:
        result = original(task, *args, **kwargs)
    except BaseException:
        _enqueuing.reset(reset)
        backend.discard(key, placeholder)
        raise
    _enqueuing.reset(reset)
    # A backend that sent no task_enqueued: name the result now. One that ran
    # the task already (ImmediateBackend) left nothing to name.
    peek = backend.peek(key)
    if peek is not None and peek.value == placeholder:
        if result.is_finished:
            backend.discard(key, placeholder)
        else:
            backend.replace(key, peek.hold, peek.value, queued(result.id), life)
    return result


def _django_duplicate(
    task: Any, spec: Spec, queue_id: str, holder: tuple[str, str] | None
) -> Any:
    holder_id = None if holder is None else holder[1]
    action = "raised"
    result = None
    if spec.options.on_duplicate == "join" and holder_id is not None:
        try:
            result = task.get_result(holder_id)
            action = "joined"
        except Exception:
            result = None
    logger.info(
        "Not enqueued %s as a call of its own: call %s is pending or running "
        "under lock %r (mode %s); %s.",
        spec.name,
        holder_id,
        queue_id,
        spec.options.mode,
        "the caller got that call's result"
        if action == "joined"
        else "AlreadyQueued raised",
    )
    if call_deduplicated.receivers:
        call_deduplicated.send_robust(
            task,
            lock_id=queue_id,
            task_id=holder_id,
            new_id=None,
            mode=spec.options.mode,
            action=action,
        )
    if result is None:
        raise AlreadyQueued(holder_id, queue_id)
    return result


# -- the worker's side: a call that ends without running its body ---------------------

# Calls whose lock a failing run handed over to the retry Celery's autoretry_for
# is about to send: task id -> (lock id, options). A call whose retry is not sent
# after all (its state is not RETRY) frees the lock at task_postrun.
_handed: dict[str, tuple[str, Any]] = {}


def handed_to_autoretry(task_id: str, lock_id: str, options: Any) -> None:
    _handed[task_id] = (lock_id, options)


def _on_postrun(task_id: str | None = None, state: str | None = None, **_: Any) -> None:
    if task_id is None:
        return
    entry = _handed.pop(task_id, None)
    if entry is None or state == "RETRY":
        return
    lock_id, options = entry
    free_call(lock_id, options, task_id, running=False)


def _on_revoked(sender: Any = None, request: Any = None, **_: Any) -> None:
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
    free_call(lock_id, spec.options, request.id, running=True)


def free_call(lock_id: str, options: Any, task_id: str, *, running: bool) -> None:
    """Remove the locks that still name call ``task_id``: the pending one, and
    with ``running`` the run's (its process is gone, a terminated revoke)."""
    mode: str = options.mode
    ids = [queue_lock_id(lock_id, mode)]
    if running and mode == "coalesce":
        ids.append(lock_id)
    backend, _alias = _store(options)
    for the_id in ids:
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
