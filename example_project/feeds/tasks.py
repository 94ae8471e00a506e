"""The cookbook's importer, twice: written the cookbook's way with
``memcache_lock``, and as a one-liner with ``@single_instance``.

Both take the same lock the cookbook describes: the task name and the MD5 digest
of the feed URL.
"""

from __future__ import annotations

import os
import time
from hashlib import md5
from typing import Any

from celery import shared_task
from celery.utils.log import get_task_logger

from django_tasklock import memcache_lock, single_instance

from .models import BeatRun, ImportRun

logger = get_task_logger(__name__)


def _import_and_record(feed_url: str, task_name: str, fence: int | None = None) -> str:
    """Import, fenced by the lock held (or ``fence``), and record when the
    import ran, so overlaps can be measured."""
    from .models import Feed

    started = time.monotonic()
    result = Feed.objects.import_feed(feed_url, fence)
    ImportRun.objects.create(
        feed_url=feed_url,
        task_name=task_name,
        started=started,
        finished=time.monotonic(),
        pid=os.getpid(),
        entries_created=result.created,
    )
    return result.feed.url


@shared_task(bind=True)
def import_feed(self, feed_url: str) -> str | None:  # type: ignore[no-untyped-def]
    # The cache key consists of the task name and the MD5 digest of the feed URL.
    feed_url_hexdigest = md5(feed_url.encode("utf-8")).hexdigest()
    lock_id = f"{self.name}-lock-{feed_url_hexdigest}"
    logger.debug("Importing feed: %s", feed_url)
    lock = memcache_lock(lock_id, self.app.oid)
    with lock as acquired:
        if acquired:
            return _import_and_record(feed_url, self.name)
    logger.info("Feed %s is already being imported by another worker", feed_url)
    return None


@shared_task(bind=True)
@single_instance(key="feed_url", expire=30, renew=True)
def import_feed_single(self, feed_url: str) -> str:  # type: ignore[no-untyped-def]
    # A short expiry, renewed while the import runs: a crashed worker's lock goes
    # within 30 s, and a slow feed keeps its lock however long it takes.
    return _import_and_record(feed_url, self.name)


@shared_task(bind=True)
@single_instance(key="feed_url", mode="coalesce", expire=30, renew=True)
def refresh_feed(self, feed_url: str) -> str:  # type: ignore[no-untyped-def]
    # "Refresh this feed", clicked again and again: a click while an import of
    # the feed runs queues one follow-up import, which picks up whatever the feed
    # gained meanwhile; further clicks join that follow-up instead of piling up.
    return _import_and_record(feed_url, self.name)


def _beat_run(task: Any, entry: str) -> None:
    """Record a periodic run with the run and fence its message carries."""
    from django_tasklock.integrations.celery.beat import FENCE, RUN

    BeatRun.objects.create(
        entry=entry,
        run_ms=task.request.get(RUN),
        fence=task.request.get(FENCE),
        received=time.time(),
        pid=os.getpid(),
    )


@shared_task(bind=True)
def check_stale_feeds(self, max_age: float = 3600) -> int:  # type: ignore[no-untyped-def]
    """Periodic (``CELERY_BEAT_SCHEDULE``): how many feeds were not imported
    within ``max_age`` seconds."""
    from django.utils import timezone

    from .models import Feed

    _beat_run(self, "check-stale-feeds")
    since = timezone.now() - timezone.timedelta(seconds=max_age)
    return Feed.objects.filter(last_imported_at__lt=since).count()


@shared_task(bind=True)
def count_entries(self) -> int:  # type: ignore[no-untyped-def]
    """Periodic (``CELERY_BEAT_SCHEDULE``): how many entries are stored."""
    from .models import Entry

    _beat_run(self, "count-entries")
    return Entry.objects.count()
