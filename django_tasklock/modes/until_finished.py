"""``until_finished``: a call holds its lock from ``.delay()`` until it is over.

Published: the call's lock is taken with its queued mark (``queued:<task id>``);
an identical ``.delay()`` meanwhile is a duplicate (``on_duplicate``). Run: the
worker takes the lock over from the call's own mark in one conditional write
(the mark of another call is contention), and frees it when the body ends. A
retry the body asks for (``self.retry()``, ``autoretry_for``) gets the lock
handed over as it is sent, never freed in between.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..calls import queued
from .base import Mode

if TYPE_CHECKING:
    from ..locks import Lock
    from ..runs import Run

__all__ = ["UntilFinished"]


class UntilFinished(Mode):
    name = "until_finished"

    def lock_for(self, run: Run) -> Lock:
        if run.call_id is None:  # called directly: as while_running
            return self.make_lock(run, run.lock_id)
        run.hands_over = True
        return self.make_lock(run, run.lock_id, take_over=queued(run.call_id))
