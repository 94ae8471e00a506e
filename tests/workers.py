"""Code that runs in the worker processes the contention tests spawn."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.processes import process_context

if TYPE_CHECKING:
    from collections.abc import Callable

    from tests.services import Memcached


def setup_django() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    import django

    django.setup()


# A storm's shared hold count and its target, set in each pool process by
# ``Storms.run``; None where a caller runs ``hammer`` for a fixed time instead.
_storm: tuple[Any, int] | None = None
_storm_total: Any = None


def _join_storms(total: Any) -> None:
    global _storm_total
    _storm_total = total
    setup_django()


def _stormed(
    worker: Callable[..., Any], wanted: int, arguments: tuple[Any, ...]
) -> Any:
    """``worker(*arguments)`` in a storm of ``wanted`` holds; then this process
    is left as it was before: no liveness record kept (nor its thread), no
    connection open, for the next storm, on whatever store."""
    global _storm
    _storm = (_storm_total, wanted)
    try:
        return worker(*arguments)
    finally:
        _storm = None
        from django.core.cache import close_caches

        from django_tasklock.locks.liveness import forget_records

        forget_records(delete=True)
        close_caches()


def _storm_over() -> bool:
    """Whether the processes of this storm have held the lock often enough."""
    return _storm is not None and _storm[0].value >= _storm[1]


def _count_hold() -> None:
    if _storm is not None:
        with _storm[0].get_lock():
            _storm[0].value += 1


class Storms:
    """Processes for storms, kept for as many as a caller runs (a module's
    storms on each store): most of a storm's CPU was its 16 Pythons starting
    and setting Django up, once per store."""

    def __init__(self, processes: int) -> None:
        from tests.services import unmeasured

        self.processes = processes
        # Chosen untraced, so forked (tests/processes.py) even where coverage
        # measures the rest; the pool's processes start here.
        with unmeasured():
            context = process_context()
            self._total = context.Value("q", 0)
            self._pool = context.Pool(
                processes, initializer=_join_storms, initargs=(self._total,)
            )
        # Every process up with Django set up before a storm is timed.
        self._pool.map(time.sleep, [0.05] * processes * 4)

    def run(
        self,
        worker: Callable[..., Any],
        processes: int,
        wanted: int,
        head: tuple[Any, ...],
        tail: tuple[Any, ...] = (),
        give_up: float = 180.0,
    ) -> list[Any]:
        """See ``storm``; ``processes`` of this pool's, at most all."""
        if processes > self.processes:
            raise ValueError(f"a storm of {processes} in a pool of {self.processes}")
        self._total.value = 0
        start_at = time.monotonic() + 1.0
        arguments = (*head, start_at, give_up, *tail)
        # One call per process: each waits for start_at, then runs until the
        # storm is over, so no process can take two.
        return self._pool.starmap(
            _stormed, [(worker, wanted, arguments)] * processes, chunksize=1
        )

    def close(self) -> None:
        self._pool.terminate()
        self._pool.join()

    def __enter__(self) -> Storms:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def storm(
    worker: Callable[..., Any],
    processes: int,
    wanted: int,
    head: tuple[Any, ...],
    tail: tuple[Any, ...] = (),
    give_up: float = 180.0,
    *,
    storms: Storms | None = None,
) -> list[Any]:
    """Run ``worker(*head, start_at, give_up, *tail)`` in ``processes`` spawned
    processes, started together, until they have held the lock ``wanted`` times
    between them (an event, so a busy machine only makes the storm longer).
    ``give_up`` seconds bound a storm whose holds stop coming: the caller's
    count assertion then fails and says so. In the processes of ``storms``
    when given, else in processes of its own.
    """
    if storms is not None:
        return storms.run(worker, processes, wanted, head, tail, give_up)
    with Storms(processes) as fresh:
        return fresh.run(worker, processes, wanted, head, tail, give_up)


