"""``while_running`` (the default): the lock is held while the body runs.

Nothing happens when a call is published; a run takes the lock when it starts
and frees it when it ends. A second run meanwhile meets the lock and does what
``on_contention`` says.
"""

from __future__ import annotations

from .base import Mode

__all__ = ["WhileRunning"]


class WhileRunning(Mode):
    name = "while_running"
    publishes = False
