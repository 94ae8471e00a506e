"""What the fault suite's quick run must show, part by part (``reliability/faults``).

The suite runs in three groups of parts (``GROUPS``), each from a test module of
its own (``tests/test_faults*.py``) so that they run side by side: most of a
part's time is spent waiting on servers, workers and expiries.
"""

from __future__ import annotations

import re
import traceback
from collections.abc import Callable

import pytest

from reliability.faults import PARTS
from reliability.recovery import LIVENESS, SLACK, TARGET
from tests.services import module_run

#: The parts each test module runs; together, every part once.
GROUPS: tuple[tuple[str, ...], ...] = (
    ("basics", "semaphores", "pools", "recovery"),
    ("calls", "limits", "unknown", "cluster"),
    ("deployments", "lifecycle", "postgres", "fenced", "waiting", "parking"),
)
#: The cases that make a holder outlive its lock on purpose.
BY_DESIGN = {"2.", "3.", "9.", "31.", "54."}
#: The cases with no second holder to overlap with (shown as "-").
NO_OVERLAP = {"19.", "20.", "21.", "24.", "27.", "36.", "43."}

Table = tuple[str, str, str, str, str, str]


def table_rows(out: str) -> list[Table]:
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


def run_group(group: tuple[str, ...]) -> None:
    """Run ``group``'s parts at their quick sizes and check every row: all the
    rows those parts give, each carried out, nothing wrong, overlaps only where
    the case builds one, and each part's own figures. A failure prints the
    run's output, then one line per failed row or figure: what was expected,
    what was seen, and the row's figures (why)."""
    parts = [argument for part in group for argument in ("--part", part)]
    # Not run_module: a failed run's rows are read before it is failed.
    result = module_run("reliability.faults", "--quick", *parts, timeout=900)
    out = result.stdout + (result.stderr if result.returncode else "")
    failed = failures(group, out)
    if result.returncode and not failed:  # it failed, and no row says why
        failed = [f"the run exited {result.returncode} with every row as it must be"]
    if failed:
        pytest.fail(
            f"{out}\n{len(failed)} failed:\n" + "\n".join(failed), pytrace=False
        )


def failures(group: tuple[str, ...], out: str) -> list[str]:
    """One line per row of ``group``'s parts in ``out`` that broke a promise
    (case, column, expected, seen, why), and per part whose figures did not
    come out as they must."""
    table = table_rows(out)
    expected = {f"{n}." for part in group for n in PARTS[part]}
    rows = {row[0].split(" ", 1)[0]: row for row in table}
    failed = [
        f"row {number} missing: its part ended before it (see its output above)"
        for number in sorted(expected - set(rows), key=lambda n: int(n[:-1]))
    ]
    for case, attempts, overlapping, marked, wrong, figures in table:
        number = case.split(" ", 1)[0]
        if number in BY_DESIGN:
            want = ("(b)", f"all {attempts}")
            ok = bool(marked) and overlapping == attempts
        elif number in NO_OVERLAP:
            want, ok = ("", "-"), not marked and overlapping == "-"
        else:
            want, ok = ("", "0"), not marked and overlapping == "0"
        checks = [
            ("attempts", "more than 0", attempts, int(attempts) > 0),
            ("wrong", "0", wrong, int(wrong) == 0),
            ("overlaps", " ".join(want).strip(), f"{overlapping}{marked}", ok),
        ]
        failed += [
            f"{case}: {column} expected {wanted}, seen {seen}; why: {figures}"
            for column, wanted, seen, fine in checks
            if not fine
        ]
    for part in group:
        try:
            FIGURES[part](out, rows)
        except (AssertionError, KeyError, AttributeError, ValueError) as error:
            line = traceback.extract_tb(error.__traceback__)[-1]
            said = f" ({error})" if str(error) else ""
            failed.append(
                f"part {part}: figures: {line.line}{said} "
                f"(tests/faults_checks.py:{line.lineno})"
            )
    return failed


def _basics(out: str, rows: dict[str, Table]) -> None:
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


def _lifecycle(out: str, rows: dict[str, Table]) -> None:
    renewed = re.search(
        r"rivals refused (\d+)/(\d+) over 3 expiries.+?free (\d+\.\d)", out
    )
    assert (
        renewed and renewed.group(1) == renewed.group(2) and int(renewed.group(2)) > 10
    )
    assert float(renewed.group(3)) <= 2 + 0.5
    assert re.search(r"holder told 1/1, \d+-\d+ ms after SIGCONT; newer fence 1/1", out)
    assert "a rival took it only after that 1/1" in out
    assert "holder told before a rival took it 2/2" in out


