"""bench_decode's report (tests/bench/decode_report.py): per-round read ceilings and paired
ratios. The benchmark itself is not collected (it builds models and runs llama.cpp); its
arithmetic is checked here on made-up rows."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))

from decode_report import Report, Row, median_row, paired_ratios  # noqa: E402


def _rounds(engine: str, decode: list[float]) -> list[Row]:
    return [Row(engine, tok_s, 100.0 + i, "note", {"round": i}) for i, tok_s in enumerate(decode)]


def test_median_row_keeps_each_round_by_its_number() -> None:
    rows = _rounds("a", [10.0, 30.0, 20.0])
    rows[1] = Row("a", note="worker failed", extra={"round": 1})  # a round that failed
    row = median_row(rows)
    assert row.decode_tok_s == 15.0  # median of 10 and 20
    assert row.extra["decode_rounds"] == {0: 10.0, 2: 20.0}
    assert row.extra["prefill_rounds"] == {0: 100.0, 2: 102.0}
    assert row.note == "note, rounds 2 of 3 (1 failed: worker failed)"  # not dropped unsaid
    assert median_row(_rounds("a", [10.0, 20.0])).note == "note, rounds 2"


def test_roofline_is_taken_against_each_rounds_own_ceiling() -> None:
    # the machine read twice as fast in round 1: the engine's speed there counts against that
    ours = median_row(_rounds("a", [50.0, 100.0, 60.0]))
    ours.bytes_per_token = 10**8
    report = Report([10e9, 20e9, 10e9], 10**9, 2, [ours])
    # per round: 0.5, 0.5, 0.6 -> median 0.5 (the medians alone: 60 * 1e8 / 10e9 = 0.6)
    assert abs(report.roofline_fraction(ours) - 0.5) < 1e-12
    assert report.read_bytes_s == 10e9
    table = report.table()
    assert "rounds: 10.0, 20.0, 10.0" in table
    assert " 50%" in table


def test_paired_ratios_pair_rounds_both_engines_ran() -> None:
    ours = median_row(_rounds("a", [110.0, 60.0, 120.0]))
    peer = median_row(_rounds("b", [100.0, 50.0, 200.0]))
    # rounds 0, 1, 2: 1.10, 1.20, 0.60 -> median 1.10 (ratio of medians 110 / 100 = 1.10 too)
    assert paired_ratios(ours, peer) == " (paired rounds: median 1.10x of 1.10, 1.20, 0.60)"
    peer_one = median_row(_rounds("b", [100.0]))
    assert paired_ratios(ours, peer_one) == ""  # one shared round: nothing to take a median of
    report = Report([1e9], 10**8, 2, [ours, peer], (("a", "b"),))
    assert "a / b: decode 1.10x (paired rounds: median 1.10x" in report.table()
