"""Feeds and their entries, plus the records the demo measures with."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from django.db import models

from django_tasklock.fenced import FencedQuerySet, FenceField

if TYPE_CHECKING:
    from django_tasklock.fenced import FenceGiven

    from .importer import ImportResult


class FeedManager(models.Manager.from_queryset(FencedQuerySet)):  # type: ignore[misc]
    def import_feed(self, url: str, fence: FenceGiven | None = None) -> ImportResult:
        """Download, parse and upsert the RSS 2.0 or Atom feed at ``url``.

        Idempotent: entries are matched on their guid (or a stand-in for feeds
        without one), so importing twice stores nothing twice. A feed that cannot
        be fetched or parsed raises ``FeedImportError`` and changes nothing; so
        does an import whose lock was lost to a newer import that wrote the feed
        since (``django_tasklock.StaleFence``: the fence of the lock in reach,
        or ``fence``, is older than the feed's).
        """
        from .importer import import_feed

        return import_feed(url, fence)


class Feed(models.Model):
    url = models.URLField(max_length=500, unique=True)
    title = models.CharField(max_length=300, blank=True)
    link = models.URLField(max_length=500, blank=True)
    last_imported_at = models.DateTimeField(null=True, blank=True)
    imports = models.PositiveIntegerField(default=0)
    entries_created = models.PositiveIntegerField(default=0)
    entries_updated = models.PositiveIntegerField(default=0)
    fence = FenceField(
        help_text="the fencing token of the lock held by the last import that wrote "
        "this feed; imports with an older one are refused",
    )

    objects: ClassVar[FeedManager] = FeedManager()

    class Meta:
        ordering = ("url",)

    def __str__(self) -> str:
        return self.title or self.url


class Entry(models.Model):
    feed = models.ForeignKey(Feed, on_delete=models.CASCADE, related_name="entries")
    guid = models.CharField(max_length=500)
    title = models.CharField(max_length=500, blank=True)
    link = models.URLField(max_length=500, blank=True)
    published = models.DateTimeField(null=True, blank=True)
    updated = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ("-published", "id")
        constraints = (
            models.UniqueConstraint(
                fields=("feed", "guid"), name="entry_unique_guid_per_feed"
            ),
        )
        verbose_name_plural = "entries"

    def __str__(self) -> str:
        return self.title or self.guid


class ImportRun(models.Model):
    """One import that held the lock: when it ran (monotonic clock) and where."""

    feed_url = models.URLField(max_length=500, db_index=True)
    task_name = models.CharField(max_length=200)
    started = models.FloatField(help_text="time.monotonic() when the import began")
    finished = models.FloatField(help_text="time.monotonic() when it ended")
    pid = models.PositiveIntegerField()
    entries_created = models.PositiveIntegerField(default=0)

    def __str__(self) -> str:
        return f"{self.task_name} {self.feed_url} [{self.started:.3f}, {self.finished:.3f}]"


class TaskOutcome(models.Model):
    """What became of every feeds task message: imported, skipped or failed."""

    IMPORTED, SKIPPED, FAILED = "imported", "skipped", "failed"

    task_id = models.CharField(max_length=100, unique=True)
    task_name = models.CharField(max_length=200)
    feed_url = models.URLField(max_length=500, db_index=True)
    outcome = models.CharField(
        max_length=10,
        choices=((IMPORTED, "imported"), (SKIPPED, "skipped"), (FAILED, "failed")),
    )
    detail = models.TextField(blank=True, help_text="the error, for failed tasks")

    def __str__(self) -> str:
        return f"{self.task_name} {self.feed_url}: {self.outcome}"


class BeatRun(models.Model):
    """One periodic run a worker received from the highly available beat: the
    run (the time the sending leader recorded for it, from the message's
    ``tasklock_beat_run`` header) and the leader's fence."""

    entry = models.CharField(max_length=200)
    run_ms = models.BigIntegerField(
        null=True, help_text="the run's time (ms since the epoch), one per run"
    )
    fence = models.BigIntegerField(null=True, help_text="the sending leader's fence")
    received = models.FloatField(help_text="time.time() when a worker ran it")
    pid = models.PositiveIntegerField()

    def __str__(self) -> str:
        return f"{self.entry} run {self.run_ms} (fence {self.fence})"
