"""What every mode shares: a mode says what happens when a call is published
and what happens when it runs, over the primitive (``Lock``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..calls import Marks, queued
from ..conf import settings
from ..exceptions import InvalidArgumentType, LockNotAcquired
from ..locks import Lock
from ..locks.recovery import judge
from ..locks.roster import note_run
from ..logs import module_logger
from ..policies import CONTENTION, ContentionPolicy
from ..runs import DEFER, DROP, FREED, enclosing, held, retry_unbound

if TYPE_CHECKING:
    from ..backends import LockBackend
    from ..runs import Run
    from ..semaphores import Semaphore

__all__ = ["Mode"]

# Logged under 'django_tasklock.locks' before: that name keeps working (see logs).
logger = module_logger(__name__, "django_tasklock.locks")


class Mode:
    """A mode of ``@single_instance``: its two hooks, and the steps of a run."""

    #: The name ``mode=`` takes.
    name = ""
    #: True if a call's lock is taken when it is published (``.delay()``).
    publishes = True
    #: Appended to the lock id for a published call's lock.
    queue_suffix = ""
    #: True if ``taken()`` does something (a call saved where it does not).
    takes = False
    #: The contention policy of a worker's call, whatever on_contention says
    #: (None: on_contention's).
    call_policy: str | None = None

    def __init__(self) -> None:
        # Read on every run: instance attributes are the interpreter's fastest.
        self.takes, self.call_policy = self.takes, self.call_policy

    # -- when a call is published ----------------------------------------------------

    def on_publish(self, lock_id: str) -> str:
        """The lock id a published call of this mode is held under until it
        starts (the integrations' publish hooks claim it, ``publishing``)."""
        return lock_id + self.queue_suffix

    def lock_ids(self, lock_id: str) -> tuple[str, ...]:
        """Every lock id a call of this mode holds, for status and clean-up:
        its run's, then its pending call's where that is another."""
        queue_id = self.on_publish(lock_id)
        return (lock_id,) if queue_id == lock_id else (lock_id, queue_id)

    def left_by(self, lock_id: str, *, running: bool) -> tuple[str, ...]:
        """The lock ids that may still name a call which ended without
        finishing: its pending call's, and with ``running`` (its run's
        process gone) its run's, where that is another."""
        queue_id = self.on_publish(lock_id)
        if running and queue_id != lock_id:
            return (queue_id, lock_id)
        return (queue_id,)

    def may_replace(
        self,
        holder: tuple[str, str] | None,
        value: object,
        backend: LockBackend,
        key: str,
    ) -> bool:
        """Whether a call being published may take its lock from ``holder``
        (``calls.call_of`` of the stored ``value``): a run whose process is
        dead (``locks.recovery.judge``; "could not tell" is never dead).
        Raises ``backend.errors``."""
        if holder is None or holder[0] != "running":
            return False
        alive, why = judge(value, backend, key)
        if alive is False:
            logger.warning(
                "A new call replaces call %s, whose run is dead: %s.", holder[1], why
            )
            return True
        return False

    # -- when a call runs -----------------------------------------------------------

    def on_run(self, run: Run) -> Any:
        """Take the run's lock as the contention policy says, run the body as
        the current lock, release the lock after it (or hand it to the retry
        the framework is about to send)."""
        lock = run.lock = self.lock_for(run)
        policy = CONTENTION[run.options.on_contention or settings.ON_CONTENTION]
        if policy.bound_only and (run.task is None or not run.bound):
            # A duplicate that met the lock could no longer be retried, and
            # would be lost.
            raise InvalidArgumentType(retry_unbound(run.name))
        if self.call_policy is not None and run.call_id is not None:
            policy = CONTENTION[self.call_policy]
        if run.call_id is None and policy.waits and not held.get():
            acquired = policy.acquire(lock, run)
        else:
            acquired = lock.acquire()
            if not acquired:
                if enclosing(lock.lock_id):
                    return self.nested(run, lock, policy)
                if run.call_id is None:
                    acquired = policy.waits and policy.acquire(lock, run)
                else:
                    # A worker's call: a lock held by this very call is a
                    # second delivery of its message, told apart before any wait.
                    verdict = run.host.verdict(run, lock)
                    if verdict is DROP:
                        return run.host.drop(run)
                    if verdict is DEFER:
                        return run.host.defer(run, lock)
                    if verdict is FREED or policy.waits:
                        acquired = policy.acquire(lock, run)
        if not acquired:
            return self.contended(run, lock, policy)
        note_run(lock, run)
        if policy.parks:
            run.host.park_started(run, lock)
        if self.takes:
            self.taken(run, lock)
        if run.task is not None:
            run.host.guard_retry(run)
        reset = held.set((*held.get(), run))
        try:
            return run.func(*run.args, **run.kwargs)
        except BaseException as exc:
            if run.hands_over and run.host.will_retry(run, exc):
                left = self.left_by(lock.lock_id, running=False)
                run.host.hand_to_retry(run, lock, left)  # type: ignore[arg-type]
            raise
        finally:
            held.reset(reset)
            lock.release_quietly()
            if policy.parks:
                run.host.park_ended(run, lock)

    def nested(self, run: Run, lock: Lock | Semaphore, policy: ContentionPolicy) -> Any:
        """The lock is held by a run this thread is inside of (a call run in
        place: eagerly, by ``apply()`` or directly, from the body of a run of
        the same lock id). Skip and raise do as they always do; a call that
        would wait or be sent again cannot wait for its own caller, and fails
        at once with ``LockNotAcquired`` (its pending mark cleared) instead of
        waiting out its timeout or its caller's lock."""
        if not (policy.waits or policy.bound_only or self.call_policy):
            return self.contended(run, lock, policy)
        self.forget_pending(run)
        raise LockNotAcquired(
            lock.lock_id,
            f"a run of it encloses this call of {run.name} in the same thread "
            "(a task run in place: eagerly, by apply() or called directly), and a "
            "call cannot wait for its own caller; a worker would run it after that "
            "run ends. Send it from outside that run, or with other arguments.",
        )

    def forget_pending(self, run: Run) -> None:
        """Clear the pending mark of a call that ends here without running (it
        will not be sent again), so that later calls do not join it."""
        if run.call_id is not None and self.publishes:
            Marks(run.options.cache, self.on_publish(run.lock_id)).clear(
                queued(run.call_id), "Could not clear the pending mark of lock %r"
            )

    def lock_for(self, run: Run) -> Lock | Semaphore:
        """The run's lock: one slot, named after the call if a worker runs it."""
        given = run.options.lock_options
        if not given:  # (a call with ``**{}`` builds a dict: 2 % of a run)
            return Lock(
                run.lock_id, oid=run.oid, max_hold=run.max_hold, call_id=run.call_id
            )
        return Lock(
            run.lock_id,
            oid=run.oid,
            max_hold=run.max_hold,
            call_id=run.call_id,
            **given,
        )

    def make_lock(self, run: Run, lock_id: str, take_over: str | None = None) -> Lock:
        """A Lock on ``lock_id`` with the run's options, naming its call."""
        return Lock(
            lock_id,
            oid=run.oid,
            max_hold=run.max_hold,
            call_id=run.call_id,
            take_over=take_over,
            **run.options.lock_options,
        )

    def contended(
        self, run: Run, lock: Lock | Semaphore, policy: ContentionPolicy
    ) -> Any:
        return policy.contended(run, lock)

    def taken(self, run: Run, lock: Lock | Semaphore) -> None:
        """The lock was taken, the body is about to run."""