def hammer(
    tasklock: dict[str, object],
    lock_id: str,
    start_at: float,
    seconds: float,
    mode: str,
    limit: int | None = None,
) -> tuple[list[tuple[float, float]], int]:
    """Take and drop one lock as often as possible for ``seconds``, or, in a
    ``storm``, until the storm's processes have held it often enough.

    Returns the (enter, exit) monotonic times of every hold and the number of
    refused attempts (a store error counts as one). CLOCK_MONOTONIC is shared
    by all processes of one machine, so holds from different processes can be
    compared. ``mode`` "none" skips the
    lock, to prove the overlap detector sees overlaps when there are some. With
    ``limit``, a Semaphore of that limit named ``lock_id`` instead of a Lock,
    each hold a little longer, so that others have room to pile in.
    """
    setup_django()
    from django.conf import settings
    from django.core.cache import close_caches

    from django_tasklock import Lock, LockBackendError, Semaphore

    settings.TASKLOCK = tasklock
    holds: list[tuple[float, float]] = []
    refused = 0
    hold_for = 0.0002 if limit is None else 0.002
    while time.monotonic() < start_at:
        time.sleep(0.001)
    deadline = start_at + seconds
    while time.monotonic() < deadline and not _storm_over():
        lock = (
            Lock(lock_id, expire=30)
            if limit is None
            else Semaphore(lock_id, limit, expire=30)
        )
        try:
            taken = mode == "none" or lock.acquire()
        except LockBackendError:
            # A store error (a cluster client out of redirections while a
            # slot moves): a failed attempt of this storm's row, not its end.
            taken = False
        if taken:
            entered = time.monotonic()
            # Hold for a moment, so an overlap would have room to show.
            while time.monotonic() - entered < hold_for:
                pass
            exited = time.monotonic()
            if mode != "none":
                with contextlib.suppress(LockBackendError):  # (then it expires)
                    assert lock.release(), "lost a lock nobody else could take"
            holds.append((entered, exited))
            _count_hold()
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
    while time.monotonic() < deadline and not _storm_over():
        lock = Lock(lock_id, expire=30)
        if lock.acquire():
            entered = time.monotonic()
            assert lock.fence is not None
            while time.monotonic() - entered < 0.0002:
                pass
            exited = time.monotonic()
            assert lock.release(), "lost a lock nobody else could take"
            holds.append((entered, exited, lock.fence))
            _count_hold()
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
    expire: float = 3,
) -> None:
    """Take a slot of ``name`` renewing, report which, then run until killed.
    A slot found lost is reported too: ``("lost", pid, late)``, ``late``
    True when the renewal that found it came after the slot's sure life had
    run out (the heartbeat starved: the safe direction, told)."""
    setup_django()
    from django.conf import settings

    from django_tasklock import Semaphore
    from django_tasklock.signals import lock_lost

    def told(sender: object, lock: Any, **details: object) -> None:
        late = time.monotonic() >= lock.acquisition.valid_until
        queue.put(("lost", os.getpid(), late))  # type: ignore[attr-defined]

    lock_lost.connect(told, weak=False)
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
    servers: list[Memcached],
    alias: str,
    ids: list[str],
    before_restart: Callable[[list[Any]], object] | None = None,
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
        valid_until[lock.lock_id] = lock.acquisition.valid_until  # type: ignore[assignment]
    backend = backend_for(alias)
    port_of = {i: backend._client(backend.key_for(i)).server[1] for i in ids}  # type: ignore[attr-defined]
    victim = max(servers, key=lambda s: list(port_of.values()).count(s.port))
    on_victim = [i for i in ids if port_of[i] == victim.port]
    if before_restart is not None:
        before_restart(locks)
    victim.stop(signal.SIGKILL)
    victim.start()
    return list(locks), valid_until, on_victim


#: The log file of each worker ``start_workers`` started and has not stopped.
_worker_logs: dict[int, Path] = {}


def start_workers(
    broker_env: dict[str, str],
    names: list[str],
    concurrency: int = 2,
    extra_env: dict[str, str] | None = None,
    logdir: Path | None = None,
) -> list[subprocess.Popen[bytes]]:
    """Real ``celery worker`` processes (prefork) of tests.celery_app, answering
    a ping before this returns; each logs to ``logdir/<name>.log`` (a directory
    of its own if not given).

    Never to a pipe: nobody reads a pipe while the worker runs, and a worker
    whose pipe is full (tracebacks of killed pool processes, warnings of a
    loaded machine) blocks on its next log line and stops dispatching calls.
    """
    import tempfile

    import pytest

    from tests.celery_app import app
    from tests.services import celery_worker

    env = {
        **os.environ,
        **broker_env,
        **(extra_env or {}),
        "DJANGO_SETTINGS_MODULE": "tests.settings",
    }
    if logdir is None:
        logdir = Path(tempfile.mkdtemp(prefix="tasklock-workers-"))
    processes = []
    for name in names:
        log = logdir / f"{name}.log"
        with log.open("ab") as output:  # the child keeps its own descriptor
            process = celery_worker(
                "tests.celery_app",
                name,
                concurrency,
                env,
                loglevel=os.environ.get("TASKLOCK_TEST_WORKER_LOGLEVEL", "WARNING"),
                logfile=log,
                stderr=output.fileno(),
            )
        _worker_logs[process.pid] = log
        processes.append(process)
    wanted = {f"{name}@{socket.gethostname()}" for name in names}
    deadline = time.monotonic() + 60
    while not wanted <= {
        name for reply in app.control.ping(timeout=0.5) for name in reply
    }:
        for process in processes:
            if process.poll() is not None:
                pytest.fail(f"celery worker died: {workers_said()}")
        if time.monotonic() > deadline:
            pytest.fail(
                f"celery workers did not answer a ping within 60 s: {workers_said()}"
            )
    return processes


