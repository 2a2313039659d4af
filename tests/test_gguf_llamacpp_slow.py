"""Against llama.cpp on the same GGUF file (opt-in: needs ``llama-cpp-python`` built from source;
``pytest --runslow``). Teacher-forced over 64 positions, llama.cpp with an F32 KV cache.

F32 files: our logits equal llama.cpp's within fp32 tolerance (1e-4) and top-1 agrees everywhere.
Quantized files (BF16, Q8_0, MXFP4, the K-quant mix): llama.cpp also quantizes the activations
(Q8_0 / Q8_K / BF16 dot products), as we do for what we keep in GGUF blocks (dense projections
and experts of the types our integer-dot kernels compute), so the exact check is our load with
every tensor dequantized against llama.cpp on an F32 file of the very weights the quantized file
holds (1e-4: proves our dequantization and tensor layout); against llama.cpp on the quantized
file itself we ask top-1 agreement >= 95 % and bound
the median over positions of max |logit difference| (router flips make the per-position maximum
jump at a few positions, so the maximum is printed, not bounded).

Measured on the first run (llama-cpp-python 0.3.36 built from source, CPU, 2 threads; tiny
models of tests/tiny_models.py, logit std ~0.65, ~1.3 for the 256-wide K-quant model; 11 passed
in 7 s). Columns: top-1 agreement and max / median-over-positions |dlogit| against llama.cpp on
the file; max |dlogit| against llama.cpp on the F32 file of the same (dequantized) weights.
    qwen3_moe f32     1.000   1.2e-6 / 8.3e-7   -
    olmoe f32         1.000   1.4e-6 / 7.8e-7   -
    mixtral f32       1.000   1.1e-6 / 7.2e-7   -
    gpt_oss f32       1.000   9.5e-7 / 6.0e-7   -         (plain RoPE, see below)
    qwen3_moe bf16    1.000   0.39   / 0.027    1.3e-6
    qwen3_moe q8_0    0.984   0.41   / 0.047    1.2e-6    (0.41 / 0.047 with Q8_0 experts kept)
    olmoe q8_0        0.984   0.26   / 0.029    1.3e-6    (0.26 / 0.030 with Q8_0 experts kept)
    mixtral q8_0      0.984   0.84   / 0.021    1.2e-6    (0.037 / 0.022 with Q8_0 experts kept)
    gpt_oss mxfp4     1.000   0.53   / 0.011    9.5e-7    (plain RoPE)
    qwen3_moe kmix    0.969   3.4    / 0.15     8.3e-6    (Q4_K/Q6_K + Q8_0/Q5_0/Q4_0 rows)
                      0.891   3.97   / 0.183    8.3e-6    (experts kept in blocks, K-quant
                                                           inputs rounded per 32 inputs)
                      0.984   0.83   / 0.085    8.3e-6    (Dec 2: per 256, llama.cpp's Q8_K)
    gpt_oss f32 YaRN  0.984   0.49   / 0.037    -         (llama.cpp's departure, below)
Added later (same wheel version, rebuilt from source on Dec 1; 6 passed in 24 s):
    qwen3_next f32    1.000   8.5e-6 / 2.5e-6   -
    qwen3_next bf16   0.969   0.39   / 0.021    1.4e-5
    qwen3_5_moe f32   1.000   1.7e-5 / 2.5e-6   -         (rope sections that fit, Q35_ROPE)
    qwen3_5_moe bf16  0.984   0.11   / 0.026    1.3e-5
    deepseek_v3 f32   1.000   2.1e-6 / 1.1e-6   -
    deepseek_v3 bf16  0.969   0.022  / 0.011    2.0e-6
That rebuilt llama.cpp segfaults in decode on every Q8_0 file (the earlier qwen3_moe q8_0 case
included), so the hybrids and deepseek2 are checked quantized in BF16 here; their Q8_0 files
are checked against transformers on the dequantized weights (test_gguf_hybrid_mla.py). (On
Dec 2 the same wheel ran every Q8_0 case: qwen3_moe 0.984 0.058 / 0.022, olmoe 0.984 0.26 /
0.019, mixtral 0.984 0.040 / 0.021, glm4_moe 0.984 0.044 / 0.029, minimax_m2 1.000 0.042 / 0.023.)
Dec 2, ours with llama.cpp's fp16 Q8_0 activation scales (``set_fp16_act_scales``; K-quants
read 256-input groups as its Q8_K), the projections of every Linear kept in the file's blocks;
columns as above:
    qwen3_moe q8_0    1.000   0      / 0        1.2e-6    (bit-equal)
    olmoe q8_0        1.000   0.017  / 0        1.3e-6
    mixtral q8_0      1.000   0      / 0        1.2e-6
    minimax_m2 q8_0   1.000   0      / 0        1.4e-6
    glm4_moe q8_0     1.000   0.039  / 0.026    1.5e-6
    qwen3_moe kmix    1.000   0.068  / 4.8e-7   8.3e-6
    olmoe kmix        1.000   1.4e-6 / 4.8e-7   7.2e-6
    mixtral kmix      1.000   5.1e-3 / 4.8e-7   1.3e-5
    gpt_oss kmix      1.000   1.4e-6 / 4.8e-7   9.8e-6    (K-quant dense parts, F32 experts)
    glm4_moe kmix     1.000   1.4e-6 / 4.8e-7   5.3e-6
    minimax_m2 kmix   1.000   0.061  / 0.037    7.5e-6
    qwen3_next q8_0   0.984   0.73   / 0.040    1.7e-5
    qwen3_next kmix   0.984   0.066  / 7.2e-7   1.0e-4
    olmoe bf16        1.000   0.012  / 7.3e-3   1.4e-6    (ours in bf16 against its BF16 dots)
    mixtral bf16      1.000   0.010  / 6.0e-3   1.1e-6
    gpt_oss bf16      0.984   0.81   / 5.4e-3   9.5e-7    (plain RoPE)
    qwen3_5_moe kmix  0.984   0.087  / 0.034    6.5e-5    (ssm_out in blocks, inputs reordered)
    qwen3_5_moe q8_0  1.000   0      / 0        7.5e-6    (32-wide shared expert: no F16 tensor)
    qwen3_5_moe q8_0 with the F16 shared-expert down (0.922): xfail, see _Q35_Q8
Dec 6, MLA's attn_k_b / attn_v_b kept in their blocks and attention run absorbed as llama.cpp
runs it (layers/mla.py; before: a float kv_b_proj, top-1 0.922 / 0.906, xfail), every row 32
wide (MLA_ROWS); columns as above:
    deepseek_v3 q8_0  0.984   0.026  / 0.014    2.7e-6
    deepseek_v3 kmix  1.000   1.4e-6 / 2.4e-7   9.8e-6
With fp32 activation scales (our default) the standard families agree 0.969-1.000 (qwen3_moe
Q8_0 0.984, median 0.022; K-quant mix 0.984, 0.085), gpt_oss's K-quant mix 0.891.
Known departures, not our bugs, handled here:
- llama.cpp's YaRN rounds the correction range to whole dimensions (floor/ceil in
  ggml_rope_yarn_corr_dims); GPT-OSS (transformers ``truncate=False``, and we) keeps it
  fractional. With transformers set to ``truncate=True`` llama.cpp matches it to 1e-6; as filed
  the tiny GPT-OSS departs by 0.49 (top-1 0.984). So the GPT-OSS cases use plain RoPE, and
  ``test_gpt_oss_yarn_departure`` records the departure with a loose bound.
- llama.cpp's OLMoE sizes the K norm by the hidden size (no GQA in OLMoE), so its case has as
  many KV heads as heads.
- llama.cpp's F16 KV cache (its default) alone moves F32 logits by ~9e-4; the F32 cache removes it.
"""

