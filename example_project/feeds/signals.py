"""Record what became of every feeds task, skipped duplicates included."""

from __future__ import annotations

from typing import Any

from celery.signals import task_postrun

from .models import TaskOutcome

FEED_TASKS = (
    "example_project.feeds.tasks.import_feed",
    "example_project.feeds.tasks.import_feed_single",
    "example_project.feeds.tasks.refresh_feed",
)


@task_postrun.connect
def record_outcome(
    sender: Any = None,
    task_id: str = "",
    args: Any = (),
    kwargs: Any = None,
    retval: Any = None,
    state: str = "",
    **extra: Any,
) -> None:
    if getattr(sender, "name", None) not in FEED_TASKS:
        return
    feed_url = args[0] if args else (kwargs or {}).get("feed_url", "")
    if state != "SUCCESS":
        outcome = TaskOutcome.FAILED
    else:
        outcome = TaskOutcome.IMPORTED if retval else TaskOutcome.SKIPPED
    TaskOutcome.objects.create(
        task_id=task_id,
        task_name=sender.name,
        feed_url=feed_url,
        outcome=outcome,
        detail="" if state == "SUCCESS" else f"{type(retval).__name__}: {retval}",
    )