def three_parked_behind_a_long_run(key: str) -> tuple[Any, list[Any], int]:
    """A long call of ``tests.tasks.parked_killable`` running, three parked
    behind it: the first's result, the three's, and the pid of the first's
    process."""
    from django_tasklock import lock_id_for
    from tests import tasks
    from tests.helpers import wait_until

    first = tasks.parked_killable.delay(key, 0, seconds=120)
    wait_until(lambda: len(started_runs(key)) == 1, 60, workers_said)
    later = [tasks.parked_killable.delay(key, n, seconds=0.05) for n in range(1, 4)]
    lock_id = lock_id_for(tasks.parked_killable, key=key, n=0)
    wait_until(
        lambda: sum(s[0] == "parked" for s in tasks.park_steps(lock_id)) >= 3,
        60,
        workers_said,
    )
    pid = started_runs(key)[0]["pid"]
    assert isinstance(pid, int)
    return first, later, pid


def kill_node(
    pid: int,
    workers: list[subprocess.Popen[bytes]],
    broker_env: dict[str, str],
    replacement: str,
) -> float:
    """SIGKILL the worker node whose pool process ``pid`` is, main process and
    pool at once (nothing of it says goodbye), and start ``replacement`` in its
    place in ``workers``; the monotonic time of the kill."""
    from django_tasklock.tokens import process_alive
    from tests.helpers import wait_until

    with open(f"/proc/{pid}/stat") as stat:
        node = int(stat.read().rsplit(")", 1)[1].split()[1])
    victim = next(p for p in workers if p.pid == node)
    for doomed in (node, pid):
        os.kill(doomed, signal.SIGKILL)
    killed = time.monotonic()
    victim.wait(10)
    wait_until(lambda: not process_alive(pid), 10)
    workers.remove(victim)
    workers.extend(start_workers(broker_env, [replacement], concurrency=3))
    return killed


def workers_said(chars: int = 3000) -> str:
    """The end of each running test worker's log, for a failure message."""
    said = []
    for pid, log in _worker_logs.items():
        try:
            text = log.read_text(errors="replace")
        except OSError as exc:
            text = f"(unreadable: {exc})"
        said.append(f"--- worker {pid} ({log}):\n{text[-chars:]}")
    return "\n".join(said) or "(no worker running)"


def stop_workers(processes: list[subprocess.Popen[bytes]]) -> None:
    from tests.services import stop_process

    for process in processes:
        stop_process(process)
        _worker_logs.pop(process.pid, None)


def _started() -> None:
    """Nothing: a pool's process has run its initializer once it answers."""


