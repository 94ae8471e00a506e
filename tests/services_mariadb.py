"""A MariaDB server of the tests' own, on a free loopback port (Debian's
``mariadb-server``): the data of the fenced-write tests on MySQL's dialect."""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.services import free_port, wait_for_closed, wait_for_port

DATABASE = "tasklock"


@dataclass
class MariaDB:
    """``mariadb-install-db`` into a directory of its own, then ``mariadbd``
    on ``port`` with no grant tables (a test server: every login is let in)."""

    port: int = 0
    process: subprocess.Popen[bytes] | None = None

    def __post_init__(self) -> None:
        self.port = self.port or free_port()
        self.root = Path(tempfile.mkdtemp(prefix="tasklock-mariadb-"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        # Its own temporary directory: bootstraps running at once in /tmp
        # (one per test worker) remove each other's temporary tables.
        self.tmp = self.root / "tmp"
        self.tmp.mkdir()

    def database_settings(self) -> dict[str, Any]:
        return {
            "ENGINE": "django.db.backends.mysql",
            "NAME": DATABASE,
            "USER": "root",
            "HOST": "127.0.0.1",
            "PORT": str(self.port),
            "TEST": {"NAME": f"test_{DATABASE}"},
        }

    def start(self) -> MariaDB:
        if not self.data.exists():
            made = subprocess.run(
                [
                    "mariadb-install-db",
                    "--no-defaults",
                    f"--datadir={self.data}",
                    f"--tmpdir={self.tmp}",
                    "--user=root",
                    "--skip-test-db",
                    "--auth-root-authentication-method=normal",
                ],
                capture_output=True,
                check=False,
            )
            if made.returncode:
                raise RuntimeError(
                    f"mariadb-install-db failed ({made.returncode}): "
                    f"{made.stdout.decode()} {made.stderr.decode()}"
                )
        args = [
            "mariadbd",
            "--no-defaults",
            f"--datadir={self.data}",
            f"--tmpdir={self.tmp}",
            "--user=root",
            f"--port={self.port}",
            "--bind-address=127.0.0.1",
            f"--socket={self.root / 'mariadb.sock'}",
            "--skip-grant-tables",
            "--skip-name-resolve",
            "--innodb-flush-log-at-trx-commit=0",
        ]
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                args, stdout=log, stderr=log, start_new_session=True
            )
        wait_for_port(self.port, timeout=60, process=self.process)
        deadline = time.monotonic() + 30
        while True:  # the port opens a moment before the server takes logins
            made = subprocess.run(
                [
                    "mariadb",
                    "--no-defaults",
                    "-h",
                    "127.0.0.1",
                    "-P",
                    str(self.port),
                    "-u",
                    "root",
                    "-e",
                    f"CREATE DATABASE IF NOT EXISTS {DATABASE}",
                ],
                capture_output=True,
            )
            if made.returncode == 0:
                return self
            if time.monotonic() > deadline:
                raise RuntimeError(made.stderr.decode())
            time.sleep(0.1)

    def remove(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=60)
        self.process = None
        wait_for_closed(self.port)
        shutil.rmtree(self.root, ignore_errors=True)
