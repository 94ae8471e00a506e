"""``django.tasks`` (Django 6+): the enqueue hook of tasks with an enqueue-time
mode, and the run inside such a task.

``Task.enqueue`` (and ``aenqueue``) are wrapped once per process, when the first
task with an enqueue-time mode is decorated: the call's lock is claimed with a
placeholder mark, which the ``task_enqueued`` signal (or the returned result)
turns into the result id's mark. The run learns its result id from its
``TaskContext`` or from the ``task_started`` signal.
"""

from __future__ import annotations

import sys
import uuid
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Final

from ..calls import queue_life, queued, store
from ..exceptions import AlreadyQueued, LockUsageError
from ..logs import module_logger
from ..modes.publishing import WAIT, claim
from ..policies import DUPLICATES
from ..runs import Host
from ..signals import call_deduplicated
from ..targets import Spec, spec_of
from .redelivery import verdict

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..backends import LockBackend, Peek
    from ..locks import Lock
    from ..runs import Run
    from ..semaphores import Semaphore

__all__ = ["DJANGO_TASKS", "install_enqueue", "is_context", "running_result_id"]

# Logged under 'django_tasklock.calls' before: that name keeps working (see logs).
logger = module_logger(__name__, "django_tasklock.calls")


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
        return _Enqueue(original, self, spec, args, kwargs).send()

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


class _Enqueue:
    """One ``enqueue`` of a task with an enqueue-time mode: what the claim
    loop (``modes.publishing``) asks of a django.tasks call. Its mark names a
    placeholder until the backend names the result (``task_enqueued``)."""

    def __init__(
        self,
        original: Callable[..., Any],
        task: Any,
        spec: Spec,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        options = spec.options
        if DUPLICATES[options.on_duplicate].needs_revoke:
            raise LockUsageError(
                f"on_duplicate='replace' needs Celery's revoke; {spec.name} is a "
                "django.tasks task. Use 'join' or 'raise'."
            )
        self.original, self.task, self.spec = original, task, spec
        self.args, self.kwargs = args, kwargs
        self.on_duplicate: str = options.on_duplicate
        self.mode = spec.mode
        lock_id = spec.lock_id(spec.name, spec.bound, args, kwargs)
        self.queue_id = self.mode.on_publish(lock_id)
        self.backend, self.alias = store(options.cache)
        self.key = self.backend.keys_for(self.queue_id)[0]
        self.life = queue_life(options.queue_expire)
        self.value = queued(_ENQUEUING_PREFIX + str(uuid.uuid4()))

    def send(self) -> Any:
        return claim(self.mode, self)

    def mine(self, holder: tuple[str, str] | None, peek: Peek, waited: float) -> Any:
        if (
            holder is not None
            and holder[1].startswith(_ENQUEUING_PREFIX)
            and waited < _ENQUEUING_WAIT
        ):
            return WAIT  # another thread's enqueue, whose result id is not known yet
        return None

    def unmerged(self, holder: tuple[str, str] | None) -> Any:
        return None

    def unattached(self, peek: Peek) -> Any:
        return self.refuse(None)

    def claimed(self, restore: Peek | None = None) -> Any:
        backend, key, placeholder = self.backend, self.key, self.value
        reset = _enqueuing.set((backend, key, placeholder, self.life))
        try:
            result = self.original(self.task, *self.args, **self.kwargs)
        except BaseException:
            _enqueuing.reset(reset)
            backend.discard(key, placeholder)
            raise
        _enqueuing.reset(reset)
        # A backend that sent no task_enqueued: name the result now. One that
        # ran the task already (ImmediateBackend) left nothing to name.
        peek = backend.peek(key)
        if peek is not None and peek.value == placeholder:
            if result.is_finished:
                backend.discard(key, placeholder)
            else:
                backend.replace(
                    key, peek.hold, peek.value, queued(result.id), self.life
                )
        return result

    # -- what the duplicate policies do (see policies.duplicates) ---------------------

    def join(self, holder_id: str) -> Any:
        try:
            result = self.task.get_result(holder_id)
        except Exception:
            return self.refuse(holder_id)
        self._announce(holder_id, "joined")
        return lambda: result

    def refuse(self, holder_id: str | None) -> Any:
        self._announce(holder_id, "raised")
        raise AlreadyQueued(holder_id, self.queue_id)

    def replace(self, holder_id: str, seen: Any) -> Any:
        raise AssertionError("refused before the enqueue")  # pragma: no cover

    def _announce(self, holder_id: str | None, action: str) -> None:
        mode = self.spec.mode.name
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
