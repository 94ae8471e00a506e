"""Everything Celery-specific: the publish hook (``publish``; ``eager`` for
calls run in place), the run inside a
task (``host``: retry, Ignore, sending a call back, time limits, canvas), the
worker's signals (``worker``: revoke, autoretry hand-over), and the registry
lookups of the ``tasklock`` command (``lookup``). Celery itself is imported
only when a task runs, a hook is installed or the command looks a task up."""

from __future__ import annotations

from .eager import install_eager
from .host import CELERY, CeleryHost, current_task, task_class
from .limits import sender_over_limit
from .publish import install_publish

__all__ = [
    "CELERY",
    "CeleryHost",
    "current_task",
    "install_eager",
    "install_publish",
    "sender_over_limit",
    "task_class",
]
