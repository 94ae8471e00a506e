"""Removing locks whose fate a failed call left unknown, once the store answers.

An acquire that times out may still be carried out when the store resumes (the
command sat in the server's socket buffer), and a release whose reply was lost
may or may not have happened. Either way a token of ours may be stored with no
holder to release it: a lock nobody owns, which would make the caller's own next
try (a Celery retry included) look like a duplicate for a whole expiry.

``watch()`` hands such a token to one daemon thread per process, which removes it,
owner-checked (only while the store still holds this very token), as soon as the
store answers, and goes on looking for a short grace period after that, because a
command still queued on the old connection may be carried out a moment after the
store's first answer on a new one. A look that waits on a store that never
answers (no socket timeout) holds back no other store's tokens for long: after
``STUCK`` seconds the next token gets a new thread, which goes on with every
token but the one that look holds, and the old one ends when its look does.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Final

from .backends import backend_for, close_thread_connections
from .exceptions import LockConfigurationError
from .logs import module_logger

__all__ = ["GRACE", "failing", "forget", "removed_count", "watch", "watched_count"]

# Logged under "django_tasklock.pending" before: that name keeps working (logs).
logger = module_logger(__name__, "django_tasklock.pending")

#: Seconds a token is still looked for after the store first answered.
GRACE: Final = 1.0
#: Pause between two looks while the store answers, and the longest pause while
#: it does not.
STEP: Final = 0.1
MAX_STEP: Final = 1.0
#: At most this many tokens are watched; the oldest is dropped (and logged) first.
LIMIT: Final = 10_000
#: Seconds one look may take before a new token gets a thread of its own: a
#: store that never answers (no socket timeout, a peer that vanished without a
#: reset) must not keep every other token waiting behind it.
STUCK: Final = 10.0


@dataclass
class _Watched:
    lock_id: str
    alias: str
    protocol: str
    key: str
    token: str
    answered_at: float | None = None
    #: What the last look that could not tell raised (for diagnostics).
    failing: str = ""
    #: Whether a thread is looking at it now: a thread started because that
    #: look is stuck goes on with the other tokens, and leaves it to that look.
    busy: bool = False


_watched: list[_Watched] = []
_mutex = threading.Lock()
_thread: list[threading.Thread] = []
_removed = [0]
#: monotonic: when the watching thread last finished a look (or started).
_progress = [0.0]


def watch(lock_id: str, alias: str, protocol: str, key: str, token: str) -> None:
    """Remove ``token`` from ``key`` in the background once the store answers."""
    with _mutex:
        if len(_watched) >= LIMIT:
            dropped = _watched.pop(0)
            logger.warning(
                "Too many locks of unknown fate to watch; lock %r is left to expire.",
                dropped.lock_id,
            )
        _watched.append(_Watched(lock_id, alias, protocol, key, token))
        _ensure_thread()


def _ensure_thread() -> None:
    """Start the watching thread unless one runs and moves (under ``_mutex``).

    A thread that died, or that has waited on one look for ``STUCK`` seconds,
    is replaced; the replaced one ends when its look returns."""
    now = time.monotonic()
    if _thread:
        running = _thread[0]
        if running.is_alive() and now - _progress[0] < STUCK:
            return
        if running.is_alive():
            logger.warning(
                "The removal of locks of unknown fate has waited %.0fs on one "
                "store; a new thread goes on with the others.",
                now - _progress[0],
            )
    thread = threading.Thread(
        target=_run, name="tasklock-pending-removals", daemon=True
    )
    _thread[:] = [thread]
    _progress[0] = now
    thread.start()


def forget() -> None:
    """Stop watching every token (they are left to expire): for tests, whose
    stores and settings go with them."""
    with _mutex:
        _watched.clear()
        # And the thread: one still in a look at a forgotten store (paused,
        # never answering) must not hold back the next token watched; it ends
        # when its look returns.
        _thread.clear()


def watched_count() -> int:
    """How many tokens are still watched in this process."""
    with _mutex:
        return len(_watched)


def failing() -> list[str]:
    """Why each token still watched could not be removed yet ("" while its
    store answered), for diagnostics."""
    with _mutex:
        return [f"{item.lock_id}: {item.failing}" for item in _watched]


def removed_count() -> int:
    """How many tokens the watcher has removed in this process so far."""
    return _removed[0]


def _look(item: _Watched) -> bool:
    """One look at ``item``; True when it needs no more looking after."""
    try:
        backend = backend_for(item.alias, protocol=item.protocol)
    except LockConfigurationError:
        logger.warning(
            "Lock %r is left to expire: CACHES no longer has %r, where it was taken.",
            item.lock_id,
            item.alias,
        )
        return True
    try:
        removed = backend.discard(item.key, item.token)
    except backend.errors as exc:
        item.failing = f"{type(exc).__name__}: {exc} ({backend.describe(item.key)})"
        return False
    now = time.monotonic()
    if removed:
        with _mutex:  # (two threads may count: a stuck one's look ends late)
            _removed[0] += 1
        logger.warning(
            "Removed lock %r from %s: a call whose outcome was unknown (the store "
            "timed out or the connection dropped) had left it held with no holder.",
            item.lock_id,
            backend.describe(item.key),
        )
        return True
    if item.answered_at is None:
        item.answered_at = now
    return now - item.answered_at >= GRACE


def _look_safely(item: _Watched) -> bool:
    try:
        return _look(item)
    except Exception:  # a bug must not end the watch of every other token
        logger.exception(
            "Could not look for lock %r; it is left to expire", item.lock_id
        )
        return True


def _run() -> None:
    me = threading.current_thread()
    step = STEP
    try:
        while True:
            with _mutex:
                items = list(_watched)
                if not items or not _thread or _thread[0] is not me:
                    if _thread and _thread[0] is me:
                        _thread.clear()  # under the mutex: watch() starts anew
                    return
            done = []
            for item in items:
                if item.busy:
                    continue
                item.busy = True
                try:
                    if _look_safely(item):
                        done.append(item)
                finally:
                    item.busy = False
                _progress[0] = time.monotonic()
            answered = any(item.answered_at is not None for item in items)
            with _mutex:
                for item in done:
                    if item in _watched:  # (forget() may have emptied it)
                        _watched.remove(item)
            step = STEP if answered or done else min(step * 2, MAX_STEP)
            time.sleep(step)
    finally:
        with _mutex:  # (ended by a bug: the next watch() starts a thread)
            if _thread and _thread[0] is me:
                _thread.clear()
        close_thread_connections()


def _forget_in_child() -> None:
    # The watcher thread is the parent's: the child neither inherits it nor the
    # parent's tokens to remove, and the mutex may have been held at the fork.
    global _mutex
    _mutex = threading.Lock()
    _watched.clear()
    _thread.clear()


os.register_at_fork(after_in_child=_forget_in_child)
