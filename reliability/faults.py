"""Fault cases for django_tasklock, each against a real memcached, with figures.

    python -m reliability.faults [--quick] [--write-readme]

Every case returns one row: what was tried, how often, how many overlapping
holds were seen, how many locks or keys were lost that should not have been, and
recovery times where the case has one. ``tests/test_faults.py`` runs the quick
sizes as part of the suite and asserts on the rows; the script runs the longer
sizes and prints the table README.rst carries.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.readme import write_section  # noqa: E402
from reliability import lifecycle  # noqa: E402
from tests.services import Memcached, celery_worker, stop_process  # noqa: E402
from tests.workers import hammer, overlaps  # noqa: E402

README_START = ".. fault-table-start"
README_END = ".. fault-table-end"


@dataclass
class Row:
    case: str
    attempts: int
    overlaps: int = 0
    lost: int = 0
    recovery: str = ""
    notes: list[str] = field(default_factory=list)


def setup_django(memcached: str) -> None:
    os.environ["TASKLOCK_TEST_MEMCACHED"] = memcached
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    import django

    django.setup()


def use_server(server: Memcached) -> Any:
    """A context in which the 'default' cache (the locks) is ``server``."""
    from django.conf import settings
    from django.test import override_settings

    default = {**settings.CACHES["default"], "LOCATION": server.address}
    return override_settings(CACHES={**settings.CACHES, "default": default})


# -- 1. contention -----------------------------------------------------------------


def contention(memcached: Memcached, processes: int, minimum: int, limit: float) -> Row:
    """``processes`` processes hammer one lock id until ``minimum`` acquisitions."""
    context = multiprocessing.get_context("spawn")
    holds: list[tuple[float, float]] = []
    started = time.monotonic()
    with context.Pool(
        processes, initializer=setup_django, initargs=(memcached.address,)
    ) as pool:
        pool.map(time.sleep, [0.05] * processes * 4)  # every process up and set up
        while len(holds) < minimum and time.monotonic() - started < limit:
            start_at = time.monotonic() + 1.0
            results = pool.starmap(
                hammer,
                [({"CACHE": "default"}, "fault-contention", start_at, 5.0, "lock")]
                * processes,
            )
            holds += [hold for process_holds, _ in results for hold in process_holds]
    span = (
        max(end for _, end in holds) - min(start for start, _ in holds) if holds else 0
    )
    row = Row(
        f"1. contention, {processes} processes, one id", len(holds), overlaps(holds)
    )
    row.notes.append(f"{len(holds) / max(span, 1e-9):.0f} acq/s while running")
    return row


# -- 2. expiry and retake ----------------------------------------------------------


def _slow_holder(memcached: str, expire: int, hold_for: float, queue: object) -> None:
    setup_django(memcached)
    from django_tasklock import Lock

    lock = Lock("fault-expiry", expire=expire)
    assert lock.acquire()
    queue.put(("acquired", time.monotonic()))  # type: ignore[attr-defined]
    time.sleep(hold_for)
    released = lock.release()
    queue.put(("released", released, lock.lost))  # type: ignore[attr-defined]


def expiry_and_retake(memcached: Memcached, tries: int) -> Row:
    from django_tasklock import Lock

    context = multiprocessing.get_context("spawn")
    lost = reported = 0
    waits = []
    for _ in range(tries):
        queue = context.Queue()
        holder = context.Process(
            target=_slow_holder, args=(memcached.address, 1, 3.0, queue)
        )
        holder.start()
        _, acquired_at = queue.get(timeout=30)
        second = Lock("fault-expiry", expire=60)
        while not second.acquire():
            time.sleep(0.05)
        waits.append(time.monotonic() - acquired_at)
        _, released, was_lost = queue.get(timeout=30)
        holder.join()
        if released or not second.owned():
            lost += 1
        reported += bool(was_lost and not released)
        second.release()
    row = Row("2. holder outlives its expiry", tries, lost=lost)
    row.recovery = f"retaken {min(waits):.1f}-{max(waits):.1f}s after (expiry 1s)"
    row.notes.append(f"first holder reported the loss {reported}/{tries}")
    return row


# -- 3. store loses the key --------------------------------------------------------


def key_lost(server: Memcached, how: str, tries: int) -> Row:
    """The old holder's release must not remove the new holder's lock."""
    from django_tasklock import Lock

    lost = 0
    for n in range(tries):
        lock_id = f"fault-lost-{how}-{n}"
        old = Lock(lock_id)
        assert old.acquire()
        if how == "flush_all":
            server.flush_all()
        elif how == "restart":
            server.restart()
        else:
            _evict(server, lock_id, len(old.token or ""))
        new = Lock(lock_id)
        if not new.acquire():
            raise AssertionError(f"{how}: the lock survived, the case did not happen")
        if old.release() or not new.owned():
            lost += 1
        new.release()
    return Row(f"3. key lost to {how}, then retaken", tries, lost=lost)


def _evict(server: Memcached, lock_id: str, token_size: int) -> None:
    """Fill a small memcached until the lock's key is evicted.

    Items of the lock's own size (memcached evicts per slab class), and no reads
    of the lock while filling: a read marks it recently used.
    """
    from pymemcache.client.base import Client

    from django_tasklock import Lock

    raw = Client(("127.0.0.1", server.port), default_noreply=False)
    filler = b"x" * token_size
    key_size = len(f":1:{lock_id}")
    number = 0
    try:
        for _ in range(20):
            for _ in range(100):
                batch = {
                    f"f{number + n}".rjust(key_size, "-"): filler for n in range(500)
                }
                raw.set_many(batch, expire=600)
                number += len(batch)
            if not Lock(lock_id).locked():
                return
        raise AssertionError("no eviction: is memcached running with -M?")
    finally:
        raw.close()


# -- 4. a worker killed mid-task ---------------------------------------------------


def killed_worker(redis_url: str, tries: int) -> Row:
    """SIGKILL the pool process running a locked task (expire=3 s); how soon does
    the next run of the same task and arguments start?"""
    from django_tasklock import Lock, lock_id_for
    from tests import tasks
    from tests.celery_app import app

    base = redis_url[:-2]
    env = {
        **os.environ,
        "TASKLOCK_TEST_BROKER": f"{base}/3",
        "TASKLOCK_TEST_REDIS": redis_url,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
    }
    os.environ.update(env)
    app.conf.update(broker_url=env["TASKLOCK_TEST_BROKER"], result_backend=None)
    worker = celery_worker("tests.celery_app", "faults", 1, env)
    recoveries: list[float] = []
    frees: list[float] = []
    early = 0
    try:
        for attempt in range(tries):
            name = f"killed-{attempt}"
            tasks.hold_for.delay(name, 60)
            deadline = time.monotonic() + 60
            while not tasks.runs(name):
                if time.monotonic() > deadline:
                    raise AssertionError("the locked task never started")
                time.sleep(0.05)
            first = tasks.runs(name)[0]
            os.kill(int(first["pid"]), signal.SIGKILL)
            killed_at = time.monotonic()
            lock = Lock(lock_id_for(tasks.hold_for, name, 0))
            while lock.locked():
                time.sleep(0.02)
            frees.append(time.monotonic() - killed_at)
            # Keep asking for the same run; skipped ones return at once.
            while len(tasks.runs(name)) < 2:
                tasks.hold_for.delay(name, 0)
                time.sleep(0.2)
                if time.monotonic() - killed_at > 60:
                    raise AssertionError("no run after the kill within 60 s")
            second = tasks.runs(name)[1]
            recoveries.append(second["start"] - killed_at)
            # Before the lock's expiry (3 s after it was taken), no run may start.
            early += second["start"] < first["start"] + 2.0
    finally:
        stop_process(worker)
        app.pool.force_close_all()
    row = Row("4. worker SIGKILLed mid-task (expire 3s)", tries, overlaps=early)
    row.recovery = (
        f"lock free {min(frees):.1f}-{max(frees):.1f}s and next run "
        f"{min(recoveries):.1f}-{max(recoveries):.1f}s after the kill"
    )
    return row


# -- 5. store unreachable ----------------------------------------------------------


def store_unreachable(server: Memcached, tries: int) -> Row:
    """Down at acquire, down at release, back again: nothing runs unlocked, nothing
    is skipped silently, and locking resumes without a restart."""
    from django_tasklock import Lock, LockBackendError, single_instance

    ran: list[int] = []

    @single_instance(key="n", expire=60)
    def job(n: int) -> str:
        ran.append(n)
        return "ran"

    unlocked_runs = silent_skips = unclear = 0
    for n in range(tries):
        server.stop()
        try:
            outcome = job(n)
        except LockBackendError as exc:
            unclear += not (server.address in str(exc) and "lock" in str(exc))
        else:
            silent_skips += outcome is None
        unlocked_runs += n in ran
        server.start()
        assert job(n) == "ran", "locking did not resume after the store came back"
        holder = Lock(f"fault-release-{n}")
        assert holder.acquire()
        server.stop()
        with contextlib.suppress(LockBackendError):
            holder.release()
        server.start()
    row = Row("5. store down at acquire/release, back", tries, overlaps=unlocked_runs)
    row.lost = silent_skips
    row.notes.append(
        f"unclear errors: {unclear}; resumed without restart {tries}/{tries}"
    )
    return row


# -- 6. bad input ------------------------------------------------------------------


def bad_input(server: Memcached) -> Row:
    """Hostile ids, bad expiries, arguments, misconfigured caches: a clear error
    or a working lock, and the store's other keys untouched."""
    from django.core.cache import caches
    from django.core.checks import run_checks
    from django.test import override_settings

    from django_tasklock import (
        Lock,
        LockConfigurationError,
        LockUsageError,
        single_instance,
    )
    from django_tasklock.exceptions import InvalidLockExpire

    cache = caches["default"]
    cache.set("fault-sentinel", "keep", 600)
    tried = failed = 0
    ids = [
        "with spaces", "new\nline", "x\r\nflush_all\r\n", "nul\x00", "ünïcødé ✓",
        "z" * 10_000, "bad\udcffsurrogate",
    ]  # fmt: skip
    for lock_id in ids:
        tried += 1
        lock = Lock(lock_id)
        ok = lock.acquire() and not Lock(lock_id).acquire() and lock.release()
        failed += not ok
    for expire in (0, None, -1, 31 * 86400, "60", True):
        tried += 1
        try:
            Lock("x", expire=expire) if expire is not None else None
            if expire is not None:
                failed += 1
        except InvalidLockExpire:
            pass
    lifecycle_options = [
        {"renew": "yes"}, {"max_hold": 0}, {"on_lost": "ignore"},
        {"expire": 1, "renew": True},  # too short to renew on memcached
    ]  # fmt: skip
    for options in lifecycle_options:
        tried += 1
        try:
            Lock("fault-options", **options).acquire()  # type: ignore[arg-type]
            failed += 1
        except (ValueError, LockUsageError) as exc:
            failed += not any(name in str(exc) for name in (*options, "2 seconds"))
    for setting in ({"RENEW": "yes"}, {"RENEW": 1}):
        tried += 1
        with override_settings(TASKLOCK=setting):
            found = [m.id for m in run_checks(tags=["caches"])]
            try:
                Lock("fault-options").acquire()
                failed += 1
            except LockConfigurationError:
                failed += "django_tasklock.E011" not in found

    @single_instance
    def job(value: object) -> None:
        pass

    for value in ({1, 2}, object(), b"bytes"):
        tried += 1
        try:
            job(value)
            failed += 1
        except TypeError as exc:
            failed += "argument 'value'" not in str(exc)
    configs = {
        "dummy": {"BACKEND": "django.core.cache.backends.dummy.DummyCache"},
        "filebased": {
            "BACKEND": "django.core.cache.backends.filebased.FileBasedCache",
            "LOCATION": "/tmp/tasklock-faults-filebased",
        },
        "database": {
            "BACKEND": "django.core.cache.backends.db.DatabaseCache",
            "LOCATION": "t",
        },
        "noreply": {**caches.settings["default"], "OPTIONS": {"default_noreply": True}},
        "ignore_exc": {**caches.settings["default"], "OPTIONS": {"ignore_exc": True}},
        "locmem": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
    }
    for name, config in {**configs, "missing": None}.items():
        tried += 1
        caches_setting = {**caches.settings}
        if config is not None:
            caches_setting["locks"] = config
        with override_settings(CACHES=caches_setting, TASKLOCK={"CACHE": "locks"}):
            ids_found = [
                m.id for m in run_checks(tags=["caches"]) if m.id.startswith("django_")
            ]
            if not ids_found:
                failed += 1
            if name in ("dummy", "filebased", "database", "missing"):
                try:
                    Lock("x").acquire()
                    failed += 1
                except LockConfigurationError:
                    pass
    lost = int(cache.get("fault-sentinel") != "keep")
    row = Row("6. bad ids, expiries, arguments, CACHES", tried, lost=lost)
    row.notes.append(f"without a clear error or check message: {failed}")
    row.overlaps = failed
    return row


