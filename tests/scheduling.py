"""How ``make test`` hands modules to pytest-xdist's workers (``--dist loadfile``).

xdist gives a worker another module as soon as it has two tests or fewer left
to run: a worker runs a test only once it knows the next one, so it always
holds one more. A worker busy with a module of one long test (a fault group,
a benchmark's smoke run) is "nearly done" from the start, and took the next
module in line, and then the next: in one run a single worker was handed all
three fault groups and ran 473 s, while the five others were done by 432 s.

Here such a worker is handed its next module from the far end of the line
(the quick modules, which ``conftest`` puts last) and the long modules go to
workers that are free. Modules are otherwise handed out in line, which
``conftest`` orders longest first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from xdist.scheduler import LoadFileScheduling

if TYPE_CHECKING:
    from xdist.workermanage import WorkerController

__all__ = ["SMALL", "LongFirstScheduling"]

#: A module of this many tests or fewer leaves its worker "nearly done" (xdist's
#: own mark) as soon as it starts.
SMALL = 2


class LongFirstScheduling(LoadFileScheduling):
    """xdist's ``loadfile``, but a worker running a small module gets the
    module that waits behind it from the end of the line."""

    def _reschedule(self, node: WorkerController) -> None:
        if node.shutting_down:
            return
        if not self.workqueue:
            node.shutdown()
            return
        work = self.assigned_work[node]
        if self._pending_of(work) > SMALL:
            return
        running = [tests for tests in work.values() if not all(tests.values())]
        behind_small = bool(running) and all(len(tests) <= SMALL for tests in running)
        self._hand_out(node, from_end=behind_small)

    def _assign_work_unit(self, node: WorkerController) -> None:
        self._hand_out(node, from_end=False)

    def _hand_out(self, node: WorkerController, *, from_end: bool) -> None:
        """Give ``node`` the first module in line (or the last) to run."""
        module, tests = self.workqueue.popitem(last=from_end)
        self.assigned_work.setdefault(node, {})[module] = tests
        collection = self.registered_collections[node]
        node.send_runtest_some(
            [collection.index(test) for test, done in tests.items() if not done]
        )
