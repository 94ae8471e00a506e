"""The run of an ``async def`` function under ``@single_instance``: ``Mode.on_run``
with the lock taken, waited for and released on the event loop.

Only a call made in place (awaited, by code or by a task runner that awaits it
as a plain call) runs here: every mode then acts as ``while_running`` does for
a direct call, and the contention policies skip, raise or wait. The worker
side of the publishing modes and ``retry`` are refused when the function is
decorated (``refuse_async``): they need a sync task.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..conf import settings
from ..locks.roster import note_run
from ..policies import CONTENTION
from ..runs import enclosing, held

if TYPE_CHECKING:
    from ..options import Options
    from ..runs import Run
    from .base import Mode

__all__ = ["arun", "refuse_async"]


async def arun(mode: Mode, run: Run) -> Any:
    """Take the run's lock as the contention policy says, await the body as
    the current lock, release the lock after it."""
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
    note_run(lock, run)
    reset = held.set((*held.get(), run))
    try:
        return await run.func(*run.args, **run.kwargs)
    finally:
        held.reset(reset)
        await lock.arelease_quietly()


def refuse_async(name: str, mode: Mode, options: Options) -> None:
    """A TypeError, at decoration, for what an ``async def`` cannot have yet."""
    if mode.publishes:
        raise TypeError(
            f"@single_instance(mode={mode.name!r}) on {name}, an async def "
            "function: the worker side of a published call's mode runs sync tasks "
            "only for now. Use mode='while_running' (the default; limit= too), "
            "or a sync function for the task."
        )
    if options.on_contention == "retry":
        raise TypeError(
            f"@single_instance(on_contention='retry') on {name}, an async def "
            "function: nothing can send a call of it again (Celery runs sync "
            "tasks), so a duplicate would be lost. Use 'skip', 'raise' or 'wait'."
        )
