"""Cache-policy replay: simulators against the traces' published reference results, policy
ordering, the engine JSONL format and `ftctl bench cache --json`."""

from __future__ import annotations

import csv
import json
from dataclasses import replace
from pathlib import Path

import pytest

from freetokend.experts.replay import (
    MIB,
    POLICIES,
    Trace,
    num_slots_for,
    read_granite_json,
    read_jsonl,
    read_trace,
    replay_ram_cache,
    replay_slot_cache,
    run_policies,
    simulate_belady,
    simulate_lru,
)
from freetokend.experts.slot_cache import EvictionPolicy

TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "routing-traces"
BIG = TRACES / "bigmoeonedge"
pytestmark = pytest.mark.skipif(not TRACES.is_dir(), reason=f"routing traces not found at {TRACES}")


def reference_curve(name: str) -> dict[tuple[int, str], float]:
    """(budget MiB, policy) -> decode hit % from reference/<name>-curve.csv."""
    with open(BIG / "reference" / f"{name}-curve.csv") as f:
        return {
            (int(r["budget_mib"]), r["policy"]): float(r["hit_pct_decode"])
            for r in csv.DictReader(f)
        }


@pytest.fixture(scope="module")
def qwen() -> Trace:
    return read_trace(BIG / "qwen.route.csv")


@pytest.fixture(scope="module")
def gptoss() -> Trace:
    return read_trace(BIG / "gptoss.route.csv")


@pytest.fixture(scope="module")
def gptoss_results(gptoss: Trace) -> dict[int, dict[str, float]]:
    """Every policy at a collapse budget (250) and above the 908 MiB token cycle (1000)."""
    return {mib: run_policies(gptoss, mib * MIB, slot_lru=mib > 250) for mib in (250, 1000)}


def head(tr: Trace, tokens: int) -> Trace:
    """Prefill and the first `tokens` decode tokens (keeps the slow SlotCache replays short)."""
    return replace(tr, batches=tr.batches[: tr.num_layers * (1 + tokens)])


def test_reader_shapes(qwen: Trace, gptoss: Trace) -> None:
    assert (qwen.num_layers, qwen.num_experts, qwen.top_k) == (48, 128, 6)
    assert sum(not b.decode for b in qwen.batches) == 48
    assert sum(b.decode for b in qwen.batches) == 128 * 48
    assert len(qwen.batches[47].ids) == 1  # last prefill layer: only the final prompt token
    assert len(qwen.batches[0].ids) == 28 and all(len(r) == 6 for r in qwen.batches[0].ids)
    assert qwen.expert_bytes is not None and set(qwen.expert_bytes) == {3059712, 2654208}
    assert (gptoss.num_layers, gptoss.top_k, len(gptoss.batches)) == (36, 2, 36 + 64 * 36)


@pytest.mark.parametrize("name", ["qwen", "gptoss"])
@pytest.mark.parametrize("budget", [250, 1000, 2000, 4000, 8000])
def test_lru_and_belady_reproduce_reference_curves(name: str, budget: int, request) -> None:  # type: ignore[no-untyped-def]
    tr = request.getfixturevalue(name)
    ref = reference_curve(name)
    assert abs(simulate_lru(tr, budget * MIB).pct - ref[(budget, "lru")]) < 0.5
    assert abs(simulate_belady(tr, budget * MIB).pct - ref[(budget, "belady")]) < 0.5


def test_granite_reference_page_ins() -> None:
    """Decode-only replay from a cold cache, budgets in experts: LRU and oracle page-ins."""
    path = TRACES / "onnx-genai-granite"
    ref = json.loads((path / "reference" / "moe_cache_sim_results.json").read_text())
    for prompt, cells in ref["workloads"].items():
        tr = read_granite_json(path / "moe_expert_trace.json", prompt).with_expert_bytes(1)
        tr = replace(tr, batches=tuple(b for b in tr.batches if b.decode))
        for cell in cells.values():
            for sim, key in ((simulate_lru, "lru"), (simulate_belady, "oracle")):
                got = sim(tr, cell["budget"])
                assert got.lookups == cell["accesses"]
                assert got.lookups - got.hits == cell["page_ins"][key], (prompt, key)


def test_belady_dominates(gptoss_results: dict[int, dict[str, float]]) -> None:
    for hit in gptoss_results.values():
        assert all(hit["belady"] >= hit[p] for p in hit)


