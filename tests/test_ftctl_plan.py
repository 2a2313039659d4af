"""`ftctl plan`: a dry run on the fake CUDA device from config.json alone (ARCHITECTURE §9.2)."""

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


# bf16 bytes of Qwen3-30B-A3B's dense weights: embeddings and lm_head (151936 x 2048 each), 48 x
# (q 4096 x 2048, k and v 512 x 2048, o 2048 x 4096, router 128 x 2048, q/k norms 2 x 128, two
# layer norms 2 x 2048), the final norm 2048
QWEN_DENSE = 2 * (
    2 * 151936 * 2048 + 48 * (2 * 4096 * 2048 + 2 * 512 * 2048 + 128 * 2048 + 2 * 128 + 2 * 2048)
    + 2048
)  # fmt: skip
QWEN_KV_PER_TOKEN = 48 * 2 * 4 * 128 * 2  # K and V, 4 KV heads of 128, bf16


def _dense_parts_on_cuda(plan: dict) -> None:
    place = plan["placement"]
    for part in ("embeddings", "attention", "norms", "router", "lm_head", "kv_cache"):
        assert place[part] == "cuda", (part, place)
    assert "cpu" not in {dev for part, dev in place.items() if part != "expert_pool"}
    assert place["expert_pool"] == "cpu" and place["expert_slots"] == "cuda"


