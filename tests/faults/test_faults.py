"""The fault suite (reliability/faults.py) at its quick sizes, asserting on every row:
its first group of parts here, the others in ``test_faults_calls.py`` and
``test_faults_deployments.py`` (``tests/faults_checks.py``)."""

from __future__ import annotations

import pytest

from reliability.faults import PARTS, Row, bad
from tests.faults_checks import FIGURES, GROUPS, run_group, table_rows

pytestmark = pytest.mark.long(seconds=100)


def test_table_rows_are_read_by_column():
    from reliability.faults import render

    out = render(
        [
            Row("16. a case named 5 -> 2", 1, 0, 0, figures=["fig 3 4"]),
            Row("2. by design", 7, 7, 0, by_design=True),
        ],
        "command",
    )
    assert table_rows(out) == [
        ("16. a case named 5 -> 2", "1", "0", "", "0", "fig 3 4"),
        ("2. by design", "7", "7", " (b)", "0", "-"),
    ]


def test_bad_rows_are_the_ones_that_break_a_promise():
    assert bad([Row("ok", 3, 0, 0)]) == []
    assert bad([Row("by design", 3, 3, 0, by_design=True)]) == []
    for row in (
        Row("overlap", 3, 1, 0),
        Row("wrong", 3, 0, 1),
        Row("never ran", 0, 0, 0),
        Row("never ran, nothing to overlap", 0, None, 0),
        Row("an overlap missing from a case that builds one", 3, 2, 0, True),
    ):
        assert bad([row]) == [row]


def test_a_failure_says_which_row_failed_and_why():
    from reliability.faults import render
    from tests.faults_checks import failures

    first, *rest = PARTS["basics"]
    out = render(
        [
            Row(
                f"{first}. a case that overlapped", 3, 1, 0, figures=["2 held at once"]
            ),
            Row("2. by design, overlap missing", 7, 6, 0, by_design=True),
            Row(f"{rest[0]}. a wrong one", 5, 0, 2, figures=["fence went back"]),
        ],
        "command",
    )
    said = failures(("basics",), out)
    assert (
        f"{first}. a case that overlapped: overlaps expected 0, seen 1; why: "
        "2 held at once" in said
    )
    assert (
        "2. by design, overlap missing: overlaps expected (b) all 7, seen 6 (b); why: -"
        in said
    )
    assert (
        f"{rest[0]}. a wrong one: wrong expected 0, seen 2; why: fence went back"
        in said
    )
    missing = [line for line in said if line.startswith("row ")]
    assert len(missing) == len(rest) - 1, said
    figures = [line for line in said if line.startswith("part basics: figures: ")]
    assert len(figures) == 1 and "faults_checks.py:" in figures[0], said
    # A run with nothing wrong says nothing.
    assert failures((), render([], "command")) == []


def test_a_starved_holder_told_of_its_loss_is_said_so_and_not_wrong():
    from reliability.deployments import LAPSED, LIVENESS, Outcome, _row

    def run(kept, stall, taken=0):
        return Outcome(tries=5, taken=taken, kept=kept, released=kept, stall=stall)

    fine = run(True, 0.1)
    starved = run(False, LIVENESS)  # told, nobody took it, stood still long
    told_unstarved = run(False, 0.2)  # told with no stall: a broken put-back
    taken = run(False, LIVENESS, taken=1)  # a second holder: never excused
    row = _row("40. case", [fine, starved])
    assert row.wrong == 0 and row.overlaps == 0
    assert any("holder starved and told it lost its lock 1" in f for f in row.figures)
    assert _row("40. case", [fine, told_unstarved]).wrong == 1
    second = _row("40. case", [taken])
    assert second.overlaps == 1 and second.wrong == 1
    # Its server stood still as long (row 37's SIGSTOP, stretched by a loaded
    # machine): told, nobody took it, the same safe direction.
    server = Outcome(tries=5, kept=False, released=True, server_stall=LIVENESS)
    assert _row("37. case", [fine, server]).wrong == 0
    server.server_stall = 0.2
    assert _row("37. case", [fine, server]).wrong == 1
    # Told by its own record's late renewal (a write delayed past the
    # record's sure life on a loaded machine), nobody took it: the same; a
    # loss told for another reason stays wrong, and says what told it.
    lapsed = run(False, 0.2)
    lapsed.told = f"check: this process's {LAPSED} (not renewed for 3s)"
    assert _row("40. case", [fine, lapsed]).wrong == 0
    told_unstarved.told = "renewing its liveness record: the lock was gone"
    wrong = _row("40. case", [fine, told_unstarved])
    assert wrong.wrong == 1
    assert any(
        "told renewing its liveness record: the lock was gone" in f
        for f in wrong.figures
    )


def test_the_groups_run_every_part_once_and_the_parts_every_row_once():
    parts = [part for group in GROUPS for part in group]
    assert sorted(parts) == sorted(PARTS) == sorted(FIGURES)
    numbers = [n for rows in PARTS.values() for n in rows]
    assert sorted(numbers) == list(range(1, 58))


@pytest.mark.slow
def test_fault_suite_quick_basics_semaphores_pools_recovery():
    run_group(GROUPS[0])
