"""The run of a decorated call in progress: what it is, and what its framework
can do for it.

A ``Run`` is made for every call of a ``@single_instance`` function: its
arguments, the lock id, the task and call it belongs to, and its ``Host``, the
framework it runs under. A plain function's host can do nothing beyond running
it; the Celery and ``django.tasks`` hosts (in ``integrations``) can retry it,
drop or send back a second delivery, and so on. Modes and policies speak to the
host only through the methods here, so they never import a framework.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .exceptions import InvalidArgumentType, LockNotAcquired
from .locks.fencing import held as fencing_held

if TYPE_CHECKING:
    from collections.abc import Callable
    from contextvars import ContextVar

    from .locks import Lock
    from .options import Options
    from .semaphores import Semaphore

__all__ = [
    "DEFER",
    "DROP",
    "FREED",
    "Host",
    "Run",
    "current_lock",
    "enclosing",
    "held",
]

#: What a call finds when the lock it meets names the call itself (see
#: ``Host.verdict``): drop this copy, run it (the dead run's lock was freed),
#: or put it back on the broker.
DROP, FREED, DEFER = object(), object(), object()

# The runs in progress in this context (thread, greenlet or asyncio task),
# innermost last (``locks.fencing.held``, where fenced writes read them too):
# current_lock() is the last one's lock, and a task's self.retry() releases
# the innermost run of that task, the one calling it.
held: ContextVar[tuple[Run, ...]] = fencing_held


def current_lock() -> Lock | Semaphore | None:
    """The lock of the innermost ``@single_instance`` body running in this thread.

    For its ``fence`` (pass it with writes) and ``check()`` (between steps of
    long work); None outside such a body.
    """
    runs = held.get()
    return runs[-1].lock if runs else None


def enclosing(lock_id: str) -> bool:
    """True if a run this context is inside of holds ``lock_id``."""
    return any(
        run.lock is not None and run.lock.lock_id == lock_id for run in held.get()
    )


def retry_unbound(name: str) -> str:
    """Why ``on_contention='retry'`` cannot work for ``name``."""
    return (
        f"on_contention='retry' needs a bound Celery task, but {name} runs without "
        "one (no Celery task as its first argument, 'self'), so a duplicate could "
        "not be retried and would be lost. Use @app.task(bind=True) with "
        "def f(self, ...), or another on_contention."
    )


class Run:
    """One call of a decorated function, as its mode and policies see it.

    Made for every call by ``integrations.begin``, which fills in every slot
    (slots are the interpreter's fastest reads)."""

    #: The decorated function, its arguments and the decorator's options.
    func: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    options: Options
    #: The task name lock ids start with, whether the first argument (a bound
    #: task, a django.tasks context) is left out of them, and the lock id.
    name: str
    bound: bool
    lock_id: str
    #: What the framework running it can do (a plain function's: nothing).
    host: Host
    #: The Celery task instance running it, if any.
    task: Any
    #: The task id of the worker's call (Celery or django.tasks), if any.
    call_id: str | None
    #: The app's oid, written into tokens.
    oid: str | None
    #: The lock's max_hold: the decorator's, else a Celery time limit's.
    max_hold: float | None
    #: True when a retry takes the lock over as it is sent (until_finished).
    hands_over: bool
    __slots__ = (
        "args",
        "bound",
        "call_id",
        "func",
        "hands_over",
        "host",
        "kwargs",
        "lock",
        "lock_id",
        "max_hold",
        "name",
        "oid",
        "options",
        "task",
    )

    #: The Lock (or Semaphore) of this run, set by its mode before anything
    #: reads it.
    lock: Lock | Semaphore

    def body(self) -> Any:
        """Run the decorated function itself."""
        return self.func(*self.args, **self.kwargs)


class Host:
    """What the framework a run belongs to can do; this one, a plain function's,
    can do nothing but run it."""

    def verdict(self, run: Run, lock: Lock | Semaphore) -> object:
        """For a worker's call whose lock is held: ``DROP``, ``FREED`` or
        ``DEFER`` if the holder is this very call; None if it is another."""
        return None

    def drop(self, run: Run) -> Any:
        """End a second delivery of a call without running it."""
        return None

    def defer(self, run: Run, lock: Lock | Semaphore) -> Any:
        """Put a second delivery back until ``lock`` would have expired."""
        raise LockNotAcquired(lock.lock_id)

    def send_back(self, run: Run, lock: Lock | Semaphore, countdown: float) -> Any:
        """Send this call again, to run in ``countdown`` seconds."""
        raise LockNotAcquired(lock.lock_id)

    def retry(self, run: Run, countdown: float) -> Any:
        """Retry this call in ``countdown`` seconds (raises, as Celery's does)."""
        raise InvalidArgumentType(retry_unbound(run.name))

    def in_canvas(self, run: Run) -> bool:
        """True if the call is part of a chain, group or chord."""
        return False

    def guard_retry(self, run: Run) -> None:
        """Make a retry from inside the body release the run's lock first."""

    def will_retry(self, run: Run, exc: BaseException) -> bool:
        """True if the framework retries the call for ``exc`` by itself."""
        return False

    def hand_to_retry(self, run: Run, lock: Lock, left: tuple[str, ...]) -> None:
        """Keep the call's lock across the retry the framework sends next;
        ``left``: the lock ids to free if that retry is not sent after all."""

    def park(self, run: Run, lock: Lock | Semaphore) -> Any:
        """Park this call beside its lock, to be sent again when a slot frees
        (``on_contention="park"``); raises to end this delivery of it."""
        raise LockNotAcquired(
            lock.lock_id,
            f"{run.name} was called outside a Celery worker (directly, or in "
            "place), and only a worker's call has a message to park",
        )

    def park_started(self, run: Run, lock: Lock | Semaphore) -> None:
        """The call holds its slot: go on, or raise to end this delivery (a
        copy of a parked call, or a newcomer behind parked calls)."""

    def park_ended(self, run: Run, lock: Lock | Semaphore) -> None:
        """The call let its slot go: the next parked call is sent."""


#: The host of a plain function call.
PLAIN = Host()
