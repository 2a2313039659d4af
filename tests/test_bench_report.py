"""bench_decode's report (tests/bench/decode_report.py): per-round read ceilings and paired
ratios. The benchmark itself is not collected (it builds models and runs llama.cpp); its
arithmetic is checked here on made-up rows."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))

from decode_report import Report, Row, median_row, paired_ratios, spell_lines  # noqa: E402


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


def _bracketed(engine: str, samples: list[list[tuple[float, float, float]]]) -> Row:
    """An engine's rows over rounds, each round's repeats as (tok/s, GB/s before, after)."""
    rows = [
        Row(
            engine,
            sorted(t for t, _, _ in rnd)[len(rnd) // 2],
            100.0,
            "note",
            {
                "round": i,
                "decode_all": [t for t, _, _ in rnd],
                "decode_bw": [[b * 1e9, a * 1e9] for _, b, a in rnd],
            },
        )
        for i, rnd in enumerate(samples)
    ]
    row = median_row(rows)
    row.bytes_per_token = 10**8
    return row


def test_spell_lines_compare_engines_within_a_bandwidth_level() -> None:
    # ours ran in the slow spell (37 GB/s) in round 0 and the fast one (68) in round 1; the peer
    # the other way round: the plain medians tie, within each spell ours is 1.2x
    ours = _bracketed("a", [[(36.0, 37, 37), (36.0, 37, 38)], [(60.0, 68, 68), (60.0, 68, 67)]])
    peer = _bracketed(
        "b",
        [[(50.0, 68, 68), (50.0, 68, 69), (99.0, 37, 68)], [(30.0, 37, 37), (30.0, 37, 37)]],
    )
    lines = spell_lines([ours, peer], (("a", "b"),))
    assert "1 repeat(s) that straddled a change left out" in lines[0]  # the 37 -> 68 one
    assert "slow below 50.3 GB/s" in lines[0]  # sqrt(37 * 68.5): the lowest and highest steady
    assert lines[1] == (
        "a / b: slow (~37 GB/s): 1.20x (36.0 vs 30.0 tok/s; 10% vs 8% of the read; repeats 2, 2),"
        " fast (~68 GB/s): 1.20x (60.0 vs 50.0 tok/s; 9% vs 7% of the read; repeats 2, 2)"
    )
    report = Report([50e9], 10**8, 2, [ours, peer], (("a", "b"),))
    assert lines[1] in report.table()


def test_spell_lines_one_spell_and_missing_sides() -> None:
    ours = _bracketed("a", [[(40.0, 40, 41)]])
    peer = _bracketed("b", [[(20.0, 42, 42)]])
    lines = spell_lines([ours, peer], (("a", "b"), ("a", "c")))
    assert "one spell, 40.5-42.0 GB/s" in lines[0]
    assert lines[1].startswith("a / b: all (~41 GB/s): 2.00x")
    assert len(lines) == 2  # no line for a pair whose peer never ran
    # a spell only one engine saw is said so, not compared
    fast = _bracketed("b", [[(20.0, 80, 80)]])
    assert "fast: - (peer only)" in spell_lines([ours, fast], (("a", "b"),))[1]
    # rows from workers that did not bracket their repeats: no lines at all
    assert spell_lines([median_row([Row("a", 1.0)])], (("a", "b"),)) == []
