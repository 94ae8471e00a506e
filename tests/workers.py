"""Code that runs in the worker processes the contention tests spawn."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.services import Memcached


def setup_django() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    import django

    django.setup()


def hammer(
    tasklock: dict[str, object],
    lock_id: str,
    start_at: float,
    seconds: float,
    mode: str,
    limit: int | None = None,
) -> tuple[list[tuple[float, float]], int]:
    """Take and drop one lock as often as possible in a fixed window.

    Returns the (enter, exit) monotonic times of every hold and the number of
    refused attempts. CLOCK_MONOTONIC is shared by all processes of one machine,
    so holds from different processes can be compared. ``mode`` "none" skips the
    lock, to prove the overlap detector sees overlaps when there are some. With
    ``limit``, a Semaphore of that limit named ``lock_id`` instead of a Lock,
    each hold a little longer, so that others have room to pile in.
    """
    setup_django()
    from django.conf import settings
    from django.core.cache import close_caches

    from django_tasklock import Lock, Semaphore

    settings.TASKLOCK = tasklock
    holds: list[tuple[float, float]] = []
    refused = 0
    hold_for = 0.0002 if limit is None else 0.002
    while time.monotonic() < start_at:
        time.sleep(0.001)
    deadline = start_at + seconds
    while time.monotonic() < deadline:
        lock = (
            Lock(lock_id, expire=30)
            if limit is None
            else Semaphore(lock_id, limit, expire=30)
        )
        if mode == "none" or lock.acquire():
            entered = time.monotonic()
            # Hold for a moment, so an overlap would have room to show.
            while time.monotonic() - entered < hold_for:
                pass
            exited = time.monotonic()
            if mode != "none":
                assert lock.release(), "lost a lock nobody else could take"
            holds.append((entered, exited))
        else:
            refused += 1
            # A refused contender gives the holder the CPU back (two cores, many
            # processes) and tries again a moment later.
            time.sleep(0.0005)
    close_caches()
    return holds, refused


def overlaps(holds: list[tuple[float, float]]) -> int:
    """How many holds began before an earlier one had ended."""
    count = 0
    latest_end = float("-inf")
    for entered, exited in sorted(holds):
        if entered < latest_end:
            count += 1
        latest_end = max(latest_end, exited)
    return count


def fenced_holds(
    tasklock: dict[str, object], lock_id: str, start_at: float, seconds: float
) -> list[tuple[float, float, int]]:
    """Like ``hammer``, recording each hold's fencing token with its times."""
    setup_django()
    from django.conf import settings
    from django.core.cache import close_caches

    from django_tasklock import Lock

    settings.TASKLOCK = tasklock
    holds: list[tuple[float, float, int]] = []
    while time.monotonic() < start_at:
        time.sleep(0.001)
    deadline = start_at + seconds
    while time.monotonic() < deadline:
        lock = Lock(lock_id, expire=30)
        if lock.acquire():
            entered = time.monotonic()
            assert lock.fence is not None
            while time.monotonic() - entered < 0.0002:
                pass
            exited = time.monotonic()
            assert lock.release(), "lost a lock nobody else could take"
            holds.append((entered, exited, lock.fence))
        else:
            time.sleep(0.0005)
    close_caches()
    return holds


def renewing_holder(
    tasklock: dict[str, object], lock_id: str, expire: float, queue: object
) -> None:
    """Take ``lock_id`` with renewal, report when, then run until killed."""
    setup_django()
    from django.conf import settings

    from django_tasklock import Lock

    settings.TASKLOCK = tasklock
    lock = Lock(lock_id, expire=expire, renew=True)
    assert lock.acquire()
    queue.put((time.monotonic(), lock.fence))  # type: ignore[attr-defined]
    while True:
        time.sleep(1)


def crashing_holder(tasklock: dict[str, object], lock_id: str) -> None:
    """Take ``lock_id`` and die without releasing it, as a killed worker does."""
    setup_django()
    from django.conf import settings

    from django_tasklock import Lock

    settings.TASKLOCK = tasklock
    assert Lock(lock_id, expire=60).acquire()
    os._exit(1)


def fork(child) -> tuple[int, int]:
    """Fork; the child runs ``child(write_fd)`` and exits. Returns (pid, read_fd)."""
    read_fd, write_fd = os.pipe()
    with warnings.catch_warnings():
        # Python 3.12+ warns that forking a process with threads may deadlock;
        # these tests fork on purpose, with nothing of theirs mid-lock.
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        status = 1
        signal.alarm(60)  # a child that hangs dies, and the parent sees it
        try:
            os.close(read_fd)
            child(write_fd)
            status = 0
        finally:
            os._exit(status)
    os.close(write_fd)
    return pid, read_fd


def most_at_once(holds: list[tuple[float, float]]) -> int:
    """The largest number of holds in progress at one moment."""
    events = sorted(
        [(start, 1) for start, _ in holds] + [(end, -1) for _, end in holds]
    )
    current = peak = 0
    for _, change in events:  # at a tie, an end (-1) sorts before a start
        current += change
        peak = max(peak, current)
    return peak


