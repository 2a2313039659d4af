"""Quantizing a float checkpoint's dense layers (and experts) at load with a preset
(``LLM(quantize=...)``; models/dense_quant.py). Oracle: transformers running the same checkpoint
with every quantized weight replaced by its dequantized values (dense layers from the GGUF blocks,
experts from the banks).

Tolerance: the native kernels quantize each projection's input to int8 per 32 values (~0.3 %
rms relative error per projection, on top of the weights the oracle already shares), so logits
differ by more than summation order: max |diff| < 0.08 on this tiny model's logits (of order
1-3; measured 0.042 q4_k_m, 0.047 q8_0, 0.041 mxfp4), well below what the 4-bit weights did to
them (0.62 q4_k_m, 1.43 mxfp4, checked, so the test can tell), and greedy tokens must agree with
the oracle's. The q4_k_m mix itself is checked against llama.cpp's rule on made-up layer lists.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny

from freetokend import LLM
from freetokend.engine.runner import Work
from freetokend.experts.formats import dequantize_banks
from freetokend.models.dense_quant import (
    PRESETS,
    choose_formats,
    dequantized_state,
    tensor_class,
)
from freetokend.native import qlinear_native

KW = dict(dtype="float32", prefix_cache=False, max_model_len=128, kv_tokens=512)
TOL = 0.08

pytestmark = pytest.mark.skipif(not qlinear_native.available(), reason="ftdense not built")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    # hidden 256 and o_proj inputs 4 x 64 = 256: q4_k fits the attention and gate/up layers
    return make_tiny(
        "qwen3_moe",
        tmp_path_factory.mktemp("dense-q"),
        seed=7,
        hidden_size=256,
        head_dim=64,
        num_attention_heads=4,
        num_key_value_heads=2,
    )


def _last_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    st = llm.runner.new_state()
    llm.runner.reserve(st, len(ids))
    logits = llm.runner.forward([Work(st, ids)])[0]
    llm.runner.release(st)
    return logits


def test_tensor_classes() -> None:
    assert tensor_class("layers.0.self_attn.k_proj") == "attn_qkv"
    assert tensor_class("layers.0.self_attn.v_proj") == "attn_v"
    assert tensor_class("layers.0.self_attn.kv_b_proj") == "attn_v"
    assert tensor_class("layers.0.self_attn.o_proj") == "attn_out"
    assert tensor_class("layers.3.mlp.shared_expert.down_proj") == "mlp_out"
    assert tensor_class("lm_head") == "lm_head"
    assert tensor_class("layers.0.mlp.router") is None


def _layers(n: int, attn: range, cols: int = 512) -> list[tuple[str, int]]:
    out = [("lm_head", cols)]
    for i in range(n):
        out += [(f"model.layers.{i}.mlp.{p}", cols) for p in ("gate_proj", "up_proj", "down_proj")]
        if i in attn:
            out += [(f"model.layers.{i}.self_attn.{p}_proj", cols) for p in "qkvo"]
    return out


def test_q4_k_m_is_llama_cpp_mix() -> None:
    """Expected layers from llama.cpp's use_more_bits (i < n/8 || i >= 7n/8 || (i - n/8) % 3 == 2)
    worked by hand: n = 16 -> 0 1 4 7 10 13 14 15."""
    got = choose_formats(_layers(16, range(16)), "q4_k_m")
    more = {0, 1, 4, 7, 10, 13, 14, 15}
    assert got["lm_head"] == "q6_k"
    for i in range(16):
        want = "q6_k" if i in more else "q4_k"
        assert got[f"model.layers.{i}.self_attn.v_proj"] == want
        assert got[f"model.layers.{i}.mlp.down_proj"] == want
        for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.o_proj", "mlp.up_proj"):
            assert got[f"model.layers.{i}.{p}"] == "q4_k"
    # attn_v counts the layers that have one: attention in layers 3 7 11 15 -> ranks 0-3 of 4,
    # more bits for rank 2 ((2 - 0) % 3 == 2) and rank 3 (>= 7*4/8)
    hybrid = choose_formats(_layers(16, range(3, 16, 4)), "q4_k_m")
    v6 = {n for n, f in hybrid.items() if n.endswith("v_proj") and f == "q6_k"}
    assert v6 == {"model.layers.11.self_attn.v_proj", "model.layers.15.self_attn.v_proj"}


def test_block_fallbacks_and_mxfp4_mix() -> None:
    odd = choose_formats(_layers(16, range(16), cols=96), "q4_k_m")  # 96: a multiple of 32 only
    assert odd["lm_head"] == "q8_0" and odd["model.layers.0.mlp.down_proj"] == "q8_0"
    assert odd["model.layers.2.mlp.up_proj"] == "q5_0"  # llama.cpp's q4_k fallback
    assert choose_formats(_layers(2, range(2), cols=48), "q4_k_m") == {}
    mx = choose_formats(_layers(4, range(4)), "mxfp4")
    assert mx.pop("lm_head") == "q8_0" and set(mx.values()) == {"mxfp4"}


@pytest.mark.parametrize("preset", ["q4_k_m", "q8_0", "mxfp4"])
def test_preset_logits_match_transformers_on_dequantized_weights(ckpt, preset: str) -> None:  # type: ignore[no-untyped-def]
    src, hf = ckpt
    llm = LLM(src, "cpu", quantize=preset, **KW)
    layers = {n: m.qweight.fmt for n, m in llm.model.named_modules() if getattr(m, "qweight", None)}
    assert "lm_head" in layers and any(n.endswith("q_proj") for n in layers)
    if preset == "q4_k_m":  # 3 layers: use_more_bits picks the last one
        assert layers["lm_head"] == "q6_k" and "q4_k" in layers.values()
        assert layers["layers.2.self_attn.v_proj"] == "q6_k"
        assert layers["layers.1.self_attn.v_proj"] == "q4_k"
    if preset == "mxfp4":
        assert layers["lm_head"] == "q8_0" and "mxfp4" in layers.values()
    # block experts per projection: gate_up (H = 256) takes q4_k, down (I = 32) its 32-input
    # fallback (q5_0, as llama.cpp's)
    # (GGUF's MXFP4 blocks throughout: "mxfp4/mxfp4"; "mxfp4" names our own bank layout)
    want = {"q4_k_m": "q4_k/q5_0", "q8_0": "q8_0", "mxfp4": "mxfp4/mxfp4"}[preset]
    assert llm.banks.format == want
    assert type(llm.moe.executor).__name__ == "BlockExecutor"

    oracle = type(hf)(hf.config).eval()
    state = hf.state_dict()
    for name, w in dequantized_state(llm.model).items():
        key = "model." + name if "model." + name in state else name
        assert key in state, name
        state[key] = w.to(state[key].dtype)
    oracle.load_state_dict(state)
    deq = dequantize_banks(llm.banks)
    e = hf.config.num_experts
    with torch.no_grad():
        experts = [m.mlp.experts for m in oracle.model.layers if hasattr(m.mlp, "experts")]
        for k, ex in enumerate(experts):
            ex.gate_up_proj.copy_(deq.gate_up[k * e : (k + 1) * e])
            ex.down_proj.copy_(deq.down[k * e : (k + 1) * e])
        ids = torch.randint(2, 97, (11,), generator=torch.Generator().manual_seed(1)).tolist()
        ref = oracle(torch.tensor([ids])).logits[0, -1].float()
        unquantized = hf(torch.tensor([ids])).logits[0, -1].float()
        seq = list(ids)
        for _ in range(8):
            seq.append(int(oracle(torch.tensor([seq])).logits[0, -1].argmax()))
    got = _last_logits(llm, ids)
    if preset != "q8_0":  # 4-bit weights moved the logits far more than TOL: the oracle tells
        assert (ref - unquantized).abs().max() > 5 * TOL
    assert (got - ref).abs().max() < TOL
    assert llm.generate(ids, 8, ignore_eos=True) == seq[len(ids) :]


def test_bad_presets_are_named(ckpt) -> None:  # type: ignore[no-untyped-def]
    src, _ = ckpt
    with pytest.raises(ValueError, match="'q3_k' is not one of"):
        LLM(src, "cpu", quantize="q3_k", **KW)
    with pytest.raises(ValueError, match="not both"):
        LLM(src, "cpu", quantize="q8_0", quantize_experts="mxfp4", **KW)


def test_daemon_presets_are_the_presets_table() -> None:
    from freetokend.config import QUANTIZE_PRESETS, ConfigError, DaemonConfig

    assert set(QUANTIZE_PRESETS) == set(PRESETS)
    DaemonConfig(quantize="q4_k_m").check()
    with pytest.raises(ConfigError, match="quantize: 'q2_k'"):
        DaemonConfig(quantize="q2_k").check()
    with pytest.raises(ConfigError, match="exclude each other"):
        DaemonConfig(quantize="q8_0", quantize_experts="mxfp4").check()
