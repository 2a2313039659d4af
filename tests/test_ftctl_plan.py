"""`ftctl plan`: a dry run on the fake CUDA device from config.json alone (DESIGN §7)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ftctl.main import main
from ftctl.plan import parse_size

# Qwen3-30B-A3B's config.json (the fields we read): 48 layers x 128 experts, 61 GB in bf16
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("qwen3-30b-a3b")
    (d / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    return d  # no weights: the plan needs none


def _plan(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict, str]:
    rc = main(["plan", *argv, "--json"])
    out = capsys.readouterr()
    return rc, json.loads(out.out), out.err


def test_qwen3_30b_fits_an_8gib_card_with_the_default_backend(qwen_dir, capsys) -> None:
    rc, plan, err = _plan(capsys, "--model", str(qwen_dir), "--vram", "8GiB", "--ram", "96GiB")
    assert rc == 0 and plan["fits"], err
    assert plan["backend"] == "offload"
    assert 4096 < plan["vram_peak_mib"] <= 8192
    assert 0 < plan["slots"] < 48 * 128 // 2  # sized from the card, not half of the pool
    assert plan["slots"] * plan["slot_mib"] < 8192
    assert plan["kv_tokens"] == 131072
    assert plan["placement"]["expert_slots"] == "cuda"
    assert plan["placement"]["expert_pool"] == "cpu" and plan["placement"]["kv_cache"] == "cpu"
    # dense layers on the host: the MoE output comes back once per MoE layer
    assert plan["host_syncs_per_decode_step"] == 48
    # 54 GiB of experts + 2.9 GiB dense + 12 GiB KV of 131072 tokens
    assert 60_000 < plan["ram_peak_mib"] < 80_000
    print(f"\nqwen3-30b-a3b on 8 GiB: {json.dumps(plan)}")


def test_what_does_not_fit_exits_non_zero_with_the_reason(qwen_dir, capsys) -> None:
    rc, plan, err = _plan(capsys, "--model", str(qwen_dir), "--backend", "fused")
    assert rc == 1 and not plan["fits"]
    assert "out of memory" in plan["reason"] and "does not fit" in err
    rc, plan, err = _plan(capsys, "--model", str(qwen_dir), "--backend", "cpu", "--ram", "32GiB")
    assert rc == 1 and "host RAM" in plan["reason"] and plan["placement"]["expert_pool"] == "cpu"


def test_bad_input(tmp_path: Path, capsys) -> None:
    assert main(["plan", "--model", str(tmp_path)]) == 2  # no config.json
    assert "ftctl plan:" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["plan", "--model", str(tmp_path), "--vram", "lots"])
    assert e.value.code == 2
    assert parse_size("8GiB") == 8192 and parse_size("24GB") == 22888 and parse_size("512") == 512


# gpt-oss-20b's config.json (the fields we read): 24 layers x 32 mxfp4 experts
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 24,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "vocab_size": 201088,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 150000,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
    "swiglu_limit": 7.0,
    "attention_bias": True,
    "quantization_config": {"quant_method": "mxfp4"},
}


def test_an_mxfp4_model_plans_with_bf16_device_slots(tmp_path: Path, capsys) -> None:
    (tmp_path / "config.json").write_text(json.dumps(GPT_OSS_20B))
    rc, plan, err = _plan(capsys, "--model", str(tmp_path), "--vram", "8GiB", "--ram", "64GiB")
    assert rc == 0 and plan["fits"], err
    assert plan["expert_format"] == "mxfp4"
    # bf16 on the device: gate_up + down + their biases
    assert plan["slot_mib"] == pytest.approx((3 * 2880 * 2880 + 3 * 2880) * 2 / 2**20)
    assert plan["vram_peak_mib"] <= 8192
    # host: the packed pool (12 GiB) and its bf16 copy for the device (36 GiB)
    assert 45_000 < plan["parts_mib"]["expert_pool"] < 50_000
