"""``Leadership``: one leader among processes, on the real stores. Leaders and
standbys are processes of their own, on other hosts as far as liveness goes
(``unshare --uts``): a standby takes over a killed leader within LIVENESS plus
a poll, with a larger fence; a paused leader that was replaced learns it at its
next look and never reports itself leader again."""

from __future__ import annotations

import io
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from django.core.management import CommandError, call_command

from django_tasklock import Leadership
from tests.helpers import ROOT
from tests.services import stop_and_wait

LIVENESS = 3.0
POLL = 0.2  # the processes' (tests/leader_process.py)
STORES = pytest.mark.parametrize(
    "alias", ["default", "redis"], ids=["memcached", "redis"]
)


class Candidate:
    """``python -m tests.leader_process`` on a host of its own."""

    def __init__(self, alias: str, name: str, host: str) -> None:
        command = [
            sys.executable,
            "-m",
            "tests.leader_process",
            alias,
            str(LIVENESS),
            name,
        ]
        rename = f'hostname {host} && exec "$@"'
        self.process = subprocess.Popen(
            ["unshare", "--uts", "sh", "-c", rename, "-", *command],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        self.lines: list[str] = []
        self._new = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.expect("standing by", timeout=60)

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            with self._new:
                self.lines.append(line.strip())
                self._new.notify_all()

    def expect(self, start: str, timeout: float, skip: int = 0) -> str | None:
        """The first line starting with ``start`` after ``skip`` such lines
        (waiting up to ``timeout``)."""
        deadline = time.monotonic() + timeout
        with self._new:
            while True:
                found = next(
                    itertools.islice(
                        (line for line in self.lines if line.startswith(start)),
                        skip,
                        None,
                    ),
                    None,
                )
                left = deadline - time.monotonic()
                if found is not None or left <= 0:
                    return found
                self._new.wait(left)

    def send(self, command: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()

    def close(self) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)
            self.process.kill()
        self.process.wait()
        self._reader.join(timeout=10)  # at the end of its output
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                stream.close()


@pytest.fixture
def candidates():
    made: list[Candidate] = []

    def make(alias: str, name: str, host: str) -> Candidate:
        made.append(Candidate(alias, name, host))
        return made[-1]

    yield make
    for candidate in made:
        candidate.close()


def gained(candidate: Candidate, timeout: float) -> tuple[int, float] | None:
    line = candidate.expect("gained ", timeout)
    if line is None:
        return None
    _, fence, at = line.split()
    return int(fence), float(at)


@pytest.mark.slow
@STORES
def test_a_standby_takes_over_a_killed_leader_within_liveness_and_a_poll(
    alias, candidates
):
    first = candidates(alias, "killed", "tasklock-leader-a")
    first_gain = gained(first, timeout=30)
    assert first_gain is not None
    standby = candidates(alias, "killed", "tasklock-leader-b")
    # Alive and leading: the standby stands by.
    assert gained(standby, timeout=2 * LIVENESS) is None
    first.process.kill()
    killed_at = time.time()
    first.process.wait()
    second_gain = gained(standby, timeout=LIVENESS + 30)
    assert second_gain is not None, standby.lines
    took = second_gain[1] - killed_at
    # The dead leader's record lapses LIVENESS after its last renewal (at most
    # a third of LIVENESS before the kill); a try comes every poll.
    print(f"{alias}: a standby took over {took:.2f}s after the leader's kill")
    # About LIVENESS plus a poll on a quiet machine (2.6-3.1 s here); bounded
    # generously, for a machine running the matrix beside this suite.
    assert took <= LIVENESS + POLL + 20, f"took over {took:.1f}s after the kill"
    assert second_gain[0] > first_gain[0]  # the fence grew


@pytest.mark.slow
@STORES
def test_a_paused_leader_that_was_replaced_learns_it_and_never_leads_again(
    alias, candidates
):
    first = candidates(alias, "paused", "tasklock-leader-c")
    first_gain = gained(first, timeout=30)
    assert first_gain is not None
    standby = candidates(alias, "paused", "tasklock-leader-d")
    stop_and_wait(first.process.pid)
    try:
        second_gain = gained(standby, timeout=LIVENESS + 30)
        assert second_gain is not None, standby.lines
    finally:
        os.kill(first.process.pid, signal.SIGCONT)
    # Woken, its first look says it no longer leads, and on_loss runs.
    first.send("is_leader")
    answer = first.expect("is_leader ", timeout=30)
    assert answer == "is_leader False", first.lines
    assert first.expect("lost ", timeout=30) is not None, first.lines
    assert second_gain[0] > first_gain[0]
    first.send("is_leader")
    later = first.expect("is_leader ", timeout=30, skip=1)
    assert later is not None, first.lines
    regained = [line for line in first.lines if line.startswith("gained ")][1:]
    # Once it knew, it leads only if it took the role anew, with a larger fence.
    assert later == "is_leader False" or (
        regained and int(regained[0].split()[1]) > second_gain[0]
    ), first.lines


@pytest.mark.slow
@STORES
def test_a_leader_paused_past_its_liveness_with_nobody_waiting_leads_again_at_once(
    alias, candidates
):
    """Paused longer than its liveness record lives, a leader loses the role
    by its own clock, though nobody took the lock: its token is still stored,
    with most of the 60 s expire left. It removes that token (owner-checked)
    and takes the role anew at its next try, with a larger fence, rather than
    stand by behind its own token until the lock expires. (A celery beat on a
    starved machine once stood by 30 s so.)"""
    first = candidates(alias, "paused-alone", "tasklock-leader-e")
    first_gain = gained(first, timeout=30)
    assert first_gain is not None
    stop_and_wait(first.process.pid)
    try:
        # The fault: paused past the record's life (LIVENESS on Redis, less on
        # memcached, whose record is sure to live LIVENESS - 2 s).
        time.sleep(LIVENESS + 1)
    finally:
        os.kill(first.process.pid, signal.SIGCONT)
    lost = first.expect("lost ", timeout=30)
    assert lost is not None, first.lines
    # Within half the expire the old token has left.
    regained = first.expect("gained ", timeout=30, skip=1)
    assert regained, f"not leader again within 30 s of its loss: {first.lines}"
    _, fence, at = regained.split()
    assert int(fence) > first_gain[0] and float(at) >= float(lost.split()[1])


@STORES
def test_in_one_process_the_role_passes_when_given_up(alias, settings):
    settings.TASKLOCK = {"CACHE": alias, "LIVENESS": LIVENESS}
    events: list[tuple[str, str, int | None]] = []

    def on_gain(leadership: Leadership) -> None:
        events.append(("gained", leadership.name, leadership.fence))

    def on_loss(leadership: Leadership) -> None:
        events.append(("lost", leadership.name, None))

    with Leadership("given-up", poll=0.05, on_gain=on_gain, on_loss=on_loss) as first:
        assert first.wait(10) and first.is_leader
        second = Leadership("given-up", poll=0.05, on_gain=on_gain).start()
        assert not second.wait(0.5) and second.fence is None
    assert not first.is_leader and first.fence is None
    assert second.wait(10) and second.is_leader
    assert second.fence > events[0][2]  # type: ignore[operator]
    second.stop()
    assert not second.is_leader
    assert [e[0] for e in events] == ["gained", "lost", "gained"]


def test_a_leadership_needs_a_name():
    with pytest.raises(ValueError, match="needs a name"):
        Leadership("")


def shown_leaders(name: str) -> list[dict]:
    out = io.StringIO()
    call_command("tasklock", "leaders", "--json", stdout=out, stderr=io.StringIO())
    return [row for row in json.loads(out.getvalue()) if row["leadership"] == name]


def wait_for_shown(name: str, fence: int, timeout: float = 30) -> dict:
    """The leadership of ``name`` as ``tasklock leaders`` shows it, once it
    shows ``fence`` and when it was gained (listed within a liveness beat)."""
    deadline = time.monotonic() + timeout
    while True:
        rows = [r for r in shown_leaders(name) if r["fence"] == fence and r["since"]]
        if rows or time.monotonic() > deadline:
            assert len(rows) == 1, shown_leaders(name)
            return rows[0]
        time.sleep(0.1)


@pytest.mark.slow
@STORES
def test_tasklock_leaders_shows_who_leads_since_when_and_its_fence(
    alias, candidates, settings
):
    settings.TASKLOCK = {"CACHE": alias, "LIVENESS": LIVENESS}
    first = candidates(alias, "shown", "tasklock-leader-e")
    first_gain = gained(first, timeout=30)
    assert first_gain is not None
    standby = candidates(alias, "shown", "tasklock-leader-f")
    shown = wait_for_shown("shown", first_gain[0])
    assert shown["leader"] == f"{first.process.pid}@tasklock-leader-e"
    assert shown["alive"] is True and shown["cache"] == alias
    assert abs(shown["since"] - first_gain[1]) < 2
    first.process.kill()
    first.process.wait()
    second_gain = gained(standby, timeout=LIVENESS + 30)
    assert second_gain is not None, standby.lines
    # The killed leader's roster still lists the role: the new leader's
    # listing, the later, is the one shown.
    shown = wait_for_shown("shown", second_gain[0])
    assert shown["leader"] == f"{standby.process.pid}@tasklock-leader-f"
    assert shown["alive"] is True and abs(shown["since"] - second_gain[1]) < 2
    out = io.StringIO()
    call_command("tasklock", "leaders", "shown", stdout=out, stderr=io.StringIO())
    text = out.getvalue()
    assert "Leadership: shown" in text and f"Fence:      {second_gain[0]}" in text
    assert f"process {standby.process.pid} on tasklock-leader-f (alive" in text
    standby.send("stop")
    assert standby.expect("stopped", timeout=30) is not None
    with pytest.raises(CommandError, match="Nobody leads 'shown'") as refused:
        call_command("tasklock", "leaders", "shown", stdout=io.StringIO())
    assert refused.value.returncode == 1
