"""One client of the fault checker (``reliability.checker``): a process, on a
host of its own when run under ``unshare --uts``, that takes, holds, checks
and releases locks on a few ids until its time is up, and writes every hold
to the witness file, outside the store.

    TASKLOCK_CHECKER='{...}' python -m reliability.checker_client

Each hold is two lines, appended under ``flock``: ``start`` when ``acquire()``
returned True (with the token and, when it could be drawn, the fence), and
``end`` with the last moment the holder still believed it held (the time just
before its last ``check()`` that said True) and whether its release found the
lock its own. A holder killed mid-hold leaves only its ``start``: it believed
then, and nothing after is known.
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

    settings.TASKLOCK = {"CACHE": config["alias"], **config["tasklock"]}
    chance = random.Random(config["seed"])
    client = config["client"]
    path = config["witness"]
    _log_to(str(Path(path).with_name(f"{client}.log")))
    deadline = time.monotonic() + config["seconds"]
    while time.monotonic() < deadline:
        lock_id = chance.choice(config["ids"])
        lock = Lock(
            lock_id,
            expire=chance.choice([3, 4, 6, 8]),
            renew=chance.random() < 0.5,
        )
        try:
            taken = lock.acquire()
        except LockBackendError:
            time.sleep(chance.uniform(0.05, 0.3))
            continue
        if not taken:
            time.sleep(chance.uniform(0.01, 0.1))
            continue
        start = time.monotonic()
        token = lock.token
        witness(
            path,
            {
                "e": "start",
                "c": client,
                "id": lock_id,
                "t": start,
                "tok": token,
                "vu": _valid_until(lock),
            },
        )
        fence = None
        if chance.random() < 0.5:
            try:
                fence = lock.fence
            except LockBackendError:
                fence = None
        last = start
        hold_for = chance.uniform(0.1, 6)
        while True:
            now = time.monotonic()
            if not lock.check():
                break
            last = now
            if now - start >= hold_for:
                break
            time.sleep(chance.uniform(0.02, 0.3))
        try:
            released: bool | None = lock.release()
        except LockBackendError:
            released = None
        ended = {"e": "end", "tok": token, "last": last, "released": released}
        witness(path, {**ended, "f": fence, "end": time.monotonic()})


def _valid_until(lock: Any) -> float | None:
    """When the holder's clock says its lock's sure life ends (monotonic)."""
    acquisition = getattr(lock, "acquisition", None)
    return getattr(acquisition, "valid_until", None)


if __name__ == "__main__":
    sys.exit(main())