def _unknown(out: str, rows: dict[str, Table]) -> None:
    assert "wrong replies 0 of 800 reads each side" in out
    assert (
        "replies lost 2; the caller took its own lock 2/2; left held after release 0"
        in out
    )
    assert "removed by the watch 1/1" in out


def _semaphores(out: str, rows: dict[str, Table]) -> None:
    assert re.search(r"\d+ acquisitions, \d+ refused; most at once 3 \(limit 3\)", out)


def _pools(out: str, rows: dict[str, Table]) -> None:
    second = re.search(r"second holders (\d+)/(\d+) ids", rows["17."][5])
    assert second and second.group(1) == "0" and int(second.group(2)) > 0


def _calls(out: str, rows: dict[str, Table]) -> None:
    storm = re.search(r"(\d+) sends, (\d+) published, (\d+) ran, (\d+) joined", out)
    assert storm, out
    sends, published, ran, joined = map(int, storm.groups())
    assert published == ran and joined == sends - published > 0
    killed = re.search(r"key free (\d+\.\d)-(\d+\.\d)s after the kill", out)
    assert killed and float(killed.group(2)) <= 3 + 1
    lost = re.search(r"key free (\d+\.\d)-(\d+\.\d)s after the send", out)
    # As the row judges it: a 2 s mark on memcached's clock, sent as a time on
    # the server's own clock, lives up to n + 3 s (a loaded CI saw 3.2 s).
    assert lost and float(lost.group(1)) >= 1 and float(lost.group(2)) <= 2 + 3
    assert "error raised 2/2; keys left held 0" in out
    dropped = r"second deliveries dropped [1-9]\d*; runs per call 1-1"
    assert len(re.findall(dropped, out)) == 3
    assert "newer calls that took the mark 1/1" in out
    copy = re.search(
        r"the copy ran (\d+\.\d)-(\d+\.\d)s after the kill, the dead "
        r"run's lock having (\d+)-(\d+)s left",
        out,
    )
    assert copy and float(copy.group(2)) < int(copy.group(3)), out
    assert re.search(
        r"error raised 1/1; phantom mark removed 1/1, \d+-\d+ ms after SIGCONT; "
        r"the same call sent again published 1/1",
        out,
    )
    _calls_recovery(out)


def _calls_recovery(out: str) -> None:
    """Rows 28 and 29: crash recovery with the calls' workers."""
    again = re.search(r"same call ran again (\d+\.\d)-(\d+\.\d)s after the kill", out)
    assert again and float(again.group(2)) <= TARGET + SLACK, out
    far = re.search(r"ran on this host (\d+\.\d)-(\d+\.\d)s after the kill", out)
    assert far and float(far.group(2)) <= LIVENESS + 2 + SLACK, out
    assert "the other slot's live holder kept it 1/1" in out


def _limits(out: str, rows: dict[str, Table]) -> None:
    assert (
        "refused naming the server's reason 2/2; taken as 'no meta commands' or "
        "'no stats' 0; locked with meta commands once free 2/2; restart detected "
        "after 1/1" in out
    )


def _recovery(out: str, rows: dict[str, Table]) -> None:
    assert "kept its lock through the pause 1/1" in out
    assert "told at SIGCONT by check(), older fence, release refused 1/1" in out
    restart = re.search(r"refused (\d+\.\d)-(\d+\.\d)s after the restart", out)
    assert restart and float(restart.group(1)) >= LIVENESS - 2
    assert float(restart.group(2)) <= LIVENESS + SLACK
    stressed = re.search(r"(\d+) holders killed holding it .+ max (\d+\.\d+)s", out)
    assert stressed and int(stressed.group(1)) > 0
    assert float(stressed.group(2)) <= TARGET + SLACK


def _deployments(out: str, rows: dict[str, Table]) -> None:
    """A live holder never robbed (rows 34-43)."""
    for number in range(34, 43):
        if number != 36:
            assert re.search(
                r"\d+ tries, 0 took the live holder's lock", rows[f"{number}."][5]
            )
    assert "holder told 1/1" in rows["36."][5]
    beats = re.search(r"beats while it held: (\d+) in", rows["43."][5])
    # Over ten periods' span: at least half of them (a beat stopped by the
    # listing makes none), and the run's lock released after it.
    assert beats and int(beats.group(1)) >= 5
    assert "released 1/1" in rows["43."][5]


