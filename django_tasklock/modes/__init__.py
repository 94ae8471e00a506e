"""The modes of ``@single_instance``, one small class each, chosen by name.

Each mode says what happens when a call is published (``on_publish``: the lock
id its pending call is held under, if it publishes at all) and what happens when
it runs (``on_run``). A new mode is one module here and one entry in ``MODES``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from .base import Mode
from .coalesce import Coalesce
from .limited import Limited
from .until_finished import UntilFinished
from .until_started import UntilStarted
from .while_running import WhileRunning

if TYPE_CHECKING:
    from ..options import Options

__all__ = ["LIMITED", "MODES", "Mode", "mode_for", "queue_lock_id"]

#: The modes by the name ``mode=`` takes.
MODES: Final[dict[str, Mode]] = {
    mode.name: mode
    for mode in (WhileRunning(), UntilFinished(), UntilStarted(), Coalesce())
}
#: ``limit=N`` (N > 1) with the default mode: a Semaphore's N slots.
LIMITED: Final = Limited()


def mode_for(options: Options) -> Mode:
    """The mode a decorator's options choose."""
    if options.limit is not None and options.limit != 1:
        return LIMITED
    return MODES[options.mode]


def queue_lock_id(lock_id: str, mode: str) -> str:
    """The lock id a pending call of ``mode`` is held under."""
    return MODES[mode].on_publish(lock_id)
