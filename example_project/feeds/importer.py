"""Fetch, parse and upsert one feed."""

from __future__ import annotations

import hashlib
import html
import urllib.error
import urllib.request
from calendar import timegm
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any
from urllib.parse import urljoin, urlsplit

import feedparser
from django.conf import settings
from django.db import transaction
from django.utils import timezone as django_timezone
from django.utils.html import strip_tags

from django_tasklock import RateLimiter, Semaphore

from .models import Entry, Feed

if TYPE_CHECKING:
    import time

    from django_tasklock.fenced import FenceGiven


class FeedImportError(Exception):
    """The feed could not be fetched or is not RSS/Atom; nothing was changed."""


@dataclass(frozen=True)
class ImportResult:
    feed: Feed
    created: int
    updated: int


def fetch(url: str) -> tuple[bytes, dict[str, str]]:
    """Download ``url``, at most ``FEED_FETCHES_PER_HOST`` (2) at once and
    ``FEED_FETCH_RATE`` per period per host, across every worker: a Semaphore
    and a RateLimiter per host, each waited on up to three timeouts. A 429
    answer pauses the host's limit for its Retry-After, in every worker."""
    timeout = getattr(settings, "FEED_TIMEOUT", 10)
    per_host = getattr(settings, "FEED_FETCHES_PER_HOST", 2)
    host = urlsplit(url).netloc
    fetches = Semaphore(f"feeds-fetch:{host}", per_host, expire=30, renew=True)
    if not fetches.acquire(blocking=True, timeout=3 * timeout):
        raise FeedImportError(
            f"Could not fetch {url}: {host} was busy with {per_host} fetches of "
            f"ours for {3 * timeout}s."
        )
    # Admitted last, right before the request: the host sees our fetches at
    # the pace the limit admits them.
    rate = RateLimiter(
        f"feeds-fetch-rate:{host}", getattr(settings, "FEED_FETCH_RATE", "20/5s")
    )
    try:
        if not rate.wait(timeout=3 * timeout):
            raise FeedImportError(
                f"Could not fetch {url}: {host} had its {rate.rate} fetches of ours "
                f"for {3 * timeout}s."
            )
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.read(), {k.lower(): v for k, v in response.headers.items()}
    except urllib.error.HTTPError as exc:
        if exc.code == 429:
            seconds = _retry_after(exc.headers.get("Retry-After"))
            rate.pause(seconds)
            raise FeedImportError(
                f"Could not fetch {url}: {host} asked for a break of {seconds:g}s "
                "(429); every worker's fetches from it wait that long."
            ) from exc
        raise FeedImportError(f"Could not fetch {url}: {exc}") from exc
    except (urllib.error.URLError, OSError) as exc:
        raise FeedImportError(f"Could not fetch {url}: {exc}") from exc
    finally:
        fetches.release_quietly()


def _retry_after(value: str | None) -> float:
    """Seconds from a Retry-After header (seconds; 60 when missing or a date)."""
    try:
        return max(float(value or ""), 1.0)
    except ValueError:
        return 60.0


def parse(url: str, body: bytes, headers: dict[str, str]) -> Any:
    parsed = feedparser.parse(
        body,
        response_headers={
            "content-location": url,  # resolves relative links against the feed URL
            "content-type": headers.get("content-type", "application/xml"),
        },
    )
    if not parsed.version:
        reason = parsed.get("bozo_exception", "no RSS or Atom document found")
        raise FeedImportError(f"{url} is not an RSS or Atom feed: {reason}")
    if parsed.bozo and not isinstance(
        parsed.bozo_exception, feedparser.CharacterEncodingOverride
    ):
        raise FeedImportError(f"{url} is malformed: {parsed.bozo_exception}")
    return parsed


def text(value: str | None) -> str:
    """Titles may carry HTML: keep the words, drop the markup and entities."""
    return html.unescape(strip_tags(value or "")).strip()


def when(struct: time.struct_time | None) -> datetime | None:
    if struct is None:
        return None
    return datetime.fromtimestamp(timegm(struct), tz=timezone.utc)


def guid_of(entry: Any, link: str) -> str:
    """The entry's id; for feeds without one, its link, else a hash of its content."""
    if entry.get("id"):
        return str(entry.id)[:500]
    if link:
        return link[:500]
    basis = f"{entry.get('title', '')}|{entry.get('published', '')}|{entry.get('summary', '')}"
    return "sha1:" + hashlib.sha1(basis.encode()).hexdigest()


def import_feed(url: str, fence: FenceGiven | None = None) -> ImportResult:
    """Fetch, parse and store the feed at ``url`` (see ``store`` for ``fence``)."""
    return store(url, fetch_and_parse(url), fence)


def fetch_and_parse(url: str) -> Any:
    body, headers = fetch(url)
    return parse(url, body, headers)


def store(url: str, parsed: Any, fence: FenceGiven | None = None) -> ImportResult:
    """Upsert a parsed feed in one transaction, fenced.

    The feed row is written first, by a fenced upsert: with the fence of the
    lock this import holds (found in reach, inside the task's lock; or
    ``fence``, given by hand). The database refuses it if a newer holder wrote
    the feed (``django_tasklock.StaleFence``), before anything changes; a write
    with no fence in reach is refused too (``NoFence``). The upsert's row lock
    (SQLite: the database's) holds to the end of the transaction, so the
    entries written after it are ordered behind any newer holder's as well.
    """
    created = updated = 0
    with transaction.atomic():
        Feed.objects.fenced_update_or_create(
            url=url,
            defaults={
                "title": text(parsed.feed.get("title"))[:300],
                "link": urljoin(url, parsed.feed.get("link", ""))[:500],
            },
            fence=fence,
        )
        feed = Feed.objects.select_for_update().get(url=url)
        for item in parsed.entries:
            link = urljoin(url, item["link"])[:500] if item.get("link") else ""
            values = {
                "title": text(item.get("title"))[:500],
                "link": link,
                # dict.get: feedparser's own get() would stand published in for a
                # missing updated (and warn that it will stop doing so).
                "published": when(dict.get(item, "published_parsed")),
                "updated": when(dict.get(item, "updated_parsed")),
            }
            entry, was_created = Entry.objects.get_or_create(
                feed=feed, guid=guid_of(item, link), defaults=values
            )
            if was_created:
                created += 1
            elif any(getattr(entry, name) != value for name, value in values.items()):
                for name, value in values.items():
                    setattr(entry, name, value)
                entry.save()
                updated += 1
        feed.imports += 1
        feed.entries_created += created
        feed.entries_updated += updated
        feed.last_imported_at = django_timezone.now()
        feed.save(
            update_fields=[
                "imports",
                "entries_created",
                "entries_updated",
                "last_imported_at",
            ]
        )
    return ImportResult(feed, created, updated)
