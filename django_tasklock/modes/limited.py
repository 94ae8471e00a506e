"""``limit=N``: at most N runs at once per lock id, a ``Semaphore``'s slots.

As ``while_running``, with N slots instead of one lock; the contention policy
applies when every slot is held. Slots do not name the call, so a second
delivery is not told apart (there is no pending call to match it to).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..semaphores import Semaphore
from .while_running import WhileRunning

if TYPE_CHECKING:
    from ..runs import Run

__all__ = ["Limited"]


class Limited(WhileRunning):
    name = "limit"

    def lock_for(self, run: Run) -> Semaphore:
        assert run.options.limit is not None
        semaphore = Semaphore(
            run.lock_id,
            limit=run.options.limit,
            oid=run.oid,
            max_hold=run.max_hold,
            **run.options.lock_options,
        )
        semaphore.about = run
        return semaphore
