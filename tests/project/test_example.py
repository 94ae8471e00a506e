"""The example project: the feed importer, its two tasks under a real worker, and
the demo a newcomer runs first."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from hashlib import md5
from pathlib import Path

import django
import pytest
from celery.contrib.testing.worker import start_worker
from django.db import OperationalError, connections

from django_tasklock import Lock, NoFence, StaleFence, lock_id_for
from example_project.celery import app as example_app
from example_project.feeds import tasks
from example_project.feeds.importer import (
    FeedImportError,
    fetch_and_parse,
    store,
)
from example_project.feeds.models import Entry, Feed, ImportRun, TaskOutcome
from example_project.feedserver import FeedServer
from tests.helpers import ROOT, forget_backend, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.long(seconds=170)]


@pytest.fixture(scope="module")
def feeds():
    server = FeedServer(delay=0).start()
    yield server
    server.stop()


def test_every_fixture_feed_imports(feeds):
    urls = feeds.feed_urls()
    assert len(urls) >= 5
    assert {Path(u).suffix for u in urls} == {".rss", ".atom"}
    for url in urls:
        result = Feed.objects.import_feed(url, fence=1)
        assert result.created >= 2, url
        assert result.updated == 0, f"{url}: entries collided on one guid"
        assert result.feed.title
        assert result.feed.entries.count() == result.created


def test_rss_fields(feeds):
    feed = Feed.objects.import_feed(feeds.url("feeds/python-news.rss"), fence=1).feed
    assert feed.title == "Python Insider"
    assert feed.link == "https://blog.python.example/"
    entry = feed.entries.get(guid="tag:blog.python.example,2026:post-sprint")
    assert entry.title == "Core sprint report"
    assert entry.link == "https://blog.python.example/2026/10/sprint.html"
    assert entry.published.isoformat() == "2026-10-19T12:30:00+00:00"


def test_html_in_titles_is_stripped(feeds):
    feed = Feed.objects.import_feed(
        feeds.url("feeds/relative-links.atom"), fence=1
    ).feed
    assert feed.title == "Relative Links Weekly"
    titles = set(feed.entries.values_list("title", flat=True))
    assert titles == {"Issue 42: links without a host", "Issue 41 & friends"}


def test_relative_links_are_resolved_against_the_feed(feeds):
    url = feeds.url("feeds/relative-links.atom")
    feed = Feed.objects.import_feed(url, fence=1).feed
    base = f"http://127.0.0.1:{feeds.port}"
    assert set(feed.entries.values_list("link", flat=True)) == {
        f"{base}/feeds/issues/42.html",
        f"{base}/weekly/issues/41.html",
    }
    assert feed.link == f"{base}/"


def test_declared_non_utf8_encodings_are_decoded(feeds):
    cafe = Feed.objects.import_feed(feeds.url("feeds/cafe-latin1.rss"), fence=1).feed
    assert cafe.title == "Le Café des Développeurs"
    assert "Crème brûlée et compilateurs" in cafe.entries.values_list(
        "title", flat=True
    )
    notes = Feed.objects.import_feed(
        feeds.url("feeds/release-notes.atom"), fence=1
    ).feed
    assert notes.title == "Release Notes \u2013 \u201cStable\u201d channel"


def test_entries_without_guid_get_distinct_stable_ids(feeds):
    url = feeds.url("feeds/no-guids.rss")
    first = Feed.objects.import_feed(url, fence=1)
    guids = set(first.feed.entries.values_list("guid", flat=True))
    assert len(guids) == 3
    assert f"http://127.0.0.1:{feeds.port}/feeds/posts/only-link.html" in guids
    assert sum(guid.startswith("sha1:") for guid in guids) == 2
    assert "Tip: use functools.cache" in first.feed.entries.values_list(
        "title", flat=True
    )
    again = Feed.objects.import_feed(url, fence=1)
    assert set(again.feed.entries.values_list("guid", flat=True)) == guids


def test_reimport_is_idempotent(feeds):
    url = feeds.url("feeds/podcast.rss")
    first = Feed.objects.import_feed(url, fence=1)
    second = Feed.objects.import_feed(url, fence=1)
    assert (second.created, second.updated) == (0, 0)
    assert Entry.objects.filter(feed__url=url).count() == first.created
    feed = Feed.objects.get(url=url)
    assert (feed.imports, feed.entries_created) == (2, first.created)


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("broken.rss", "is malformed"),
        ("not-a-feed.html", "is not an RSS or Atom feed"),
        ("missing.rss", "Could not fetch"),
    ],
)
def test_bad_feed_gives_clear_error_and_changes_nothing(feeds, path, message):
    url = feeds.url(path)
    feed = Feed.objects.create(url=url, title="kept", imports=3)
    Entry.objects.create(feed=feed, guid="g1", title="kept entry")
    with pytest.raises(FeedImportError, match=message):
        Feed.objects.import_feed(url)
    feed.refresh_from_db()
    assert (feed.title, feed.imports) == ("kept", 3)
    assert list(feed.entries.values_list("title", flat=True)) == ["kept entry"]


def test_unreachable_server_is_a_clear_error():
    with pytest.raises(
        FeedImportError, match=r"Could not fetch http://127\.0\.0\.1:9/"
    ):
        Feed.objects.import_feed("http://127.0.0.1:9/feed.rss")
    assert Feed.objects.count() == 0


@pytest.fixture
def example_worker(redis_server, settings):
    settings.TASKLOCK = {"CACHE": "default"}
    base = redis_server.url[:-2]
    forget_backend(example_app)
    example_app.conf.update(broker_url=f"{base}/5", result_backend=f"{base}/6")
    with start_worker(
        example_app,
        pool="threads",
        concurrency=2,
        perform_ping_check=False,
        loglevel="WARNING",
    ) as worker:
        yield worker
    connections.close_all()


def outcomes_recorded(count: int) -> None:
    """Wait for ``count`` TaskOutcome rows: task_postrun records a message's
    outcome after its result is stored, so ``.get()`` may return first, and the
    worker thread may be writing the row (SQLite then says the table is
    locked) while this one reads."""

    def recorded() -> bool:
        try:
            return TaskOutcome.objects.count() >= count
        except OperationalError:
            return False

    wait_until(recorded)


@pytest.mark.slow
def test_both_tasks_through_a_worker(feeds, example_worker):
    url = feeds.url("feeds/python-news.rss")
    cookbook_id = f"{tasks.import_feed.name}-lock-{md5(url.encode()).hexdigest()}"
    # @single_instance(key="feed_url") takes the lock id the cookbook would build.
    single_id = lock_id_for(tasks.import_feed_single, url)
    assert (
        single_id
        == f"{tasks.import_feed_single.name}-lock-{md5(url.encode()).hexdigest()}"
    )

    assert tasks.import_feed.delay(url).get(timeout=30) == url
    assert tasks.import_feed_single.delay(url).get(timeout=30) == url
    with Lock(cookbook_id), Lock(single_id):
        assert tasks.import_feed.delay(url).get(timeout=30) is None
        assert tasks.import_feed_single.delay(url).get(timeout=30) is None
    outcomes_recorded(4)
    outcomes = list(
        TaskOutcome.objects.order_by("id").values_list("task_name", "outcome")
    )
    assert outcomes == [
        (tasks.import_feed.name, "imported"),
        (tasks.import_feed_single.name, "imported"),
        (tasks.import_feed.name, "skipped"),
        (tasks.import_feed_single.name, "skipped"),
    ]
    assert ImportRun.objects.count() == 2
    assert Feed.objects.get(url=url).imports == 2
    assert Entry.objects.filter(feed__url=url).count() == 3


def run_demo(env=None, *extra: str):
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "example_project.demo",
            "--duplicates",
            "2",
            "--producers",
            "2",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
        env=env,
    )


@pytest.mark.slow
def test_demo_without_memcached_falls_back_to_redis(tmp_path):
    """No memcached binary: the demo says how to install it and uses Redis."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "redis-server").symlink_to(shutil.which("redis-server"))
    result = run_demo({**os.environ, "PATH": str(bin_dir)})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "memcached is not installed (apt-get install -y memcached)" in result.stdout
    assert "Lock store: private Redis on 127.0.0.1:" in result.stdout
    assert "RESULT: OK" in result.stdout


