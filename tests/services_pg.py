"""A private PostgreSQL cluster, and PgBouncer in front of it, for the tests.

Started on free loopback ports from Debian's ``postgresql`` and ``pgbouncer``
binaries (``make test`` installs them): the machine's own PostgreSQL on 5432 is
never used. As root, the servers run as the ``postgres`` user (``initdb``
refuses root).
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.services import free_port, wait_for_closed, wait_for_port

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ["PgBouncer", "Postgres", "lock_servers", "postgres_bin"]

USER = "tasklock"
DATABASE = "tasklock"
HINT = (
    "is not installed. Run the README's test command (make test), which installs "
    "it with apt-get, or install it yourself: apt-get install -y postgresql pgbouncer"
)


def postgres_bin(name: str) -> str:
    """The path of PostgreSQL's program ``name`` (Debian keeps them under
    /usr/lib/postgresql/<version>/bin, off PATH)."""
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    path = found[-1] if found else shutil.which(name)
    if path is None:
        raise RuntimeError(f"PostgreSQL's {name} {HINT}")
    return path


def _as_owner() -> dict[str, Any]:
    """Popen's arguments that run a server as ``postgres`` when we are root."""
    if os.geteuid() != 0:
        return {}
    return {"user": "postgres", "group": "postgres"}


def _own_dir(prefix: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix=prefix))
    if os.geteuid() == 0:
        entry = pwd.getpwnam("postgres")
        os.chown(path, entry.pw_uid, entry.pw_gid)
    return path