@pytest.mark.parametrize("backend", ["auto", "offload", "hybrid"])
def test_qwen3_30b_fits_an_8gib_card_dense_and_kv_on_the_card(qwen_dir, capsys, backend) -> None:
    rc, plan, err = _plan(
        capsys, "--model", str(qwen_dir), "--vram", "8GiB", "--ram", "96GiB", "--backend", backend
    )
    assert rc == 0 and plan["fits"], err
    assert plan["backend"] == ("offload" if backend == "auto" else backend)
    _dense_parts_on_cuda(plan)
    assert plan["parts_mib"]["dense_weights"] == pytest.approx(QWEN_DENSE / 2**20)
    # the KV pool: a quarter of what the dense weights leave of the card's 7.5 GiB after the
    # CUDA context (placement.DEVICE_KV_SHARE); the slots shrink to what is left after both
    left = 7680 * 2**20 - QWEN_DENSE
    assert plan["kv_tokens"] == pytest.approx(left // 4 // QWEN_KV_PER_TOKEN, abs=64)
    slots_mib = plan["slots"] * plan["slot_mib"]
    assert 0 < plan["slots"] < 48 * 128 // 2
    assert slots_mib < (left / 2**20) - plan["parts_mib"]["kv_cache"]
    assert slots_mib > 0.5 * ((left / 2**20) - plan["parts_mib"]["kv_cache"])  # not starved
    assert 7000 < plan["vram_peak_mib"] <= 8192
    # the sampled token ids each step (hybrid: + its CPU branch's wait per MoE layer for the
    # asynchronous copy of its inputs)
    assert plan["host_syncs_per_decode_step"] == (49 if backend == "hybrid" else 1)
    # one read; no blocking host -> device copy (it would stall the host as well)
    want = {"d2h": 1, "h2d": 0, **({"event": 48} if backend == "hybrid" else {})}
    assert plan["host_syncs_by_kind"] == want
    # host: the 54 GiB expert pool only (the dense part and KV are on the card)
    assert 54_000 < plan["ram_peak_mib"] < 56_000
    print(f"\nqwen3-30b-a3b on 8 GiB ({backend}): {json.dumps(plan)}")


def test_dense_weights_too_large_for_the_card_fail_with_the_numbers(qwen_dir, capsys) -> None:
    rc, plan, err = _plan(capsys, "--model", str(qwen_dir), "--vram", "3GiB", "--ram", "96GiB")
    assert rc == 1 and not plan["fits"]
    assert "dense weights" in plan["reason"]
    assert f"{QWEN_DENSE / 2**20:.0f} MiB" in plan["reason"] and "2560 MiB free" in plan["reason"]


def test_what_does_not_fit_exits_non_zero_with_the_reason(qwen_dir, capsys) -> None:
    rc, plan, err = _plan(capsys, "--model", str(qwen_dir), "--backend", "fused")
    assert rc == 1 and not plan["fits"]
    assert "out of memory" in plan["reason"] and "does not fit" in err
    rc, plan, err = _plan(capsys, "--model", str(qwen_dir), "--backend", "cpu", "--ram", "32GiB")
    assert rc == 1 and "host RAM" in plan["reason"] and plan["placement"]["expert_pool"] == "cpu"
    # the cpu backend keeps everything on the host: 54 GiB experts + 2.9 GiB dense + 12 GiB KV
    assert plan["kv_tokens"] == 131072 and plan["placement"]["kv_cache"] == "cpu"
    assert 60_000 < plan["ram_peak_mib"] < 80_000


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
    # host: the packed pool (9.5 GiB: half a byte a weight, a scale byte per 32, bf16 biases)
    # and its bf16 copy for the device (35.6 GiB; it shares the pool's biases)
    experts, weights, biases = 24 * 32, 3 * 2880 * 2880, 3 * 2880
    pool = experts * (weights // 2 + weights // 32 + 2 * biases)
    assert plan["parts_mib"]["expert_pool"] == pool / 2**20
    assert plan["parts_mib"]["expert_pool_bf16"] == experts * weights * 2 / 2**20
    assert pool + experts * weights * 2 <= plan["ram_peak_mib"] * 2**20 < 46_500 * 2**20


# gpt-oss-120b's config.json: 36 layers x 128 mxfp4 experts, top-4 (65 GB of experts)
GPT_OSS_120B = {
    **GPT_OSS_20B,
    "num_hidden_layers": 36,
    "num_local_experts": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 18,
}


@pytest.mark.parametrize("backend", ["offload", "hybrid"])
def test_gpt_oss_120b_fits_a_24gib_card(tmp_path: Path, capsys, backend) -> None:
    (tmp_path / "config.json").write_text(json.dumps(GPT_OSS_120B))
    # host: the packed pool and its bf16 copy for the device slots (~60 + ~214 GiB)
    rc, plan, err = _plan(
        capsys, "--model", str(tmp_path), "--vram", "24GiB", "--ram", "320GiB",
        "--backend", backend,
    )  # fmt: skip
    assert rc == 0 and plan["fits"], err
    _dense_parts_on_cuda(plan)
    # bf16: embeddings + lm_head 2 x 201088 x 2880 (2209 MiB), 36 x attention (q/o 4096 x 2880,
    # k/v 512 x 2880: 1823 MiB), routers, norms, biases, sinks
    assert 4040 < plan["parts_mib"]["dense_weights"] < 4080
    assert plan["vram_peak_mib"] <= 24 * 1024
    assert plan["kv_tokens"] > 32768  # a long context on the card beside the slots
    assert plan["slots"] >= 2 * 128  # a full-layer double buffer for prefill
    print(f"\ngpt-oss-120b on 24 GiB ({backend}): {json.dumps(plan)}")


def test_expert_format_plans_the_experts_in_another_format(qwen_dir, tmp_path, capsys) -> None:
    """--expert-format: the routed experts in a format of experts/formats.py whatever
    config.json's quantization_config says."""
    argv = ["--model", str(qwen_dir), "--vram", "8GiB", "--ram", "96GiB", "--backend", "cpu"]
    rc, plan, err = _plan(capsys, *argv, "--expert-format", "nvfp4")
    assert rc == 0 and plan["fits"], err
    assert plan["expert_format"] == "nvfp4"
    # 48 x 128 experts: e2m1 (half a byte a weight), an e4m3 scale per 16, 3 fp32 global scales
    weights = 3 * 2048 * 768
    assert (
        plan["parts_mib"]["expert_pool"] == 48 * 128 * (weights // 2 + weights // 16 + 12) / 2**20
    )
    assert "expert_pool_bf16" not in plan["parts_mib"]  # the cpu backend computes it packed
    # a ModelOpt NVFP4 config.json plans as nvfp4 by itself (models/release_quant.py), the same
    # pool; the flag replaces what it says
    cfg = {
        **QWEN3_30B_A3B,
        "quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"},
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    argv[1] = str(tmp_path)
    rc, read, err = _plan(capsys, *argv)
    assert rc == 0 and read["expert_format"] == "nvfp4", err
    assert read["parts_mib"]["expert_pool"] == plan["parts_mib"]["expert_pool"]
    rc, plan, err = _plan(capsys, *argv, "--expert-format", "q4_0")
    assert rc == 0 and plan["expert_format"] == "q4_0", err
    # the quantization_config of a checkpoint that is not read is refused by name
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["plan", *argv]) == 2
    assert "'awq' is not supported" in capsys.readouterr().err
    # an unknown format is bad input
    assert main(["plan", *argv, "--expert-format", "fp3"]) == 2
    assert "unknown expert format 'fp3'" in capsys.readouterr().err