def _cluster(out: str, rows: dict[str, Table]) -> None:
    storm = re.search(r"most at once (\d+)", rows["44."][5])
    assert storm and storm.group(1) == "1"
    failover = rows["45."][5]
    assert "second holders 0/20 " in failover and "refused 20/20 " in failover
    # Every holder had its lock put back, or (starved past LIVENESS on a busy
    # machine) knew it lost: never taken from a holder that did not know.
    kept = re.search(
        r"put back by their live holders (\d+)/20 \(holders starved past "
        r"LIVENESS that knew their lock lost (\d+),",
        failover,
    )
    assert kept and int(kept.group(1)) + int(kept.group(2)) >= 20, failover
    assert "without the grace 20/20 retaken and 20 holders told" in failover
    moved = re.search(r"slot moved (\d+) times", rows["46."][5])
    assert moved and int(moved.group(1)) >= 2
    assert "kept 1/1, fence grew 1/1" in rows["46."][5]
    again = re.search(r"ran again (\d+\.\d)-(\d+\.\d)s after the kill", rows["47."][5])
    assert again and float(again.group(2)) <= TARGET + SLACK
    assert "the other slot's live holder kept it 1/1" in rows["47."][5]
    far = re.search(r"on this host (\d+\.\d)-(\d+\.\d)s after", rows["48."][5])
    # (Not before the dead worker's record lapsed: the row's own verdict.)
    assert far and float(far.group(2)) <= LIVENESS + 2 + SLACK


def _postgres(out: str, rows: dict[str, Table]) -> None:
    freed = re.search(r"lock free (\d+\.\d)-(\d+\.\d)s after the kill", rows["49."][5])
    assert freed and float(freed.group(2)) <= 3 + 2
    for number in ("50.", "51."):
        kept = re.search(
            r"second holders 0/(\d+); every holder kept its lock (\d+)/(\d+)",
            rows[number][5],
        )
        assert kept and kept.group(2) == kept.group(3) == kept.group(1) != "0"
    assert re.search(r"kept through the rollback (\d+)/\1", rows["52."][5])
    refused = re.search(r"refused for (\d+\.\d)-(\d+\.\d)s after", rows["53."][5])
    assert refused and float(refused.group(1)) >= 9
    assert "second holders 0/20" in rows["53."][5]


def _fenced(out: str, rows: dict[str, Table]) -> None:
    figures = rows["54."][5]
    late = re.search(
        r"late writes refused (\d+)/(\d+) \((\d+) by the database", figures
    )
    assert late and late.group(1) == late.group(2) != "0"
    # The flushed half's holders were told nothing: the database refused them.
    assert int(late.group(3)) >= int(late.group(2)) // 2
    kept = re.search(r"new holder's row kept (\d+)/(\d+)", figures)
    assert kept and kept.group(1) == kept.group(2)


def _waiting(out: str, rows: dict[str, Table]) -> None:
    from django_tasklock.locks.line import LONGEST, MARK
    from reliability.waiting import SLACK

    for number, bound in (("55.", MARK + 2 + LONGEST), ("56.", LONGEST)):
        took = re.findall(r"(\d+\.\d)-(\d+\.\d)s \((\w+)\)", rows[number][5])
        assert sorted(store for _, _, store in took) == [
            "PostgreSQL", "Redis", "memcached"
        ], rows[number][5]  # fmt: skip
        assert all(float(most) <= bound + SLACK for _, most, _ in took), took


def _parking(out: str, rows: dict[str, Table]) -> None:
    took = re.search(r"started (\d+\.\d)-(\d+\.\d)s after the kill", rows["57."][5])
    # Its holder's process gone on this host: recovered at once, sent by the
    # other node's next sweep (every second), not after the lock's expiry.
    assert took and float(took.group(2)) < 10, rows["57."][5]


#: Each part's own figures, checked on the output of a run that included it.
FIGURES: dict[str, Callable[[str, dict[str, Table]], None]] = {
    "basics": _basics,
    "lifecycle": _lifecycle,
    "unknown": _unknown,
    "semaphores": _semaphores,
    "pools": _pools,
    "calls": _calls,
    "limits": _limits,
    "recovery": _recovery,
    "deployments": _deployments,
    "cluster": _cluster,
    "postgres": _postgres,
    "fenced": _fenced,
    "waiting": _waiting,
    "parking": _parking,
}