@pytest.mark.slow
def test_demo_end_to_end():
    """The README's first command, with a small storm."""
    result = run_demo()
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "RESULT: OK" in out
    imports_part, _, refresh_part = out.partition("clicks published")
    rows = re.findall(
        r"^(\S+\.(?:rss|atom))\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)$",
        imports_part,
        re.M,
    )
    assert len(rows) == 12, out  # six feeds, two tasks
    clicks = re.findall(
        r"^(\S+\.(?:rss|atom))\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)$",
        refresh_part,
        re.M,
    )
    assert len(clicks) == 6, out
    for name, sent, published, ran, coalesced, at_once in clicks:
        assert int(ran) == int(published) >= 1, name
        assert int(coalesced) == int(sent) - int(published) > 0, name
        assert int(at_once) == 1, name
    for name, imports, _skipped, failed, at_once, entries in rows:
        assert int(imports) >= 1, name
        assert int(failed) == 0, name
        assert int(at_once) == 1, name
        assert int(entries) >= 2, name
    # The async view: every request answered (imported, or 409 while the
    # feed's import held the lock), every feed imported, never two at once.
    web = re.search(r"(\d+) requests: (\d+) imported, (\d+) answered 409 \(busy\)", out)
    assert web, out
    requests, imported, busy = map(int, web.groups())
    assert imported + busy == requests and imported >= 6 and busy > 0, out
    assert "every feed imported by the view, never two imports of one feed" in out
    # The django.tasks step: run on Django 6 and later (tests/integrations/test_django_tasks.py
    # runs it there), said not run on 5.2.
    if django.VERSION < (6, 0):
        assert "not run: Django 5.2" in out and "has no django.tasks" in out, out
    else:
        assert "every feed imported by the task, never two imports" in out, out
    # Two celery beats, the leader killed halfway: each periodic run once.
    beat_rows = re.findall(
        r"^   (check-stale-feeds|count-entries)\s+(\d+)\s+(\d+)\s+([\d.]+)s$",
        out,
        re.M,
    )
    assert len(beat_rows) == 2, out
    for entry, runs, twice, _gap in beat_rows:
        assert int(runs) >= 5 and int(twice) == 0, entry
    assert re.search(r"the other beat \(pid \d+\) leads, fence \d+", out), out
    assert "Stopped every process the demo started" in out


