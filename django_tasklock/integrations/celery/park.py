"""Park and promote, Celery's side (``parking`` holds the line): a parked
call's message kept and sent again, a dropped call told through the result
backend and the ``call_parked`` signal, and the sweep every worker runs so
that a slot freed by crash recovery, a promotion lost with its sender or a
call parked as the last run ended still gets the next parked call sent."""

from __future__ import annotations

import base64
import json
import threading
from typing import TYPE_CHECKING, Any, Final

from ...calls import queue_life
from ...conf import settings
from ...exceptions import (
    ParkedCallDropped,
    ParkFull,
    TaskLockError,
)
from ...logs import module_logger
from ...parking import DECLARED, ParkLine, Registry, Verdict
from ...runs import Host

if TYPE_CHECKING:
    from collections.abc import Callable

    from ...locks import Lock
    from ...runs import Run
    from ...semaphores import Semaphore

__all__ = [
    "SWEEP_EVERY",
    "ended",
    "install_park",
    "kick",
    "line_of",
    "message_of",
    "park",
    "send",
    "start_sweep",
    "started",
    "sweep",
    "told",
]

logger = module_logger(__name__, "django_tasklock.calls")

#: How often each worker sweeps the park lines of its stores (seconds).
SWEEP_EVERY: Final = 1.0


def message_of(task: Any) -> str:
    """The message of the call ``task`` runs, as text to keep in the store:
    the call itself (same task id, arguments and options), serialized with
    the task's serializer."""
    from kombu.serialization import dumps

    signature = task.signature_from_request(task.request)
    content_type, encoding, body = dumps(  # type: ignore[no-untyped-call]
        dict(signature), serializer=task.serializer
    )
    raw = body if isinstance(body, bytes) else body.encode(encoding or "utf-8")
    data = {"t": content_type, "e": encoding, "b": base64.b64encode(raw).decode()}
    return json.dumps(data, separators=(",", ":"))


def send(app: Any, message: str) -> str:
    """Put a kept message on the broker again; its task id."""
    from celery.canvas import Signature
    from kombu.serialization import loads

    data = json.loads(message)
    raw = base64.b64decode(data["b"])
    body = loads(  # type: ignore[no-untyped-call]
        raw, data["t"], data["e"], accept={data["t"]}
    )
    signature = Signature.from_dict(body, app=app)
    result = signature.apply_async()
    return str(result.id)


def told(
    lock_id: str,
    call_id: str,
    action: str,
    by: str = "",
    app: Any = None,
    ticket: int = 0,
) -> None:
    """Say a step of a parked call: logged, the ``call_parked`` signal, and
    for a dropped call its result, ``ParkedCallDropped``, stored."""
    from ...signals import call_parked

    if action == "dropped":
        error = ParkedCallDropped(call_id, lock_id, by)
        logger.warning("%s", error)
        try:
            app.backend.mark_as_failure(call_id, error)
        except Exception:  # (a disabled or failing result backend: said, not raised)
            logger.warning("Could not store the result of dropped call %s", call_id)
    else:
        logger.info("Call %s of lock %r %s", call_id, lock_id, action)
    if call_parked.receivers:
        call_parked.send_robust(
            None, lock_id=lock_id, task_id=call_id, action=action, by=by, ticket=ticket
        )


def _sender(app: Any, lock_id: str) -> Callable[[str, str], None]:
    """How a promotion is sent: the kept message on the broker again."""

    def promoted(call_id: str, message: str) -> None:
        send(app, message)
        told(lock_id, call_id, "promoted")

    return promoted


def kick(app: Any, line: ParkLine, limit: int) -> int:
    """``ParkLine.kick``, the promoted calls sent to ``app``'s broker."""
    return line.kick(limit, _sender(app, line.lock_id))


def sweep(app: Any, alias: str) -> None:
    """One sweep of the park lines listed in ``alias``'s store."""
    registry = Registry(alias)
    for lock_id, (limit, life) in registry.read().items():
        line = ParkLine(lock_id, alias, life)
        line.sweep(int(limit), _sender(app, lock_id))
        state = line.read()
        if not (state.waiting or state.running):
            registry.remove(lock_id)


