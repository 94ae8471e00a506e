"""Fault cases 15 and 16: a Semaphore under contention, and a semaphore whose
holders are killed and whose limit is lowered while they hold it."""

from __future__ import annotations

import os
import signal
import time
from typing import TYPE_CHECKING

from reliability.faults import Row, setup_django
from tests.processes import process_context
from tests.workers import beyond, hammer, most_at_once, semaphore_holder

if TYPE_CHECKING:
    from tests.services import Memcached

LIMIT = 3


def contention(memcached: Memcached, processes: int, minimum: int, limit: float) -> Row:
    """``processes`` processes hammer one semaphore of limit 3."""
    context = process_context()
    holds: list[tuple[float, float]] = []
    refused = 0
    with context.Pool(
        processes, initializer=setup_django, initargs=(memcached.address,)
    ) as pool:
        pool.map(time.sleep, [0.05] * processes * 4)  # every process up and set up
        # The limit counts the hammering, not the start-up (as in case 1): on a
        # busy machine the 16 processes took longer to start than a quick run's
        # limit, and the case made no attempt at all.
        started = time.monotonic()
        while len(holds) < minimum and time.monotonic() - started < limit:
            start_at = time.monotonic() + 1.0
            results = pool.starmap(
                hammer,
                [({"CACHE": "default"}, "fault-pool", start_at, 3.0, "lock", LIMIT)]
                * processes,
            )
            holds += [hold for process_holds, _ in results for hold in process_holds]
            refused += sum(count for _, count in results)
    peak = most_at_once(holds)
    row = Row(
        f"15. semaphore limit {LIMIT}, {processes} processes",
        attempts=len(holds) + refused,
        overlaps=beyond(holds, LIMIT),
        wrong=(peak != LIMIT) + (len(holds) < minimum),
    )
    row.figures.append(
        f"{len(holds)} acquisitions, {refused} refused; most at once {peak} "
        f"(limit {LIMIT}); overlaps: holds begun beyond the limit"
    )
    return row


def killed_and_lowered(memcached: Memcached, tries: int) -> Row:
    """Two renewing holders of a limit-3 semaphore, one SIGKILLed: only its slot
    frees. Then five holders of a limit-5 semaphore, the limit lowered to 2: no
    more than two run once the old holders above the new limit have finished."""
    from django_tasklock import Lock, Semaphore
    from django_tasklock.semaphores import slot_id

    context = process_context()
    attempts = overlapping = wrong = 0
    frees: list[float] = []
    for attempt in range(tries):
        attempts += 1
        name = f"fault-sem-kill-{attempt}"
        queue = context.Queue()
        tasklock = {"CACHE": "default"}
        holders = [
            context.Process(
                target=_holder, args=(memcached.address, tasklock, name, queue)
            )
            for _ in range(2)
        ]
        for holder in holders:
            holder.start()
        try:
            slot_of = dict(queue.get(timeout=60) for _ in holders)
            victim, survivor = holders
            os.kill(victim.pid, signal.SIGKILL)  # type: ignore[arg-type]
            killed_at = time.monotonic()
            newcomers = []
            while True:
                newcomer = Semaphore(name, 3, expire=60)
                if newcomer.acquire():
                    newcomers.append(newcomer)
                    if newcomer.slot == slot_of[victim.pid]:
                        break
                if time.monotonic() - killed_at > 30:
                    raise AssertionError("the killed holder's slot never freed")
                time.sleep(0.02)
            frees.append(time.monotonic() - killed_at)
            # The survivor's slot is its own still; one more would be a fourth.
            wrong += not Lock(slot_id(name, slot_of[survivor.pid])).locked()
            overlapping += Semaphore(name, 3).acquire()
            for newcomer in newcomers:
                wrong += not newcomer.release()
        finally:
            for holder in holders:
                holder.kill()
                holder.join()
        old = [Semaphore(f"fault-sem-lower-{attempt}", 5) for _ in range(5)]
        assert all(holder.acquire() for holder in old)
        for holder in old:
            if holder.slot is not None and holder.slot >= 2:
                holder.release()
        overlapping += Semaphore(f"fault-sem-lower-{attempt}", 2).acquire()
        for holder in old:
            holder.release_quietly()
    row = Row(
        "16. semaphore: holder killed, limit lowered", attempts, overlapping, wrong
    )
    row.figures.append(
        f"killed holder's slot free {min(frees):.1f}-{max(frees):.1f}s after the "
        "kill (expire 3s, renewed); overlaps: a fourth holder of limit 3, or a third "
        "after the limit went down from 5 to 2"
    )
    return row


def _holder(
    memcached: str, tasklock: dict[str, object], name: str, queue: object
) -> None:
    setup_django(memcached)
    semaphore_holder(tasklock, name, 3, queue)


def run(main: Memcached, quick: bool) -> list[Row]:
    return [
        contention(main, 16, 300 if quick else 5_000, 30 if quick else 120),
        killed_and_lowered(main, 1 if quick else 3),
    ]
