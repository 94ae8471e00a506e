"""The frameworks a decorated call runs under: Celery (``celery/``) and
``django.tasks`` (``django_tasks``). ``begin()`` tells which one runs a call and
makes its ``Run``; ``install()`` puts the publish hooks in place. The core
(locks, modes, policies) never imports this package; neither does this package
import a framework before one is in use."""

from __future__ import annotations

import sys
import threading
from typing import TYPE_CHECKING, Any

from ..runs import PLAIN, Run
from .celery import (
    CELERY,
    current_task,
    install_eager,
    install_publish,
    sender_over_limit,
)
from .django_tasks import DJANGO_TASKS, install_enqueue, is_context

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..options import Options
    from ..targets import LockIdMaker

__all__ = ["install", "sender_over_limit", "starter"]

modules = sys.modules
# Types a TaskContext never is: the first argument of most calls, told at once.
_PLAIN = frozenset((str, int, float, bytes, dict, list, tuple, type(None)))

#: Makes a Run without running an __init__ from C: begin() fills it in, on
#: every call of a decorated function.
new = object.__new__
_installed: list[bool] = []
_install_lock = threading.Lock()


def install() -> None:
    """Wrap ``Celery.send_task`` (and ``Task.apply``, for eager calls) and
    ``django.tasks``' ``Task.enqueue``, and
    connect the signals of either side, once per process."""
    if _installed:
        return
    with _install_lock:
        if _installed:
            return
        install_publish()
        install_eager()
        install_enqueue()
        _installed.append(True)


def starter(
    func: Callable[..., Any],
    options: Options,
    lock_id: LockIdMaker,
    plain_name: str,
    publishes: bool,
) -> Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Run]:
    """How a call of the wrapper over ``func`` begins: ``begin(wrapper, args,
    kwargs)`` tells which framework runs it, under which task name and call,
    and makes its ``Run`` with its lock id."""

    def begin(
        wrapper: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Run:
        # task_class(), inlined: called, an @single_instance call took 0.8 %
        # more instructions (make bench-cpu), past that row's 2 % budget.
        module = modules.get("celery.app.task")
        celery_task = None if module is None else getattr(module, "Task", None)
        bound = (
            celery_task is not None and bool(args) and isinstance(args[0], celery_task)
        )
        task = args[0] if bound else current_task(wrapper)
        if task is not None:
            name = task.name
        elif args and type(args[0]) not in _PLAIN and is_context(args[0]):
            # Django's @task(takes_context=True) passes its TaskContext first.
            bound, name = True, args[0].task_result.task.module_path
        else:
            name = plain_name
        # A plain function's run; a worker's call is one of its framework's.
        run: Run = new(Run)
        run.func = func
        run.args = args
        run.kwargs = kwargs
        run.options = options
        run.name = name
        run.bound = bound
        run.lock_id = lock_id(name, bound, args[1:] if bound else args, kwargs)
        run.host = PLAIN
        run.task = None
        run.call_id = None
        run.oid = None
        run.max_hold = options.max_hold
        run.hands_over = False
        if task is not None:
            CELERY.prepare(run, task)
        elif publishes:
            DJANGO_TASKS.prepare(run)
        return run

    return begin
