"""Publishing a Celery call of a task with an enqueue-time mode.

Every way a Celery task reaches the broker goes through ``Celery.send_task``:
``delay()``, ``apply_async()``, canvas members, ``send_task()`` by name, beat
and ``retry()``. That one method is wrapped, once per process, when the first
task with an enqueue-time mode is decorated; a task without one costs a dict
lookup there. The call's lock is claimed with its queued mark before the
message goes out, and given back if the message cannot be sent.
"""

from __future__ import annotations

import datetime
import time
import uuid
from typing import TYPE_CHECKING, Any, Final

from ...calls import queue_life, queued, store
from ...exceptions import AlreadyQueued
from ...locks import Lock
from ...locks.liveness import note_queued
from ...locks.roster import Entry, describe_call
from ...logs import module_logger
from ...modes.publishing import AGAIN, claim, unknown_fate
from ...runs import held
from ...signals import call_deduplicated
from ...targets import Spec, spec_of
from .worker import on_failure, on_postrun, on_revoked, on_shutdown

if TYPE_CHECKING:
    from collections.abc import Callable

    from ...backends import Peek

__all__ = ["install_publish"]

# Logged under 'django_tasklock.calls' before: that name keeps working (see logs).
logger = module_logger(__name__, "django_tasklock.calls")

# Options that make a message part of a canvas: its links belong to it, so it
# is never merged into another call.
_CANVAS: Final = ("link", "link_error", "chord", "group_id", "chain")
# The call being sent again runs in another thread or process.
_ELSEWHERE: Final = object()


def _delay(app: Any, countdown: object, eta: object) -> float:
    """Seconds until the message may run."""
    if isinstance(countdown, (int, float)) and not isinstance(countdown, bool):
        return float(countdown)
    if isinstance(eta, str):
        eta = datetime.datetime.fromisoformat(eta)
    if isinstance(eta, datetime.datetime):
        now = app.now() if eta.tzinfo is not None else datetime.datetime.now()
        return (eta - now).total_seconds()
    return 0.0


class _Publish:
    """One ``send_task`` of a task with an enqueue-time mode."""

    def __init__(
        self,
        original: Callable[..., Any],
        app: Any,
        spec: Spec,
        task: Any,
        name: str,
        call: tuple[Any, ...],
        options: dict[str, Any],
    ) -> None:
        self.original, self.app, self.spec, self.task = original, app, spec, task
        self.name = name
        self.args, self.kwargs, self.countdown, self.eta, self.given_id = call
        self.options = options
        self.mode = spec.mode
        self.on_duplicate: str = spec.options.on_duplicate
        self.lock_id = spec.lock_id(
            spec.name, spec.bound, tuple(self.args or ()), dict(self.kwargs or {})
        )
        self.queue_id = self.mode.on_publish(self.lock_id)
        self.backend, self.alias = store(spec.options.cache)
        self.key = self.backend.keys_for(self.queue_id)[0]
        self.task_id: str = self.given_id or str(uuid.uuid4())
        self.value = queued(self.task_id)
        self.life = queue_life(
            spec.options.queue_expire, _delay(app, self.countdown, self.eta)
        )

    def send(self) -> Any:
        return claim(self.mode, self)

    # -- what the claim loop asks of a Celery call (modes.publishing) -----------------

    def mine(self, holder: tuple[str, str] | None, peek: Peek, waited: float) -> Any:
        if holder is None or holder[1] != self.task_id:
            return None
        # The same call sent again: its own retry, or a re-publish.
        handed = self._hand_over(peek, running=holder[0] == "running")
        if handed is _ELSEWHERE:
            # Sent again while it runs in another thread or process: that run
            # keeps its lock, and this copy is dropped when it starts.
            return self._publish_unclaimed
        return AGAIN if handed is None else self.claimed

    def unmerged(self, holder: tuple[str, str] | None) -> Any:
        if self.given_id is None and not any(self.options.get(o) for o in _CANVAS):
            return None
        logger.info(
            "Sent %s[%s] although call %s holds lock %r: a call with a task id "
            "of its own or with canvas links is never merged into another; it "
            "takes the lock when it starts.",
            self.name,
            self.task_id,
            holder[1] if holder else "(unknown)",
            self.queue_id,
        )
        return self._publish_unclaimed

    def unattached(self, peek: Peek) -> Any:
        # Held by a run outside any worker (a direct call), or by other code:
        # there is no call to join.
        if self.on_duplicate == "raise":
            self._announce(None, "raised")
            raise AlreadyQueued(None, self.queue_id)
        logger.info(
            "Sent %s[%s]: lock %r is held outside a task call (%r), so there "
            "is no pending call to join; it takes the lock when it starts.",
            self.name,
            self.task_id,
            self.queue_id,
            peek.value,
        )
        return self._publish_unclaimed

    def _hand_over(self, peek: Peek, *, running: bool) -> object:
        """Make the lock this message's: the new hold, None if it changed in
        between, or ``_ELSEWHERE`` if the call runs elsewhere."""
        # The running call retrying itself holds the lock in this thread: it
        # hands it over, so its heartbeat stops and it does not report a loss.
        for run in reversed(held.get()):
            lock = run.lock
            if (
                isinstance(lock, Lock)
                and lock.call_id == self.task_id
                and lock.lock_id == self.queue_id
            ):
                return True if lock.hand_over(self.value, self.life) else None
        if running:
            return _ELSEWHERE
        return self.backend.replace(
            self.key, peek.hold, peek.value, self.value, self.life
        )

    def _call_original(self) -> Any:
        return self.original(
            self.app,
            self.name,
            self.args,
            self.kwargs,
            self.countdown,
            self.eta,
            self.task_id,
            **self.options,
        )

    def _publish_unclaimed(self) -> Any:
        return self._call_original()

    def claimed(self, restore: Peek | None = None) -> Any:
        # Made before the send: nothing that may raise (an argument's repr()
        # is user code) runs once the message is out and cannot be undone.
        entry = Entry(
            lock_id=self.queue_id,
            kind="queued",
            task=self.name,
            args=describe_call(self.args or (), self.kwargs or {}),
            call_id=self.task_id,
            since=time.time(),
            renews=False,
        )
        try:
            sent = self._call_original()
        except BaseException:
            self._roll_back(restore)
            raise
        try:
            note_queued(self.alias, self.key, entry, self.life)
        except Exception:  # listing only: the call was sent, and stays sent
            logger.exception("Could not list queued call %s", self.task_id)
        return sent

    def _roll_back(self, restore: Peek | None) -> None:
        """The publish failed: nothing was sent, so nothing may stay locked."""
        backend = self.backend
        try:
            if restore is not None:
                hold = backend.peek(self.key)
                if hold is not None and hold.value == self.value:
                    backend.replace(
                        self.key, hold.hold, hold.value, str(restore.value), self.life
                    )
                    return
            backend.discard(self.key, self.value)
        except backend.errors as exc:
            unknown_fate(self, exc)

    # -- what the duplicate policies do (see policies.duplicates) ---------------------

    def join(self, holder_id: str) -> Callable[[], Any]:
        self._announce(holder_id, "joined")
        result_cls = self.options.get("result_cls") or self.app.AsyncResult
        return lambda: result_cls(holder_id)

    def refuse(self, holder_id: str) -> Callable[[], Any]:
        self._announce(holder_id, "raised")
        raise AlreadyQueued(holder_id, self.queue_id)

    def replace(self, holder_id: str, seen: Peek) -> Callable[[], Any]:
        return lambda: self._replace(holder_id, seen)

    def _replace(self, holder_id: str, peek: Peek) -> Any:
        backend = self.backend
        try:
            replaced = backend.replace(
                self.key, peek.hold, peek.value, self.value, self.life
            )
        except backend.errors as exc:
            raise unknown_fate(self, exc) from exc
        if replaced is None:
            return self.send()  # it changed meanwhile: look again
        result = self.claimed(restore=peek)
        # Only once this call is out. Should the revoke not reach a worker, the
        # pending call meets the newer call's lock when it starts, and its
        # on_contention decides (skipped by default).
        try:
            self.app.control.revoke(holder_id)
        except Exception:
            logger.warning(
                "Could not revoke call %s, replaced by %s under lock %r; when it "
                "starts it meets the newer call's lock (see on_contention).",
                holder_id,
                self.task_id,
                self.queue_id,
                exc_info=True,
            )
        self._announce(holder_id, "replaced")
        return result

    def _announce(self, holder_id: str | None, action: str) -> None:
        logger.info(
            "Not sent %s[%s] as a call of its own: call %s is pending or running "
            "under lock %r (mode %s); %s.",
            self.name,
            self.task_id,
            holder_id,
            self.queue_id,
            self.mode.name,
            {
                "joined": "the caller got that call's result",
                "raised": "AlreadyQueued raised",
                "replaced": "that call was revoked and this one sent in its place",
            }[action],
        )
        if call_deduplicated.receivers:
            call_deduplicated.send_robust(
                self.task,
                lock_id=self.queue_id,
                task_id=holder_id,
                new_id=self.task_id,
                mode=self.mode.name,
                action=action,
            )