# -- 7. many locks -----------------------------------------------------------------


def _take_many(
    memcached: str, ids: list[str], start_at: float, done: object
) -> list[str]:
    setup_django(memcached)
    from django_tasklock import Lock

    while time.monotonic() < start_at:
        time.sleep(0.001)
    held = []
    for lock_id in random.sample(ids, len(ids)):
        lock = Lock(lock_id)
        if lock.acquire():
            held.append(lock)
    done.wait()  # type: ignore[attr-defined]  # hold everything until all have tried
    taken = [lock.lock_id for lock in held]
    failed = [lock.lock_id for lock in held if not lock.release()]
    assert not failed, f"could not release {failed[:3]}"
    return taken


def many_locks(memcached: Memcached, count: int, processes: int) -> Row:
    context = multiprocessing.get_context("spawn")
    ids = [f"fault-many-{n}" for n in range(count)]
    before = memcached.stat("curr_items")
    with context.Manager() as manager:
        done = manager.Barrier(processes)
        with context.Pool(processes) as pool:
            start_at = time.monotonic() + 3.0
            taken = pool.starmap(
                _take_many, [(memcached.address, ids, start_at, done)] * processes
            )
    flat = [lock_id for process_ids in taken for lock_id in process_ids]
    shared = len(flat) - len(set(flat))
    never = count - len(set(flat))
    # Each id keeps its fencing counter (for a day) by design; anything else that
    # stayed is a leak.
    from django.core.cache import caches

    from django_tasklock.keys import fence_id

    with use_server(memcached):
        counters = len(caches["default"].get_many([fence_id(i) for i in ids]))
    leaked = memcached.stat("curr_items") - before - counters
    row = Row(
        f"7. {count} ids, {processes} processes", count, overlaps=shared, lost=never
    )
    row.notes.append(f"keys left behind: {leaked}")
    row.notes.append(f"fencing counters kept: {counters}")
    return row


