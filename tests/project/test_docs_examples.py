"""Every Python example in README.rst and the docs runs, in order, against the
test session's real memcached and Redis (and an in-process Celery worker where
an example waits for a result). Sybil parses the examples, visible and invisible
(``.. invisible-code-block: python``: set-up and assertions a reader does not
need); each example is a test of its own, sharing its page's namespace as a
reader's session would."""

from __future__ import annotations

import logging
from hashlib import md5

import pytest
from sybil import Sybil
from sybil.parsers.rest import PythonCodeBlockParser, SkipParser

from tests.helpers import ROOT

PAGES = [ROOT / "README.rst", *sorted((ROOT / "docs").rglob("*.rst"))]
_SYBIL = Sybil(parsers=[PythonCodeBlockParser(), SkipParser()])
DOCUMENTS = {page.relative_to(ROOT).as_posix(): _SYBIL.parse(page) for page in PAGES}
EXAMPLES = [
    (name, example)
    for name, document in DOCUMENTS.items()
    for example in document.examples()
]

pytestmark = pytest.mark.django_db(transaction=True)

#: The Redis databases of the examples' broker and results: none another
#: module's (3 and 4 the worker modules', 5 and 6 the example project's, 7
#: and 8 the new project's, 9 and 10 the beats').
EXAMPLES_BROKER = (11, 12)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_python_example_is_collected(page):
    # Every ``.. code-block:: python`` is collected (none skipped by a typo).
    name = page.relative_to(ROOT).as_posix()
    examples = [e for n, e in EXAMPLES if n == name]
    shown = [
        e
        for e in examples
        if "invisible" not in str(e.region) and "Skipper" not in str(e.region)
    ]
    assert len(shown) == (page.read_text().count(".. code-block:: python"))


@pytest.fixture(scope="module")
def namespace(redis_server, memcached):
    """What the examples find defined: helpers for the invisible blocks, and
    the test Celery app as the current app (``shared_task`` binds to it)."""
    from celery import current_app
    from celery.contrib.testing.worker import start_worker

    from tests.celery_app import app
    from tests.helpers import reset_publisher, use_redis_broker

    previous = current_app._get_current_object()
    app.set_current()

    def assert_settings_pass_checks(caches, tasklock):
        from django.test import override_settings

        from django_tasklock.checks import check_settings

        caches = {a: {**c, "LOCATION": memcached.address} for a, c in caches.items()}
        with override_settings(CACHES=caches, TASKLOCK=tasklock):
            assert check_settings() == []

    def assert_skips_while_held(task, url):
        from django_tasklock import Lock, lock_id_for

        try:
            lock_id = lock_id_for(task, url)
        except TypeError:  # not @single_instance: the cookbook recipe's id
            lock_id = f"{task.name}-lock-{md5(url.encode()).hexdigest()}"
        with Lock(lock_id):
            assert task(url) is None  # skipped: the Feed was never touched

    root = logging.getLogger()
    logging_before = (root.level, list(root.handlers))

    from celery.signals import task_postrun

    from django_tasklock.backends import close_thread_connections

    def close_in_worker_thread(**_):
        # The pool's threads end with the worker: their lock connections are
        # closed as a thread pool's should be (README, Threads of your own).
        close_thread_connections()

    running = []
    broker = []

    def use_the_broker():
        """Point the app at the session's Redis (once: again would close the
        result backends of calls already sent), in databases of the examples'
        own, emptied first: a worker another module left running (or an
        example's that failed) consumes none of their calls, nor they its."""
        if not broker:
            import redis

            for database in EXAMPLES_BROKER:
                with redis.Redis.from_url(f"{redis_server.url[:-2]}/{database}") as db:
                    db.flushdb()
            broker.append(use_redis_broker(app, redis_server.url, EXAMPLES_BROKER))

    def before_a_worker():
        """What a worker an example starts needs: the broker, and its pool's
        threads' lock connections closed as they end; no worker of an earlier
        example left running (one that failed before stopping it), which
        would take this page's calls and know none of its tasks."""
        for left in list(running):
            stop_the_worker(left)
        task_postrun.connect(close_in_worker_thread, weak=False)
        use_the_broker()

    def after_a_worker():
        """Put back what a stopped worker changed (the root logger's level and
        handlers; the publisher's connections)."""
        import gc

        task_postrun.disconnect(close_in_worker_thread)
        reset_publisher(app)  # the broker connections and result consumers too
        gc.collect()  # a socket left open surfaces here, not in a later test
        root.setLevel(logging_before[0])
        root.handlers[:] = logging_before[1]

    def start_a_worker():
        before_a_worker()
        # The worker sets the root logger's level (to ERROR by default): the
        # WARNINGs later tests capture would be dropped. It is put back below.
        worker = start_worker(
            app,
            pool="threads",
            concurrency=2,
            perform_ping_check=False,
            loglevel="WARNING",
        )
        worker.__enter__()
        running.append(worker)
        return worker

    def stop_the_worker(worker):
        running.remove(worker)
        worker.__exit__(None, None, None)
        after_a_worker()

    for name, document in DOCUMENTS.items():
        document.namespace.update(
            # The module of the tasks a page defines: one per page, so that two
            # pages' tasks of one name are two Celery tasks.
            __name__="docs." + name.removesuffix(".rst").replace("/", "."),
            assert_settings_pass_checks=assert_settings_pass_checks,
            assert_skips_while_held=assert_skips_while_held,
            start_a_worker=start_a_worker,
            before_a_worker=before_a_worker,
            after_a_worker=after_a_worker,
            use_the_broker=use_the_broker,
            stop_the_worker=stop_the_worker,
        )
    yield DOCUMENTS
    # An example that failed between starting and stopping its worker: the
    # worker must not go on consuming the broker later tests publish to.
    for worker in list(running):
        stop_the_worker(worker)
    root.setLevel(logging_before[0])  # also when an example failed midway
    root.handlers[:] = logging_before[1]
    previous.set_current()
    reset_publisher(app)
    if broker:  # worker processes started later go to the usual databases
        use_redis_broker(app, redis_server.url)


@pytest.mark.parametrize(
    "example", [e for _n, e in EXAMPLES], ids=[f"{n}:{e.line}" for n, e in EXAMPLES]
)
def test_example(namespace, example):
    example.evaluate()
