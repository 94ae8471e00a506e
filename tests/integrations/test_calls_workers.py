"""Duplicates stopped at ``.delay()``, under real ``celery worker`` processes on a
private Redis broker: what runs, how often, never two at once, and when each
call's lock is freed. Every run records its start and end; overlaps are
measured, and every test has a count that would differ if the lock did not work.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time

import pytest
from celery import chain, chord, group
from celery.exceptions import ChordError, MaxRetriesExceededError

from django_tasklock import LockNotAcquired, lock_id_for
from django_tasklock.calls import QUEUE_SUFFIX, call_of
from django_tasklock.signals import call_deduplicated
from django_tasklock.status import lock_status
from tests import tasks
from tests.celery_app import app
from tests.helpers import LONGER, ROOT, send_storm, wait_until
from tests.workers import (
    overlaps,
    start_workers,
    stop_workers,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("memcached_locks")]


@pytest.fixture(scope="module")
def workers(broker):
    """Two worker processes, two pool processes each."""
    processes = start_workers(broker, ["calls-1", "calls-2"])
    yield processes
    stop_workers(processes)


@pytest.fixture
def joined():
    seen: list[dict[str, object]] = []

    def receiver(sender, **details):
        seen.append(details)

    call_deduplicated.connect(receiver)
    yield seen
    call_deduplicated.disconnect(receiver)


def held(lock_id: str) -> tuple[str, str] | None:
    status = lock_status(lock_id)
    return call_of(status.value) if status.held else None


def free(lock_id: str) -> bool:
    return not lock_status(lock_id).held


def test_duplicate_storm_until_finished(workers, joined):
    keys = [f"storm-{n}" for n in range(4)]
    calls = [(tasks.finish_once, (key,), {"seconds": 0.5}) for key in keys * 10]
    results = send_storm(calls)
    outcomes = [result.get(timeout=120) for result in results]
    for key in keys:
        runs = tasks.runs(key)
        ids = {
            r.id
            for r, (_t, args, _k) in zip(results, calls, strict=False)
            if args[0] == key
        }
        assert overlaps([(run["start"], run["end"]) for run in runs]) == 0
        # Every call that went out ran once; every other one joined a call that ran.
        assert sorted(run["task_id"] for run in runs) == sorted(ids)
    # Each caller got the result of the run it joined, not None.
    assert outcomes == [
        f"{args[0]}:{r.id}" for r, (_t, args, _k) in zip(results, calls, strict=False)
    ]
    published = len({r.id for r in results})
    assert published < len(calls), "no duplicate was stopped: nothing tested"
    assert len(joined) == len(calls) - published
    for key in keys:
        assert free(lock_id_for(tasks.finish_once, key))


def test_send_task_by_name_joins_a_delay(workers):
    first = tasks.finish_once.delay("by-name", seconds=1.0)
    again = app.send_task(
        "tests.tasks.finish_once", args=["by-name"], kwargs={"seconds": 1.0}
    )
    assert again.id == first.id
    assert again.get(timeout=60) == f"by-name:{first.id}"
    assert len(tasks.runs("by-name")) == 1


def test_retry_keeps_the_call_locked_and_the_last_try_frees_it(workers):
    lock_id = lock_id_for(tasks.finish_retrying, "retry", 2, 0.2, 0.5)
    first = tasks.finish_retrying.delay("retry", 2, 0.2, 0.5)
    duplicates = []  # (when its send returned, its result)
    while not first.ready():
        duplicate = tasks.finish_retrying.delay("retry", 2, 0.2, 0.5)
        duplicates.append((time.monotonic(), duplicate))
        time.sleep(0.05)
    assert first.get(timeout=60) == 2
    runs = tasks.runs("retry")
    ours = [run for run in runs if run["task_id"] == first.id]
    assert [run["retries"] for run in ours] == [0, 1, 2]
    # Through every retry a duplicate joins the call. Only one whose send
    # returned after the last try had ended may be a call of its own: the lock
    # is freed before the result is stored, and ready() polled (a window a
    # busy machine widens). (Judged by when the send began, a send begun just
    # before the end that looked at the lock just after it was counted wrong,
    # in one loaded fresh clone.)
    ended = ours[-1]["end"]
    late = {d.id for at, d in duplicates if at > ended}
    own = {d.id for _at, d in duplicates if d.id != first.id}
    assert own <= late, "a retry let a duplicate out"
    assert sum(d.id == first.id for _at, d in duplicates) > 10
    assert {run["task_id"] for run in runs} <= {first.id} | late
    wait_until(lambda: free(lock_id), 15)


def test_max_retries_exhausted_frees_the_call(workers):
    lock_id = lock_id_for(tasks.finish_retrying, "exhaust", 9, 0.1, 0.2)
    result = tasks.finish_retrying.delay("exhaust", 9, 0.1, 0.2)
    with pytest.raises(MaxRetriesExceededError):
        result.get(timeout=60)
    assert [run["retries"] for run in tasks.runs("exhaust")] == [0, 1, 2, 3]
    wait_until(lambda: free(lock_id), 5)


def test_autoretry_keeps_the_call_locked_and_final_failure_frees_it(workers):
    lock_id = lock_id_for(tasks.finish_autoretry, "auto", 1)
    first = tasks.finish_autoretry.delay("auto", 1)
    duplicates, joined = [], []
    while not first.ready():
        duplicate = tasks.finish_autoretry.delay("auto", 1)
        duplicates.append(duplicate)
        # The first call's lock still, after the send: it was all through it
        # (nothing gives the lock back to a finished call), so the duplicate
        # must have joined. A send after the last run freed the lock, before
        # its result was stored, is a new call.
        holder = held(lock_id)
        if holder is not None and holder[1] == first.id:
            joined.append(duplicate)
        time.sleep(0.05)
    assert first.get(timeout=60) == 1
    assert len(joined) >= 2  # the retry's countdown alone is 0.5 s
    assert {d.id for d in joined} == {first.id}
    runs = [run["retries"] for run in tasks.runs("auto") if run["task_id"] == first.id]
    assert runs == [0, 1]
    for later in {d.id: d for d in duplicates if d.id != first.id}.values():
        later.get(timeout=60)
    wait_until(lambda: free(lock_id), 5)

    failing_id = lock_id_for(tasks.finish_autoretry, "auto-fail", 5)
    failing = tasks.finish_autoretry.delay("auto-fail", 5)
    with pytest.raises(ValueError, match="failure 2"):
        failing.get(timeout=60)
    assert [run["retries"] for run in tasks.runs("auto-fail")] == [0, 1, 2]
    wait_until(lambda: free(failing_id), 5)


def test_revoking_a_pending_call_frees_it_when_a_worker_drops_it(workers):
    # A countdown keeps the call pending, whatever the pool processes are doing
    # (a worker holds it unstarted): it is revoked long before it is due, and
    # the worker drops it when it comes due. Four busy calls filling the pool
    # were not enough: a worker acks a call as it starts it, so it may take a
    # third and fourth while the other worker idles, and a call it got then ran.
    lock_id = lock_id_for(tasks.finish_once, "revoked")
    pending = tasks.finish_once.apply_async(("revoked",), countdown=3)
    assert held(lock_id) == ("queued", pending.id)
    pending.revoke()
    # Its lock lasts the countdown and the queue allowance: freed by the drop.
    wait_until(lambda: free(lock_id), 20)
    assert tasks.runs("revoked") == [], "the revoked call ran"
    again = tasks.finish_once.delay("revoked")
    assert again.id != pending.id
    again.get(timeout=60)
    assert [run["task_id"] for run in tasks.runs("revoked")] == [again.id]


def test_revoking_a_running_call_with_terminate_frees_it(workers):
    lock_id = lock_id_for(tasks.finish_once, "terminated", 30.0)
    running = tasks.finish_once.delay("terminated", 30.0)
    wait_until(lambda: held(lock_id) == ("running", running.id), 30)
    running.revoke(terminate=True, signal="SIGKILL")
    # Its lock would last 60 s: freed by the revoke, not by expiring.
    wait_until(lambda: free(lock_id), 20)


def test_worker_killed_mid_call_frees_it_within_the_lock_expiry(workers):
    lock_id = lock_id_for(tasks.finish_killable, "killed", 30.0)
    tasks.finish_killable.delay("killed", 30.0)
    wait_until(lambda: tasks.runs("killed"), 30)
    assert held(lock_id)[0] == "running"
    os.kill(tasks.runs("killed")[0]["pid"], signal.SIGKILL)
    killed_at = time.monotonic()
    wait_until(lambda: free(lock_id), 10)
    # expire=3 on memcached, an end on the server's clock: gone within 3 s of
    # the last write, up to LONGER late.
    assert time.monotonic() - killed_at <= 3 + LONGER


def test_coalesce_queues_one_follow_up_while_a_run_is_in_progress(workers, joined):
    lock_id = lock_id_for(tasks.coalesced, "co", 1.5)
    first = tasks.coalesced.delay("co", 1.5)
    # Running, and its pending mark cleared (just after it took the lock): a
    # call sent from now on is a new one.
    wait_until(
        lambda: (
            held(lock_id) == ("running", first.id)
            and held(lock_id + QUEUE_SUFFIX) is None
        ),
        30,
    )
    during = [tasks.coalesced.delay("co", 1.5) for _ in range(10)]
    follow_up = during[0].id
    assert follow_up != first.id
    assert {d.id for d in during} == {follow_up}
    assert held(lock_id + QUEUE_SUFFIX) == ("queued", follow_up)
    assert first.get(timeout=60) == f"co:{first.id}"
    assert [d.get(timeout=60) for d in during] == [f"co:{follow_up}"] * 10
    runs = tasks.runs("co")
    assert [run["task_id"] for run in runs] == [first.id, follow_up]
    assert overlaps([(run["start"], run["end"]) for run in runs]) == 0
    assert len(joined) == 9
    assert free(lock_id) and free(lock_id + QUEUE_SUFFIX)


def test_until_started_allows_one_pending_call(workers):
    lock_id = lock_id_for(tasks.debounced, "deb", 1.0)

    def burst():
        # A countdown keeps the burst's first call pending while the rest arrive.
        return [
            tasks.debounced.apply_async(("deb", 1.0), countdown=1) for _ in range(10)
        ]

    first = burst()
    assert {r.id for r in first} == {first[0].id}
    wait_until(lambda: held(lock_id) == ("started", first[0].id), 30)
    later = burst()  # while the first runs: one new pending call
    assert {r.id for r in later} == {later[0].id}
    assert later[0].id != first[0].id
    assert first[0].get(timeout=60) == f"deb:{first[0].id}"
    assert later[0].get(timeout=60) == f"deb:{later[0].id}"
    assert sorted(run["task_id"] for run in tasks.runs("deb")) == sorted(
        [first[0].id, later[0].id]
    )


def test_replace_runs_the_latest_arguments_only(workers):
    older = tasks.latest_wins.apply_async(("rep", 1), countdown=2)
    newer = tasks.latest_wins.apply_async(("rep", 2), countdown=2)
    assert newer.id != older.id
    assert newer.get(timeout=60) == 2
    wait_until(lambda: older.state == "REVOKED", 30)
    assert [run["version"] for run in tasks.runs("rep")] == [2]


def test_a_chain_whose_first_link_meets_a_held_lock_fails_instead_of_passing_none(
    workers,
):
    lock_id = lock_id_for(tasks.skip_duplicate, "ch", 3.0)
    holder = tasks.skip_duplicate.delay("ch", 3.0)
    wait_until(lambda: held(lock_id) == ("running", holder.id), 30)
    blocked = chain(tasks.skip_duplicate.si("ch", 3.0), tasks.add_one.s())()
    with pytest.raises(LockNotAcquired):
        blocked.get(timeout=60)
    holder.get(timeout=60)
    # The control: with the lock free, the same chain runs through.
    passed = chain(tasks.skip_duplicate.si("ch", 0.0), tasks.add_one.s())()
    assert passed.get(timeout=60).endswith("+1")


def test_a_chord_with_duplicate_members_fails_instead_of_hanging(workers):
    members = [tasks.finish_once.si("chord", 3.0) for _ in range(3)]
    result = chord(group(members), tasks.gather.s())()
    # Celery fails the callback with the member's error (or a ChordError).
    with pytest.raises((ChordError, LockNotAcquired)):
        result.get(timeout=60)
    # The one member that took the lock runs to its end; the others failed.
    wait_until(lambda: tasks.runs("chord"), 30)
    assert len(tasks.runs("chord")) == 1


def test_a_group_member_meeting_a_held_lock_never_returns_none(workers):
    outcomes = group(tasks.finish_once.si("grp", 3.0) for _ in range(3))().get(
        timeout=60, propagate=False
    )
    assert None not in outcomes
    assert sum(isinstance(o, LockNotAcquired) for o in outcomes) == 3 - len(
        tasks.runs("grp")
    )


def test_beat_ticking_faster_than_the_body_runs_publishes_once_per_run(
    workers, tmp_path
):
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "TASKLOCK_TEST_BEAT": "0.1",
    }
    command = [
        sys.executable,
        *shlex.split("-m celery -A tests.celery_app beat -l INFO"),
    ]
    files = ["-s", str(tmp_path / "schedule"), "-f", str(tmp_path / "beat.log")]
    beat = subprocess.Popen(
        [*command, *files, "--pidfile", str(tmp_path / "beat.pid")],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until(lambda: len(tasks.runs("beat")) >= 3, 60)
    finally:
        beat.send_signal(signal.SIGTERM)
        beat.wait(timeout=30)
    lock_id = lock_id_for(tasks.finish_once, "beat")
    wait_until(lambda: free(lock_id), 10)
    runs = tasks.runs("beat")
    log = (tmp_path / "beat.log").read_text()
    ticks = log.count("Scheduler: Sending due task")
    assert overlaps([(run["start"], run["end"]) for run in runs]) == 0
    assert len({run["task_id"] for run in runs}) == len(runs)
    assert ticks > 2 * len(runs), f"beat sent {ticks} for {len(runs)} runs"


def test_int_keyed_dict_argument_has_one_lock_id_at_delay_and_in_the_worker(workers):
    """JSON turns the keys to str ("10" < "2" sorted as text): the queued mark
    and the run must still share one id, so the call frees its lock at the end
    and the same call made again runs again instead of joining a finished one."""
    options = {10: "ten", 2: "two", 1: "one"}
    lock_id = lock_id_for(tasks.finish_with_options, "int-keys", options)
    first = tasks.finish_with_options.delay("int-keys", options)
    assert first.get(timeout=60) == f"int-keys:{first.id}"
    wait_until(lambda: free(lock_id), 10)
    again = tasks.finish_with_options.delay("int-keys", options)
    assert again.id != first.id
    assert again.get(timeout=60) == f"int-keys:{again.id}"
    assert [run["task_id"] for run in tasks.runs("int-keys")] == [first.id, again.id]
    # Mixed int and str keys can be sent as well (kombu sends them).
    mixed = tasks.finish_with_options.delay("mixed-keys", {1: "a", "b": 2})
    assert mixed.get(timeout=60) == f"mixed-keys:{mixed.id}"
    wait_until(
        lambda: free(
            lock_id_for(tasks.finish_with_options, "mixed-keys", {1: "a", "b": 2})
        ),
        10,
    )


class MutationWatch:
    """memcached's ``watch mutations`` stream: every store the server carried
    out, with the command that did it (``add`` for an add-mode ``ms``, ``cas``
    for a conditional rewrite)."""

    def __init__(self, port: int) -> None:
        import socket

        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.sock.sendall(b"watch mutations\r\n")
        assert self.sock.recv(4) == b"OK\r\n"
        self.buffer = b""

    def commands(self, key: str) -> list[str]:
        """The commands that stored ``key`` so far, in order."""
        import re

        self.sock.settimeout(0.2)
        try:
            while chunk := self.sock.recv(65536):
                self.buffer += chunk
        except TimeoutError:
            pass
        from urllib.parse import quote

        # memcached's worker threads write their lines in batches: ordered by
        # gid, the server's global sequence, not by arrival.
        found = re.findall(
            rf"gid=(\d+) type=item_store key={re.escape(quote(key, safe=''))} "
            rf"status=stored cmd=(\w+)",
            self.buffer.decode(),
        )
        return [command for _gid, command in sorted(found, key=lambda f: int(f[0]))]

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("how", ["retry", "autoretry_for"])
def test_a_retry_takes_the_lock_over_in_one_write_never_freeing_it(
    workers, memcached, how
):
    """What the store did, step by step: the publish adds the mark, and from
    there every change (worker takes over, run hands over to its retry, the
    retry takes over) is a conditional rewrite of that item. A release and a
    new add in between, however short the gap, shows up as a second add."""
    watch = MutationWatch(memcached.port)
    try:
        if how == "retry":
            lock_id = lock_id_for(tasks.finish_retrying, "one-write", 2, 0.1, 0.2)
            result = tasks.finish_retrying.delay("one-write", 2, 0.1, 0.2)
            assert result.get(timeout=60) == 2
        else:
            lock_id = lock_id_for(tasks.finish_autoretry, "one-write", 2)
            result = tasks.finish_autoretry.apply_async(
                ("one-write", 2), retry_policy=None
            )
            assert result.get(timeout=60) == 2
        wait_until(lambda: free(lock_id), 5)
        commands = watch.commands(f":1:{lock_id}")
    finally:
        watch.close()
    # Added once when published; then per run a take-over, per retry a
    # hand-over (autoretry_for's re-publish rewrites the mark once more).
    assert commands[0] == "add", commands
    assert "add" not in commands[1:], commands
    assert commands.count("cas") >= 5, commands


def test_a_call_sent_again_with_its_own_task_id_while_it_runs_leaves_its_lock(
    workers,
):
    """``apply_async(task_id=<the running call's id>)``: published, and the copy
    dropped when it starts; the run keeps its very lock (same token) to the end."""
    lock_id = lock_id_for(tasks.finish_when_told, "own-id")
    result = tasks.finish_when_told.delay("own-id")
    wait_until(lambda: held(lock_id) == ("running", result.id), 30)
    token = lock_status(lock_id).value
    again = tasks.finish_when_told.apply_async(("own-id",), task_id=result.id)
    assert again.id == result.id
    assert lock_status(lock_id).value == token, "the running call's lock was taken"
    # The copy reaches a worker and is dropped (Ignore) while the run goes on.
    wait_until(lambda: result.id in tasks.ignored(), 30)
    assert lock_status(lock_id).value == token
    tasks.let_go("own-id")
    assert result.get(timeout=60) == f"own-id:{result.id}"
    starts = [run for run in tasks.runs("own-id") if run.get("phase") == "start"]
    assert len(starts) == 1, starts
    wait_until(lambda: free(lock_id), 5)
