"""Fault case 54: robbed holders' late writes, refused by the database.

Holder processes (``tests.fenced_writer``) take a lock each and write a row
through a fenced update, then are stopped (SIGSTOP) while their locks are
taken from them: by their expiry, a ``flush_all`` or a store restart with no
grace. A new holder takes each lock and writes the row; the stopped holder is
continued and writes again, with the fence from the holder in reach and with
the fence it drew, given by hand. Each late write must be refused (by the
database, or by the holder's own clock first), and the new holder's data kept.
``tests/fenced/test_robbed_holders.py`` runs the same trials on more stores.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

from reliability.faults import Row

if TYPE_CHECKING:
    from collections.abc import Callable

#: Each round robs this many holders in each database at once (one expiry's
#: wait for them all).
LANES = 5
#: The lock id every writer's lanes start with (then the database, the lane).
LOCK = "robbed-writer"


class Writer:
    """``tests.fenced_writer`` in a process of its own, writing to the
    database ``database`` names here."""

    def __init__(
        self, alias: str, database: str, expire: float, env: dict[str, str]
    ) -> None:
        from django.db import connections

        data = {
            key: value
            for key, value in connections[database].settings_dict.items()
            if key in ("ENGINE", "NAME", "USER", "HOST", "PORT", "OPTIONS")
        }
        env = {
            **os.environ,
            **env,
            "TASKLOCK_TEST_EXTRA_DATABASES": json.dumps({"fenced_data": data}),
        }
        self.errors = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed in stop)
        command = [sys.executable, "-m", "tests.fenced_writer", alias, "fenced_data"]
        self.process = subprocess.Popen(
            [*command, f"{LOCK}-{database}", str(expire)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.errors,
            text=True,
            env=env,
        )

    def ask(self, command: str, timeout: float = 60) -> list[str]:
        assert self.process.stdin is not None
        assert self.process.stdout is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        reply = self.process.stdout.readline().split() if ready else []
        if not reply:
            self.errors.seek(0)
            raise AssertionError(
                f"no answer to {command!r} in {timeout} s: {self.errors.read()}"
            )
        return reply

    def signal(self, sig: int) -> None:
        self.process.send_signal(sig)

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout, self.errors):
            if stream is not None:
                stream.close()


def trials(
    alias: str,
    databases: list[str],
    rob: Callable[[], None],
    expire: float,
    rounds: int,
    env: dict[str, str] | None = None,
) -> tuple[Counter[str], int]:
    """``rounds`` rounds of ``LANES`` holders in each of ``databases`` robbed
    by ``rob`` (called with them stopped). What each robbed holder's two late
    writes met, counted; and how many new holders' rows were overwritten."""
    from django.conf import settings

    from tests.fenced.models import Register

    settings.TASKLOCK = {"CACHE": alias, "LIVENESS": None, "RESTART_GRACE": 0}
    met: Counter[str] = Counter()
    overwritten = 0
    writers = {db: Writer(alias, db, expire, env or {}) for db in databases}
    lanes = [(db, lane) for db in databases for lane in range(LANES)]
    try:
        for _round in range(rounds):
            old = {}
            for db, lane in lanes:
                Register.objects.using(db).get_or_create(name=f"robbed-{lane}")
                reply = writers[db].ask(f"take {lane}")
                assert reply[0] == "wrote", reply
                old[db, lane] = int(reply[1])
            new = _robbed(writers, rob, lanes)
            for db, lane in lanes:
                fence = new[db, lane].held_fence()
                assert fence > old[db, lane], (fence, old[db, lane])
                reply = writers[db].ask(f"again {lane}")
                assert reply[0] == "again", reply
                met.update(
                    f"{how} ({'context' if i == 0 else 'by hand'})"
                    for i, how in enumerate(reply[1:])
                )
                row = Register.objects.using(db).get(name=f"robbed-{lane}")
                overwritten += (row.value, row.fence) != (fence, fence)
                new[db, lane].release()
                assert writers[db].ask(f"forget {lane}") == ["forgot"]
    finally:
        for writer in writers.values():
            writer.stop()
    return met, overwritten


