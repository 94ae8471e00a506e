"""``django.tasks`` (Django 6+): the enqueue hook of tasks with an enqueue-time
mode, and the run inside such a task.

``Task.enqueue`` (and ``aenqueue``) are wrapped once per process, when the first
task with an enqueue-time mode is decorated: the call's lock is claimed with a
placeholder mark, which the ``task_enqueued`` signal (or the returned result)
turns into the result id's mark. The run learns its result id from its
``TaskContext`` or from the ``task_started`` signal.
"""

from __future__ import annotations

import logging
import sys
import time
import uuid
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Final

from ..calls import call_of, queue_life, queued, store, store_error
from ..exceptions import AlreadyQueued, LockUsageError
from ..locks.recovery import replaceable
from ..modes import MODES
from ..policies import DUPLICATES
from ..runs import Host
from ..signals import call_deduplicated
from ..targets import Spec, spec_of
from .redelivery import verdict

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..backends import LockBackend
    from ..locks import Lock
    from ..runs import Run
    from ..semaphores import Semaphore

__all__ = ["DJANGO_TASKS", "install_enqueue", "is_context", "running_result_id"]

# Named as before the reshape, so that logging configurations keep working.
logger = logging.getLogger("django_tasklock.calls")


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


def install_enqueue() -> None:
    """Wrap ``Task.enqueue`` and ``aenqueue``, and connect the signals (once)."""
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
    if DUPLICATES[options.on_duplicate].needs_revoke:
        raise LockUsageError(
            f"on_duplicate='replace' needs Celery's revoke; {spec.name} is a "
            "django.tasks task. Use 'join' or 'raise'."
        )
    lock_id = spec.lock_id(spec.name, spec.bound, args, kwargs)
    queue_id = MODES[options.mode].on_publish(lock_id)
    backend, _alias = store(options.cache)
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
        if replaceable(holder, peek.value, backend, key):
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
        duplicate = _Duplicate(task, spec, queue_id)
        if holder is None:
            return duplicate.refuse(None)
        policy = DUPLICATES[options.on_duplicate]
        return policy.resolve(duplicate, holder[1], holder[0] == "queued", peek)


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


class _Duplicate:
    """What a duplicate enqueue gets, as ``policies.duplicates`` chooses."""

    def __init__(self, task: Any, spec: Spec, queue_id: str) -> None:
        self.task, self.spec, self.queue_id = task, spec, queue_id

    def join(self, holder_id: str) -> Any:
        try:
            result = self.task.get_result(holder_id)
        except Exception:
            return self.refuse(holder_id)
        self._announce(holder_id, "joined")
        return result

    def refuse(self, holder_id: str | None) -> Any:
        self._announce(holder_id, "raised")
        raise AlreadyQueued(holder_id, self.queue_id)

    def replace(self, holder_id: str, seen: Any) -> Any:
        raise AssertionError("refused before the enqueue")  # pragma: no cover

    def _announce(self, holder_id: str | None, action: str) -> None:
        mode = self.spec.options.mode
        logger.info(
            "Not enqueued %s as a call of its own: call %s is pending or running "
            "under lock %r (mode %s); %s.",
            self.spec.name,
            holder_id,
            self.queue_id,
            mode,
            "the caller got that call's result"
            if action == "joined"
            else "AlreadyQueued raised",
        )
        if call_deduplicated.receivers:
            call_deduplicated.send_robust(
                self.task,
                lock_id=self.queue_id,
                task_id=holder_id,
                new_id=None,
                mode=mode,
                action=action,
            )


# -- the run inside a django.tasks task -------------------------------------------------


def is_context(value: object) -> bool:
    """True if ``value`` is a ``django.tasks`` TaskContext (takes_context=True)."""
    module = sys.modules.get("django.tasks.base")
    context_class = getattr(module, "TaskContext", None)
    return context_class is not None and isinstance(value, context_class)


class DjangoTasksHost(Host):
    """A run of a ``django.tasks`` task: a second delivery is told apart as a
    Celery one is, but there is no way to send a call again (it raises
    ``LockNotAcquired`` instead)."""

    def prepare(self, run: Run) -> None:
        """Make ``run`` one of a django.tasks task if it runs in one: its
        result id, from its context or the task_started signal."""
        call_id = run.args[0].task_result.id if run.bound else running_result_id()
        if call_id is not None:
            run.host, run.call_id = self, call_id

    def verdict(self, run: Run, lock: Lock | Semaphore) -> object:
        return verdict(run, lock)


#: The host of a django.tasks run.
DJANGO_TASKS = DjangoTasksHost()
