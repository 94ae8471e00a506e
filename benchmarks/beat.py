"""Highly available Celery beat under faults: three beats, one sending.

    python -m benchmarks.beat [--quick] [--minutes M] [--cache default|redis]
                              [--database | --peers]

Three real ``celery beat`` processes on three hosts (``unshare --uts``), each
with ``LeaderScheduler``, a 1-second schedule of five entries, on a private
Redis broker and the lock store named by ``--cache`` (memcached or Redis). For
``--minutes`` (5; ``--quick``: 1) from the first send, the current leader is
SIGKILLed every 30 s (and started again, as a supervisor would) and
SIGSTOPped past ``LIVENESS`` every 45 s (then woken). Every message the beats publish is counted by
Celery's own ``before_task_publish`` signal (tests/beat_app.py), and for each
entry the report gives:

- doubles: a run sent twice (two messages carry the same run, or two runs of
  an entry less than half a period apart, by the run's time each message
  carries: tests/beats.py); and, for every scheduler alike, by when each was
  sent (two sends of an entry less than half a period apart: a catch-up run
  sent just before the next one counts there);
- gaps: more than 1.5 periods between runs sent. A gap across which the sending
  process changed is a change of leader (the runs missed meanwhile are sent
  once, late: Celery beat's own catch-up), lost beyond it when longer than
  ``TAKEOVER_MOST`` (the record's lapse, the standby's next tick and a
  period's slack); a gap in one leader's sends of two periods or more (a
  whole period went by without its run) is a lost run, and a shorter one a
  late tick (a busy machine);
- takeover: from each fault to the next send by another beat process (on
  another host, or the killed one's replacement), median and max; and the
  earliest by a beat on another host, which must wait for the leader's
  record to lapse: one sooner than ``LIVENESS`` less a renewal period and a
  second is premature (the paused or killed leader's runs may still go);
- beats that exited: beats that stopped on their own (restarted at once, as a
  supervisor would).

``--database``: ``LeaderDatabaseScheduler`` (django-celery-beat's schedules, in
one SQLite file the three beats share). ``--peers`` (``make bench-beat-peers``):
``LeaderScheduler``, RedBeat and Celery's own beat under single-beat, one after
another on Redis, under the same faults (RedBeat's lock and single-beat's key
lasting ``LIVENESS``), in one table. Messages of the peers carry no run: their
doubles are counted by when each was sent.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.beats import (  # noqa: E402
    LEADER,
    LEADER_DB,
    LIVENESS,
    REDBEAT,
    SINGLE_BEAT,
    Beat,
    beat_database,
    doubles,
    run_time,
    sends,
)
from tests.services import Memcached, Redis, stop_and_wait  # noqa: E402

ENTRIES = 5
#: The longest gap across a change of leader that Celery beat's catch-up
#: explains: the leader's record lapses LIVENESS after its last renewal, the
#: standby looks within a second (its tick), then a period's slack.
TAKEOVER_MOST = LIVENESS + 3.0
#: The earliest a beat on another host may take over: the leader's record,
#: renewed up to a second before the fault, lasts LIVENESS (a second's slack
#: for the clocks' reads).
TAKEOVER_LEAST = LIVENESS - 2.0
HOSTS = ("tasklock-beat-1", "tasklock-beat-2", "tasklock-beat-3")


def leader_now(client: object, since: float) -> tuple[str, int] | None:
    """The host and pid of the beat whose send is the latest since ``since``."""
    recent = [s for s in sends(client) if s["at"] > since]  # type: ignore[arg-type]
    if not recent:
        return None
    latest = max(recent, key=lambda s: s["at"])
    return latest["host"], latest["pid"]


def run(
    minutes: float, cache: str, workdir: Path, scheduler: str = LEADER
) -> dict[str, object]:
    memcached, redis_server = Memcached().start(), Redis().start()
    os.environ["TASKLOCK_TEST_MEMCACHED"] = memcached.address
    os.environ["TASKLOCK_TEST_REDIS"] = redis_server.url
    broker = redis_server.url.rsplit("/", 1)[0] + "/9"
    import redis

    client = redis.Redis.from_url(broker)
    # LeaderDatabaseScheduler: django-celery-beat's tables in one SQLite file
    # the beats share.
    database = beat_database(workdir) if scheduler == LEADER_DB else ""
    beats: dict[str, Beat] = {}
    # (kind, at, pid and host of the leader)
    faults: list[tuple[str, float, int, str]] = []
    exits = 0  # beats that exited on their own (a supervisor restarts them)

    def start(host: str) -> None:
        beats[host] = Beat(
            scheduler, host, broker, cache, workdir, database, entries=ENTRIES
        )

    try:
        for host in HOSTS:
            start(host)
        # The clock starts at the first send: on a busy machine three beats
        # may take many seconds to start, and the faults are timed from then.
        first = time.time()
        while leader_now(client, first) is None:
            if time.time() - first > 120:
                raise RuntimeError("no beat sent anything within 120 s of its start")
            time.sleep(0.2)
        started = time.time()
        deadline = started + minutes * 60
        next_kill, next_pause = started + 30, started + 45
        while time.time() < deadline:
            time.sleep(0.5)
            for host, beat in list(beats.items()):
                if beat.process.poll() is not None:
                    exits += 1
                    beat.stop()
                    start(host)
            now = time.time()
            if now < min(next_kill, next_pause):
                continue
            leading = leader_now(client, now - 2)
            if leading is None:
                continue  # between leaders: try again shortly
            host, pid = leading
            if not beats[host].owns(pid):
                continue  # sent by a beat since replaced on that host
            if now >= next_kill:
                beats[host].signal(signal.SIGKILL)
                faults.append(("kill", time.time(), pid, host))
                beats[host].stop()
                start(host)
                next_kill += 30
            else:
                beats[host].signal(signal.SIGSTOP)
                stop_and_wait(pid)
                faults.append(("pause", time.time(), pid, host))
                time.sleep(LIVENESS + 2)
                beats[host].signal(signal.SIGCONT)
                next_pause += 45
        records = [r for r in sends(client) if r["at"] >= first]
    finally:
        for beat in beats.values():
            beat.stop()
        client.close()
        memcached.stop()
        redis_server.stop()
    return {**judge(records, faults, started), "beats that exited": exits}


def judge(
    records: list[dict], faults: list[tuple[str, float, int, str]], started: float
) -> dict[str, object]:
    takeovers, elsewhere = [], []
    for _kind, at, pid, host in faults:
        after = sorted(
            (r["at"], r["host"]) for r in records if r["at"] > at and r["pid"] != pid
        )
        if after:
            takeovers.append(after[0][0] - at)
        other = [when for when, where in after if where != host]
        if other:
            elsewhere.append(other[0] - at)
    takeover_gaps, late, unexplained = 0, 0, []
    for entry in sorted({r["entry"] for r in records}):
        sent = sorted((run_time(r), r["pid"]) for r in records if r["entry"] == entry)
        for (a, pid_a), (b, pid_b) in itertools.pairwise(sent):
            if b - a <= 1.5:
                continue
            if pid_a != pid_b and b - a <= TAKEOVER_MOST:
                takeover_gaps += 1  # a change of leader: the catch-up rule
                continue
            if b - a < 2:
                late += 1  # a late tick: no whole period went without a run
                continue
            nearest = min(faults, key=lambda f: abs(f[1] - a), default=None)
            near = f", {a - nearest[1]:+.1f}s from a {nearest[0]}" if nearest else ""
            unexplained.append(f"{entry} {a - started:.1f}s-{b - started:.1f}s{near}")
    senders = [r["pid"] for r in sorted(records, key=lambda r: r["at"])]
    changes = sum(1 for a, b in itertools.pairwise(senders) if a != b)
    by_send = [{k: v for k, v in r.items() if k != "run"} for r in records]
    return {
        "sends": len(records),
        "leader changes": changes,
        "entries": len({r["entry"] for r in records}),
        "doubles": doubles(records),
        "doubles by send time": doubles(by_send),
        "takeover gaps": takeover_gaps,
        "late ticks": late,
        "lost beyond catch-up": len(unexplained),
        "faults": len(faults),
        "takeover median": statistics.median(takeovers) if takeovers else None,
        "takeover max": max(takeovers) if takeovers else None,
        "takeover elsewhere, earliest": min(elsewhere) if elsewhere else None,
        "premature takeovers": sum(t < TAKEOVER_LEAST for t in elsewhere),
        "seconds": time.time() - started,
        "gaps not at a fault": "; ".join(unexplained) or "none",
    }


PEERS = (
    ("LeaderScheduler", LEADER),
    ("RedBeat", REDBEAT),
    ("single-beat", SINGLE_BEAT),
)
SHOWN = (
    "sends",
    "faults",
    "doubles by send time",
    "lost beyond catch-up",
    "takeover median",
    "takeover max",
    "takeover elsewhere, earliest",
    "premature takeovers",
    "beats that exited",
)


def peers(minutes: float) -> int:
    """LeaderScheduler, RedBeat and single-beat, one after another on Redis,
    under the same faults: one table."""
    try:
        import redbeat  # noqa: F401
        import singlebeat  # noqa: F401
    except ImportError:
        raise SystemExit(
            "RedBeat and single-beat are not installed: pip install -e '.[peers]' "
            "(make bench-beat-peers does)"
        ) from None
    results = {}
    for label, scheduler in PEERS:
        with tempfile.TemporaryDirectory(prefix="tasklock-beat-bench-") as workdir:
            results[label] = run(minutes, "redis", Path(workdir), scheduler)
        print(f"{label}: {results[label]}", flush=True)
    print(
        f"\nthree beats each, {ENTRIES} entries every second, {minutes:g} min, on "
        f"Redis; the leader SIGKILLed every 30 s and SIGSTOPped for {LIVENESS + 2} s "
        f"every 45 s; RedBeat's lock and single-beat's key last {LIVENESS} s, as "
        "LIVENESS does:"
    )
    print(f"{'':<22}" + "".join(f"{label:>17}" for label, _ in PEERS))
    for name in SHOWN:
        cells = []
        for label, _ in PEERS:
            value = results[label][name]
            if isinstance(value, float):
                cells.append(f"{value:.2f}")
            else:
                cells.append("-" if value is None else str(value))
        print(f"{name:<22}" + "".join(f"{cell:>17}" for cell in cells))
    ours = results["LeaderScheduler"]
    good = not ours["doubles"] and not ours["premature takeovers"]
    return 0 if good and ours["lost beyond catch-up"] == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one minute")
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--cache", default="default", choices=["default", "redis"])
    parser.add_argument(
        "--database",
        action="store_true",
        help="LeaderDatabaseScheduler (django-celery-beat) on a shared SQLite file",
    )
    parser.add_argument(
        "--peers",
        action="store_true",
        help="LeaderScheduler, RedBeat and single-beat, one after another on Redis",
    )
    options = parser.parse_args(argv)
    minutes = 1.0 if options.quick else options.minutes
    if options.peers:
        return peers(minutes)
    with tempfile.TemporaryDirectory(prefix="tasklock-beat-bench-") as workdir:
        scheduler = LEADER_DB if options.database else LEADER
        result = run(minutes, options.cache, Path(workdir), scheduler)
    store = "memcached" if options.cache == "default" else "Redis"
    if options.database:
        store += ", LeaderDatabaseScheduler on one SQLite file"
    print(
        f"three beats, {ENTRIES} entries every second, {minutes:g} min on {store}, "
        f"leader SIGKILLed every 30 s and SIGSTOPped past LIVENESS ({LIVENESS} s) "
        "every 45 s:"
    )
    for name, value in result.items():
        if isinstance(value, float):
            value = f"{value:.2f}"
        print(f"  {name}: {value}")
    with contextlib.suppress(BrokenPipeError):
        sys.stdout.flush()
    # A short run (the suite's smoke run, on a machine make test keeps fully
    # busy) fails on a double only: its lost runs measure the load as much as
    # the scheduler. A full run fails on either.
    lost = result["lost beyond catch-up"] and not options.quick
    good = result["doubles"] == 0 and not result["premature takeovers"]
    return 0 if good and not lost else 1


if __name__ == "__main__":
    sys.exit(main())