def test_ours_beats_lru_where_lru_collapses(
    qwen: Trace, gptoss_results: dict[int, dict[str, float]]
) -> None:
    hit = gptoss_results[250]
    assert hit["lru"] < 1.0 and hit["ours"] > hit["lru"] + 5.0
    assert gptoss_results[1000]["ours"] >= gptoss_results[1000]["lru"]
    budget, short = 500 * MIB, head(qwen, 32)  # below Qwen's 785 MiB token cycle
    lru = simulate_lru(short, budget).pct
    ours = replay_slot_cache(short, num_slots_for(short, budget), EvictionPolicy.AGED_FREQ).pct
    assert lru < 1.0 and ours > lru + 10.0


def test_slot_cache_lru_matches_byte_lru(gptoss_results: dict[int, dict[str, float]]) -> None:
    """Uniform expert size: the real SlotCache under LRU is the byte simulator's LRU."""
    hit = gptoss_results[1000]
    assert hit["lru"] > 10.0 and abs(hit["lru_slotcache"] - hit["lru"]) < 0.5


def write_jsonl(tr: Trace, path: Path) -> Path:
    meta = {
        "num_layers": tr.num_layers,
        "num_experts": tr.num_experts,
        "expert_bytes": list(tr.sizes()),
    }
    lines = [json.dumps({"meta": meta})]
    for b in tr.batches:
        phase = "decode" if b.decode else "prefill"
        lines.append(
            json.dumps({"phase": phase, "layer": b.layer, "ids": [list(r) for r in b.ids]})
        )
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_roundtrip(gptoss: Trace, tmp_path: Path) -> None:
    short = head(gptoss, 8)
    back = read_jsonl(write_jsonl(short, tmp_path / "trace.jsonl"))
    assert back.batches == short.batches and back.expert_bytes == short.expert_bytes
    assert (back.num_layers, back.num_experts, back.top_k) == (36, 128, 2)
    assert simulate_lru(back, 500 * MIB) == simulate_lru(short, 500 * MIB)


def test_cli_json(gptoss: Trace, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ftctl.main import main

    short = head(gptoss, 16)
    path = write_jsonl(short, tmp_path / "short.jsonl")
    rc = main(["bench", "cache", "--trace", str(path), "--budgets-mib", "250,1000", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_layers"] == 36 and [r["budget_mib"] for r in out["results"]] == [250, 1000]
    for row in out["results"]:
        budget = int(row["budget_mib"]) * MIB
        assert row["num_slots"] == num_slots_for(short, budget)
        assert {p: row[p] for p in POLICIES} == run_policies(short, budget)


def test_ram_cache_replay_of_the_qwen_trace(qwen: Trace) -> None:
    """The disk tier's RAM-cache policy over the real Qwen3-30B-A3B routing (prefill and 32
    decode tokens): hit rates by cache size, printed; an LRU of uniform slots is the byte LRU
    of uniform sizes up to the order of one batch's entries (measured within 1 point)."""
    tr = head(qwen, 32)
    uniform = tr.with_expert_bytes(1)
    pool = tr.num_layers * tr.num_experts
    for share in (0.1, 0.25, 0.5, 0.75):
        slots = int(pool * share)
        got = replay_ram_cache(tr, slots)
        lru = simulate_lru(uniform, slots)
        print(
            f"qwen RAM cache {share:.0%} of the pool ({slots} slots): {got.pct:.1f} % decode hits"
        )
        assert got.lookups == lru.lookups
        assert abs(got.pct - lru.pct) < 2.0, (share, got.pct, lru.pct)
    # top-k slots, fewer than a prefill layer's experts: prefill batches run a few tokens at a
    # time (as the tier splits them), decode counts the same lookups, and hits fewer
    small = replay_ram_cache(tr, tr.top_k)
    assert small.lookups == lru.lookups and small.pct < replay_ram_cache(tr, pool // 10).pct
    # three quarters of one token's experts (its layers x top-k): an LRU hits nothing (each
    # expert evicted before the next token's return), the bimodal insertion keeps what is
    # resident and hits
    slots = tr.num_layers * tr.top_k * 3 // 4
    got, lru = replay_ram_cache(tr, slots), simulate_lru(uniform, slots)
    print(f"qwen RAM cache {slots} slots: {got.pct:.1f} % decode hits, LRU {lru.pct:.1f} %")
    assert lru.pct < 2.0 and got.pct > lru.pct + 10.0
    # everything resident: only first uses miss
    full = replay_ram_cache(tr, pool)
    assert full.pct == simulate_lru(uniform, pool).pct
