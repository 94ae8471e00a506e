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
import threading
import time

_said = threading.Lock()


def say(line: str) -> None:
    """Print ``line`` whole: on_loss runs on the leadership's thread, and two
    threads' prints may interleave (``print`` writes the text and the newline
    apart)."""
    with _said:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def main(argv: list[str]) -> None:
    from tests.workers import setup_django

    setup_django()
    from django.conf import settings

    from django_tasklock import Leadership

    alias, liveness, name = argv
    settings.TASKLOCK = {"CACHE": alias, "LIVENESS": float(liveness)}

    def gained(leadership: Leadership) -> None:
        say(f"gained {leadership.fence} {time.time():.3f}")

    def lost(leadership: Leadership) -> None:
        say(f"lost {time.time():.3f}")

    leadership = Leadership(name, poll=0.2, expire=60, on_gain=gained, on_loss=lost)
    leadership.start()
    say("standing by")
    for line in sys.stdin:
        command = line.strip()
        if command == "is_leader":
            say(f"is_leader {leadership.is_leader}")
        elif command == "stop":
            leadership.stop()
            say("stopped")
            return


if __name__ == "__main__":
    main(sys.argv[1:])
