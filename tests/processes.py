"""The multiprocessing context the tests and the fault runs start Python
processes with: forked from a server that has imported Django, Celery and the
store clients once.

A spawned process starts a fresh Python and imports all of them: about 0.6
CPU-s before it runs a line of a test, where a process forked from the server
takes about 0.15 (16 processes set up with Django: 10 CPU-s spawned, 2.3
forked, measured on this project's 2-core machine). The suite starts a few
hundred of them. The processes are as separate as spawned ones: the server
imports library modules only, never this package nor the tests' settings, and
configures nothing; each process sets Django up itself, as a spawned one does.

Two things differ from ``spawn``, both made good here:

- A forked process inherits the server's environment, which is the one its
  first user had. ``Process`` keeps the environment it was made in, and puts
  it back in the new process before its target runs (the fault runs point
  processes at a store through the environment).
- Coverage starts in a process when the process starts, from its environment;
  where coverage is measuring (``COVERAGE_PROCESS_*`` set, see
  ``tests.services.unmeasured``), the processes are spawned, as before.
"""

from __future__ import annotations

import multiprocessing
import os
from multiprocessing.context import BaseContext, ForkServerContext, ForkServerProcess

from tests.services import COVERAGE_VARIABLES

#: What the server imports: the libraries every process imports, none of
#: which reads a setting or starts a thread at import.
PRELOADED = [
    "asyncio",
    "celery.app",
    "celery.worker",
    "django.contrib.admin.options",
    "django.core.cache.backends.memcached",
    "django.core.cache.backends.redis",
    "django.core.mail",
    "django.db.backends.sqlite3.base",
    "django.db.models",
    "django.forms",
    "django.http",
    "django.template.defaultfilters",
    "django.test",
    "django.urls",
    "django.views.generic",
    "kombu",
    "pymemcache.client.base",
    "redis",
    "redis.asyncio",
]


class Process(ForkServerProcess):
    """A process forked from the server, run in the environment it was made in."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._environment = dict(os.environ)

    def run(self) -> None:
        os.environ.clear()
        os.environ.update(self._environment)
        super().run()


class _Context(ForkServerContext):
    Process = Process  # type: ignore[assignment]


_forked = _Context()
_forked.set_forkserver_preload(PRELOADED)


def process_context() -> BaseContext:
    """Forked from the server; spawned where coverage is measuring."""
    if any(name in os.environ for name in COVERAGE_VARIABLES):
        return multiprocessing.get_context("spawn")
    return _forked
