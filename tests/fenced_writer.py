"""A holder that writes one row through a fenced update, for the tests of
robbed holders (tests/fenced/test_robbed_holders.py).

    python -m tests.fenced_writer <cache alias> <database alias> <lock id> <expire>

Reads commands on stdin, one a line, each for a lane ``n``: its own lock
(``<lock id>-n``) and row (``robbed-n``):

- ``take n``: takes the lock (no renewal, no liveness record) and writes the
  row with its fence in the lock's block; prints ``wrote <fence>``.
- ``again n``: writes the row twice more, as a holder that did not see its
  lock go: in the block (the fence from the holder in reach) and with the
  fence it drew, given by hand; prints ``again <first> <second>``, each
  ``refused`` (``StaleFence``: the database), ``lost`` (``LockLost``: the
  holder knew) or ``applied``.
- ``forget n``: drops the lock object without a release; prints ``forgot``.
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> None:
    from tests.workers import setup_django

    setup_django()
    from django.conf import settings

    from django_tasklock import Lock, LockLost, StaleFence
    from django_tasklock.fenced import fenced_by
    from tests.fenced.models import Register

    alias, database, lock_id, expire = argv
    settings.TASKLOCK = {"CACHE": alias, "LIVENESS": None, "RESTART_GRACE": 0}
    locks: dict[str, Lock] = {}
    fences: dict[str, int] = {}
    # Connected to the data's database before any lock is taken: a lock of
    # 3 s is sure for 1 s on memcached, and a first connection on a machine
    # running the whole suite took longer (the first write found it lost).
    Register.objects.using(database).filter(name="").exists()

    def attempt(lane: str, **given: int) -> str:
        rows = Register.objects.using(database).filter(name=f"robbed-{lane}")
        try:
            rows.fenced_update(value=-fences[lane], **given)
        except StaleFence:
            return "refused"
        except LockLost:
            return "lost"
        return "applied"

    for line in sys.stdin:
        command, lane = line.split()
        if command == "take":
            lock = locks[lane] = Lock(
                f"{lock_id}-{lane}", expire=float(expire), renew=False
            )
            assert lock.acquire(blocking=True, timeout=30)
            with fenced_by(lock):
                fences[lane] = lock.held_fence()
                assert attempt(lane) == "applied"
            print(f"wrote {fences[lane]}", flush=True)
        elif command == "again":
            with fenced_by(locks[lane]):
                first = attempt(lane)
            print(f"again {first} {attempt(lane, fence=fences[lane])}", flush=True)
        elif command == "forget":
            del locks[lane], fences[lane]
            print("forgot", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
