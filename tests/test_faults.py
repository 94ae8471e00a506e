"""The fault suite (reliability/faults.py) at its quick sizes, asserting on every row."""

from __future__ import annotations

import re

import pytest

from reliability.faults import Row, bad
from reliability.recovery import LIVENESS, SLACK, TARGET
from tests.services import run_module


def table_rows(out: str) -> list[tuple[str, str, str, str, str, str]]:
    """The table's rows, read by column (render() pads every column to its width):
    (case, attempts, overlaps, " (b)" or "", wrong, figures)."""
    rows = []
    for line in out.splitlines():
        if not re.match(r"^    \d+\. ", line):
            continue
        overlaps = line[60:70].strip()
        rows.append(
            (
                line[4:50].strip(),
                line[51:59].strip(),
                overlaps.removesuffix(" (b)"),
                " (b)" if overlaps.endswith(" (b)") else "",
                line[71:76].strip(),
                line[78:],
            )
        )
    return rows


#: The cases that make a holder outlive its lock on purpose.
BY_DESIGN = {"2.", "3.", "9.", "31."}
#: The cases with no second holder to overlap with (shown as "-").
NO_OVERLAP = {"19.", "20.", "21.", "24.", "27.", "36.", "43."}


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


@pytest.mark.slow
def test_fault_suite_quick():
    out = run_module("reliability.faults", "--quick", timeout=900)
    rows = {row[0].split(" ", 1)[0]: row for row in table_rows(out)}
    assert set(rows) == {f"{n}." for n in range(1, 44)}, out
    for number, (case, attempts, overlapping, marked, wrong, figures) in rows.items():
        assert int(attempts) > 0, case
        assert int(wrong) == 0, f"{case}: {figures}"
        if number in BY_DESIGN:
            assert marked and int(overlapping) == int(attempts), f"{case}: {figures}"
        elif number in NO_OVERLAP:
            assert not marked and overlapping == "-", f"{case}: {figures}"
        else:
            assert not marked and int(overlapping) == 0, f"{case}: {figures}"
    acquisitions = re.search(r"(\d+) acquisitions, (\d+) refused", rows["1."][5])
    assert acquisitions and int(acquisitions.group(1)) >= 300
    assert int(rows["1."][1]) == sum(map(int, acquisitions.groups()))
    assert "first holder told 1/1, left the new lock alone, newer fence 1/1" in out
    freed = re.search(r"lock free (\d+\.\d)-(\d+\.\d)s and next run", out)
    assert freed and float(freed.group(2)) <= 3 + 1.5, "outlived its expiry"
    assert "said the lock went with the server 2/2, free after restart 2/2" in out
    assert "resumed without restart 2/2" in out
    assert "without a clear error or check message: 0" in out
    assert "ids never held 0; keys left behind 0; fencing counters kept 0" in out
    renewed = re.search(
        r"rivals refused (\d+)/(\d+) over 3 expiries.+?free (\d+\.\d)", out
    )
    assert (
        renewed and renewed.group(1) == renewed.group(2) and int(renewed.group(2)) > 10
    )
    assert float(renewed.group(3)) <= 2 + 0.5
    assert re.search(r"holder told 1/1, \d+-\d+ ms after SIGCONT; newer fence 1/1", out)
    assert "wrong replies 0 of 800 reads each side" in out
    assert (
        "replies lost 2; the caller took its own lock 2/2; left held after release 0"
        in out
    )
    assert "a rival took it only after that 1/1" in out
    assert "holder told before a rival took it 2/2" in out
    assert "removed by the watch 1/1" in out
    storm = re.search(r"(\d+) sends, (\d+) published, (\d+) ran, (\d+) joined", out)
    assert storm, out
    sends, published, ran, joined = map(int, storm.groups())
    assert published == ran and joined == sends - published > 0
    killed = re.search(r"key free (\d+\.\d)-(\d+\.\d)s after the kill", out)
    assert killed and float(killed.group(2)) <= 3 + 1
    lost = re.search(r"key free (\d+\.\d)-(\d+\.\d)s after the send", out)
    assert lost and float(lost.group(1)) >= 1 and float(lost.group(2)) <= 3
    assert "error raised 2/2; keys left held 0" in out
    assert (
        len(re.findall(r"second deliveries dropped [1-9]\d*; runs per call 1-1", out))
        == 3
    )
    assert "newer calls that took the mark 1/1" in out
    copy = re.search(r"the copy ran (\d+\.\d)-(\d+\.\d)s after the kill, the dead "
                     r"run's lock having (\d+)-(\d+)s left", out)  # fmt: skip
    assert copy and float(copy.group(2)) < int(copy.group(3)), out
    assert re.search(
        r"error raised 1/1; phantom mark removed 1/1, \d+-\d+ ms after SIGCONT; "
        r"the same call sent again published 1/1",
        out,
    )
    assert (
        "refused naming the server's reason 2/2; taken as 'no meta commands' or "
        "'no stats' 0; locked with meta commands once free 2/2; restart detected "
        "after 1/1" in out
    )
    assert re.search(r"\d+ acquisitions, \d+ refused; most at once 3 \(limit 3\)", out)
    # Crash recovery (rows 28-33).
    again = re.search(r"same call ran again (\d+\.\d)-(\d+\.\d)s after the kill", out)
    assert again and float(again.group(2)) <= TARGET + SLACK, out
    far = re.search(r"ran on this host (\d+\.\d)-(\d+\.\d)s after the kill", out)
    assert far and float(far.group(2)) <= LIVENESS + 2 + SLACK, out
    assert "kept its lock through the pause 1/1" in out
    assert "told at SIGCONT by check(), older fence, release refused 1/1" in out
    restart = re.search(r"refused (\d+\.\d)-(\d+\.\d)s after the restart", out)
    assert restart and float(restart.group(1)) >= LIVENESS - 2
    assert float(restart.group(2)) <= LIVENESS + SLACK
    assert "the other slot's live holder kept it 1/1" in out
    stressed = re.search(r"(\d+) holders killed holding it .+ max (\d+\.\d+)s", out)
    assert stressed and int(stressed.group(1)) > 0
    assert float(stressed.group(2)) <= TARGET + SLACK
    # A live holder never robbed (rows 34-43).
    for number in range(34, 43):
        if number != 36:
            assert re.search(
                r"\d+ tries, 0 took the live holder's lock", rows[f"{number}."][5]
            )
    assert "holder told 1/1" in rows["36."][5]
    beats = re.search(r"beats while it held: (\d+) in", rows["43."][5])
    assert beats and int(beats.group(1)) >= 10
