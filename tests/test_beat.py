"""Celery beat, highly available (``LeaderScheduler``): two real ``celery
beat`` processes on two hosts (``unshare --uts``), a 1-second schedule, the
leader SIGKILLed or SIGSTOPped past LIVENESS midway. Every publish is counted
by Celery's own ``before_task_publish`` signal (tests/beat_app.py): no run is
sent twice (two sends of an entry less than half its period apart), and the
standby takes over. The same two beats with Celery's own scheduler send
every run twice (the control)."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from tests.services import stop_and_wait

ROOT = Path(__file__).resolve().parent.parent
LEADER = "django_tasklock.integrations.celery.beat:LeaderScheduler"
LEADER_DB = "django_tasklock.integrations.celery.beat_db:LeaderDatabaseScheduler"
PLAIN = "celery.beat:PersistentScheduler"
LIVENESS = 3  # tests/beat_app.py

pytestmark = pytest.mark.slow


@pytest.fixture
def broker(redis_server):
    url = redis_server.url.rsplit("/", 1)[0] + "/9"
    with redis.Redis.from_url(url) as client:
        client.flushdb()
        yield url, client


def beat_database(workdir: Path) -> str:
    """A SQLite file with django-celery-beat's tables, for the beats to share."""
    path = str(workdir / "beat.sqlite3")
    migrated = subprocess.run(
        [sys.executable, "-m", "django", "migrate", "--verbosity", "0"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT), "BEAT_DATABASE": path,
             "DJANGO_SETTINGS_MODULE": "tests.beat_settings"},
    )  # fmt: skip
    assert migrated.returncode == 0, migrated.stdout + migrated.stderr
    return path


class Beat:
    def __init__(
        self,
        scheduler: str,
        host: str,
        broker: str,
        cache: str,
        workdir: Path,
        database: str = "",
    ):
        command = [
            sys.executable, "-m", "celery", "-A", "tests.beat_app", "beat",
            "-S", scheduler, "-s", str(workdir / f"schedule-{host}"),
            "--pidfile=", "-l", "warning",
        ]  # fmt: skip
        rename = f'hostname {host} && exec "$@"'
        self.host = host
        self.log = (workdir / f"{host}.log").open("w")
        self.process = subprocess.Popen(
            ["unshare", "--uts", "sh", "-c", rename, "-", *command],
            cwd=ROOT,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(ROOT), "BEAT_BROKER": broker,
                 "BEAT_CACHE": cache, "BEAT_ENTRIES": "2", "BEAT_DATABASE": database},
        )  # fmt: skip

    def stop(self) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


def sends(client: redis.Redis) -> list[dict]:
    return [json.loads(raw) for raw in client.lrange("beat-sends", 0, -1)]


def wait_for_sends(
    client, host: str, timeout: float, after: float = 0.0
) -> float | None:
    """When ``host`` first published after ``after``, waiting up to ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [
            s["at"] for s in sends(client) if s["host"] == host and s["at"] > after
        ]
        if found:
            return min(found)
        time.sleep(0.1)
    return None


def doubles(records: list[dict]) -> int:
    """Sends of an entry less than half its 1 s period after its previous send."""
    count = 0
    for entry in {r["entry"] for r in records}:
        times = sorted(r["at"] for r in records if r["entry"] == entry)
        count += sum(1 for a, b in itertools.pairwise(times) if b - a < 0.5)
    return count


@pytest.fixture
def beats(tmp_path):
    started: list[Beat] = []

    def start(
        scheduler: str, host: str, broker: str, cache: str, database: str = ""
    ) -> Beat:
        started.append(Beat(scheduler, host, broker, cache, tmp_path, database))
        return started[-1]

    yield start
    for beat in started:
        beat.stop()


@pytest.mark.parametrize(
    ("scheduler", "cache"),
    [(LEADER, "default"), (LEADER, "redis"), (LEADER_DB, "default")],
    ids=["persistent-memcached", "persistent-redis", "database-memcached"],
)
@pytest.mark.parametrize("fault", ["kill", "pause"])
def test_two_beats_send_each_run_once_through_a_change_of_leader(
    broker, beats, scheduler, cache, fault, tmp_path
):
    url, client = broker
    database = beat_database(tmp_path) if scheduler == LEADER_DB else ""
    first = beats(scheduler, "tasklock-beat-a", url, cache, database)
    assert wait_for_sends(client, "tasklock-beat-a", timeout=60) is not None
    second = beats(scheduler, "tasklock-beat-b", url, cache, database)
    time.sleep(4)  # both up: the second stands by
    assert not [s for s in sends(client) if s["host"] == "tasklock-beat-b"]
    faulted = time.time()
    if fault == "kill":
        first.process.kill()
    else:
        stop_and_wait(first.process.pid)
    took_over = wait_for_sends(client, "tasklock-beat-b", timeout=LIVENESS + 30)
    assert took_over is not None, "the standby never sent"
    if fault == "pause":
        os.kill(first.process.pid, signal.SIGCONT)  # wakes, and must not send
    time.sleep(4)
    stopping = time.time()  # from then on the woken first beat may lead again
    second.stop()
    records = sends(client)
    assert doubles(records) == 0, records
    if fault == "pause":  # woken while the second led: it sent nothing
        assert not [
            s
            for s in records
            if s["host"] == "tasklock-beat-a" and took_over < s["at"] < stopping
        ], records
    print(
        f"{scheduler.rsplit(':')[1]}, {cache}, {fault}: the standby sent "
        f"{took_over - faulted:.2f}s after the "
        f"fault; {len(records)} sends, 0 doubles"
    )
    assert took_over - faulted <= LIVENESS + 3


def test_two_beats_of_celerys_own_scheduler_send_every_run_twice(broker, beats):
    """The control: the count above would see doubles."""
    url, client = broker
    beats(PLAIN, "tasklock-beat-c", url, "default")
    beats(PLAIN, "tasklock-beat-d", url, "default")
    assert wait_for_sends(client, "tasklock-beat-c", timeout=60) is not None
    assert wait_for_sends(client, "tasklock-beat-d", timeout=60) is not None
    time.sleep(4)
    assert doubles(sends(client)) >= 4
