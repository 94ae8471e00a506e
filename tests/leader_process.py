"""A process that asks for a leadership and reports what it gets.

    python -m tests.leader_process <alias> <liveness> <name>

Prints ``gained <fence> <unix time>`` when it becomes leader and ``lost <unix
time>`` when it stops being leader (its on_gain and on_loss), ``standing by``
once it started. A line ``is_leader`` on stdin prints ``is_leader
<True|False>``; ``stop`` gives the role up and exits. Run under ``unshare
--uts`` it is a process on another host.
"""

from __future__ import annotations

import sys
import time


def main(argv: list[str]) -> None:
    from tests.workers import setup_django

    setup_django()
    from django.conf import settings

    from django_tasklock import Leadership

    alias, liveness, name = argv
    settings.TASKLOCK = {"CACHE": alias, "LIVENESS": float(liveness)}

    def gained(leadership: Leadership) -> None:
        print(f"gained {leadership.fence} {time.time():.3f}", flush=True)

    def lost(leadership: Leadership) -> None:
        print(f"lost {time.time():.3f}", flush=True)

    leadership = Leadership(name, poll=0.2, expire=60, on_gain=gained, on_loss=lost)
    leadership.start()
    print("standing by", flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "is_leader":
            print(f"is_leader {leadership.is_leader}", flush=True)
        elif command == "stop":
            leadership.stop()
            print("stopped", flush=True)
            return


if __name__ == "__main__":
    main(sys.argv[1:])
