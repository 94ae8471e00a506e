"""A process that takes locks and holds them until it is killed or told to stop.

    python -m tests.holder <alias> <liveness or "none"> <lock id> [<semaphore limit>]

Prints ``held <token> <fence>`` once it holds, then waits for a line on stdin:
``check`` prints ``check <True|False> <lost>``; ``told`` prints ``told <during: reason>`` of
each ``lock_lost`` it was sent (``-``: none); ``stall`` prints ``stall
<seconds>``, the longest this process stood still (a tick thread's longest
gap past its 0.1 s: starved of CPU, or stopped); ``record`` prints
what its liveness record's keeper knows (beats, seconds it is still sure,
locks it vouches for); ``release`` releases and prints
``released <True|False>``, then exits; ``exit`` exits holding it. Run under
``unshare --uts`` it is a holder on another host (a hostname of its own, same
loopback stores).
"""

from __future__ import annotations

import sys
import threading
import time


def main(argv: list[str]) -> None:
    from tests.workers import setup_django

    setup_django()
    from django.conf import settings

    from django_tasklock import Lock, Semaphore

    stalled = [0.0]

    def tick() -> None:
        last = time.monotonic()
        while True:
            time.sleep(0.1)
            now = time.monotonic()
            stalled[0] = max(stalled[0], now - last - 0.1)
            last = now

    threading.Thread(target=tick, daemon=True).start()
    from django_tasklock.signals import lock_lost

    told: list[str] = []

    def on_lost(during: str = "", reason: str = "", **_: object) -> None:
        told.append(f"{during}: {reason}")

    lock_lost.connect(on_lost, weak=False)
    alias, liveness, lock_id, *rest = argv
    settings.TASKLOCK = {
        "CACHE": alias,
        "LIVENESS": None if liveness == "none" else float(liveness),
    }
    holder: Lock | Semaphore = (
        Semaphore(lock_id, int(rest[0]), expire=600)
        if rest
        else Lock(lock_id, expire=600)
    )
    if not holder.acquire():
        print("refused", flush=True)
        return
    lock = holder if isinstance(holder, Lock) else holder.lock
    assert lock is not None
    print(f"held {lock.token} {lock.fence}", flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "check":
            print(f"check {lock.check()} {lock.lost}", flush=True)
        elif command == "told":  # what found the lock lost, and what it found
            print(f"told {' | '.join(told) or '-'}", flush=True)
        elif command == "stall":
            print(f"stall {stalled[0]:.3f}", flush=True)
        elif command == "record":  # what its liveness record's keeper knows
            acq = lock._acq
            record = None if acq is None else acq.record
            if record is None:
                print("record none", flush=True)
            else:
                sure_until, lapsed_at = record.kept_for(acq.key)
                print(
                    f"record beats={record.beats} "
                    f"valid_for={sure_until - time.monotonic():.2f} "
                    f"held={len(record.held)} lapsed_at={lapsed_at:.2f}"
                    f"{beside_now(acq)}",
                    flush=True,
                )
        elif command == "fence":
            print(f"fence {lock.fence}", flush=True)
        elif command == "exit":  # leave without releasing: the way out does
            sys.exit(0)
        elif command == "release":
            print(f"released {holder.release()}", flush=True)
            return


def beside_now(acq: object) -> str:
    """On a cluster, the record beside the lock as this process reads it now
    (its key and time to live, ms), for a failure message; else nothing."""
    backend = getattr(acq, "backend", None)
    if getattr(backend, "records_beside", None) is None:
        return ""
    key = acq.key  # type: ignore[attr-defined]
    record_key = backend._record_key(key)  # type: ignore[union-attr]
    try:
        pttl = backend._redis(record_key).pttl(record_key)  # type: ignore[union-attr]
    except Exception as exc:  # a failure message's evidence, never a failure
        pttl = f"{type(exc).__name__}: {exc}"
    return f" beside={record_key} pttl={pttl}"


if __name__ == "__main__":
    main(sys.argv[1:])
