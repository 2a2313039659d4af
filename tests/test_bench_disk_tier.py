"""The disk tier benchmark's disk-bound ceiling (tests/bench/disk_tier_rates.py, issue 45): the
read size its rate is measured at is the tier's own (oracle: the bytes each of the tier's reads
returns, over every expert of a GGUF file, at the source's read limit and at one that splits a
projection's rows), and a run's ceiling uses the higher of the rates measured around it."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
from gguf_files import write_gguf
from test_gguf_experts import _tiny

from freetokend import LLM
from freetokend.models.gguf_experts import GgufExpertSource

sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))
from disk_tier_rates import ceiling_rate, tier_pieces  # noqa: E402


@pytest.fixture(scope="module")
def kmix(tmp_path_factory: pytest.TempPathFactory) -> Path:
    _, hf = _tiny(tmp_path_factory.mktemp("bench_disk_tier"))  # 3 MoE layers of 8 experts
    return write_gguf("qwen3_moe", hf, tmp_path_factory.mktemp("kmix") / "m.gguf", "kmix")


@pytest.mark.parametrize("most", [None, 144 * 8 * 3])  # Q4_K rows of 256: 24 rows a read
def test_tier_pieces_are_the_reads_the_tier_makes(
    kmix: Path, most: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if most is not None:
        monkeypatch.setattr(GgufExpertSource, "piece_bytes", most)
    llm = LLM(kmix, "cpu", expert_cache_mb=0.01, max_model_len=64, kv_tokens=64)
    tier = llm.moe.tier
    assert tier is not None
    readers = tier._readers
    made = Counter(
        p()
        for fid in range(tier.num_layers * tier.num_experts)
        for p in tier.tier.source.pieces(fid, *readers.slot_io(0))
    )
    pieces = tier_pieces(str(kmix))
    assert Counter({n: c * tier.num_experts for n, c in Counter(pieces).items()}) == made
    assert (len(made) > 1 and max(pieces) <= most) if most else len(pieces) == 3 * tier.num_layers


def test_ceiling_uses_the_higher_tier_rate_around_the_run() -> None:
    seq = {"seq": 9e9}  # the sequential rate never sets the ceiling
    assert ceiling_rate({"tier": 4e8, **seq}, {"tier": 6e8, **seq}) == (
        6e8, "the tier pattern's, after the run (the higher)"
    )  # fmt: skip
    assert ceiling_rate({"tier": 7e8}, {"tier": 6e8})[0] == 7e8
    assert ceiling_rate({"error": "rc 1"}, {"tier": 5e8}) == (
        5e8, "the tier pattern's, after the run (the other side failed)"
    )  # fmt: skip
    assert ceiling_rate({"tier": 3e8}, {}) == (
        3e8, "the tier pattern's, before the run (the other side failed)"
    )  # fmt: skip
    assert ceiling_rate({}, {"error": "timeout"}) == (None, "no rate measured")