def start_sweep(app: Any, aliases: set[str | None]) -> threading.Event:
    """Sweep the park lines of ``aliases`` every ``SWEEP_EVERY`` seconds in a
    daemon thread of this process, until the event returned is set."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(SWEEP_EVERY):
            for alias in {alias or settings.CACHE for alias in aliases}:
                try:
                    sweep(app, alias)
                except TaskLockError as exc:
                    logger.warning("Park sweep of %r: %s", alias, exc)
                except Exception:
                    logger.exception("Park sweep of %r failed", alias)

    threading.Thread(target=loop, name="tasklock-park-sweep", daemon=True).start()
    return stop


# -- the steps of a run (CeleryHost.park, park_started, park_ended) ---------------


def line_of(run: Run) -> ParkLine:
    """The park line of the run's lock."""
    return ParkLine(
        run.lock_id, run.options.cache, queue_life(run.options.queue_expire)
    )


def _limit(run: Run) -> int:
    return run.options.limit or 1


def park(run: Run, lock: Lock | Semaphore) -> Any:
    """Park this call (its message kept, its id at the end of the line; back
    at the head for a promoted call that found no slot), then end this
    delivery (Celery's Ignore). A full line refuses it (``ParkFull``) or
    drops another parked call, as ``on_park_full`` says."""
    task, call_id = run.task, run.call_id
    if call_id is None or task is None or getattr(task.request, "is_eager", False):
        return Host.park(run.host, run, lock)
    line = line_of(run)
    at_head = call_id in line.read().promoted
    line.keep_message(call_id, message_of(task))
    options = run.options
    assert options.park is not None
    parked = line.park(call_id, options.park, options.on_park_full, at_head)
    if parked is None:  # a copy of a call that started meanwhile
        return run.host.drop(run)
    left, ticket = parked
    if left == call_id:
        line.forget_message(call_id)
        told(run.lock_id, call_id, "refused")
        raise ParkFull(run.lock_id, options.park)
    Registry(options.cache).add(run.lock_id, _limit(run), line.life)
    told(run.lock_id, call_id, "returned" if at_head else "parked", ticket=ticket)
    if left:
        line.forget_message(left)
        told(run.lock_id, left, "dropped", by=call_id, app=task.app)
    # A slot freed between this call's try and its parking: its run ended
    # seeing no line. The head goes now, not at the next sweep.
    kick(task.app, line, _limit(run))
    return run.host.drop(run)


def started(run: Run, lock: Lock | Semaphore) -> None:
    """The call holds its slot: a parked or promoted call leaves the line and
    runs; a copy of a call that started or ended is dropped; a newcomer
    behind parked calls parks too (its slot let go first)."""
    call_id = run.call_id
    if call_id is None:
        return
    line = line_of(run)
    token = lock.token
    assert token is not None
    verdict = line.start(call_id, token, line.alive(_limit(run)))
    if verdict == Verdict.RUN:
        return
    lock.release_quietly()
    if verdict == Verdict.DROP:
        logger.warning(
            "Dropped a copy of call %s of %r: it started or ended before",
            call_id,
            run.lock_id,
        )
        run.host.drop(run)
    park(run, lock)


def ended(run: Run, lock: Lock | Semaphore) -> None:
    """The run let its slot go: it leaves the line (if it came through it),
    and the next parked call is sent. A store error is logged: the sweeps
    send it later."""
    line = line_of(run)
    try:
        if run.call_id is None:
            waiting = line.read().waiting
        else:
            ours, waiting = line.ended(run.call_id)
            if ours:
                line.forget_message(run.call_id)
        if waiting:  # (else nothing to send: no slot probed)
            kick(run.task.app, line, _limit(run))
    except TaskLockError as exc:
        logger.warning(
            "Could not send the next parked call of %r: %s", run.lock_id, exc
        )


_SWEEP: list[threading.Event] = []


def install_park(cache: str | None) -> None:
    """A parking task is declared in this process: its store is swept by
    the worker this process becomes (``worker_ready``, the main process)."""
    try:
        from celery import signals
    except ImportError:  # Celery is optional: a park line is a Celery task's
        return
    DECLARED.add(cache)
    signals.worker_ready.connect(_on_ready, weak=False, dispatch_uid="tasklock.park")
    signals.worker_shutdown.connect(
        _on_shutdown, weak=False, dispatch_uid="tasklock.park.exit"
    )


def _on_ready(sender: Any = None, **_: Any) -> None:
    app = getattr(sender, "app", None)
    if app is not None and not _SWEEP:
        _SWEEP.append(start_sweep(app, DECLARED))


def _on_shutdown(**_: Any) -> None:
    while _SWEEP:
        _SWEEP.pop().set()