def restart_under_holders(
    servers: list[Memcached],
    alias: str,
    ids: list[str],
    caches_setting: dict[str, object],
) -> dict[str, object]:
    """Take every id in ``ids`` in this process (default settings: LOCK_EXPIRE
    600, LIVENESS on), SIGKILL and restart empty the server holding the most,
    then let a fresh process take those ids and a new id of that server.

    Returns the ids of the restarted server, the seconds from the restart to
    the fresh process taking its new id (how long new locks were refused), the
    held ids it took (second holders), and whether each holder still owns its
    lock afterwards.
    """
    from django_tasklock.backends import backend_for
    from tests.helpers import wait_until

    def settled(locks: list[Any]) -> None:
        # The holders' liveness thread has read their locks since they were
        # taken (its connections are old ones when the server restarts).
        record = locks[0].acquisition.record
        assert record is not None, "taken without a liveness record"
        beats = record.beats
        wait_until(lambda: record.beats >= beats + 2, 30)

    context = process_context()
    with context.Pool(1, initializer=setup_django) as pool:
        # The fresh process started and Django set up before the restart: its
        # start-up on a loaded machine (seconds, in a fresh clone's full run)
        # is not counted as refusal. It has not met the servers yet.
        pool.apply(_started)
        locks, _valid_until, on_victim = hold_and_restart_busiest(
            servers, alias, ids, settled
        )
        restarted = time.monotonic()
        backend = backend_for(alias)
        victim_port = backend._client(backend.key_for(on_victim[0])).server[1]  # type: ignore[attr-defined]
        fresh = next(
            f"restart-new-{n}"
            for n in range(10_000)
            if backend._client(backend.key_for(f"restart-new-{n}")).server[1]  # type: ignore[attr-defined]
            == victim_port
        )
        result = pool.apply(
            take_until_all, (caches_setting, {"CACHE": alias}, [fresh], 60)
        )
        taken_fresh: dict[str, float] = result["taken"]  # type: ignore[assignment]
        seconds = taken_fresh[fresh] - restarted if fresh in taken_fresh else None
        second = pool.apply(
            take_until_all, (caches_setting, {"CACHE": alias}, on_victim, 2)
        )
    stolen = sorted(second["taken"])  # type: ignore[call-overload]
    owned = [lock.owned() for lock in locks]  # type: ignore[attr-defined]
    for lock in locks:
        lock.release_quietly()  # type: ignore[attr-defined]
    return {
        "on_victim": on_victim,
        "refused_for": seconds,
        "stolen": stolen,
        "owned": owned,
    }


def started_runs(key: str) -> list[dict[str, object]]:
    """The runs of ``key`` a task in tests.tasks recorded as started."""
    from tests import tasks

    return [run for run in tasks.runs(key) if run.get("phase") == "start"]


def kill_then_run_again(task: Any, key: str, *args: Any) -> tuple[float, int]:
    """Start a call of ``task`` (one of tests.tasks' ``*_when_told``), SIGKILL
    its pool process mid-body, send the same call again once the process is
    dead; the seconds from the kill to the second run's start, and the killed
    pid."""
    from django_tasklock.tokens import process_alive
    from tests import tasks
    from tests.helpers import wait_until

    before = len(started_runs(key))
    task.delay(key, *args)
    wait_until(
        lambda: len(started_runs(key)) == before + 1,
        30,
        lambda: f"runs {started_runs(key)}; the workers said:\n{workers_said()}",
    )
    pid = started_runs(key)[before]["pid"]
    assert isinstance(pid, int)
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    # SIGKILL takes effect asynchronously: a call sent while the holder still
    # ran would rightly join it (and be lost with it, as that call's message
    # was acknowledged when it started).
    wait_until(lambda: not process_alive(pid), 10)
    second = task.delay(key, *args)
    wait_until(
        lambda: len(started_runs(key)) == before + 2,
        30,
        lambda: (
            f"runs {started_runs(key)}; the call sent again: {second.state} "
            f"{second.result!r}; the workers said:\n{workers_said()}"
        ),
    )
    restarted = started_runs(key)[before + 1]["start"]
    assert isinstance(restarted, float)
    tasks.let_go(key)
    assert second.get(timeout=30) == f"{key}:{second.id}"
    return restarted - killed, pid


class Holder:
    """``python -m tests.holder`` in a process of its own, on this host or, with
    ``host``, in a UTS namespace with that hostname (another host as far as
    tokens and liveness records go)."""

    def __init__(self, alias, lock_id, *, host=None, liveness=3.0, limit=None):
        command = [sys.executable, "-m", "tests.holder", alias, str(liveness), lock_id]
        if limit is not None:
            command.append(str(limit))
        if host is not None:
            rename = f'hostname {host} && exec "$@"'
            command = ["unshare", "--uts", "sh", "-c", rename, "-", *command]
        self.process = subprocess.Popen(
            command,
            cwd=Path(__file__).resolve().parent.parent,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={
                **os.environ,
                "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
            },
        )
        line = self.read()
        assert line.startswith("held "), line
        _, self.token, fence = line.split()
        self.fence = int(fence)

    def read(self) -> str:
        assert self.process.stdout is not None
        return self.process.stdout.readline().strip()

    def ask(self, command: str) -> str:
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self.read()

    def kill(self, *, reap: bool = True) -> float:
        self.process.kill()
        killed = time.monotonic()
        if reap:
            self.process.wait()
        return killed

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                stream.close()