def _robbed(
    writers: dict[str, Writer], rob: Callable[[], None], lanes: list[tuple[str, int]]
) -> dict[tuple[str, int], Any]:
    """Stop the holders, rob them, and take and write every lane's row anew."""
    from django_tasklock import Lock
    from django_tasklock.fenced import fenced_by
    from tests.fenced.models import Register

    new = {}
    for writer in writers.values():
        writer.signal(signal.SIGSTOP)
    try:
        rob()
        for db, lane in lanes:
            lock = new[db, lane] = Lock(f"{LOCK}-{db}-{lane}", expire=60, renew=False)
            assert lock.acquire(blocking=True, timeout=30)
            with fenced_by(lock):
                rows = Register.objects.using(db).filter(name=f"robbed-{lane}")
                assert rows.fenced_update(value=lock.held_fence()) == 1
    finally:
        for writer in writers.values():
            writer.signal(signal.SIGCONT)
    return new


def expired(alias: str, databases: list[str], expire: float) -> Callable[[], None]:
    """Wait, with the holders stopped, until their locks are gone from the store."""
    from django_tasklock import Lock

    def rob() -> None:
        locks = [
            Lock(f"{LOCK}-{db}-{lane}", cache=alias)
            for db in databases
            for lane in range(LANES)
        ]
        deadline = time.monotonic() + expire + 10
        while any(lock.locked() for lock in locks):
            assert time.monotonic() < deadline, "a lock never expired"
            time.sleep(0.05)

    return rob


def robbed_writes(quick: bool) -> Row:
    """54. Holders stopped past their expiry and holders whose locks were
    flushed, on memcached, with SQLite and PostgreSQL data: every late write
    refused, every new holder's row kept."""
    from django.core.cache import caches

    databases = ["sqlite_file", "pg"]
    rounds = 1 if quick else 5
    by_expiry, lost_rows = trials(
        "default", databases, expired("default", databases, 3), 3, rounds
    )
    by_flush, flushed_rows = trials(
        "default", databases, caches["default"].clear, 600, rounds
    )
    attempts = 2 * rounds * LANES * len(databases)
    late = by_expiry + by_flush
    refused = late["refused (by hand)"] + late["refused (context)"]
    knew = late["lost (context)"]
    applied = late["applied (by hand)"] + late["applied (context)"]
    row = Row(
        "54. robbed holders' late fenced writes",
        attempts,
        attempts,  # each a second holder while the first ran, on purpose
        applied + lost_rows + flushed_rows,
        by_design=True,
    )
    row.figures.append(
        f"late writes refused {refused + knew}/{2 * attempts} ({refused} by the "
        f"database, {knew} by the holder's own clock first); the new holder's row "
        f"kept {attempts - lost_rows - flushed_rows}/{attempts} (half past their "
        "expiry, half flushed; SQLite and PostgreSQL data)"
    )
    return row


def run(quick: bool) -> list[Row]:
    from django.conf import settings
    from django.db import connections

    from tests.fenced.models import Register, RegisterWrite
    from tests.services_pg import Postgres

    server = Postgres().start()
    directory = tempfile.mkdtemp(prefix="tasklock-fenced-")
    try:
        settings.DATABASES["pg"]["PORT"] = str(server.port)
        settings.DATABASES["sqlite_file"]["NAME"] = os.path.join(directory, "data.db")
        for alias in ("sqlite_file", "pg"):
            connections[alias].close()
            with connections[alias].schema_editor() as editor:
                editor.create_model(Register)
                editor.create_model(RegisterWrite)
        return [robbed_writes(quick)]
    finally:
        for alias in ("sqlite_file", "pg"):
            connections[alias].close()
        server.remove()
