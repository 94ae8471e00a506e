"""What the waiting line's tests share across stores."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from django_tasklock import Lock
from tests.helpers import background, wait_until


def stopped_while_waiting(
    settings, backend: str, location: str, server, joined: Callable[[], object]
) -> list[BaseException]:
    """A blocking acquire in line on its own ``server`` (a ``backend`` cache
    at ``location``) when the server stops once ``joined()`` says it is in
    line: the errors the acquire raised."""
    from tests.helpers import background

    settings.CACHES = {
        **settings.CACHES,
        "own": {"BACKEND": backend, "LOCATION": location},
    }
    settings.TASKLOCK = {"CACHE": "own", "LIVENESS": None}
    holder = Lock("stopped-line", expire=30)
    assert holder.acquire()
    errors: list[BaseException] = []

    def wait() -> None:
        from django_tasklock import LockBackendError

        try:
            Lock("stopped-line").acquire(blocking=True, timeout=30)
        except LockBackendError as exc:
            errors.append(exc)

    thread, outcome = background(wait)
    deadline = time.monotonic() + 10
    while not joined() and time.monotonic() < deadline:
        time.sleep(0.01)
    server.stop()
    thread.join(60)
    assert not thread.is_alive() and "error" not in outcome, outcome
    return errors


def shared_in_turn(store: str, share: float) -> None:
    """4 processes on ``store`` (``redis``, ``memcached``, ``postgres``), each
    taking one lock again at once after its release: in line each gets its
    turn (the fewest holds at least ``share`` of the most: 25/25/25/25 alone,
    but a fresh clone's loaded full run gave 34/30/27/26 on memcached, and
    another 34/53/31/31, a waiter starved of CPU past its mark passed over and
    back at the end); polling, the control, let one take most (the fewest
    under half the most), and no wait in line timed out."""
    from benchmarks import handoff

    got = handoff.measure(f"line-{store}", 4, 0.02, 4.0)
    print(f"line: {got}")
    assert got["overlaps"] == 0
    assert got["timeouts"] == 0
    assert min(got["holds"]) >= share * max(got["holds"]), got["holds"]
    control = handoff.measure(f"poll-{store}", 4, 0.02, 4.0)
    print(f"poll: {control}")
    assert control["overlaps"] == 0
    assert min(control["holds"]) < 0.5 * max(control["holds"]), control["holds"]


def taken_in_order(lock_id: str, waiting: Callable[[], int]) -> list[int]:
    """5 threads that each join the line of ``lock_id`` once the one before
    is in it (``waiting()``: how many are), then the holder releases: the
    order in which they took the lock."""
    import threading

    holder = Lock(lock_id, expire=30)
    assert holder.acquire()
    order: list[int] = []
    done = threading.Barrier(6)

    def wait(n: int) -> None:
        lock = Lock(lock_id, expire=30)
        assert lock.acquire(blocking=True, timeout=30)
        order.append(n)
        time.sleep(0.01)
        lock.release()
        done.wait(30)

    for n in range(5):
        threading.Thread(target=wait, args=(n,), daemon=True).start()
        deadline = time.monotonic() + 10
        while waiting() != n + 1:
            assert time.monotonic() < deadline, "a waiter did not join the line"
            time.sleep(0.01)
    holder.release()
    done.wait(30)
    return order


def handoff_across_processes(lock_id: str, cache: str, waiting: str) -> float:
    """Seconds from another process's release of ``lock_id`` (in ``cache``,
    held for a second) to the take of a thread here that waited for it
    (``waiting``: the WAITING setting of both): no release here wakes it."""
    import os
    import subprocess
    import sys

    from django.test import override_settings

    from tests.helpers import background

    tasklock = {"CACHE": cache, "LIVENESS": None, "WAITING": waiting}
    code = (
        "import sys, time\n"
        "from tests.workers import setup_django; setup_django()\n"
        "from django.conf import settings\n"
        f"settings.TASKLOCK = {tasklock!r}\n"
        "from django_tasklock import Lock\n"
        f"lock = Lock({lock_id!r}, expire=30)\n"
        "assert lock.acquire()\n"
        "print('held', flush=True)\n"
        "sys.stdin.readline()\n"
        "lock.release()\n"
        "print(time.monotonic(), flush=True)\n"
    )
    other = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=os.environ.copy(),
    )
    took: list[float] = []

    def wait() -> None:
        lock = Lock(lock_id, expire=30)
        assert lock.acquire(blocking=True, timeout=30)
        took.append(time.monotonic())
        lock.release()

    assert other.stdin is not None and other.stdout is not None
    try:
        with override_settings(TASKLOCK=tasklock):
            assert other.stdout.readline() == "held\n"
            thread, outcome = background(wait)
            time.sleep(1.0)  # in line, or its polls' pause at its longest
            other.stdin.write("\n")
            other.stdin.flush()
            released_at = float(other.stdout.readline())
            thread.join(60)
        assert "error" not in outcome, outcome
    finally:
        other.kill()
        other.wait()
        other.stdin.close()
        other.stdout.close()
    return took[0] - released_at


def after_a_killed_waiter(
    lock_id: str, cache: str, waiting: Callable[[], int]
) -> float:
    """A waiter in another process joins the line of ``lock_id`` (held here,
    in ``cache``), a thread here joins behind it (``waiting()``: how many are
    in line), the first is SIGKILLed and the lock released: the seconds the
    thread waited after the release (the dead waiter's turn held it up)."""
    import os
    import signal
    import subprocess
    import sys

    from tests.helpers import background

    def until(count: int) -> None:
        deadline = time.monotonic() + 30
        while waiting() != count:
            assert time.monotonic() < deadline, f"{count} waiters never in line"
            time.sleep(0.01)

    holder = Lock(lock_id, expire=30)
    assert holder.acquire()
    code = (
        "from tests.workers import setup_django; setup_django()\n"
        "from django.conf import settings\n"
        f"settings.TASKLOCK = {{'CACHE': {cache!r}, 'LIVENESS': None}}\n"
        "from django_tasklock import Lock\n"
        f"Lock({lock_id!r}, expire=30).acquire(blocking=True, timeout=60)\n"
    )
    first = subprocess.Popen([sys.executable, "-c", code], env=os.environ.copy())
    took: list[float] = []

    def second() -> None:
        lock = Lock(lock_id, expire=30)
        assert lock.acquire(blocking=True, timeout=30)
        took.append(time.monotonic())
        lock.release()

    try:
        until(1)
        thread, outcome = background(second)
        until(2)
        first.send_signal(signal.SIGKILL)
        first.wait()
        released_at = time.monotonic()
        holder.release()
        thread.join(60)
        assert not thread.is_alive() and "error" not in outcome, outcome
    finally:
        first.kill()
        first.wait()
    waited = took[0] - released_at
    print(f"next waiter took it {waited:.2f} s after the release")
    return waited


def _waiting_thread(lock_id: str, took: list[float]) -> tuple[Any, dict]:
    """A thread that waits (blocking) for ``lock_id``, notes when it took it
    in ``took`` and releases it at once."""

    def wait() -> None:
        lock = Lock(lock_id, expire=30)
        assert lock.acquire(blocking=True, timeout=30)
        took.append(time.monotonic())
        lock.release()

    return background(wait)


def _joined(running: tuple[Any, dict]) -> None:
    thread, outcome = running
    thread.join(60)
    assert not thread.is_alive(), "the thread did not end"
    if "error" in outcome:
        raise outcome["error"]


def joins_the_end(lock_id: str, waiting: Callable[[], int]) -> None:
    """A holder that takes the lock again at once after its release, while
    one waits in line (``waiting``: how many are in it), takes it only after
    the waiter's turn."""
    holder = Lock(lock_id, expire=30)
    assert holder.acquire()
    took: list[float] = []
    running = _waiting_thread(lock_id, took)
    wait_until(lambda: waiting() == 1)
    holder.release()
    again = Lock(lock_id, expire=30)
    assert again.acquire(blocking=True, timeout=30)  # after the waiter's turn
    taken_again = time.monotonic()
    again.release()
    _joined(running)
    assert took[0] < taken_again


def gives_up_and_leaves(lock_id: str, waiting: Callable[[], int]) -> float:
    """A waiter whose timeout ran out leaves the line; returns how long the
    next blocking acquire took once the lock was free (a waiter left behind
    would hold it up until its mark expired)."""
    holder = Lock(lock_id, expire=30)
    assert holder.acquire()
    assert not Lock(lock_id).acquire(blocking=True, timeout=0.3)
    assert waiting() == 0
    holder.release()
    started = time.monotonic()
    assert Lock(lock_id).acquire(blocking=True, timeout=30)
    return time.monotonic() - started


def after_a_lost_line(
    lock_id: str, waiting: Callable[[], int], lose: Callable[[], object]
) -> float:
    """Seconds from a release to a waiter's take when its line was lost
    (``lose``: as a flush would) while it waited: nobody is woken, and the
    waiter's own next try finds the lock free."""
    holder = Lock(lock_id, expire=30)
    assert holder.acquire()
    took: list[float] = []
    running = _waiting_thread(lock_id, took)
    wait_until(lambda: waiting() == 1)
    lose()
    released_at = time.monotonic()
    holder.release()
    _joined(running)
    return took[0] - released_at
