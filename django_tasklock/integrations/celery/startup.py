"""What a Celery worker refuses at start-up, where Django's system checks do
not run: a lock store each process has its own of (check W001, unless
``TASKLOCK['ALLOW_PER_PROCESS']``), and a task that would retry on contention
but is not bound (no ``self`` to retry with). Told once, before the pool
starts, instead of by duplicate runs or by the first contended call."""

from __future__ import annotations

from typing import Any

from ...backends import refuse_per_process
from ...conf import settings
from ...exceptions import LockConfigurationError
from ...runs import retry_unbound
from ...targets import decorated

__all__ = ["connect", "start_problems"]


def connect() -> None:
    """Have every worker this process starts ask ``start_problems`` first."""
    from celery import signals

    signals.worker_init.connect(
        _refuse, weak=False, dispatch_uid="django_tasklock.startup"
    )


def _refuse(sender: Any = None, **_: Any) -> None:
    problems = start_problems(getattr(sender, "app", None))
    if problems:
        # Not an Exception: Celery's signals log those and go on.
        raise SystemExit(
            "django_tasklock refuses to start this worker:\n- " + "\n- ".join(problems)
        )


def start_problems(app: Any) -> list[str]:
    """Why a worker of ``app`` must not start (none: it may)."""
    problems: list[str] = []
    aliases = {settings.CACHE}
    tasks = {} if app is None else app.tasks
    for task in list(tasks.values()):
        try:
            function, name, bound = decorated(task)
        except TypeError:
            continue  # not one of ours
        options = function._tasklock_options
        if options.cache is not None:
            aliases.add(options.cache)
        contention = options.on_contention or settings.ON_CONTENTION
        if contention == "retry" and not bound:
            problems.append(retry_unbound(name))
    try:
        refuse_per_process(aliases, "This worker would run @single_instance tasks")
    except LockConfigurationError as exc:
        problems.insert(0, str(exc))
    return problems
