"""The demo's django.tasks step: ``feeds.jobs.refresh_job``, an async task
under ``@single_instance``, enqueued many times at once for every feed.

Django's ``ImmediateBackend`` runs a task where it is enqueued, so each of
``per_feed`` threads per feed enqueues once and runs the task in an event
loop of its own: the runs of one feed contend for its lock across threads and
loops, as they would across workers. Each import records its start and end
(``ImportRun``); the report counts per feed the runs that imported and those
skipped, and the most imports of one feed at one moment. On Django 5.2, which
has no ``django.tasks``, the step says so and is not run.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import django

#: Whether this Django has django.tasks (6.0 and later).
HAS_TASKS = django.VERSION >= (6, 0)


def say(message: str = "") -> None:
    print(message, flush=True)


def enqueue_all(urls: list[str], per_feed: int) -> dict[str, list[Any]]:
    """Enqueue ``refresh_job`` ``per_feed`` times at once for every feed, one
    thread per enqueue, all released together: each feed's results."""
    from django.db import connection

    from example_project.feeds.jobs import refresh_job

    results: dict[str, list[Any]] = {url: [] for url in urls}
    start = threading.Barrier(len(urls) * per_feed)

    def one(url: str) -> None:
        try:
            start.wait()
            results[url].append(refresh_job.enqueue(url))
        finally:
            connection.close()  # this thread's database connection

    threads = [
        threading.Thread(target=one, args=(url,))
        for url in urls
        for _ in range(per_feed)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def report(results: dict[str, list[Any]]) -> bool:
    """Per feed: imported at least once, never twice at once, every run
    successful (imported, or skipped while another imported)."""
    from example_project.feeds.jobs import JOB_NAME
    from example_project.feeds.models import ImportRun
    from tests.workers import most_at_once

    ok = True
    imported = skipped = 0
    for url, outcomes in results.items():
        failed = [r for r in outcomes if r.status != "SUCCESSFUL"]
        ran = [r for r in outcomes if r.status == "SUCCESSFUL" and r.return_value]
        imported += len(ran)
        skipped += len(outcomes) - len(ran) - len(failed)
        runs = ImportRun.objects.filter(feed_url=url, task_name=JOB_NAME)
        peak = most_at_once(list(runs.values_list("started", "finished")))
        if failed or not ran or peak > 1 or runs.count() != len(ran):
            say(
                f"   <- {url}: {len(ran)} imported, {len(failed)} failed, "
                f"{runs.count()} recorded, {peak} at once"
            )
            ok = False
    say(
        f"   {imported} runs imported, {skipped} skipped (their feed was being imported)"
    )
    if ok:
        say("   every feed imported by the task, never two imports of one feed at once")
    return ok


def run(urls: list[str], per_feed: int) -> bool:
    """The step; True where it passed or cannot run (Django 5.2, said)."""
    if not HAS_TASKS:
        say(
            f"   not run: Django {django.get_version()} has no django.tasks (6.0 "
            "and later; tests/integrations/test_django_tasks.py runs this step on 6.0 and 6.1)"
        )
        return True
    # Each skipped run is logged at INFO; the report counts them instead.
    logging.getLogger("django_tasklock.policies.contention").setLevel(logging.WARNING)
    return report(enqueue_all(urls, per_feed))
