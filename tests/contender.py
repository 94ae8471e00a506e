"""Tries at a lock from a process of its own, and what it judged of the holder.

    python -m tests.contender <alias> <liveness> <lock id> [<seconds>]

Tries once, or for ``seconds`` (every 0.1 s, each take released at once), and
prints ``<tries> <takes> <why>``, where why is what ``tasklock status`` says of
the holder. Run under a /proc mounted ``hidepid=2`` and without the
capabilities that see past it, it is a contender that cannot look at other
users' processes.
"""

from __future__ import annotations

import sys
import time


def main(argv: list[str]) -> None:
    from tests.workers import setup_django

    setup_django()
    from django.conf import settings

    from django_tasklock import Lock
    from django_tasklock.status import lock_status

    alias, liveness, lock_id = argv[:3]
    seconds = float(argv[3]) if len(argv) > 3 else 0.0
    settings.TASKLOCK = {"CACHE": alias, "LIVENESS": float(liveness)}
    owner = lock_status(lock_id, cache=alias).owner
    why = "" if owner is None else owner.why
    tries = takes = 0
    until = time.monotonic() + seconds
    while True:
        lock = Lock(lock_id, expire=30)
        tries += 1
        if lock.acquire():
            takes += 1
            lock.release()
        if time.monotonic() >= until:
            break
        time.sleep(0.1)
    print(f"{tries} {takes} {why}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
