"""Real ``celery beat`` processes on hosts of their own (``unshare --uts``),
with the app of tests/beat_app.py, and what they published: for the highly
available beat's tests (tests/integrations/test_beat.py) and benchmark (benchmarks/beat.py)."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import redis

ROOT = Path(__file__).resolve().parent.parent
LEADER = "django_tasklock.integrations.celery.beat:LeaderScheduler"
LEADER_DB = "django_tasklock.integrations.celery.beat_db:LeaderDatabaseScheduler"
PLAIN = "celery.beat:PersistentScheduler"
#: The peers measured beside LeaderScheduler (benchmarks/beat.py): RedBeat's
#: scheduler (its Redis lock), and Celery's own scheduler under single-beat (a
#: wrapper process holding a Redis key), each from PyPI (the ``peers`` extra).
REDBEAT = "redbeat.RedBeatScheduler"
SINGLE_BEAT = "single-beat"
LIVENESS = 3  # tests/beat_app.py


def beat_database(workdir: Path) -> str:
    """A SQLite file with django-celery-beat's tables, for the beats to share."""
    path = str(workdir / "beat.sqlite3")
    settings = {"BEAT_DATABASE": path, "DJANGO_SETTINGS_MODULE": "tests.beat_settings"}
    migrated = subprocess.run(
        [sys.executable, "-m", "django", "migrate", "--verbosity", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT), **settings},
    )
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
        entries: int = 2,
    ):
        wrapper = []
        if scheduler == SINGLE_BEAT:  # Celery's own beat, under single-beat
            wrapper, scheduler = (
                [str(Path(sys.executable).parent / "single-beat")],
                PLAIN,
            )
        schedule = str(workdir / f"schedule-{host}")
        command = [*wrapper, sys.executable, "-m", "celery", "-A", "tests.beat_app"]
        command += ["beat", "-S", scheduler, "-s", schedule, "--pidfile=", "-l", "info"]
        rename = f'hostname {host} && exec "$@"'
        beat = {"BEAT_BROKER": broker, "BEAT_CACHE": cache, "BEAT_DATABASE": database}
        beat["BEAT_ENTRIES"] = str(entries)
        single_beat = {
            "SINGLE_BEAT_REDIS_SERVER": broker,
            "SINGLE_BEAT_IDENTIFIER": "beatha",
            "SINGLE_BEAT_LOCK_TIME": str(LIVENESS),
            "SINGLE_BEAT_HEARTBEAT_INTERVAL": "1",
        }
        self.host = host
        self.log = (workdir / f"{host}.log").open("w")
        # A session (process group) of its own: a fault reaches every process
        # of the "host" (single-beat's wrapper and its beat alike).
        self.process = subprocess.Popen(
            ["unshare", "--uts", "sh", "-c", rename, "-", *command],
            cwd=ROOT,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONPATH": str(ROOT), **beat, **single_beat},
        )

    def role(self) -> str | None:
        """What this beat's log last said of its role: "leading", "standing
        by", "lost" (no longer leading), or None (nothing yet)."""
        text = Path(self.log.name).read_text(errors="replace")
        said = {
            text.rfind("Leading '"): "leading",
            text.rfind("Standing by for"): "standing by",
            text.rfind("No longer leading"): "lost",
        }
        last = max(said)
        return said[last] if last >= 0 else None

    def tail(self, lines: int = 30) -> str:
        """The end of this beat's log (stopped or not)."""
        if not self.log.closed:
            self.log.flush()
        text = Path(self.log.name).read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def stacks(self) -> str:
        """Every thread's stack, as this beat's process dumps it to its log
        on SIGUSR1 (tests/beat_app.py), and the lines logged since: where it
        is stuck. Nothing if it has exited."""
        before = Path(self.log.name).stat().st_size
        self.signal(signal.SIGUSR1)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # (a dump ends with no marker)
            time.sleep(0.5)
            if Path(self.log.name).stat().st_size > before:
                break
        time.sleep(0.5)
        with open(self.log.name, errors="replace") as log:
            log.seek(before)
            return log.read()

    def owns(self, pid: int) -> bool:
        """Whether process ``pid`` is one of this beat's (its group's)."""
        try:
            return os.getpgid(pid) == self.process.pid
        except ProcessLookupError:
            return False

    def signal(self, sig: int) -> None:
        """Send ``sig`` to every process of this beat."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, sig)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.process.wait()
        self.signal(signal.SIGKILL)  # a child its wrapper left behind
        self.log.close()


def settled_roles(first: Beat, second: Beat, timeout: float) -> tuple[Beat, Beat]:
    """(leader, standby): once one beat leads and the other stands by, as
    their logs last said, waiting up to ``timeout`` seconds. Usually the first
    leads; on a starved machine the first may judge its lock lost by its own
    clock (its liveness thread was not run in time) and let it go, and the
    second, starting, lead instead."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        roles = (first.role(), second.role())
        if roles == ("leading", "standing by"):
            return first, second
        if roles == ("standing by", "leading"):
            return second, first
        if first.process.poll() is not None or second.process.poll() is not None:
            break
        time.sleep(0.1)
    raise AssertionError(
        f"no leader and standby within {timeout}s:\n{first.tail()}\n{second.tail()}"
    )


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


def run_time(record: dict) -> float:
    """The time of the run a send was: the one its message carries
    (``LeaderScheduler``), else (the peers) when it was sent."""
    run: float | None = record.get("run")
    return record["at"] if run is None else run


def doubles(records: list[dict]) -> int:
    """Runs of an entry sent twice: two sends less than half its 1 s period
    apart, judged by the time of the run each message carries (the time
    ``LeaderScheduler`` stored for it: the same run sent again, or two runs
    of one period), else (Celery's own scheduler) by when each was sent."""
    count = 0
    for entry in {r["entry"] for r in records}:
        times = sorted(run_time(r) for r in records if r["entry"] == entry)
        count += sum(1 for a, b in itertools.pairwise(times) if b - a < 0.5)
    return count
