"""The modes of ``@single_instance``, one small class each, chosen by name.

Each mode owns its whole life. Published: the lock id its pending call is held
under (``on_publish``), which holder a new call may replace (``may_replace``),
the lock ids a call of it holds for status and clean-up (``lock_ids``,
``left_by``); the claim loop both publishers run is ``publishing.claim``. Run:
``on_run``. A new mode is one module here and one entry in ``MODES``.
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

__all__ = ["LIMITED", "MODES", "Mode", "mode_for"]

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
