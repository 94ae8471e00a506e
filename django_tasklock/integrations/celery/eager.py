"""Eager calls of a task with an enqueue-time mode: claimed as a sent call is,
then run in place.

Celery runs an eager call (``task_always_eager``, or ``task.apply()``) through
``Task.apply`` and never reaches ``send_task``, where a sent call's lock is
claimed (``publish``). Without a claim, an ``until_finished`` duplicate of a
pending call would run, meet the lock and be skipped, where a worker's
duplicate joins the pending call. ``Task.apply`` is wrapped, once per process,
so that an eager call claims its lock with its queued mark before it runs,
exactly as a sent call does, and its duplicates are joined, refused or
replaced as ``on_duplicate`` says.

Celery's eager ``apply_async()`` always names the call it runs with a new task
id; only an id the caller gave keeps a call from being merged into another
(``_Publish.unmerged``), so ``apply_async`` is wrapped too, to tell the two
apart.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from .publish import _Publish, _spec_for

if TYPE_CHECKING:
    from collections.abc import Callable

    from ...targets import Spec

__all__ = ["install_eager"]

# In an apply_async() on its way to an eager apply(): whether its caller gave
# the task id. None: apply() was called by something else (the caller itself,
# or Celery's eager retry, which names the call it retries).
_given: ContextVar[bool | None] = ContextVar("tasklock_eager_given", default=None)


class _EagerPublish(_Publish):
    """One eager call: claimed like a sent one; "sent" runs it in place."""

    def __init__(
        self,
        original: Callable[..., Any],
        task: Any,
        spec: Spec,
        call: tuple[Any, Any, str | None, bool],
        options: dict[str, Any],
    ) -> None:
        args, kwargs, task_id, given = call
        app = task.app
        sent = (args, kwargs, None, None, task_id)
        super().__init__(original, app, spec, task, task.name, sent, options)
        if not given:
            self.given_id = None

    def _call_original(self) -> Any:
        return self.original(
            self.task, self.args, self.kwargs, task_id=self.task_id, **self.options
        )


def install_eager() -> None:
    """Wrap Celery's ``Task.apply`` (and ``apply_async``, to learn whether a
    task id was given) for eager calls of tasks with an enqueue-time mode."""
    try:
        from celery.app.task import Task as task_class
    except ImportError:  # Celery is optional: django.tasks only
        return
    original_async = task_class.apply_async
    original_apply = task_class.apply

    def apply_async(
        self: Any,
        args: Any = None,
        kwargs: Any = None,
        task_id: Any = None,
        *more: Any,
        **options: Any,
    ) -> Any:
        token = _given.set(task_id is not None)
        try:
            return original_async(self, args, kwargs, task_id, *more, **options)
        finally:
            _given.reset(token)

    def apply(
        self: Any, args: Any = None, kwargs: Any = None, *more: Any, **options: Any
    ) -> Any:
        spec = None if more else _spec_for(self.app, self.name, self)[0]
        if spec is None:
            return original_apply(self, args, kwargs, *more, **options)
        given = _given.get()
        task_id = options.pop("task_id", None)
        call = (args, kwargs, task_id, task_id is not None and given is not False)
        # The call's own body starts afresh: its apply() calls are its caller's.
        token = _given.set(None)
        try:
            return _EagerPublish(original_apply, self, spec, call, options).send()
        finally:
            _given.reset(token)

    for wrapper, original in ((apply_async, original_async), (apply, original_apply)):
        wrapper.__wrapped__ = original  # type: ignore[attr-defined]
        wrapper.__doc__ = original.__doc__
        wrapper.__name__ = original.__name__
    task_class.apply_async = apply_async
    task_class.apply = apply
