"""A short demo of django_tasklock against a private memcached.

1. Many processes fight for one lock id; every hold's start and end are recorded
   and checked for overlaps.
2. The Celery cookbook recipe and django_tasklock go through the same accident
   (memcached flushed, then restarted, while a task holds its lock): the recipe's
   old holder deletes the new holder's lock; django_tasklock's does not.

Exits non-zero if any hold overlapped or django_tasklock lost the new holder's
lock. (The example project's feed importer replaces this demo.)
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from typing import TYPE_CHECKING

from tests.services import Memcached
from tests.workers import hammer, overlaps, setup_django

if TYPE_CHECKING:
    from collections.abc import Callable

PROCESSES = 8
SECONDS = 3.0


def say(message: str = "") -> None:
    print(message, flush=True)


def contention(memcached: Memcached) -> int:
    say(f"1. {PROCESSES} processes take and release one lock id for {SECONDS:.0f} s...")
    context = multiprocessing.get_context("spawn")
    with context.Pool(PROCESSES, initializer=setup_django) as pool:
        pool.map(time.sleep, [0.05] * PROCESSES * 4)  # every process up and set up
        start_at = time.monotonic() + 1.0
        results = pool.starmap(
            hammer,
            [({"CACHE": "default"}, "demo-lock", start_at, SECONDS, "lock")]
            * PROCESSES,
        )
    holds = [hold for process_holds, _ in results for hold in process_holds]
    refused = sum(count for _, count in results)
    overlapping = overlaps(holds)
    say(
        f"   holds: {len(holds)} ({len(holds) / SECONDS:.0f}/s), refused while held: {refused}"
    )
    say(f"   processes that held it: {sum(1 for h, _ in results if h)} of {PROCESSES}")
    say(
        f"   overlapping holds (measured from each hold's start and end): {overlapping}"
    )
    return overlapping


def as_another_worker(function):  # type: ignore[no-untyped-def]
    """Run ``function`` in a thread of its own: its own cache connection, as in
    another worker process."""
    from concurrent.futures import ThreadPoolExecutor

    from django.core.cache import close_caches

    def run():  # type: ignore[no-untyped-def]
        try:
            return function()
        finally:
            close_caches()

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(run).result()


def after_flush(memcached: Memcached) -> bool:
    """The recipe and django_tasklock when memcached loses a held key."""
    from django.core.cache import cache

    lock_id = "feeds.import_feed-lock-flushed"
    # The cookbook: cache.add to take, cache.delete to release.
    assert cache.add(lock_id, "true", 60)
    memcached.flush_all()
    assert as_another_worker(lambda: cache.add(lock_id, "true", 60))
    cache.delete(lock_id)  # the old holder finishes
    third = as_another_worker(lambda: cache.add(lock_id, "true", 60))
    say(
        "   cookbook recipe: the old holder's delete removed the new holder's lock; "
        f"a third worker {'ALSO GOT IN: two imports at once' if third else 'was refused'}"
    )
    cache.delete(lock_id)

    return stale_holder_spares_new_one(lock_id, memcached.flush_all)


def after_restart(memcached: Memcached) -> bool:
    """A restarted memcached comes back empty: new locks on it are refused for
    RESTART_GRACE seconds, since the old holders may still run. Without that
    grace, the owner check still keeps the old holder from releasing the new
    one's lock, although a restart resets the CAS ids."""
    from django.conf import settings
    from django.test import override_settings

    from django_tasklock import Lock, LockBackendError

    lock_id = "feeds.import_feed-lock-restarted"
    old = Lock(lock_id)
    assert old.acquire()
    memcached.restart()
    try:
        as_another_worker(Lock(lock_id).acquire)
        refused = False
        say("   django_tasklock: a new lock on the restarted memcached WAS GIVEN OUT")
    except LockBackendError as exc:
        refused = True
        say(f"   django_tasklock refused a new lock on it: {exc.__cause__}")
    old.release()
    # Without liveness records too: with them, the old holder's process puts
    # its lock back on the restarted server at its next beat (a contender
    # after that is refused), and whether that beat came before the new
    # worker's try was up to the clock (a busy machine's run once saw it).
    say(
        "   ... and with TASKLOCK['RESTART_GRACE'] = 0 and no liveness records "
        "(which would put the old holder's lock back), after another restart:"
    )
    no_grace = {**settings.TASKLOCK, "RESTART_GRACE": 0, "LIVENESS": None}
    with override_settings(TASKLOCK=no_grace):
        kept = stale_holder_spares_new_one(lock_id, memcached.restart, show_cas=True)
    return refused and kept


def stale_holder_spares_new_one(
    lock_id: str, lose_key: Callable[[], None], show_cas: bool = False
) -> bool:
    """A holder loses its key, a new holder takes the lock, the old one releases.

    True if django_tasklock left the new holder's lock in place.
    """
    from django_tasklock import Lock

    old, new = Lock(lock_id), Lock(lock_id)
    assert old.acquire()
    lose_key()
    assert as_another_worker(new.acquire)
    if show_cas:
        say(
            f"   the old holder's CAS id is {old.acquisition.hold.cas}, "  # type: ignore[union-attr]
            f"the new holder's is {new.acquisition.hold.cas}"  # type: ignore[union-attr]
        )
    released = old.release()
    third_lock = as_another_worker(lambda: Lock(lock_id).acquire())
    say(
        f"   django_tasklock: the old holder's release {'REMOVED' if released else 'left'} "
        f"the new holder's lock; a third worker {'GOT IN' if third_lock else 'was refused'}"
    )
    kept = not released and not third_lock and as_another_worker(new.owned)
    as_another_worker(new.release)
    return kept


def main() -> int:
    memcached = Memcached().start()
    os.environ["TASKLOCK_TEST_MEMCACHED"] = memcached.address
    os.environ["DJANGO_SETTINGS_MODULE"] = "tests.settings"
    import django

    django.setup()
    from django.core.management import call_command

    say(f"Private memcached on {memcached.address}; Django system checks:")
    call_command("check")
    logging.basicConfig(
        stream=sys.stdout,
        level=logging.WARNING,
        format="   [%(levelname)s] %(message)s",
    )
    try:
        overlapping = contention(memcached)
        say("2. memcached loses the key while a task holds its lock (flush_all):")
        kept_flush = after_flush(memcached)
        say(
            "3. memcached restarts while a task holds its lock (its CAS ids start over):"
        )
        kept_restart = after_restart(memcached)
    finally:
        from django.core.cache import close_caches

        close_caches()
        memcached.stop()
        say(f"Stopped the private memcached on {memcached.address}.")
    ok = overlapping == 0 and kept_flush and kept_restart
    say(
        "RESULT: "
        + (
            "OK: no overlapping holds, no lock lost to a stale owner"
            if ok
            else "FAILED"
        )
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
