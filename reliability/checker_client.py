"""One client of the fault checker (``reliability.checker``): a process, on a
host of its own when run under ``unshare --uts``, that takes, holds, checks
and releases locks on a few ids until its time is up, and writes every hold
to the witness file, outside the store.

    TASKLOCK_CHECKER='{...}' python -m reliability.checker_client

Each hold is two lines, appended under ``flock``: ``start`` when ``acquire()``
returned True (with the token, whether it waited for it, blocking, and,
when it could be drawn, the fence), and
``end`` with the last moment the holder still believed it held (the time just
before its last ``check()`` that said True) and whether its release found the
lock its own. A holder killed mid-hold leaves only its ``start``: it believed
then, and nothing after is known.

Every hold whose fence could be drawn also writes the fenced register (a row
per lock id in a SQLite file, ``tests.fenced.models.Register``) through
``fenced_update_or_create`` with that fence, given by hand as by a holder
that never checks: now and then while it holds, and once more after it stops
believing, just before its release. Each write that the database took is
appended to the register's history in the same transaction; the ``end`` line
counts the writes taken, refused (``StaleFence``) and failed.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import random
import sys
import time
from pathlib import Path
from typing import Any


def witness(path: str, record: dict[str, Any]) -> None:
    line = json.dumps(record, separators=(",", ":")) + "\n"
    with open(path, "a", encoding="utf-8") as file:
        fcntl.flock(file, fcntl.LOCK_EX)
        try:
            file.write(line)
            file.flush()
        finally:
            fcntl.flock(file, fcntl.LOCK_UN)


def _log_to(path: str) -> None:
    """The package's log, INFO and up, to ``path``, each line stamped with
    ``time.monotonic()`` (the witness's clock): what a violation's holders
    were told and did."""

    class Monotonic(logging.Formatter):
        def format(self, record: logging.LogRecord) -> str:
            return f"{time.monotonic():.3f} {super().format(record)}"

    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(Monotonic("%(levelname)s %(name)s %(message)s"))
    package = logging.getLogger("django_tasklock")
    package.addHandler(handler)
    package.setLevel(logging.INFO)


def main() -> None:
    config = json.loads(os.environ["TASKLOCK_CHECKER"])
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    import django

    django.setup()
    from django.conf import settings

    from django_tasklock import Lock, LockBackendError
    from reliability.checker_calls import Calls

    settings.TASKLOCK = {"CACHE": config["alias"], **config["tasklock"]}
    _register_tables(config["witness"])
    chance = random.Random(config["seed"])
    client = config["client"]
    path = config["witness"]
    _log_to(str(Path(path).with_name(f"{client}.log")))
    deadline = time.monotonic() + config["seconds"]
    calls = Calls(config, chance, lambda lock, call: _hold(lock, config, chance, call))
    if config.get("drain"):
        calls.drain(deadline)
        return
    while time.monotonic() < deadline:
        lock_id = chance.choice(config["ids"])
        # Some steps are parked calls' (``on_contention="park"``'s line):
        # called, delivered, parked, promoted and run, their runs holds as any.
        if chance.random() < config.get("calls", 0.0):
            calls.step(lock_id)
            continue
        lock = Lock(
            lock_id,
            expire=chance.choice([3, 4, 6, 8]),
            renew=chance.random() < 0.5,
        )
        # Some wait (in the lock's line, on a store that keeps one), up to a
        # timeout: a waiter woken into an overlap is a violation as any.
        blocking = chance.random() < 0.4
        timeout = chance.uniform(0.2, 3) if blocking else None
        try:
            taken = lock.acquire(blocking=blocking, timeout=timeout)
        except LockBackendError:
            time.sleep(chance.uniform(0.05, 0.3))
            continue
        if not taken:
            time.sleep(chance.uniform(0.01, 0.1))
            continue
        _hold(lock, config, chance, None, blocking)


def _hold(
    lock: Any,
    config: dict[str, Any],
    chance: random.Random,
    call: str | None,
    blocking: bool = False,
) -> None:
    """Hold ``lock`` (taken) for a while, checking it, writing the register
    with its fence now and then, and release it; its ``start`` and ``end``
    in the witness (``call``: the parked call this hold runs, if any)."""
    from django_tasklock import LockBackendError

    client, path, lock_id = config["client"], config["witness"], lock.lock_id
    start = time.monotonic()
    token = lock.token
    record = {"e": "start", "c": client, "id": lock_id, "t": start, "tok": token}
    record.update(vu=_valid_until(lock), wt=blocking)
    witness(path, {**record, "call": call} if call else record)
    fence = None
    if chance.random() < 0.7:
        try:
            fence = lock.fence
        except LockBackendError:
            fence = None
    writes = {"applied": 0, "refused": 0, "failed": 0}
    last = start
    hold_for = chance.uniform(0.1, 6)
    while True:
        now = time.monotonic()
        if not lock.check():
            break
        last = now
        if now - start >= hold_for:
            break
        if fence is not None and chance.random() < 0.3:
            writes[_write(lock_id, fence, client)] += 1
        time.sleep(chance.uniform(0.02, 0.3))
    if fence is not None:  # believed or not: the database judges
        writes[_write(lock_id, fence, client)] += 1
    try:
        released: bool | None = lock.release()
    except LockBackendError:
        released = None
    ended = {"e": "end", "tok": token, "last": last, "released": released}
    witness(path, {**ended, "f": fence, "end": time.monotonic(), "w": writes})


def _register_tables(witness_path: str) -> None:
    """The register's tables, made by the first client (under a file lock)."""
    from django.db import connections

    from tests.fenced.models import Register, RegisterWrite

    connection = connections["register"]
    with open(Path(witness_path).with_name("register.lock"), "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        if Register._meta.db_table not in connection.introspection.table_names():
            with connection.schema_editor() as editor:
                editor.create_model(Register)
                editor.create_model(RegisterWrite)


def _write(lock_id: str, fence: int, client: str) -> str:
    """One fenced write of the register ``lock_id``: applied, refused, failed."""
    from django.db import DatabaseError, transaction

    from django_tasklock import StaleFence
    from tests.fenced.models import Register, RegisterWrite

    try:
        with transaction.atomic(using="register"):
            Register.objects.using("register").fenced_update_or_create(  # type: ignore[attr-defined]
                name=lock_id, defaults={"note": client}, fence=fence
            )
            RegisterWrite.objects.using("register").create(
                register=lock_id, fence=fence, client=client
            )
    except StaleFence:
        return "refused"
    except DatabaseError:
        return "failed"
    return "applied"


def _valid_until(lock: Any) -> float | None:
    """When the holder's clock says its lock's sure life ends (monotonic)."""
    acquisition = getattr(lock, "acquisition", None)
    return getattr(acquisition, "valid_until", None)


if __name__ == "__main__":
    sys.exit(main())