from __future__ import annotations

import pytest
import torch
from gguf_files import dequantized_reference, write_gguf
from llama_cpp_logits import compare, llama_logits
from tiny_models import hf_config, make_tiny

from freetokend import LLM
from freetokend.engine.tokenizer import Tokenizer
from freetokend.models import gguf_experts
from freetokend.models.layers.common import Linear
from freetokend.native import qlinear_native as ql

pytestmark = pytest.mark.slow
llama_cpp = pytest.importorskip("llama_cpp")

PLAIN_ROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 150000.0}}
# llama.cpp's qwen35moe asserts its rope sections fit the rotary dims (the converter writes
# Qwen3.5's [11, 11, 10] when a checkpoint has none, too wide for the tiny one)
Q35_ROPE = {
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "mrope_section": [2, 1, 1],
    }
}
KMIX = {"mlp_only_layers": [], "hidden_size": 256, "moe_intermediate_size": 96}
# Quantized files on which we part from llama.cpp more than elsewhere (measured Dec 2, fp16
# activation scales). DeepSeek-V3 (top-1 0.922 Q8_0, 0.906 K-quant mix; median |dlogit| 0.029,
# 0.16): its attn_k_b / attn_v_b are joined into a float kv_b_proj for our MLA, llama.cpp
# computes them from the blocks against int8 inputs. Qwen3.5's Q8_0 file (0.922, median 0.043;
# 0.859 before its ssm_out stayed in blocks with its inputs reordered, QuantWeight.in_perm):
# every projection is in blocks now. What is left is llama.cpp's: its 24-wide shared expert's
# down projection stays F16 in the file (no 32-input block fits), and llama.cpp rounds an F16
# matmul's inputs to fp16; we compute it in fp32. The same model with a 32-wide shared expert
# (no F16 tensor) is bit-equal to llama.cpp (top-1 1.000, max |dlogit| 0).
_Q35_Q8 = pytest.mark.xfail(
    reason="llama.cpp rounds the F16 shared-expert down projection's inputs to fp16", strict=False
)
# MLA with every row a multiple of 32 wide, as in the released models (narrower rows fall back
# to F16 in a Q8_0 file, whose matmuls llama.cpp computes on fp16-rounded inputs: top-1 0.922)
MLA_ROWS = {
    "intermediate_size": 64,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
}
CASES = [
    ("qwen3_moe", "f32", {"mlp_only_layers": []}),
    ("qwen3_moe", "bf16", {"mlp_only_layers": []}),
    ("qwen3_moe", "q8_0", {"mlp_only_layers": []}),
    ("olmoe", "f32", {"clip_qkv": None, "num_key_value_heads": 4}),
    ("olmoe", "q8_0", {"clip_qkv": None, "num_key_value_heads": 4}),
    ("mixtral", "f32", {}),
    ("mixtral", "q8_0", {}),
    ("gpt_oss", "f32", PLAIN_ROPE),
    ("gpt_oss", "mxfp4", PLAIN_ROPE),
    ("qwen3_moe", "kmix", KMIX),
    ("qwen3_next", "f32", {"mlp_only_layers": []}),
    ("qwen3_next", "bf16", {"mlp_only_layers": []}),
    ("qwen3_5_moe", "f32", Q35_ROPE),
    ("qwen3_5_moe", "bf16", Q35_ROPE),
    ("deepseek_v3", "f32", {}),
    ("deepseek_v3", "bf16", {}),
    # the issue-16 families, as llama.cpp reads them (GLM-4.7-Flash written as deepseek2)
    ("glm4_moe", "f32", {}),
    ("glm4_moe", "q8_0", {}),
    ("glm4_moe_lite", "f32", {}),
    ("minimax_m2", "f32", {}),
    ("minimax_m2", "q8_0", {}),
    ("gemma4", "f32", {}),
    # added Dec 2: the K-quant mix (Q4_K_M-like) for every family llama.cpp reads, Q8_0 for the
    # hybrids and MLA (the wheel that segfaulted on Q8_0 files before runs them now)
    ("olmoe", "bf16", {"clip_qkv": None, "num_key_value_heads": 4}),
    ("mixtral", "bf16", {}),
    ("gpt_oss", "bf16", PLAIN_ROPE),
    ("olmoe", "kmix", {"clip_qkv": None, "num_key_value_heads": 4, "hidden_size": 256,
                       "intermediate_size": 96}),
    ("mixtral", "kmix", {"hidden_size": 256, "intermediate_size": 96, "head_dim": 64}),
    ("gpt_oss", "kmix", {**PLAIN_ROPE, "hidden_size": 256, "intermediate_size": 64}),
    ("glm4_moe", "kmix", {"hidden_size": 256, "intermediate_size": 64}),
    ("minimax_m2", "kmix", {"hidden_size": 256}),
    ("qwen3_next", "q8_0", {"mlp_only_layers": []}),
    ("qwen3_next", "kmix", {"hidden_size": 256, "mlp_only_layers": [],
                            "shared_expert_intermediate_size": 32}),
    pytest.param("qwen3_5_moe", "q8_0", Q35_ROPE, marks=_Q35_Q8),
    ("qwen3_5_moe", "q8_0", {**Q35_ROPE, "shared_expert_intermediate_size": 32}),  # no F16
    ("qwen3_5_moe", "kmix", {**Q35_ROPE, "hidden_size": 256, "shared_expert_intermediate_size": 32}),
    ("deepseek_v3", "q8_0", MLA_ROWS),
    ("deepseek_v3", "kmix", {**MLA_ROWS, "hidden_size": 256}),
]  # fmt: skip
F32_TOL = 1e-4  # measured ~1e-6 (fp32 in both engines, F32 KV cache)
# our dequantized load against llama.cpp on the F32 of the same weights: measured <= 1.3e-5, and
# 1.0e-4 for qwen3_next's 256-wide K-quant model (logit std ~1.3, a hybrid: fp32 DeltaNet sums)
EXACT_TOL = 3e-4
# F32 files on which llama.cpp parts from transformers (and so from us: we match transformers on
# these within 2e-5, tests/test_gguf_new_families.py), median over positions of max |dlogit|.
# gemma4: measured 2.2e-3 from position 0 on (max 6.4e-2, one position), top-1 1.000. Part of it
# is ggml's GELU, which reads an fp16 table: rounding our dense GELU's input and output to fp16
# the same way brings the median to 1.6e-3; the rest is not explained yet (issue 12).
F32_DEPARTS = {"gemma4": 5e-3}
# Median over the 64 positions of max |logit difference| against llama.cpp on the quantized
# file: its activation quantization, not ours (measured: see the module docstring).
MEDIAN_TOL = {"bf16": 0.1, "q8_0": 0.15, "mxfp4": 0.15, "kmix": 0.2}
IDS = torch.randint(2, 400, (64,), generator=torch.Generator().manual_seed(1)).tolist()


