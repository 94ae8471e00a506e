"""Fault case 17: a memcached node of a pool SIGKILLed and restarted empty while
holders still run, and a fresh process (one that never saw the node) taking the
same ids."""

from __future__ import annotations

import time

from reliability.faults import Row, setup_django
from tests.processes import process_context
from tests.services import Memcached
from tests.workers import hold_and_restart_busiest, take_until_all

MEMCACHED = "django.core.cache.backends.memcached.PyMemcacheCache"
EXPIRE = 4


def node_restarted(main: Memcached, tries: int, ids: int = 75) -> Row:
    """Per try: three fresh nodes; this process takes ``ids`` ids (expire 4 s);
    the node with the most is SIGKILLed and restarted empty; a fresh process
    takes every id as soon as it can. Overlaps: ids it took while their first
    holder's lock was still valid."""
    from django.conf import settings
    from django.test import override_settings

    attempts = overlapping = wrong = 0
    waits: list[float] = []
    context = process_context()
    for n in range(tries):
        servers = [Memcached().start() for _ in range(3)]
        caches_setting = {
            **settings.CACHES,
            "pool": {"BACKEND": MEMCACHED, "LOCATION": [s.address for s in servers]},
        }
        tasklock = {"CACHE": "pool", "LOCK_EXPIRE": EXPIRE}
        names = [f"fault-node-{n}-{i}" for i in range(ids)]
        try:
            with override_settings(CACHES=caches_setting, TASKLOCK=tasklock):
                from django_tasklock.conf import settings as tasklock_settings

                grace = tasklock_settings.RESTART_GRACE
                _locks, valid_until, on_victim = hold_and_restart_busiest(
                    servers, "pool", names
                )
                restarted = time.monotonic()
                with context.Pool(
                    1, initializer=setup_django, initargs=(main.address,)
                ) as pool:
                    result = pool.apply(
                        take_until_all,
                        (caches_setting, tasklock, names, grace + EXPIRE + 6),
                    )
                taken: dict[str, float] = result["taken"]  # type: ignore[assignment]
                attempts += len(on_victim)
                overlapping += sum(
                    taken[name] < valid_until[name]
                    for name in on_victim
                    if name in taken
                )
                wrong += len(set(names) - set(taken))  # never taken once free
                if any(name in taken for name in on_victim):
                    waits.append(min(taken[name] for name in on_victim) - restarted)
                # Not released: every lock has expired or gone with its node by
                # now (each release would only report that), and the servers go.
        finally:
            from django_tasklock.backends import close_thread_connections

            close_thread_connections()
            for server in servers:
                server.stop()
    # New locks on the restarted node are refused for the grace (LIVENESS
    # with liveness records, as here; LOCK_EXPIRE without): taken a second sooner,
    # and the old holders' locks may still be valid.
    wrong += sum(wait < min(grace, EXPIRE) - 1 for wait in waits)
    row = Row(
        f"17. pool node restarted empty (grace {grace:.0f}s)",
        attempts,
        overlapping,
        wrong,
    )
    longest = f"{max(waits):.1f}" if waits else "-"
    row.figures.append(
        f"second holders {overlapping}/{attempts} ids of the restarted node; new "
        f"locks on it waited {min(waits, default=0):.1f}-{longest} s"
    )
    return row


def run(main: Memcached, quick: bool) -> list[Row]:
    return [node_restarted(main, 1 if quick else 3)]
