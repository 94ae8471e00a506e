"""One try at a lock from a process of its own, and what it judged of the holder.

    python -m tests.contender <alias> <liveness> <lock id>

Prints ``took <why>`` (and releases it) or ``refused <why>``, where why is what
``tasklock status`` says of the holder. Run under a /proc mounted ``hidepid=2``
and without the capabilities that see past it, it is a contender that cannot
look at other users' processes.
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> None:
    from tests.workers import setup_django

    setup_django()
    from django.conf import settings

    from django_tasklock import Lock
    from django_tasklock.status import lock_status

    alias, liveness, lock_id = argv
    settings.TASKLOCK = {"CACHE": alias, "LIVENESS": float(liveness)}
    owner = lock_status(lock_id, cache=alias).owner
    why = "" if owner is None else owner.why
    lock = Lock(lock_id, expire=30)
    if lock.acquire():
        print(f"took {why}", flush=True)
        lock.release()
    else:
        print(f"refused {why}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
