"""The randomized fault checker (``reliability/checker.py``): its verdict,
a control run it must fail, and the short run of ``make test``.

The short run takes one flavour per commit (the flavours in turn as the
commit's seed, pytest-randomly's, changes), so that every flavour runs over a
few commits; ``make soak`` runs them all for as long as it is given.
"""

from __future__ import annotations

import contextlib
import sqlite3

import pytest

from reliability.checker import (
    FLAVOURS,
    Fault,
    Hold,
    Result,
    check,
    regressions,
    verdict,
)

pytestmark = [pytest.mark.slow, pytest.mark.long(seconds=95)]


def hold(client: str, start: float, last: float) -> Hold:
    return Hold("x", client, start, last, token=f"{client}-{start}")


def test_the_verdict_names_holds_that_overlapped_while_both_believed():
    result = Result("pool", seed=1)
    holds = [hold("a", 0.0, 5.0), hold("b", 5.5, 7.0), hold("c", 6.0, 6.5)]
    verdict(result, holds, [Fault(3.0, "pause-server", "server-0", 1.0)])
    # a and b never overlapped; c began while b believed: one violation,
    # printed with the seed and the fault before it.
    assert len(result.violations) == 1, result.violations
    assert "seed 1" in result.violations[0] and "pause-server" in result.violations[0]
    assert "'x' held by b" in result.violations[0]


def test_an_overlap_after_a_fault_that_loses_locks_by_design_is_counted_apart():
    result = Result("pool", seed=1)
    holds = [hold("a", 0.0, 5.0), hold("b", 2.0, 3.0)]
    verdict(result, holds, [Fault(1.0, "flush", "server-0")])
    assert result.violations == [] and result.by_design == 1


def fenced(client: str, start: float, last: float, let_go: float, fence: int) -> Hold:
    made = hold(client, start, last)
    made.fence, made.let_go, made.ended = fence, let_go, True
    return made


def test_a_newer_hold_begun_before_the_older_was_let_go_needs_a_larger_fence():
    """The older holder stopped believing at 2 s (told it lost its lock) but
    let it go at 6 s: a write it made in between is what fences are for. A
    newer hold from 3 s must have drawn a larger fence; unless a fault that
    loses locks (and counters) by design came between."""
    result = Result("pool", seed=1)
    verdict(result, [fenced("a", 0, 2, 6, 10), fenced("b", 3, 5, 5, 10)], [])
    assert result.violations == [] and len(result.fence_inversions) == 1
    assert "a fence 10, then b fence 10" in result.fence_inversions[0]
    larger = Result("pool", seed=1)
    verdict(larger, [fenced("a", 0, 2, 6, 10), fenced("b", 3, 5, 5, 11)], [])
    assert larger.fence_inversions == []
    flushed = Result("pool", seed=1)
    flush = [Fault(2.5, "flush", "server-0")]
    verdict(flushed, [fenced("a", 0, 2, 6, 10), fenced("b", 3, 5, 5, 9)], flush)
    assert flushed.fence_inversions == []
    after = Result("pool", seed=1)  # begun after the older was let go
    verdict(after, [fenced("a", 0, 2, 6, 10), fenced("b", 7, 8, 8, 9)], [])
    assert after.fence_inversions == []


def test_with_the_restart_grace_off_the_checker_finds_robbed_holders():
    """The control: memcached restarted empty under live holders, with
    RESTART_GRACE 0 and no liveness records, hands their locks out again at
    once, and the checker must see it."""
    result = check(
        "memcached",
        seconds=40,
        clients=5,
        seed=5,
        quiet=True,
        tasklock={"RESTART_GRACE": 0, "LIVENESS": None},
        kinds=["kill-server"],
    )
    assert result.faults["kill-server"] >= 3, result.faults
    assert result.violations, (result.row(), result.holds)
    # The robbed holders wrote the fenced register too: the database took
    # no write older than one it took before.
    assert result.writes["applied"] >= 10, result.register_row()
    assert result.regressions == [], "\n".join(result.regressions)


def test_the_register_history_names_a_write_older_than_one_before(tmp_path):
    path = tmp_path / "register.sqlite3"
    with contextlib.closing(sqlite3.connect(path)) as db, db:
        db.execute(
            "CREATE TABLE fenced_registerwrite (id INTEGER PRIMARY KEY, "
            "register TEXT, fence INTEGER, client TEXT)"
        )
        db.executemany(
            "INSERT INTO fenced_registerwrite (register, fence, client) "
            "VALUES (?, ?, ?)",
            [("x", 5, "a"), ("y", 1, "b"), ("x", 7, "b"), ("x", 7, "b"), ("x", 6, "a")],
        )
    assert regressions(path) == ["register x: a wrote fence 6 after b wrote fence 7"]


def test_the_short_run_finds_no_violation(request):
    seed = request.config.getoption("randomly_seed")
    seed = seed if isinstance(seed, int) else 0
    flavour = FLAVOURS[seed % len(FLAVOURS)]
    result = check(flavour, seconds=40, clients=4, seed=seed, quiet=True)
    print(result.row())
    assert result.holds >= 10 and sum(result.faults.values()) >= 5, result.row()
    assert result.violations == [], "\n".join(result.violations)
    assert result.fence_inversions == [], "\n".join(result.fence_inversions)
    print(result.register_row())
    assert result.writes["applied"] >= 10, result.register_row()
    assert result.regressions == [], "\n".join(result.regressions)


def test_the_calls_verdict_names_a_call_run_twice_and_a_parked_call_lost(tmp_path):
    import json

    from reliability.checker import calls_verdict

    path = tmp_path / "witness.jsonl"
    records = [
        {"e": "call", "call": "c1", "t": 1.0},
        {"e": "parked", "call": "c1", "t": 1.1, "head": False},
        {"e": "start", "call": "c1", "t": 2.0, "tok": "a"},
        {"e": "start", "call": "c1", "t": 9.0, "tok": "b"},  # twice
        {"e": "parked", "call": "c2", "t": 3.0, "head": False},  # lost
        {"e": "parked", "call": "c3", "t": 3.0, "head": False},
        {"e": "dropped", "call": "c3", "t": 4.0},  # told
        {"e": "parked", "call": "c4", "t": 3.0, "head": False},
        {"e": "line", "id": "x", "parked": ["c4"], "promoted": []},  # still there
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    result = Result("postgres", seed=1)
    calls_verdict(result, path, [Fault(5.0, "kill-server", "server-0", 0.0)])
    assert sorted(v.split(" (")[0].split(" ran")[0] for v in result.violations) == [
        "parked call c1",
        "parked call c2",
    ], result.violations
    # On memcached a restart empties the store: the same is by design there.
    result = Result("memcached", seed=1)
    calls_verdict(result, path, [Fault(5.0, "kill-server", "server-0", 0.0)])
    assert result.violations == [] and result.by_design == 2
    # A promotion loses them where the primary replicated asynchronously.
    result = Result("postgres", seed=1)
    calls_verdict(result, path, [Fault(5.0, "promote", "server-0")], {"promote"})
    assert result.violations == [] and result.by_design == 2
    # Without the drain's record of the lines, losses cannot be judged: said.
    path.write_text("".join(json.dumps(r) + "\n" for r in records[:-1]))
    result = Result("postgres", seed=1)
    calls_verdict(result, path, [])
    assert "drain wrote nothing" in result.violations[-1]
