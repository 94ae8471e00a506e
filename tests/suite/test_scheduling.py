"""make test's hand-out of modules to xdist's workers (tests/scheduling.py),
driven as xdist drives it: workers collect, the run starts, tests complete."""

from __future__ import annotations

from types import SimpleNamespace

from tests.scheduling import LongFirstScheduling

#: In line as conftest orders them: three long modules of one test (fault
#: groups), a long module of many, then quick modules.
LINE = {
    "test_fault_a.py": 1,
    "test_fault_b.py": 1,
    "test_fault_c.py": 1,
    "test_recovery.py": 5,
    "test_quick_1.py": 4,
    "test_quick_2.py": 4,
    "test_quick_3.py": 4,
    "test_quick_4.py": 4,
}
COLLECTION = [
    f"{module}::test_{n}" for module, count in LINE.items() for n in range(count)
]


class Worker:
    """What the scheduler sees of an xdist worker: tests sent, a shutdown."""

    def __init__(self, name: str) -> None:
        self.gateway = SimpleNamespace(id=name)
        self.sent: list[str] = []
        self.shutting_down = False

    def send_runtest_some(self, indices: list[int]) -> None:
        self.sent += [COLLECTION[i] for i in indices]

    def shutdown(self) -> None:
        self.shutting_down = True

    def modules(self) -> list[str]:
        return list(dict.fromkeys(test.partition("::")[0] for test in self.sent))


class Run:
    """``workers`` workers that have collected ``COLLECTION``, the run started."""

    def __init__(self, workers: int) -> None:
        config = SimpleNamespace(
            getvalue=lambda name: [f"{workers}*popen"] if name == "tx" else None,
            option=SimpleNamespace(loadscopereorder=False),
        )
        self.scheduler = LongFirstScheduling(config, None)
        self.workers = [Worker(f"gw{i}") for i in range(workers)]
        for worker in self.workers:
            self.scheduler.add_node(worker)
            self.scheduler.add_node_collection(worker, COLLECTION)
        self.scheduler.schedule()

    def complete(self, worker: Worker, test: str) -> None:
        self.scheduler.mark_test_complete(worker, COLLECTION.index(test))

    def waiting(self, worker: Worker) -> list[str]:
        """The tests ``worker`` was sent and has not completed, in order."""
        work = self.scheduler.assigned_work.get(worker, {})
        done = {test for tests in work.values() for test, flag in tests.items() if flag}
        return [test for test in worker.sent if test not in done]


def test_a_worker_on_a_one_test_module_waits_with_a_quick_one_behind_it():
    run = Run(2)
    first, second = run.workers
    # xdist's own loadfile gives the first worker fault_a, then fault_c behind
    # it (fault_a leaves it "nearly done"): two long modules on one worker.
    assert first.modules() == ["test_fault_a.py", "test_quick_4.py"]
    assert second.modules() == ["test_fault_b.py", "test_quick_3.py"]
    # The long modules still in line go to whichever worker comes free.
    run.complete(second, "test_fault_b.py::test_0")
    assert second.modules() == ["test_fault_b.py", "test_quick_3.py"]
    for n in range(2):
        run.complete(second, f"test_quick_3.py::test_{n}")
    assert second.modules()[-1] == "test_fault_c.py"
    assert "test_fault_c.py" not in first.modules()


def test_a_worker_near_the_end_of_a_large_module_takes_the_next_in_line():
    run = Run(2)
    first = run.workers[0]
    run.complete(first, "test_fault_a.py::test_0")
    assert first.modules() == ["test_fault_a.py", "test_quick_4.py"]
    for n in range(2):
        run.complete(first, f"test_quick_4.py::test_{n}")
    # Two left of quick_4 (not a small module): the next in line, a long one.
    assert first.modules()[-1] == "test_fault_c.py"


def test_every_test_is_handed_out_once_and_every_worker_let_go():
    run = Run(3)
    for _ in range(len(COLLECTION)):
        for worker in run.workers:
            waiting = run.waiting(worker)
            # A worker runs a test once it knows the next (or is let go).
            if len(waiting) > 1 or (waiting and worker.shutting_down):
                run.complete(worker, waiting[0])
    sent = [test for worker in run.workers for test in worker.sent]
    assert sorted(sent) == sorted(COLLECTION)
    assert all(
        worker.shutting_down and not run.waiting(worker) for worker in run.workers
    )
