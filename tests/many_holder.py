"""A process that holds many locks, for the console's scale test.

    python -m tests.many_holder <alias> <count> <prefix>

Takes ``count`` locks ``<prefix>-lock-<n>`` (600 s, each named after a task
``scale.import_feed`` with argument ``n``), prints ``held <count>`` once it
holds them all, then waits for a line on stdin and exits (releasing them).
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> None:
    from tests.workers import setup_django

    setup_django()
    from django.conf import settings

    from django_tasklock import Lock

    alias, count, prefix = argv[0], int(argv[1]), argv[2]
    settings.TASKLOCK = {"CACHE": alias, "LIVENESS": 10}
    locks = []
    for n in range(count):
        lock = Lock(f"{prefix}-lock-{n}", expire=600)
        lock.about = ("scale.import_feed", (n,), {})
        assert lock.acquire(), n
        locks.append(lock)
    print(f"held {len(locks)}", flush=True)
    sys.stdin.readline()


if __name__ == "__main__":
    main(sys.argv[1:])
