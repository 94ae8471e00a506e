"""What a decorated target is: the ``@single_instance`` wrapper inside a
function, a Celery task or a ``django.tasks`` task, found without importing
either framework, and the lock ids its calls use."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from .exceptions import InvalidArgumentType
from .foreign import celery_original_run

if TYPE_CHECKING:
    from .modes import Mode
    from .options import Options

__all__ = [
    "Spec",
    "decorated",
    "lock_cache_for",
    "lock_id_for",
    "lock_mode_for",
    "refuse_task_object",
    "spec_of",
]

#: How a lock id is made: (task name, bound, args, kwargs) -> lock id.
LockIdMaker = Callable[[str, bool, tuple[Any, ...], dict[str, Any]], str]


class Spec(NamedTuple):
    """What the publish hooks need of a decorated task."""

    lock_id: LockIdMaker
    name: str
    bound: bool
    options: Options
    mode: Mode


def decorated(target: Callable[..., Any]) -> tuple[Any, str, bool]:
    """The ``@single_instance`` wrapper inside ``target``, the task name its lock
    ids start with, and whether its first argument is left out of them."""
    func = getattr(target, "func", None)
    # A django.tasks Task:
    if hasattr(target, "module_path") and hasattr(func, "_tasklock_lock_id"):
        return func, target.module_path, getattr(target, "takes_context", False)
    # autoretry_for replaces a task's run with a plain function over the
    # original bound method.
    run = celery_original_run(target) or getattr(target, "run", None)
    if run is not None and hasattr(target, "name"):  # a Celery task
        function = getattr(run, "__func__", run)
        if hasattr(function, "_tasklock_lock_id"):
            return function, target.name, inspect.ismethod(run)
    if not hasattr(target, "_tasklock_lock_id"):
        raise InvalidArgumentType(f"{target!r} is not decorated with @single_instance.")
    return target, target._tasklock_name, False  # type: ignore[attr-defined]


def refuse_task_object(func: object, decorator: str) -> None:
    """Raise if ``func`` is already a Celery task (an ``@app.task`` Task, or
    ``@shared_task``'s proxy of one) or a ``django.tasks`` task: the lock
    decorators wrap the function, under the task decorator. Told from the
    object's own type (a proxy's attributes would build the task, and
    finalize its app, at import time), without importing either framework."""
    kind = type(func)
    made = (
        getattr(sys.modules.get(module), name, None) for module, name in _TASK_TYPES
    )
    if any(isinstance(cls, type) and issubclass(kind, cls) for cls in made):
        raise InvalidArgumentType(
            f"@{decorator} is above a task decorator here ({func!r} is already a "
            f"task), so it would wrap the task object, not the function, and the "
            f"task's .delay() and .enqueue() would be lost. Put @{decorator} "
            "under @shared_task / @app.task / @task, right above the def:\n\n"
            f"    @shared_task(bind=True)\n    @{decorator}(...)\n"
            "    def my_task(self, ...): ..."
        )


#: The types of an already-made task, by module (none of an object's type
#: unless that module is loaded): a Celery Task, the proxy ``@shared_task``
#: returns (whose class names itself after its module), a ``django.tasks``
#: Task.
_TASK_TYPES = (
    ("celery.app.task", "Task"),
    ("celery.local", "Proxy"),
    ("django.tasks.base", "Task"),
)


def spec_of(task: Any, *, any_mode: bool = False) -> Spec | None:
    """The enqueue-time spec of a task; None for a task without an enqueue-time
    mode (unless ``any_mode``), or not decorated at all."""
    try:
        function, name, bound = decorated(task)
    except TypeError:
        return None
    mode: Mode = function._tasklock_mode
    if not (mode.publishes or any_mode):
        return None
    return Spec(
        function._tasklock_lock_id, name, bound, function._tasklock_options, mode
    )


def lock_id_for(target: Callable[..., Any], /, *args: Any, **kwargs: Any) -> str:
    """The lock id a call of ``target`` with these arguments would use.

    ``target`` is a ``@single_instance`` function, or a Celery or Django task
    built on one (pass the arguments as for ``delay()``/``enqueue()``, without
    ``self`` or the context). The id is the same for every spelling of one call,
    and for its arguments after a JSON round trip.
    """
    function, name, bound = decorated(target)
    result: str = function._tasklock_lock_id(name, bound, args, kwargs)
    return result


def lock_cache_for(target: Callable[..., Any], /) -> str | None:
    """The ``cache=`` alias ``target``'s ``@single_instance`` names, if any."""
    function, _name, _bound = decorated(target)
    cache: str | None = function._tasklock_options.cache
    return cache


def lock_mode_for(target: Callable[..., Any], /) -> Mode:
    """The mode ``target``'s ``@single_instance`` chose."""
    function, _name, _bound = decorated(target)
    mode: Mode = function._tasklock_mode
    return mode
