"""The run of an ``async def`` function under ``@single_instance``: ``Mode.on_run``
with the lock taken, waited for and released on the event loop.

A call made in place (awaited by code, or by a task runner as a plain call)
acts as ``while_running`` does for a direct call, whatever the mode, and the
contention policies skip, raise or wait. A published call of a django.tasks
async task (a run that knows its call's id) runs as its mode says: under
``until_finished`` the run takes its lock over from the call's own mark,
under ``coalesce`` it waits for the running call and clears its pending mark,
under ``until_started`` it marks the call started and holds a lock named
after the call; a second delivery is told apart as in a sync run. The store
reads those paths need beyond the lock's own (a holder's verdict, the marks)
run on executor threads. ``retry`` is refused when the function is decorated
(``refuse_async``): nothing can send a call of it again.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from ..calls import Marks
from ..conf import settings
from ..exceptions import InvalidArgumentType
from ..keys import RUN_MARK
from ..locks.roster import note_run
from ..policies import CONTENTION
from ..runs import DEFER, DROP, FREED, enclosing, held
from .until_started import UntilStarted, dropped

if TYPE_CHECKING:
    from ..locks import Lock
    from ..options import Options
    from ..runs import Run
    from ..semaphores import Semaphore
    from .base import Mode

__all__ = ["arun", "refuse_async"]


async def arun(mode: Mode, run: Run) -> Any:
    """Take the run's lock as the mode and the contention policy say, await
    the body as the current lock, release the lock after it."""
    if run.call_id is not None and mode.publishes:
        if isinstance(mode, UntilStarted):
            return await _arun_started(mode, run)
        return await _arun_call(mode, run)
    lock = run.lock = mode.lock_for(run)
    policy = CONTENTION[run.options.on_contention or settings.ON_CONTENTION]
    if policy.waits and not held.get():
        acquired = await policy.aacquire(lock, run)
    else:
        acquired = await lock.aacquire()
        if not acquired:
            if enclosing(lock.lock_id):
                return mode.nested(run, lock, policy)
            acquired = policy.waits and await policy.aacquire(lock, run)
    if not acquired:
        return mode.contended(run, lock, policy)
    return await _body(run, lock)


async def _arun_call(mode: Mode, run: Run) -> Any:
    """A published call's run (``until_finished``, ``coalesce``): the
    worker's side of ``Mode.on_run``."""
    lock = run.lock = mode.lock_for(run)
    name = mode.call_policy or run.options.on_contention or settings.ON_CONTENTION
    policy = CONTENTION[name]
    acquired = await lock.aacquire()
    if not acquired:
        if enclosing(lock.lock_id):
            return await asyncio.to_thread(mode.nested, run, lock, policy)
        # A lock held by this very call is a second delivery of its message.
        verdict = await asyncio.to_thread(run.host.verdict, run, lock)
        if verdict is DROP:
            return run.host.drop(run)
        if verdict is DEFER:
            return run.host.defer(run, lock)
        if verdict is FREED or policy.waits:
            acquired = await policy.aacquire(lock, run)
    if not acquired:
        return mode.contended(run, lock, policy)
    if mode.takes:
        await asyncio.to_thread(mode.taken, run, lock)
    return await _body(run, lock)


async def _arun_started(mode: Mode, run: Run) -> Any:
    """An ``until_started`` call's run: a lock named after the call (a second
    delivery meets it and is dropped), the call marked started meanwhile."""
    call_id = run.call_id
    assert call_id is not None
    run_lock = run.lock = mode.make_lock(run, f"{run.lock_id}{RUN_MARK}{call_id}")
    if not await run_lock.aacquire():
        verdict = await asyncio.to_thread(run.host.verdict, run, run_lock)
        if verdict is DEFER:
            return run.host.defer(run, run_lock)
        if verdict is not FREED or not await run_lock.aacquire():
            return dropped(run, run_lock, verdict)
    marks = Marks(run.options.cache, run.lock_id)
    expire = run.options.expire
    life = expire if expire is not None else settings.LOCK_EXPIRE
    note_run(run_lock, run)
    reset = held.set((*held.get(), run))
    try:
        mark = await asyncio.to_thread(marks.start, call_id, life)
        try:
            return await run.func(*run.args, **run.kwargs)
        finally:
            await asyncio.to_thread(
                marks.clear, mark, "Could not clear the started mark of lock %r"
            )
    finally:
        held.reset(reset)
        await run_lock.arelease_quietly()


async def _body(run: Run, lock: Lock | Semaphore) -> Any:
    """Await the body with ``lock`` taken, as the current lock; release it
    after."""
    note_run(lock, run)
    reset = held.set((*held.get(), run))
    try:
        return await run.func(*run.args, **run.kwargs)
    finally:
        held.reset(reset)
        await lock.arelease_quietly()


def refuse_async(name: str, options: Options) -> None:
    """A TypeError, at decoration, for what an ``async def`` cannot have."""
    if options.on_contention in ("retry", "park"):
        raise InvalidArgumentType(
            f"@single_instance(on_contention={options.on_contention!r}) on {name}, an async def "
            "function: nothing can send a call of it again (Celery runs sync "
            "tasks), so a duplicate would be lost. Use 'skip', 'raise' or 'wait'."
        )