def semaphore_holder(
    tasklock: dict[str, object],
    name: str,
    limit: int,
    queue: object,
    expire: float = 2,
) -> None:
    """Take a slot of ``name`` renewing, report which, then run until killed."""
    setup_django()
    from django.conf import settings

    from django_tasklock import Semaphore

    settings.TASKLOCK = tasklock
    semaphore = Semaphore(name, limit, expire=expire, renew=True)
    assert semaphore.acquire()
    queue.put((os.getpid(), semaphore.slot))  # type: ignore[attr-defined]
    while True:
        time.sleep(1)


def beyond(holds: list[tuple[float, float]], limit: int) -> int:
    """How many holds began while ``limit`` others were already in progress."""
    events = sorted(
        [(start, 1) for start, _ in holds] + [(end, -1) for _, end in holds]
    )
    current = count = 0
    for _, change in events:
        if change > 0 and current >= limit:
            count += 1
        current += change
    return count


def take_until_all(
    caches_setting: dict[str, object],
    tasklock: dict[str, object],
    ids: list[str],
    seconds: float,
) -> dict[str, object]:
    """Try to take every id in ``ids`` until all are taken or ``seconds`` pass.

    A fresh process that never saw the servers before. Returns, per id taken,
    the monotonic time it was taken (holds are kept), and how many attempts the
    store refused with an error, with the last message.
    """
    setup_django()
    from django.test import override_settings

    from django_tasklock import Lock, LockBackendError

    taken: dict[str, float] = {}
    errors = 0
    last_error = ""
    with override_settings(CACHES=caches_setting, TASKLOCK=tasklock):
        deadline = time.monotonic() + seconds
        holds = []
        remaining = list(ids)
        while remaining and time.monotonic() < deadline:
            for lock_id in list(remaining):
                lock = Lock(lock_id)
                try:
                    if lock.acquire():
                        taken[lock_id] = time.monotonic()
                        holds.append(lock)
                        remaining.remove(lock_id)
                except LockBackendError as exc:
                    errors += 1
                    last_error = str(exc)
            time.sleep(0.02)
    return {"taken": taken, "errors": errors, "last_error": last_error}


def hold_and_restart_busiest(
    servers: list[Memcached], alias: str, ids: list[str]
) -> tuple[list[object], dict[str, float], list[str]]:
    """Take every id in ``ids`` on the pool ``alias``; SIGKILL the server that
    holds the most and restart it empty.

    Returns the locks, until when each holder may count on its lock (memcached's
    whole seconds), and the ids that were on the restarted server.
    """
    from django_tasklock import Lock
    from django_tasklock.backends import backend_for

    locks = [Lock(lock_id) for lock_id in ids]
    valid_until: dict[str, float] = {}
    for lock in locks:
        assert lock.acquire()
        valid_until[lock.lock_id] = lock._valid_until  # type: ignore[assignment]
    backend = backend_for(alias)
    port_of = {i: backend._client(backend.key_for(i)).server[1] for i in ids}  # type: ignore[attr-defined]
    victim = max(servers, key=lambda s: list(port_of.values()).count(s.port))
    on_victim = [i for i in ids if port_of[i] == victim.port]
    victim.stop(signal.SIGKILL)
    victim.start()
    return list(locks), valid_until, on_victim


def start_workers(
    broker_env: dict[str, str],
    names: list[str],
    concurrency: int = 2,
    extra_env: dict[str, str] | None = None,
    logdir: Path | None = None,
) -> list[subprocess.Popen[bytes]]:
    """Real ``celery worker`` processes (prefork) of tests.celery_app, answering
    a ping before this returns; each logs to ``logdir/<name>.log`` if given."""
    import pytest

    from tests.celery_app import app
    from tests.services import celery_worker

    env = {
        **os.environ,
        **broker_env,
        **(extra_env or {}),
        "DJANGO_SETTINGS_MODULE": "tests.settings",
    }
    processes = [
        celery_worker(
            "tests.celery_app",
            name,
            concurrency,
            env,
            loglevel="WARNING",
            logfile=None if logdir is None else logdir / f"{name}.log",
            stderr=subprocess.PIPE,
        )
        for name in names
    ]
    wanted = {f"{name}@{socket.gethostname()}" for name in names}
    deadline = time.monotonic() + 60
    while not wanted <= {
        name for reply in app.control.ping(timeout=0.5) for name in reply
    }:
        for process in processes:
            if process.poll() is not None:
                pytest.fail(
                    f"celery worker died: {process.stderr.read().decode()[-2000:]}"
                )
        if time.monotonic() > deadline:
            pytest.fail("celery workers did not answer a ping within 60 s")
    return processes


def stop_workers(processes: list[subprocess.Popen[bytes]]) -> None:
    from tests.services import stop_process

    for process in processes:
        stop_process(process)
        if process.stderr is not None:
            process.stderr.close()
