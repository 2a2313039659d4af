"""`ftctl plan` on a GGUF file, and the disk tier's plan (issue 45, build item 3): a GGUF of
block experts whose files exceed three quarters of the RAM, under the cpu backend, is planned as
the daemon runs it, with its RAM cache of experts, the bytes a token reads at uniform routing and
the decode rate the disk's read rate bounds.

The file is Qwen3-30B-A3B's geometry in Q4_K experts (Q8_0 dense), 18 GB in size, written as a
header over a hole (``write_skeleton_gguf``: no data on disk)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from gguf_files import write_skeleton_gguf
from test_ftctl_plan import QWEN3_30B_A3B, QWEN_KV_PER_TOKEN

from freetokend.engine import plan as plan_mod
from freetokend.engine.plan import plan_model
from freetokend.experts.formats import get_format
from freetokend.runtime.memlimit import TIER_WORK_RESERVE_BYTES
from ftctl.main import main
from ftctl.plan import parse_rate

MIB = 1 << 20
PER = get_format("q4_k").nbytes_per_expert(2048, 768, None)  # one expert's Q4_K blocks
POOL = 48 * 128 * PER


@pytest.fixture(scope="module")
def q30(tmp_path_factory: pytest.TempPathFactory) -> Path:
    raw = {k: v for k, v in QWEN3_30B_A3B.items() if k not in ("architectures", "model_type")}
    cfg = transformers.Qwen3MoeConfig(**raw)
    return write_skeleton_gguf("qwen3_moe", cfg, tmp_path_factory.mktemp("q30") / "q30.gguf")


def test_a_gguf_file_is_planned_from_its_header(q30: Path) -> None:
    p = plan_model(q30, 8192, 64 * 1024, backend="cpu", kv_tokens=32768)
    assert p.fits, p.reason
    assert p.expert_format == "q4_k" and not p.disk_tier
    assert p.parts_mib["expert_pool"] == pytest.approx(POOL / MIB)
    assert p.placement["expert_pool"] == "cpu"


def test_files_over_three_quarters_of_ram_plan_the_disk_tier(q30: Path) -> None:
    ram = 16 * 1024  # MiB: 12 GiB of budget under an 18 GB file
    p = plan_model(q30, 8192, ram, backend="cpu", disk_rate=2e9)
    assert p.fits, p.reason
    t = p.disk_tier
    assert p.placement["expert_pool"] == "disk"
    # the cache: the budget less the dense weights (the file less its experts), one
    # 40960-token sequence's KV, the snapshots, the runtime and the tier's buffers
    dense = q30.stat().st_size - POOL
    rest = dense + 40960 * QWEN_KV_PER_TOKEN + plan_mod.SNAPSHOT_MIB * MIB
    rest += plan_mod.RUNTIME_RESIDENT_MIB * MIB + TIER_WORK_RESERVE_BYTES
    left = ram * MIB * 3 // 4 - rest
    assert t["cache_experts"] == left // PER and t["pool_experts"] == 48 * 128
    assert t["cache_mib"] * MIB == pytest.approx(t["cache_experts"] * PER)
    assert p.ram_peak_mib * MIB == pytest.approx(rest + t["cache_experts"] * PER)
    assert p.ram_peak_mib <= ram * 3 / 4
    hit = t["cache_experts"] / (48 * 128)
    assert t["hit_fraction"] == pytest.approx(hit)
    missed = 8 * 48 * PER * (1 - hit)  # top-8 of every layer, the misses read
    assert t["missed_mib_per_token"] * MIB == pytest.approx(missed)
    assert t["decode_tok_s_disk_bound"] == pytest.approx(2e9 / missed)
    assert t["disk_rate_source"] == "given"


def test_the_disk_rate_is_measured_on_the_file_when_not_given(q30: Path) -> None:
    t = plan_model(q30, 8192, 16 * 1024, backend="cpu").disk_tier
    assert t["disk_rate_source"].startswith("measured on q30.gguf")
    assert t["disk_read_mb_s"] > 0
    assert t["decode_tok_s_disk_bound"] == pytest.approx(
        t["disk_read_mb_s"] * 1e6 / (t["missed_mib_per_token"] * MIB)
    )


def test_too_little_ram_for_one_tokens_experts_does_not_fit(q30: Path, capsys) -> None:
    rc = main(["plan", "--model", str(q30), "--backend", "cpu", "--ram", "6GiB", "--json"])
    out = capsys.readouterr()
    plan = json.loads(out.out)
    assert rc == 1 and not plan["fits"]
    assert "fewer than one token's 8 experts" in plan["reason"] and "does not fit" in out.err


def test_the_table_shows_the_tier(q30: Path, capsys) -> None:
    argv = ["plan", "--model", str(q30), "--backend", "cpu", "--ram", "16GiB"]
    assert main([*argv, "--disk-rate", "1.5GB/s"]) == 0
    out = capsys.readouterr().out
    for row in ("disk tier", "read per token", "1500 MB/s (given)", "decode, disk-bound"):
        assert row in out


def test_offload_and_hybrid_plan_a_bf16_cache_fused_none(q30: Path) -> None:
    """Under offload and hybrid the RAM cache's slots are bf16 (the device format: experts/
    device_tier.py) and the dense weights, model state and snapshots are on the card; what a
    token reads is still the file's Q4_K bytes. fused keeps every expert on the card: no tier."""
    ram = 16 * 1024
    bf16 = get_format("bf16").nbytes_per_expert(2048, 768, torch.bfloat16)
    for backend in ("offload", "hybrid"):
        p = plan_model(q30, 24576, ram, backend=backend, disk_rate=2e9)
        assert p.fits, p.reason
        t = p.disk_tier
        assert p.placement["expert_pool"] == "disk" and "expert_ram_cache" in p.placement
        assert "expert_pool_bf16" not in p.parts_mib  # no bf16 copy of the pool
        assert p.parts_mib["expert_ram_cache"] * MIB == t["cache_experts"] * bf16
        rest = int(p.parts_mib["kv_cache"] * min(p.kv_tokens, 40960) / p.kv_tokens * MIB)
        rest += plan_mod.RUNTIME_RESIDENT_MIB * MIB + TIER_WORK_RESERVE_BYTES
        assert t["cache_experts"] == (ram * MIB * 3 // 4 - rest) // bf16
        hit = t["cache_experts"] / (48 * 128)
        assert t["missed_mib_per_token"] * MIB == pytest.approx(8 * 48 * PER * (1 - hit))
    p = plan_model(q30, 81920, 12 * 1024, backend="fused")  # the card holds the pool
    assert not p.fits and not p.disk_tier
    assert "under the cpu, offload and hybrid backends only" in p.reason


def test_parse_rate() -> None:
    assert parse_rate("2GB/s") == 2e9 and parse_rate("900MB/s") == 9e8
    assert parse_rate("1.5G") == 1.5 * 2**30 and parse_rate("100") == 100 * 2**20
    for bad in ("fast", "2GB/h", "", "-1GB/s"):
        with pytest.raises(ValueError, match="not a read rate"):
            parse_rate(bad)