def _llama_logits(path) -> torch.Tensor:
    return llama_logits(path, IDS)


def _ours(path, dequantize_blocks: bool = False) -> torch.Tensor:
    """Our logits; ``dequantize_blocks``: the projections we keep in GGUF blocks (integer dot
    products on int8 inputs) computed from their dequantized weights instead, so the result is
    comparable to fp32 tolerance with llama.cpp on an F32 file of the same weights."""
    llm = LLM(path, max_model_len=128, kv_tokens=512, dtype="float32")
    if dequantize_blocks:
        for m in llm.model.modules():
            if getattr(m, "qweight", None) is not None:
                m.weight = torch.nn.Parameter(m.qweight.dequantize(), requires_grad=False)
                m.qweight = None
            if getattr(m, "kv_b_blocks", None) is not None:  # MLA's attn_k_b / attn_v_b
                _float_kv_b(m)
    return llm.logits(IDS)


def _float_kv_b(attn) -> None:
    """MLA's kv_b from its per-head blocks back to a float kv_b_proj (the expanded path)."""
    k_b, v_b = attn.kv_b_blocks
    k = torch.stack([w.dequantize() for w in k_b]).transpose(1, 2)  # [heads, nope, kv_lora]
    v = torch.stack([w.dequantize() for w in v_b])  # [heads, v, kv_lora]
    w = torch.cat([k, v], 1).reshape(-1, attn.kvr)
    attn.kv_b_proj = Linear(w.shape[1], w.shape[0], torch.float32)
    attn.kv_b_proj.weight = torch.nn.Parameter(w, requires_grad=False)
    attn.kv_b_blocks = None