# -- the table ---------------------------------------------------------------------


def render(rows: list[Row], command: str) -> str:
    lines = [
        f"``{command}``:",
        "",
        ".. code-block:: text",
        "",
        f"    {'case':<42} {'attempts':>8} {'overlaps':>8} {'lost':>5}  recovery / notes",
    ]
    for row in rows:
        extra = "; ".join(filter(None, [row.recovery, *row.notes])) or "-"
        lines.append(
            f"    {row.case:<42} {row.attempts:>8} {row.overlaps:>8} {row.lost:>5}  {extra}"
        )
    return "\n".join(lines) + "\n"


def run(quick: bool) -> list[Row]:
    from tests.services import Redis

    rows = []
    main = Memcached().start()
    small = Memcached(args=["-m", "2"]).start()
    flaky = Memcached().start()
    redis_server = Redis().start()
    try:
        setup_django(main.address)
        rows.append(
            contention(main, 16, 300 if quick else 10_000, 30 if quick else 120)
        )
        rows.append(expiry_and_retake(main, 1 if quick else 5))
        rows.append(key_lost(main, "flush_all", 3 if quick else 50))
        rows.append(key_lost(main, "restart", 2 if quick else 10))
        with use_server(small):
            rows.append(key_lost(small, "eviction", 1 if quick else 5))
        rows.append(killed_worker(redis_server.url, 1 if quick else 3))
        with use_server(flaky):
            rows.append(store_unreachable(flaky, 2 if quick else 10))
        rows.append(bad_input(main))
        rows.append(many_locks(main, 1_000 if quick else 10_000, 8))
        rows.append(lifecycle.renewing_killed(main, 1 if quick else 5, Row))
        rows.append(lifecycle.renewing_paused(main, 1 if quick else 5, Row))
    finally:
        from django.core.cache import close_caches

        from django_tasklock.backends import close_thread_connections

        close_caches()
        close_thread_connections()
        small.stop()
        flaky.stop()
        redis_server.stop()
        main.stop()
    return rows


def write_readme(table: str) -> None:
    write_section(README_START, README_END, table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--write-readme", action="store_true")
    options = parser.parse_args(argv)
    rows = run(options.quick)
    table = render(
        rows, "python -m reliability.faults" + (" --quick" if options.quick else "")
    )
    print(table)
    if options.write_readme:
        write_readme(table)
    bad = [row for row in rows if row.overlaps or row.lost]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
