"""The demo's last step: Celery beat on two processes, one sending.

Two real ``celery -A example_project beat`` processes run the project's
``CELERY_BEAT_SCHEDULE`` (two entries, each every second) with
``LeaderScheduler`` (``CELERY_BEAT_SCHEDULER``). Midway the leader is
SIGKILLed; the other takes over. Every periodic run a worker receives is
recorded with the run its message carries (``BeatRun``), and the report counts,
per entry, the runs received, those received twice, and the longest gap in one
leader's runs.
"""

from __future__ import annotations

import itertools
import shlex
import subprocess
import sys
import time
from typing import TYPE_CHECKING

from tests.services import stop_process

if TYPE_CHECKING:
    from contextlib import ExitStack
    from pathlib import Path

#: A gap in one leader's runs longer than this many seconds fails the demo
#: (each entry is due every second; a busy machine delays a tick or two).
LONGEST_GAP = 3.0


def say(message: str = "") -> None:
    print(message, flush=True)


#: A beat of the example project, quiet but for warnings, with no pid file.
BEAT = [
    sys.executable,
    *shlex.split("-m celery -A example_project beat --pidfile= -l warning"),
]


def start_beat(name: str, run_dir: Path, env: dict[str, str]) -> subprocess.Popen:
    log = (run_dir / f"{name}.log").open("w")
    return subprocess.Popen(
        [*BEAT, "-s", str(run_dir / f"{name}-schedule")],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def leader(
    timeout: float, other_than: int | None = None, above: int = 0
) -> tuple[int, int, float]:
    """The pid and fence of the beats' leader once one (other than the pid
    ``other_than``) leads with a fence above ``above``, and when it was seen.
    (A new leader's fence is drawn at its first send: until then the lock's
    counter still shows its predecessor's.)"""
    from django_tasklock.console import leaders, take_inventory

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for row in leaders(take_inventory(), "celery-beat-example_project"):
            if row.status is None or row.fence is None or not row.holder:
                continue
            pid = int(row.holder.partition("@")[0])
            if pid != other_than and row.alive and row.fence > above:
                return pid, row.fence, time.time()
        time.sleep(0.1)
    raise SystemExit(f"No beat became leader within {timeout:.0f}s")


def settled(timeout: float = 60) -> int:
    """Wait until the workers have run every periodic run sent (no new record
    for two seconds); how many there are."""
    from example_project.feeds.models import BeatRun

    deadline = time.monotonic() + timeout
    count, quiet_since = -1, time.monotonic()
    while time.monotonic() < deadline:
        now = BeatRun.objects.count()
        if now != count:
            count, quiet_since = now, time.monotonic()
        elif time.monotonic() - quiet_since >= 2:
            break
        time.sleep(0.2)
    return count


def run(stack: ExitStack, run_dir: Path, env: dict[str, str], seconds: float) -> bool:
    """Two beats for ``seconds``, the leader SIGKILLed halfway; True if no
    periodic run reached a worker twice and the other beat took over."""
    from example_project.feeds.models import BeatRun

    beats = [start_beat(f"beat{n}", run_dir, env) for n in (1, 2)]
    for beat in beats:
        stack.callback(stop_process, beat)
    first_pid, first_fence, _ = leader(timeout=60)
    number = next(n for n, beat in enumerate(beats, 1) if beat.pid == first_pid)
    time.sleep(seconds / 2)
    killed = next(beat for beat in beats if beat.pid == first_pid)
    killed.kill()
    killed_at = time.time()
    killed.wait()
    second_pid, second_fence, seen_at = leader(
        timeout=60, other_than=first_pid, above=first_fence
    )
    say(
        f"   beat{number} (pid {first_pid}) led, fence {first_fence}; SIGKILLed "
        f"{seconds / 2:.0f}s in"
    )
    time.sleep(seconds / 2)
    for beat in beats:
        stop_process(beat)
    settled()
    runs = list(BeatRun.objects.order_by("run_ms"))
    taken_over = [r.received for r in runs if r.fence == second_fence]
    took = (min(taken_over) - killed_at) if taken_over else None
    say(
        f"   the other beat (pid {second_pid}) leads, fence {second_fence}; its first "
        "run reached a worker "
        + (f"{took:.1f}s after the kill" if took is not None else "never")
        + f" (seen leading {seen_at - killed_at:.1f}s after it)"
    )
    ok = took is not None and second_fence > first_fence
    say(f"   {'entry':<20}{'runs':>6}{'received twice':>16}{'longest gap':>13}")
    for entry in sorted({r.entry for r in runs}):
        mine = [r for r in runs if r.entry == entry and r.run_ms is not None]
        per_run = [len(list(g)) for _, g in itertools.groupby(mine, lambda r: r.run_ms)]
        twice = sum(1 for n in per_run if n > 1)
        gap = max(
            (
                (b.run_ms - a.run_ms) / 1000
                for a, b in itertools.pairwise(mine)
                if a.fence == b.fence
            ),
            default=0.0,
        )
        unmarked = sum(1 for r in runs if r.entry == entry and r.run_ms is None)
        say(f"   {entry:<20}{len(per_run):>6}{twice:>16}{gap:>12.1f}s")
        if twice or unmarked or gap > LONGEST_GAP or not per_run:
            say("   <- A RUN RECEIVED TWICE, UNMARKED OR LOST")
            ok = False
    say(
        "   Each periodic run reached a worker once (counted by the run each "
        "message carries)."
        if ok
        else "   <- THE BEATS DID NOT SEND EACH RUN ONCE"
    )
    return ok