def test_paused_holders_late_write_is_refused(feeds, settings):
    """A holder stalls (GC pause, SIGSTOP, swapped out) between fetching and
    writing, past its expiry; a newer holder imports meanwhile. The database
    refuses the stalled holder's write, by its older fencing token."""
    settings.TASKLOCK = {"CACHE": "default"}
    url = feeds.url("feeds/python-news.rss")
    lock_id = lock_id_for(tasks.import_feed_single, url)
    # Not renewed: a paused process runs no heartbeat either.
    paused = Lock(lock_id, expire=2)
    assert paused.acquire()
    assert paused.fence is not None  # drawn before the work, as the tasks do
    parsed = fetch_and_parse(url)
    deadline = time.monotonic() + 5
    while paused.owned():
        assert time.monotonic() < deadline, "the lock never expired"
        time.sleep(0.05)
    assert tasks.import_feed_single(url) == url  # the newer holder, fenced
    feed = Feed.objects.get(url=url)
    assert feed.fence is not None and paused.fence is not None
    assert feed.fence > paused.fence
    before = (feed.imports, feed.last_imported_at, Entry.objects.count())
    with pytest.raises(StaleFence, match="Refused a stale write") as refused:
        store(url, parsed, paused.fence)
    assert (refused.value.fence, refused.value.stored) == (paused.fence, feed.fence)
    feed.refresh_from_db()
    assert (feed.imports, feed.last_imported_at, Entry.objects.count()) == before
    assert feed.fence > paused.fence
    # The paused holder finds its lock lost, and leaves the new one alone.
    assert paused.release() is False and paused.lost