class _Process:
    """A server process of ours on ``port``, its files under ``root``."""

    port: int
    root: Path
    process: subprocess.Popen[bytes] | None

    def stop(self, sig: int = signal.SIGINT) -> None:
        """Stop it (SIGINT: a fast shutdown; SIGKILL: a crash)."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)
            self.process.wait(timeout=30)
        self.process = None
        wait_for_closed(self.port)

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


@dataclass
class Postgres(_Process):
    """One PostgreSQL cluster of our own: ``initdb`` once, then started and
    stopped on the same port; trust authentication on 127.0.0.1 only."""

    port: int = 0
    #: Extra ``-c name=value`` settings of the server.
    settings: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None

    def __post_init__(self) -> None:
        self.port = self.port or free_port()
        self.root = _own_dir("tasklock-pg-")
        self.data = self.root / "data"
        self.sockets = self.root / "sockets"
        self.log = self.root / "server.log"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def dsn(self, dbname: str = DATABASE) -> str:
        return f"host=127.0.0.1 port={self.port} user={USER} dbname={dbname}"

    def database_settings(self, port: int | None = None) -> dict[str, Any]:
        """A DATABASES entry for the ``tasklock`` database (through ``port``:
        PgBouncer's, say)."""
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": DATABASE,
            "USER": USER,
            "HOST": "127.0.0.1",
            "PORT": str(port or self.port),
        }

    def start(self) -> Postgres:
        if not (self.data / "PG_VERSION").exists():
            self._initdb()
        self.sockets.mkdir(exist_ok=True)
        if os.geteuid() == 0:
            shutil.chown(self.sockets, "postgres", "postgres")
        options = {
            "listen_addresses": "127.0.0.1",
            "port": str(self.port),
            "unix_socket_directories": str(self.sockets),
            # A test server: what it holds need not outlive the machine.
            "fsync": "off",
            "full_page_writes": "off",
            "max_connections": "300",
            **self.settings,
        }
        args = [postgres_bin("postgres"), "-D", str(self.data)]
        for name, value in options.items():
            args += ["-c", f"{name}={value}"]
        # Started again after a SIGKILL, it may find the old backends still
        # attached to its shared memory for a moment, and exit: tried again.
        deadline = time.monotonic() + 30
        while True:
            with self.log.open("ab") as log:
                self.process = subprocess.Popen(
                    args, stdout=log, stderr=log, start_new_session=True, **_as_owner()
                )
            try:
                wait_for_port(self.port, timeout=30, process=self.process)
                break
            except RuntimeError:
                if self.process.poll() is None or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        self._wait_ready()
        return self

    def _initdb(self) -> None:
        subprocess.run(
            [
                postgres_bin("initdb"),
                "-D",
                str(self.data),
                "-U",
                USER,
                "-A",
                "trust",
                "-E",
                "UTF8",
                "--no-sync",
                "--locale=C",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            **_as_owner(),
        )
        self._first_start = True

    def _wait_ready(self, timeout: float = 30) -> None:
        import psycopg

        deadline = time.monotonic() + timeout
        while True:
            try:
                with psycopg.connect(
                    self.dsn("postgres"), autocommit=True, connect_timeout=2
                ) as conn:
                    if getattr(self, "_first_start", False):
                        conn.execute(f"CREATE DATABASE {DATABASE}")
                        self._first_start = False
                    return
            except psycopg.OperationalError:
                if self.process is not None and self.process.poll() is not None:
                    raise RuntimeError(
                        f"PostgreSQL on {self.address} exited; its log: "
                        f"{self.log.read_text()[-2000:]}"
                    ) from None
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def execute(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        """Run ``sql`` in the ``tasklock`` database; its rows (if any)."""
        import psycopg

        with psycopg.connect(self.dsn(), autocommit=True, connect_timeout=5) as conn:
            cursor = conn.execute(sql, params)
            return cursor.fetchall() if cursor.description else []

    def clear(self) -> None:
        """Empty the lock table (every lock, record and item of the aliases
        ``postgres`` and ``pgbouncer``)."""
        from django_tasklock.backends.postgres.statements import RUN_KEY, TABLE

        self.execute(f"DELETE FROM {TABLE} WHERE key <> '{RUN_KEY}'")

    def restart(self) -> None:
        self.stop()
        self.start()

    def standby(self) -> Postgres:
        """A streaming standby of this server (``pg_basebackup -R``), started
        on a port of its own."""
        replica = Postgres()
        subprocess.run(
            [
                postgres_bin("pg_basebackup"),
                *("-h", "127.0.0.1", "-p", str(self.port), "-U", USER),
                *("-D", str(replica.data), "-R", "-X", "stream", "--no-sync"),
                *("--checkpoint", "fast"),
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            **_as_owner(),
        )
        return replica.start()

    def _processes(self) -> list[int]:
        """The server's pid, then its children's (each backend is a process
        group of its own: PostgreSQL's children call setsid)."""
        assert self.process is not None
        pid = self.process.pid
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        return [pid, *map(int, children)]

    def freeze(self) -> None:
        """Stop every process of the server where it is (SIGSTOP): a frozen VM."""
        self._signal(signal.SIGSTOP)

    def thaw(self) -> None:
        self._signal(signal.SIGCONT)

    def _signal(self, sig: int) -> None:
        for pid in self._processes():
            # (A backend may end between the listing and its signal: the
            # postmaster, resumed first, reaps one whose client went away.)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)


@dataclass
class PgBouncer(_Process):
    """PgBouncer in transaction pooling mode in front of ``upstream``."""

    upstream: Postgres
    port: int = 0
    pool_size: int = 20
    process: subprocess.Popen[bytes] | None = None

    def __post_init__(self) -> None:
        self.port = self.port or free_port()
        self.root = _own_dir("tasklock-pgbouncer-")
        self.config = self.root / "pgbouncer.ini"
        self.users = self.root / "users.txt"
        self.users.write_text(f'"{USER}" ""\n')
        self._configure()

    def _configure(self) -> None:
        users = self.users
        self.config.write_text(
            "[databases]\n"
            f"* = host=127.0.0.1 port={self.upstream.port}\n"
            "[pgbouncer]\n"
            "listen_addr = 127.0.0.1\n"
            f"listen_port = {self.port}\n"
            f"unix_socket_dir = {self.root}\n"
            "auth_type = trust\n"
            f"auth_file = {users}\n"
            "pool_mode = transaction\n"
            f"default_pool_size = {self.pool_size}\n"
            "max_client_conn = 1000\n"
            "ignore_startup_parameters = extra_float_digits,options\n"
            f"logfile = {self.root / 'pgbouncer.log'}\n"
        )
        if os.geteuid() == 0:
            for path in (self.config, users):
                shutil.chown(path, "postgres", "postgres")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def point_at(self, upstream: Postgres) -> None:
        """Send new transactions to ``upstream`` (its configuration reloaded,
        SIGHUP): its clients keep their connections, as behind a failover
        manager that re-points the pooler."""
        assert self.process is not None
        self.upstream = upstream
        self._configure()
        before = self.log_size()
        self.process.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while b"re-reading config" not in self.log_since(before):
            if time.monotonic() > deadline:
                raise RuntimeError(f"pgbouncer did not reload: {self.log_since(0)!r}")
            time.sleep(0.05)

    def log_size(self) -> int:
        log = self.root / "pgbouncer.log"
        return log.stat().st_size if log.exists() else 0

    def log_since(self, offset: int) -> bytes:
        with open(self.root / "pgbouncer.log", "rb") as log:
            log.seek(offset)
            return log.read()

    def start(self) -> PgBouncer:
        binary = shutil.which("pgbouncer") or shutil.which(
            "pgbouncer", path="/usr/sbin"
        )
        if binary is None:
            raise RuntimeError(f"pgbouncer {HINT}")
        self.process = subprocess.Popen(
            [binary, str(self.config)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            **_as_owner(),
        )
        wait_for_port(self.port, timeout=30, process=self.process)
        return self


@contextlib.contextmanager
def lock_servers() -> Iterator[tuple[Postgres, PgBouncer]]:
    """A private PostgreSQL, its lock table made, and a PgBouncer in front of
    it, named to this process and its children by TASKLOCK_TEST_POSTGRES and
    TASKLOCK_TEST_PGBOUNCER (the ports tests/settings.py's ``pg`` and
    ``pgbouncer`` databases read); both removed after."""
    from django_tasklock.backends.postgres.statements import CREATE

    database = Postgres().start()
    bouncer = PgBouncer(database).start()
    try:
        database.execute(CREATE)
        os.environ["TASKLOCK_TEST_POSTGRES"] = str(database.port)
        os.environ["TASKLOCK_TEST_PGBOUNCER"] = str(bouncer.port)
        yield database, bouncer
    finally:
        bouncer.remove()
        database.remove()