def _specs(app: Any) -> dict[str, Spec | None]:
    specs: dict[str, Spec | None] | None = app.__dict__.get("_tasklock_specs")
    if specs is None:
        specs = app.__dict__["_tasklock_specs"] = {}
    return specs


def _spec_for(app: Any, name: str, task: Any) -> tuple[Spec | None, Any]:
    specs = _specs(app)
    spec = specs.get(name, False)
    if spec is not False:
        return spec, task  # type: ignore[return-value]
    if task is None:
        try:
            task = app.tasks.get(name)
        except RuntimeError:  # not finalized, and autofinalize is off
            return None, None
    found = None if task is None else spec_of(task)
    if task is not None:
        specs[name] = found
    return found, task


def install_publish() -> None:
    """Wrap ``Celery.send_task`` and connect the worker's signals (once)."""
    try:
        from celery import Celery, signals
    except ImportError:  # Celery is optional: django.tasks only
        return
    original = Celery.send_task

    def send_task(
        self: Any,
        name: str,
        args: Any = None,
        kwargs: Any = None,
        countdown: Any = None,
        eta: Any = None,
        task_id: Any = None,
        *more: Any,
        **options: Any,
    ) -> Any:
        spec, task = (
            (None, None) if more else _spec_for(self, name, options.get("task_type"))
        )
        if spec is None:
            return original(
                self, name, args, kwargs, countdown, eta, task_id, *more, **options
            )
        call = (args, kwargs, countdown, eta, task_id)
        return _Publish(original, self, spec, task, name, call, options).send()

    send_task.__wrapped__ = original  # type: ignore[attr-defined]
    send_task.__doc__ = original.__doc__
    Celery.send_task = send_task
    signals.task_revoked.connect(
        on_revoked, weak=False, dispatch_uid="django_tasklock.revoked"
    )
    signals.task_postrun.connect(
        on_postrun, weak=False, dispatch_uid="django_tasklock.postrun"
    )
    signals.task_failure.connect(
        on_failure, weak=False, dispatch_uid="django_tasklock.failure"
    )
    for shutdown in (signals.worker_process_shutdown, signals.worker_shutdown):
        shutdown.connect(on_shutdown, weak=False, dispatch_uid="django_tasklock.exit")