def test_fenced_writes_in_order_are_accepted(feeds):
    url = feeds.url("feeds/python-news.rss")
    parsed = fetch_and_parse(url)
    assert store(url, parsed, 10).feed.fence == 10
    assert store(url, parsed, 10).feed.fence == 10  # the same holder again
    assert store(url, parsed, 11).feed.fence == 11
    with pytest.raises(StaleFence):
        store(url, parsed, 9)
    # A write with no fence in reach is refused, never sent unfenced; inside
    # a lock's block, the lock's fence is found.
    with pytest.raises(NoFence):
        store(url, parsed)
    with Lock("feed-by-hand") as lock:
        assert store(url, parsed).feed.fence == lock.fence
    assert lock.fence is not None and lock.fence > 11


def fetch_at_once(urls: list[str]) -> list[int]:
    """Fetch ``urls`` from six threads at once, as six workers would; the sizes."""
    from concurrent.futures import ThreadPoolExecutor

    from example_project.feeds.importer import fetch
    from tests.helpers import close_connections

    def fetch_in_thread(url):
        try:
            return len(fetch(url)[0])
        finally:
            close_connections()

    with ThreadPoolExecutor(6) as pool:
        return list(pool.map(fetch_in_thread, urls))


def test_at_most_two_fetches_at_once_from_one_host():
    slow = FeedServer(delay=0.3).start()
    try:
        urls = slow.feed_urls()
        sizes = fetch_at_once(urls)
    finally:
        slow.stop()
    assert all(size > 0 for size in sizes) and len(sizes) == len(urls) >= 5
    # Six fetchers at once, one host: the semaphore lets two through at a time.
    assert slow.peak == 2, slow.peak
    assert slow.requests == len(urls)


def test_fetches_from_one_host_keep_to_the_rate_limit(settings):
    from urllib.parse import urlsplit

    from django_tasklock import RateLimiter

    settings.FEED_FETCH_RATE = "3/1s"
    server = FeedServer(delay=0).start()
    try:
        urls = server.feed_urls() * 2
        host = urlsplit(urls[0]).netloc
        RateLimiter(f"feeds-fetch-rate:{host}", "3/1s").reset()
        sizes = fetch_at_once(urls)
    finally:
        server.stop()
    assert all(size > 0 for size in sizes) and len(sizes) == len(urls) == 12
    # Three a second: twelve fetches span at least three seconds, less what a
    # loaded machine puts between an admission and its arrival. Unlimited, six
    # threads would bring all twelve within a fraction of a second.
    assert max(server.arrivals) - min(server.arrivals) >= 3.0 - 0.5


def test_a_429_pauses_the_hosts_limit_for_every_worker(settings):
    from urllib.parse import urlsplit

    from django_tasklock import RateLimiter
    from example_project.feeds.importer import fetch

    settings.FEED_FETCH_RATE = "100/1s"
    server = FeedServer(delay=0).start()
    try:
        url = server.feed_urls()[0]
        limiter = RateLimiter(f"feeds-fetch-rate:{urlsplit(url).netloc}", "100/1s")
        limiter.reset()
        server.throttle = 3
        with pytest.raises(FeedImportError, match="asked for a break of 3s"):
            fetch(url)
        refused = limiter.admit()  # as any other worker would see it
        assert not refused and refused.paused and 2 < refused.retry_after <= 3
        server.throttle = None
        started = time.monotonic()
        assert len(fetch(url)[0]) > 0  # waits out the pause, then fetches
        assert time.monotonic() - started >= 2
    finally:
        server.stop()
    limiter.reset()


@pytest.mark.slow
def test_demo_locks_on_a_redis_cluster():
    """``--store cluster``: the whole demo, its locks, marks, limits and
    console on a private three-primary Redis Cluster through django-valkey."""
    result = run_demo(None, "--store", "cluster")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Lock store: a private Redis Cluster (3 primaries" in result.stdout
    assert "RESULT: OK" in result.stdout


@pytest.mark.slow
def test_demo_on_postgresql_alone():
    """``--store postgres``: the whole demo with PostgreSQL as the project's
    only store: its database, and its locks, marks, limits, leadership and
    console in the same database (PostgresCache on the default alias)."""
    result = run_demo(None, "--store", "postgres")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Lock store and database: a private PostgreSQL on" in result.stdout
    assert "Database: the same PostgreSQL, migrated" in result.stdout
    assert "RESULT: OK" in result.stdout