@pytest.mark.parametrize("family, kind, over", CASES)
def test_logits_match_llama_cpp(family, kind, over, builtin_model_dir, tmp_path, monkeypatch):
    vocab = Tokenizer.from_dir(builtin_model_dir).vocab_size  # llama.cpp needs a real vocab
    hf = make_tiny(family, tmp_path / "hf", seed=3, vocab_size=vocab, **over)[1]
    path = write_gguf(family, hf, tmp_path / f"{kind}.gguf", kind, tokenizer=builtin_model_dir)
    ql.set_fp16_act_scales(True)  # llama.cpp's Q8_0 activation scales: bit-comparable roundings
    try:
        ours = _ours(path)
    finally:
        ql.set_fp16_act_scales(False)
    theirs = _llama_logits(path)
    agree, err, med = compare(ours, theirs)
    line = f"{family} {kind}: top-1 {agree:.3f}, max |dlogit| {err:.2e}, median {med:.2e}"
    if kind == "f32" and family in F32_DEPARTS:
        print(f"{line} (a known departure)")
        assert agree == 1.0 and med < F32_DEPARTS[family], line
        return
    if kind == "f32":
        print(line)
        assert agree == 1.0 and err < F32_TOL, line
        return
    dequantized_reference(family, hf, path)  # hf now holds the file's weights, dequantized
    same = write_gguf(family, hf, tmp_path / "same.gguf", "f32", tokenizer=builtin_model_dir)
    # the exact check on our dequantized load: experts and projections out of their blocks
    monkeypatch.setattr(gguf_experts, "block_expert_format", lambda *a: None)
    floats = _llama_logits(same)
    exact = (_ours(path, dequantize_blocks=True) - floats).abs().max().item()
    print(f"{line}; vs llama.cpp on the F32 of the same weights {exact:.2e}")
    assert exact < EXACT_TOL, exact
    assert med < MEDIAN_TOL[kind], line
    assert agree >= 0.95, line


