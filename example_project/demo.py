"""The demo: a storm of duplicate feed imports over real Celery worker processes.

    python -m example_project.demo [--duplicates N] [--producers N] [--workers N]

It starts a private memcached (or, without one, a private Redis, and says so), a
local feed server with slow responses, a fresh SQLite database and real
``celery worker`` processes (prefork) on kombu's filesystem transport, or on
``CELERY_BROKER_URL`` when that is set. Then, for each of the two importer tasks
(the cookbook's ``memcache_lock`` and ``@single_instance``), several producer
threads enqueue every feed many times at once. Each import records its start and
end; the report shows per feed how many imports ran, how many duplicates were
skipped, the most imports of that feed running at one moment, and the entries
stored. Then the refresh button: ``refresh_feed`` (``mode="coalesce"``) clicked
many times per feed by every producer; the report shows per feed how many clicks
were sent, how many became a published task (at most one running plus one
pending), how many ran, and how many were coalesced into a pending call. Then
an async view (``async with memcache_lock``) and, on Django 6 and later, a
django.tasks async task (``@single_instance`` on ``async def``) import every
feed, many requests and enqueues at once. Last, two ``celery beat``
processes with ``LeaderScheduler``, the leader SIGKILLed halfway
(``beat_demo``): per periodic entry, the runs the workers received and any
received twice. The exit status is 1 if any feed was imported twice at once,
never imported, a task failed, a published refresh did not run, or a periodic
run was received twice or the other beat did not take over; every process the
demo started is stopped.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from django_tasklock.locks.liveness import forget_records  # noqa: E402
from example_project import beat_demo, job_demo  # noqa: E402
from tests.services import (  # noqa: E402
    Memcached,
    Redis,
    RedisCluster,
    celery_worker,
    stop_process,
)
from tests.workers import most_at_once  # noqa: E402

if TYPE_CHECKING:
    from example_project.feedserver import FeedServer

TASKS = ("import_feed", "import_feed_single")


def say(message: str = "") -> None:
    print(message, flush=True)


def start_lock_store(stack: ExitStack, store: str = "auto") -> str:
    """A private lock store: memcached (``auto``: Redis when memcached is
    missing), Redis, a Redis Cluster of three primaries with a replica each
    (through django-valkey's ``ClusterValkeyCache``), or PostgreSQL (the
    project's database and its lock store at once)."""
    if store == "postgres":
        from tests.services_pg import Postgres

        database = Postgres().start()
        stack.callback(database.remove)
        say(
            f"Lock store and database: a private PostgreSQL on {database.address}, "
            "the project's only store (PostgresCache on its default database)"
        )
        return f"postgres://{database.address}/tasklock"
    if store == "cluster":
        cluster = RedisCluster().start()
        stack.callback(cluster.stop)
        say(
            "Lock store: a private Redis Cluster (3 primaries, a replica each) on "
            + ", ".join(node.address for node in cluster.nodes)
        )
        return "valkey-cluster://" + cluster.nodes[0].address
    if store in ("auto", "memcached") and shutil.which("memcached"):
        server = Memcached().start()
        stack.callback(server.stop)
        say(f"Lock store: private memcached on {server.address}")
        return f"memcached://{server.address}"
    if store == "memcached":
        raise SystemExit("memcached is not installed: apt-get install -y memcached")
    if store == "auto":
        say(
            "memcached is not installed (apt-get install -y memcached); falling "
            "back to a private Redis, which also holds locks across processes."
        )
    if not shutil.which("redis-server"):
        raise SystemExit(
            "Neither memcached nor redis-server is installed: apt-get install -y memcached"
        )
    redis = Redis().start()
    stack.callback(redis.stop)
    say(f"Lock store: private Redis on {redis.address}")
    return redis.url


def start_workers(
    stack: ExitStack, run_dir: Path, count: int, concurrency: int
) -> None:
    env = dict(os.environ)
    procs = []
    for number in range(1, count + 1):
        log = run_dir / f"worker{number}.log"
        proc = celery_worker(
            "example_project",
            f"demo{number}",
            concurrency,
            env,
            loglevel="INFO",
            logfile=log,
            stderr=subprocess.STDOUT,
        )
        procs.append((proc, log))
        stack.callback(stop_process, proc)
    deadline = time.monotonic() + 60
    for proc, log in procs:
        while "ready." not in (log.read_text() if log.exists() else ""):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log.read_text()[-3000:] if log.exists() else ""
                raise SystemExit(f"A celery worker did not start:\n{tail}")
            time.sleep(0.1)
    say(
        f"Started {count} celery workers (prefork, {concurrency} processes each); logs in {run_dir}"
    )


def start_console(stack: ExitStack) -> str:
    """The example project's web server (the admin's lock console and the
    metrics), on a free port, with a superuser demo / demo; its address."""
    import socket

    from django.contrib.auth.models import User

    User.objects.create_superuser("demo", "demo@example.com", "demo")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    served = "manage.py runserver --noreload --insecure"
    web = subprocess.Popen(
        [sys.executable, *shlex.split(served), f"127.0.0.1:{port}"],
        cwd=ROOT,
        env=dict(os.environ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    stack.callback(stop_process, web)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if web.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(
                    "The example project's web server did not start"
                ) from None
            time.sleep(0.1)
    address = f"http://127.0.0.1:{port}"
    say(
        f"Lock console: {address}/admin/django_tasklock/heldlock/ (log in as demo, "
        f"password demo); metrics: {address}/metrics/tasklock"
    )
    return address


def report_metrics(metrics_dir: Path) -> bool:
    """What the Prometheus metrics counted, summed over every process (the
    workers' pool processes and this one), against the database: each run of
    the @single_instance importer took its lock once, and each skipped
    duplicate was one refused acquire."""
    from prometheus_client import CollectorRegistry, multiprocess

    from example_project.feeds.models import ImportRun, TaskOutcome

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(metrics_dir))
    task = "example_project.feeds.tasks.import_feed_single"
    labels = {"task": task, "cache": "default"}
    taken = registry.get_sample_value("tasklock_acquisitions_total", labels) or 0
    refused = (
        registry.get_sample_value(
            "tasklock_contentions_total", {**labels, "policy": "skip"}
        )
        or 0
    )
    held = registry.get_sample_value("tasklock_hold_seconds_count", labels) or 0
    runs = ImportRun.objects.filter(task_name=task).count()
    skipped = TaskOutcome.objects.filter(task_name=task, outcome="skipped").count()
    files = len(list(metrics_dir.glob("*.db")))
    say(
        f"Metrics ({files} process files summed): {task.rsplit('.', 1)[1]} took its "
        f"lock {taken:.0f} times ({runs} runs recorded), was refused {refused:.0f} "
        f"times ({skipped} duplicates skipped), {held:.0f} holds timed."
    )
    if (taken, refused, held) != (runs, skipped, runs):
        say("   <- THE METRICS DO NOT MATCH WHAT RAN")
        return False
    return True


def storm(task_name: str, urls: list[str], duplicates: int, producers: int) -> int:
    """Every producer thread sends every feed ``duplicates`` times; returns the total."""
    from example_project.feeds import tasks

    task = getattr(tasks, task_name)
    barrier = threading.Barrier(producers)

    def produce(number: int) -> None:
        barrier.wait()
        # Bursts of one feed from every producer at once: the worst case.
        for url in urls:
            for _ in range(duplicates):
                task.delay(url)

    threads = [threading.Thread(target=produce, args=(n,)) for n in range(producers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return producers * duplicates * len(urls)


def clicks(urls: list[str], clicks: int, producers: int) -> dict[str, list[str]]:
    """The refresh button pressed once per feed, then, while those imports run,
    ``clicks`` times per feed by every producer at once; the task id each click
    got back, per feed."""
    from django_tasklock import lock_id_for
    from django_tasklock.status import lock_status
    from example_project.feeds import tasks
    from example_project.feeds.models import ImportRun

    # One click per feed, then the storm once each of those imports is running:
    # the storm's clicks arrive while an import of their feed is in progress.
    got: dict[str, list[str]] = {
        url: [tasks.refresh_feed.delay(url).id] for url in urls
    }
    waiting = set(urls)
    deadline = time.monotonic() + 60
    while waiting and time.monotonic() < deadline:
        for url in list(waiting):
            call = lock_status(lock_id_for(tasks.refresh_feed, url)).call
            if (
                call == ("running", got[url][0])
                or ImportRun.objects.filter(
                    task_name=tasks.refresh_feed.name, feed_url=url
                ).exists()
            ):
                waiting.discard(url)
        time.sleep(0.01)
    barrier = threading.Barrier(producers)
    guard = threading.Lock()

    def produce(number: int) -> None:
        barrier.wait()
        for url in urls:
            ids = [tasks.refresh_feed.delay(url).id for _ in range(clicks)]
            with guard:
                got[url] += ids

    threads = [threading.Thread(target=produce, args=(n,)) for n in range(producers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return got


def web_refreshes(urls: list[str], per_feed: int) -> tuple[list[int], float]:
    """Every feed refreshed through the async view (``feeds/refresh``), by
    ``per_feed`` requests at once each, all in one event loop through Django's
    ASGI handler: their status codes, and the loop's largest lag (how much
    later than asked a probe's 5 ms sleep woke)."""
    import asyncio

    from django.test import AsyncClient

    from django_tasklock.aio import close_loop_connections

    async def main() -> tuple[list[int], float]:
        client = AsyncClient()
        lags: list[float] = []
        done = asyncio.Event()

        async def probe() -> None:
            while not done.is_set():
                asked = time.monotonic()
                await asyncio.sleep(0.005)
                lags.append(time.monotonic() - asked - 0.005)

        probing = asyncio.ensure_future(probe())
        try:
            posts = [
                client.post("/feeds/refresh", {"url": url})
                for url in urls
                for _ in range(per_feed)
            ]
            responses = await asyncio.gather(*posts)
        finally:
            done.set()
            await probing
            await close_loop_connections()
        return [response.status_code for response in responses], max(lags)

    from django.conf import settings
    from django.test import override_settings

    # (Django's test client names the host "testserver".)
    with override_settings(ALLOWED_HOSTS=[*settings.ALLOWED_HOSTS, "testserver"]):
        return asyncio.run(main())


def report_web(urls: list[str], statuses: list[int], lag: float) -> bool:
    """Each feed imported by the view at most once at a time, and every
    request answered 200 or 409."""
    from example_project.feeds.models import ImportRun
    from example_project.feeds.views import VIEW_NAME

    imported, busy = statuses.count(200), statuses.count(409)
    say(
        f"   {len(statuses)} requests: {imported} imported, {busy} answered 409 "
        f"(busy); the event loop's largest lag: {lag * 1000:.0f} ms"
    )
    ok = imported + busy == len(statuses) and imported >= len(urls)
    if not ok:
        say(f"   <- UNEXPECTED ANSWERS: {sorted(set(statuses))}")
    for url in urls:
        runs = ImportRun.objects.filter(feed_url=url, task_name=VIEW_NAME)
        web = runs.count()
        peak = most_at_once(list(runs.values_list("started", "finished")))
        if web == 0 or peak > 1:
            say(f"   <- {url}: {web} imports by the view, {peak} imports at once")
            ok = False
    if ok:
        say("   every feed imported by the view, never two imports of one feed at once")
    return ok


def report_clicks(sent: dict[str, list[str]]) -> bool:
    from example_project.feeds.models import ImportRun

    full_name = "example_project.feeds.tasks.refresh_feed"
    say(
        f"{'feed':<28} {'clicks':>7} {'published':>9} {'ran':>5} {'coalesced':>9} "
        f"{'at once':>7}"
    )
    ok = True
    for url, ids in sent.items():
        runs = ImportRun.objects.filter(task_name=full_name, feed_url=url)
        published = len(set(ids))
        peak = most_at_once(list(runs.values_list("started", "finished")))
        problems = []
        if runs.count() != published:
            problems.append("A PUBLISHED REFRESH DID NOT RUN ONCE")
        if peak > 1:
            problems.append("IMPORTED CONCURRENTLY")
        ok = ok and not problems
        say(
            f"{url.rsplit('/', 1)[1]:<28} {len(ids):>7} {published:>9} "
            f"{runs.count():>5} {len(ids) - published:>9} {peak:>7}"
            + ("   <- " + ", ".join(problems) if problems else "")
        )
    return ok


def wait_for(task_name: str, expected: int, timeout: float = 60) -> None:
    from example_project.feeds.models import TaskOutcome

    full_name = f"example_project.feeds.tasks.{task_name}"
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        outcomes = TaskOutcome.objects.filter(task_name=full_name)
        done = outcomes.count()
        line = (
            f"   {done}/{expected} done: "
            f"{outcomes.filter(outcome='imported').count()} imported, "
            f"{outcomes.filter(outcome='skipped').count()} skipped, "
            f"{outcomes.filter(outcome='failed').count()} failed"
        )
        if line != last:
            say(line)
            last = line
        if done >= expected:
            return
        if time.monotonic() > deadline:
            raise SystemExit(
                f"Timed out: only {done} of {expected} {task_name} tasks finished"
            )
        time.sleep(0.5)


def report(task_name: str, urls: list[str]) -> bool:
    from example_project.feeds.models import Entry, ImportRun, TaskOutcome

    full_name = f"example_project.feeds.tasks.{task_name}"
    say(
        f"{'feed':<28} {'imports':>7} {'skipped':>7} {'failed':>6} {'at once':>7} {'entries':>7}"
    )
    ok = True
    for url in urls:
        runs = ImportRun.objects.filter(task_name=full_name, feed_url=url)
        outcomes = TaskOutcome.objects.filter(task_name=full_name, feed_url=url)
        peak = most_at_once(list(runs.values_list("started", "finished")))
        failed = outcomes.filter(outcome="failed").count()
        row = (
            f"{url.rsplit('/', 1)[1]:<28} {runs.count():>7} "
            f"{outcomes.filter(outcome='skipped').count():>7} {failed:>6} {peak:>7} "
            f"{Entry.objects.filter(feed__url=url).count():>7}"
        )
        problems = []
        if peak > 1:
            problems.append("IMPORTED CONCURRENTLY")
        if runs.count() == 0:
            problems.append("NEVER IMPORTED")
        if failed:
            problems.append("TASKS FAILED")
        ok = ok and not problems
        say(row + ("   <- " + ", ".join(problems) if problems else ""))
        for detail in outcomes.filter(outcome="failed").values_list(
            "detail", flat=True
        )[:3]:
            say(f"      failed: {detail}")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--duplicates", type=int, default=4, help="sends of each feed per producer"
    )
    parser.add_argument("--producers", type=int, default=3, help="producer threads")
    parser.add_argument(
        "--workers", type=int, default=2, help="celery worker processes"
    )
    parser.add_argument(
        "--concurrency", type=int, default=2, help="pool processes per worker"
    )
    parser.add_argument(
        "--delay", type=float, default=0.3, help="feed server delay, seconds"
    )
    parser.add_argument(
        "--store",
        choices=("auto", "memcached", "redis", "cluster", "postgres"),
        default="auto",
        help="the lock store: memcached (auto: Redis when memcached is missing), "
        "Redis, a Redis Cluster through django-valkey, or PostgreSQL as the "
        "project's only store (its database and its locks)",
    )
    parser.add_argument(
        "--beat-seconds",
        type=float,
        default=12.0,
        help="how long the two celery beats run (the leader is killed halfway)",
    )
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep the run folder (database, worker logs, metrics) and, after the "
        "report, the workers, the lock console and the metrics endpoint, until Enter",
    )
    options = parser.parse_args(argv)
    started = time.monotonic()

    with ExitStack() as stack:
        run_dir = Path(tempfile.mkdtemp(prefix="tasklock-demo-"))
        if not options.keep:
            stack.callback(shutil.rmtree, run_dir, ignore_errors=True)
        os.environ["EXAMPLE_LOCK_STORE"] = start_lock_store(stack, options.store)
        # Before the store stops: this process's liveness record (it publishes
        # calls, which its roster lists for the console) goes with it.
        stack.callback(forget_records, delete=True)
        os.environ["EXAMPLE_DATABASE"] = str(run_dir / "demo.sqlite3")
        os.environ["EXAMPLE_BROKER_DIR"] = str(run_dir / "broker")
        os.environ["DJANGO_SETTINGS_MODULE"] = "example_project.settings"
        # Prometheus's multiprocess mode: every process writes its counts here
        # (set before prometheus_client is imported, workers included).
        metrics_dir = run_dir / "metrics"
        metrics_dir.mkdir()
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
        for folder in ("queue", "control"):
            (run_dir / "broker" / folder).mkdir(parents=True)
        broker = os.environ.get("CELERY_BROKER_URL", "filesystem:// (kombu, no server)")
        say(f"Broker: {broker}")

        import django

        django.setup()
        from django.core.management import call_command

        from example_project.feedserver import FeedServer

        call_command("migrate", verbosity=0)
        call_command("check")
        if options.store == "postgres":
            say("Database: the same PostgreSQL, migrated (the lock table with it)")
        else:
            say(f"Database: fresh SQLite at {os.environ['EXAMPLE_DATABASE']}")
        server = FeedServer(delay=options.delay).start()
        stack.callback(server.stop)
        urls = server.feed_urls()
        say(
            f"Feed server: {len(urls)} fixture feeds on 127.0.0.1:{server.port}, "
            f"{options.delay}s per response"
        )
        start_workers(stack, run_dir, options.workers, options.concurrency)
        start_console(stack)

        ok = True
        for number, task_name in enumerate(TASKS, 1):
            cookbook = task_name == "import_feed"
            label = (
                "the cookbook's code, with django_tasklock's memcache_lock"
                if cookbook
                else "@single_instance"
            )
            say()
            say(
                f"{number}. {task_name}, {label}: {options.producers} producers send every feed "
                f"{options.duplicates} times each"
            )
            sent = storm(task_name, urls, options.duplicates, options.producers)
            say(f"   sent {sent} tasks")
            wait_for(task_name, sent)
            ok = report(task_name, urls) and ok
            if cookbook:
                say(
                    "   Step 2's result, by design: the cookbook's code, with "
                    "django_tasklock's\n   memcache_lock in place of the recipe's. "
                    "The recipe's own lock goes wrong\n   only when a lock expires, "
                    "is flushed or restarts under a run: `make lock-demo`\n   shows "
                    "it deleting a newer holder's lock."
                )
        say()
        say(
            f'{len(TASKS) + 1}. refresh_feed, @single_instance(mode="coalesce"): '
            f"{options.producers} producers click refresh on every feed "
            f"{options.duplicates} times each"
        )
        # Each refused click is logged at INFO by django_tasklock; the table
        # below counts them instead.
        logging.getLogger("django_tasklock.calls").setLevel(logging.WARNING)
        sent = clicks(urls, options.duplicates, options.producers)
        published = sum(len(set(ids)) for ids in sent.values())
        say(
            f"   {sum(map(len, sent.values()))} clicks became {published} published "
            "tasks; the rest joined a pending refresh of their feed"
        )
        wait_for("refresh_feed", published)
        ok = report_clicks(sent) and ok
        say()
        say(
            f"{len(TASKS) + 2}. an async Django view imports a feed, one request "
            "at a time per feed (async with memcache_lock): "
            f"{options.producers * options.duplicates} requests at once for every feed"
        )
        statuses, lag = web_refreshes(urls, options.producers * options.duplicates)
        ok = report_web(urls, statuses, lag) and ok
        say()
        say(
            f"{len(TASKS) + 3}. a django.tasks async task imports a feed, one run "
            "at a time per feed (@single_instance on async def): "
            f"{options.producers * options.duplicates} enqueues at once for every feed"
        )
        ok = job_demo.run(urls, options.producers * options.duplicates) and ok
        say()
        say(
            f"{len(TASKS) + 4}. Celery beat on two processes (LeaderScheduler), two "
            f"entries every second, for {options.beat_seconds:g}s; the leader is "
            "SIGKILLed halfway"
        )
        ok = (
            beat_demo.run(stack, run_dir, dict(os.environ), options.beat_seconds) and ok
        )
        say()
        from django.conf import settings

        per_host = settings.FEED_FETCHES_PER_HOST
        say(
            f"Feed server answered {server.requests} requests, at most {server.peak} "
            f"at once (the importer allows {per_host} fetches per host at once)."
        )
        if server.peak > per_host:
            say("   <- MORE FETCHES AT ONCE THAN THE SEMAPHORE ALLOWS")
            ok = False
        ok = report_rate(server, settings.FEED_FETCH_RATE) and ok
        ok = report_metrics(metrics_dir) and ok
        if options.keep:
            say(
                "--keep: the workers, the lock console and the metrics stay up; "
                "press Enter to stop them."
            )
            try:
                sys.stdin.readline()
            except KeyboardInterrupt:  # the servers had it too: they are going
                say()
    say(
        f"Stopped every process the demo started ({time.monotonic() - started:.1f}s in all)."
    )
    say(
        "RESULT: "
        + (
            "OK: no feed imported twice at once, every feed imported, each "
            "periodic run received once"
            if ok
            else "FAILED"
        )
    )
    return 0 if ok else 1


def report_rate(server: FeedServer, rate_text: str) -> bool:
    """The busiest period the feed server saw, against the fetch rate limit.
    A request arrives a moment after its admission; half a second of that is
    allowed for before calling the limit broken."""
    from django_tasklock.rates import parse_rate

    rate = parse_rate(rate_text)
    shorter = rate.period - 0.5
    busiest, within = server.busiest(rate.period), server.busiest(shorter)
    say(
        f"At most {busiest} requests reached it in any {rate.period:g}s and {within} "
        f"in any {shorter:g}s (the importer admits {rate} fetches per host, a "
        "RateLimiter per host; a request arrives a moment after its admission)."
    )
    if within > rate.count:
        say("   <- MORE FETCHES PER PERIOD THAN THE RATE LIMIT ALLOWS")
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