def test_gpt_oss_yarn_departure(builtin_model_dir, tmp_path):
    """GPT-OSS with YaRN as filed (fractional correction range): llama.cpp rounds the range, so
    the logits differ by up to ~0.5 (measured 0.49, top-1 0.984); with transformers rounding too
    they agree to fp32 tolerance, which shows the rest of the model is the same."""
    vocab = Tokenizer.from_dir(builtin_model_dir).vocab_size
    hf = make_tiny("gpt_oss", tmp_path / "hf", seed=3, vocab_size=vocab)[1]
    path = write_gguf("gpt_oss", hf, tmp_path / "y.gguf", "f32", tokenizer=builtin_model_dir)
    ref = _llama_logits(path)
    agree, err, med = compare(_ours(path), ref)
    print(f"gpt_oss f32 YaRN: top-1 {agree:.3f}, max |dlogit| {err:.2e}, median {med:.2e}")
    assert agree >= 0.95 and err < 1.0, (agree, err)
    rope = {**hf_config("gpt_oss").rope_parameters, "truncate": True}
    rounded = make_tiny("gpt_oss", tmp_path / "r", seed=3, vocab_size=vocab, rope_parameters=rope)
    with torch.no_grad():
        hf_rounded = rounded[1](torch.tensor([IDS])).logits[0].float()
    assert (hf_rounded - ref).abs().max().item() < F32_TOL
