"""GGUF files of the hybrid (Qwen3-Next ``qwen3next``, Qwen3.5-MoE ``qwen35moe``) and MLA
(DeepSeek-V3 ``deepseek2``) architectures, written from tiny HF checkpoints with llama.cpp's
converter transforms reproduced (``gguf_convert``: A_log as -exp, squeezed conv1d, (1 + w) norms
stored with the 1 added, Qwen3-Next's split qkvz and fused ba, Qwen3.5's tiled value heads,
DeepSeek's kv_b split into k_b / v_b), load into the HF checkpoint's numerics: logits within
fp32 tolerance and transformers' greedy tokens. The tiny hybrids have more value than key heads,
so a value-head order left tiled shows; the norms carry perturbed weights, so a +1 left in
shows."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import gguf
import pytest
import torch
from gguf_files import (
    ARCH,
    against_transformers_gguf_loader,
    dequantized_reference,
    gguf_tensors,
    int_dot_reference,
    kmix_logit_errors,
    write_gguf,
)
from gguf_files import (
    hf_logits as _hf_logits,
)
from gguf_files import (
    prompt as _prompt,
)
from tiny_models import make_tiny

from freetokend import LLM
from freetokend.formats.gguf_file import GgufTensor
from freetokend.models.config import ConfigError
from freetokend.models.gguf_config import hf_fields

ATOL = 2e-4
# projections kept in GGUF blocks: one int8 input flipped across a rounding boundary moves the
# logits by ~2e-2 (test_gguf.py's ATOL_BLOCKS; measured 1.6e-2 for qwen3_next's Q8_0 file once
# its linear-attention projections stay in blocks too)
ATOL_BLOCKS = 5e-2
FAMILIES = ("qwen3_next", "qwen3_5_moe", "deepseek_v3")


@pytest.fixture(scope="module", params=FAMILIES)
def f32(request, tmp_path_factory):
    family = request.param
    d = tmp_path_factory.mktemp(f"gguf-{family}")
    # llama.cpp's qwen3next has no dense-MLP layers: every layer routed, as in the real models
    over = {"mlp_only_layers": []} if family == "qwen3_next" else {}
    hf = make_tiny(family, d / "hf", seed=3, **over)[1]
    path = write_gguf(family, hf, d / f"{family}-F32.gguf", "f32")
    return family, hf, path, LLM(path, max_model_len=256, kv_tokens=2048)


def test_file_has_the_converters_layout(f32):
    family, hf, path, _ = f32
    names = {t.name for t in gguf.GGUFReader(path).tensors}
    want = {
        "qwen3_next": {"blk.0.attn_qkv.weight", "blk.0.attn_gate.weight", "blk.0.ssm_ba.weight"},
        "qwen3_5_moe": {"blk.0.ssm_beta.weight", "blk.0.ssm_alpha.weight", "blk.0.ssm_a"},
        "deepseek_v3": {"blk.1.attn_k_b.weight", "blk.1.attn_v_b.weight", "blk.1.exp_probs_b.bias"},
    }[family]
    assert want <= names, want - names
    assert not any("kv_b." in n or "ssm_in" in n for n in names)


def test_f32_logits_match_the_hf_checkpoint(f32):
    family, hf, _, llm = f32
    assert llm.config.family == family and llm.config.torch_dtype == "float32"
    ids = _prompt(32, seed=1)
    err = (llm.logits(ids) - _hf_logits(hf, ids)).abs().max().item()
    assert err < ATOL, f"{family}: max |logit diff| {err}"


def test_f32_greedy_tokens_match_transformers(f32):
    family, hf, _, llm = f32
    ids = _prompt(10, seed=4)
    with torch.no_grad():  # transformers' own greedy decoding (its caches, its DeltaNet state)
        out = hf.generate(
            torch.tensor([ids]), max_new_tokens=24, min_new_tokens=24, do_sample=False
        )
    want = out[0, len(ids) :].tolist()
    assert llm.generate(ids, max_tokens=24, ignore_eos=True) == want, family


def test_config_from_metadata_equals_the_hf_config(f32):
    """The metadata-derived config is the one the HF folder gives (the fields the model uses)."""
    from freetokend.models.loader import model_config

    family, _, path, llm = f32
    ref = model_config(path.parent / "hf")
    fields = (
        "layer_types moe_layers num_experts top_k norm_topk_prob moe_intermediate_size "
        "shared_expert_intermediate_size linear_num_key_heads linear_num_value_heads "
        "linear_key_head_dim linear_value_head_dim linear_conv_kernel q_lora_rank kv_lora_rank "
        "qk_nope_head_dim qk_rope_head_dim v_head_dim n_group topk_group "
        "routed_scaling_factor head_dim num_heads num_kv_heads rope"
    ).split()
    for f in fields:
        assert getattr(llm.config, f) == getattr(ref, f), f


def test_deepseek2_softmax_router_is_refused():
    """DeepSeek-V2 files (softmax router) share the architecture name: refused by name."""
    meta = {
        "general.architecture": "deepseek2",
        "deepseek2.block_count": 2,
        "deepseek2.embedding_length": 64,
        "deepseek2.attention.head_count": 4,
        "deepseek2.expert_count": 8,
        "deepseek2.expert_used_count": 2,
        "deepseek2.expert_gating_func": 1,
    }
    embd = GgufTensor("token_embd.weight", "F32", 0, (97, 64), 0, 97 * 64 * 4, Path("x.gguf"))
    tensors = {"token_embd.weight": embd}
    with pytest.raises(ConfigError, match="softmax router"):
        hf_fields(meta, tensors, "float32", "x.gguf")


@pytest.mark.parametrize("kind", ["bf16", "q8_0"])
@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_file_matches_its_dequantized_weights(
    family, kind, tmp_path, experts_dequantized
):
    """transformers on the file's own dequantized weights (the converter's transforms inverted
    in ``gguf_convert.hf_value``) is the oracle: the check is on placement and layout."""
    over = {"mlp_only_layers": []} if family == "qwen3_next" else {}
    hf = make_tiny(family, tmp_path / "hf", seed=3, **over)[1]
    path = write_gguf(family, hf, tmp_path / f"m-{kind}.gguf", kind)
    types = {t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert kind.upper() in types, types
    llm = LLM(path, max_model_len=256, kv_tokens=2048, dtype="float32")
    dequantized_reference(family, hf, path)
    kept = int_dot_reference(hf, llm)  # projections in blocks: as the kernels compute them
    assert bool(kept) == (kind == "q8_0"), kept
    ids = _prompt(24, seed=2)
    err = (llm.logits(ids) - _hf_logits(hf, ids)).abs().max().item()
    # kept blocks: the kernels sum the per-block fp32 terms in their own order (test_gguf.py)
    tol = ATOL_BLOCKS if kept else ATOL
    assert err < tol, f"{family} {kind}: max |logit diff| {err}"


# Dimensions K-quants accept: hidden 256 (Q4_K / Q6_K rows), every other row a multiple of 32
# (Q4_0 / Q5_0 / Q8_0 blocks), as in real Q4_K_M files.
KMIX = {
    "qwen3_next": dict(hidden_size=256, mlp_only_layers=[], shared_expert_intermediate_size=32),
    "qwen3_5_moe": dict(hidden_size=256, shared_expert_intermediate_size=32),
    "deepseek_v3": dict(
        hidden_size=256,
        intermediate_size=64,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=32,
        v_head_dim=32,
    ),
}


# One activation value that rounds to the other int8 code in the two engines (their fp32 sums
# differ by 1e-6 upstream: DeltaNet's chunked and recurrent forms, MLA's absorbed attention) moves
# that token's logits by up to ~0.04, and later tokens' through attention; a misplaced block or
# scale moves every token's by 0.1 and more. The placement of the kept rows is checked exactly.
ATOL_INT8_FLIP = 0.1


@pytest.mark.parametrize("family", FAMILIES)
def test_k_quant_mix_matches_its_dequantized_weights(family, tmp_path, experts_dequantized):
    """A Q4_K_M-like file (``gguf_files.quantize``'s kmix: Q4_K rows, Q6_K for output / attn_v
    / down experts, Q4_0 / Q5_0 / Q8_0 for shorter rows) of the hybrid and MLA layouts: every
    projection kept in its blocks holds the file's rows in the HF order (dequantized, equal to
    the weights transformers gets from the file through the converter's inverse transforms),
    and the logits agree with transformers computing those blocks as our kernels do."""
    hf = make_tiny(family, tmp_path / "hf", seed=3, **KMIX[family])[1]
    _, err = kmix_logit_errors(family, hf, tmp_path, {"Q4_K", "Q6_K", "Q4_0"})
    assert err.max() < ATOL_INT8_FLIP, f"{family} Q4_K_M mix: max |logit diff| per token {err}"


def test_deepseek2_yarn_rope(tmp_path):
    """DeepSeek-V3's YaRN (the file keeps mscale_all_dim as 0.1 x yarn_log_multiplier)."""
    rope = dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=4.0,
        original_max_position_embeddings=16,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=1.0,
    )
    hf = make_tiny("deepseek_v3", tmp_path / "hf", seed=3, rope_parameters=rope)[1]
    llm = LLM(write_gguf("deepseek_v3", hf, tmp_path / "y.gguf"), max_model_len=256, kv_tokens=2048)
    assert llm.config.rope.kind == "yarn" and llm.config.rope.factor == 4.0
    ids = _prompt(40, seed=1)  # past the original context
    err = (llm.logits(ids) - _hf_logits(hf, ids)).abs().max().item()
    assert err < ATOL, f"deepseek2 yarn: max |logit diff| {err}"


def _write(path: Path, family: str, hf, tensors: dict, config=None, extra=None) -> Path:
    from gguf_files import _metadata

    w = gguf.GGUFWriter(path, ARCH[family])
    _metadata(w, family, config or hf.config)
    if extra:
        extra(w)
    w.add_eos_token_id(hf.config.eos_token_id)
    for name, t in tensors.items():
        w.add_tensor(name, t.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_deepseek2_file_with_kv_b_unsplit(tmp_path):
    """Files from converters before the k_b / v_b split carry ``attn_kv_b`` as HF has it."""
    hf = make_tiny("deepseek_v3", tmp_path / "hf", seed=3)[1]
    tensors = gguf_tensors("deepseek_v3", hf)
    for i in range(hf.config.num_hidden_layers):
        del tensors[f"blk.{i}.attn_k_b.weight"], tensors[f"blk.{i}.attn_v_b.weight"]
        kv_b = hf.model.layers[i].self_attn.kv_b_proj.weight.detach().float()
        tensors[f"blk.{i}.attn_kv_b.weight"] = kv_b.contiguous()
    llm = LLM(_write(tmp_path / "old.gguf", "deepseek_v3", hf, tensors), max_model_len=64)
    ids = _prompt(24, seed=3)
    assert (llm.logits(ids) - _hf_logits(hf, ids)).abs().max().item() < ATOL


def test_mtp_blocks_after_the_decoder_are_skipped(tmp_path):
    """llama.cpp counts Qwen3.5's MTP block in block_count (``nextn_predict_layers``) and
    stores it as the last ``blk``: it is not loaded, and the model is the decoder's."""
    hf = make_tiny("qwen3_5_moe", tmp_path / "hf", seed=3)[1]
    tensors = gguf_tensors("qwen3_5_moe", hf)
    n = hf.config.num_hidden_layers
    last = f"blk.{n - 1}."
    tensors.update(
        {f"blk.{n}." + k[len(last) :]: t for k, t in tensors.items() if k.startswith(last)}
    )
    tensors[f"blk.{n}.nextn.eh_proj.weight"] = torch.zeros(64, 128)
    cfg = copy.copy(hf.config)
    cfg.num_hidden_layers = n + 1
    path = _write(
        tmp_path / "mtp.gguf",
        "qwen3_5_moe",
        hf,
        tensors,
        cfg,
        lambda w: w.add_nextn_predict_layers(1),
    )
    llm = LLM(path, max_model_len=64)
    assert llm.config.num_layers == n
    ids = _prompt(24, seed=3)
    assert (llm.logits(ids) - _hf_logits(hf, ids)).abs().max().item() < ATOL


def test_ftw_from_the_gguf_gives_the_same_logits(f32, tmp_path):
    """``ftctl checkpoint --model X.gguf`` (its convert function): the config written from the
    metadata rebuilds the same model, and the FTW holds the un-transformed weights."""
    from freetokend.models.ftw_convert import convert

    family, _, path, llm = f32
    convert(path, tmp_path / "ftw")
    ftw = LLM(tmp_path / "ftw", max_model_len=256, kv_tokens=2048)
    assert ftw.config.family == family
    ids = _prompt(20, seed=7)
    assert torch.equal(llm.logits(ids), ftw.logits(ids)), family


def test_qwen35_ssm_out_stays_in_blocks_with_its_inputs_reordered(tmp_path, experts_dequantized):
    """Qwen3.5's converter tiles ssm_out's input columns (value heads); the blocks stay as the
    file has them and the input is reordered instead (QuantWeight.in_perm); an FTW conversion
    stores that projection dequantized, in the model's order, and computes the same within the
    int8 activations' rounding."""
    from freetokend.models.ftw_convert import convert

    hf = make_tiny("qwen3_5_moe", tmp_path / "hf", seed=3)[1]
    path = write_gguf("qwen3_5_moe", hf, tmp_path / "m-q8_0.gguf", "q8_0")
    # bf16: a quantized file's default. The fp32-activation kernels for the bf16 weights here
    # and in the FTW load below: this tiny recurrent model is sensitive to any rounding (HF's
    # own bf16 forward parts from its fp32 one by 0.13), and with vdpbf16ps rounding the
    # activations of every bf16 projection the two loads part by 0.11 (0.028 without), which
    # would hide what is checked here, ssm_out's reordered int8 inputs
    kw = dict(max_model_len=256, kv_tokens=2048, cpu_bf16_dot=False)
    llm = LLM(path, **kw)
    out = llm.model.get_submodule("layers.0.linear_attn.out_proj")
    assert out.qweight is not None and out.qweight.in_perm is not None
    perm = out.qweight.in_perm
    assert not torch.equal(perm, torch.arange(perm.numel()))  # a real reorder (tiled heads)
    dequantized_reference("qwen3_5_moe", hf, path)
    want = hf.get_submodule("model.layers.0.linear_attn.out_proj").weight.detach().float()
    assert torch.allclose(out.qweight.dequantize(), want, rtol=1e-6, atol=1e-7)
    # an accelerator backend dequantizes it for the device in the model's order (placement)
    dev = LLM(path, "fused", accelerator="standin", max_model_len=256, kv_tokens=2048)
    dev_w = dev.model.get_submodule("layers.0.linear_attn.out_proj").weight
    assert torch.equal(dev_w.float(), want.to(dev_w.dtype).float())
    convert(path, tmp_path / "ftw")
    ftw = LLM(tmp_path / "ftw", **kw)
    ftw_out = ftw.model.get_submodule("layers.0.linear_attn.out_proj")
    assert ftw_out.qweight is None and torch.equal(ftw_out.weight, want.to(ftw_out.weight.dtype))
    ids = _prompt(20, seed=7)
    a, b = llm.logits(ids), ftw.logits(ids)
    # one projection on int8 inputs against floats, through the recurrence, in bf16: measured
    # ||d|| / ||logits|| 2.8e-2 (max 0.14), top-1 18 of 20
    assert ((a - b).norm() / b.norm()).item() < 6e-2
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.8

    out.qweight = dataclasses.replace(out.qweight, in_perm=None)  # the file's order, unmoved
    wrong = llm.logits(ids)
    assert ((wrong - b).norm() / b.norm()).item() > 0.5  # measured 1.22: the order matters


def test_fused_gate_up_experts(tmp_path):
    """The converter's ``--fuse-gate-up-exps``: one ``ffn_gate_up_exps`` [E, 2I, H] a layer."""
    hf = make_tiny("qwen3_5_moe", tmp_path / "hf", seed=3)[1]
    tensors = gguf_tensors("qwen3_5_moe", hf)
    for i in range(hf.config.num_hidden_layers):
        gate = tensors.pop(f"blk.{i}.ffn_gate_exps.weight")
        up = tensors.pop(f"blk.{i}.ffn_up_exps.weight")
        tensors[f"blk.{i}.ffn_gate_up_exps.weight"] = torch.cat([gate, up], 1).contiguous()
    llm = LLM(_write(tmp_path / "fused.gguf", "qwen3_5_moe", hf, tensors), max_model_len=64)
    ids = _prompt(24, seed=3)
    assert (llm.logits(ids) - _hf_logits(hf, ids)).abs().max().item() < ATOL


@pytest.mark.parametrize(
    "family, drop",
    [
        ("qwen3_next", "blk.0.ssm_a"),
        ("qwen3_next", "blk.0.ssm_ba.weight"),
        ("qwen3_5_moe", "blk.2.ssm_conv1d.weight"),
        ("qwen3_5_moe", "blk.0.ffn_gate_inp_shexp.weight"),
        ("deepseek_v3", "blk.1.attn_k_b.weight"),
        ("deepseek_v3", "blk.2.attn_v_b.weight"),
        ("deepseek_v3", "blk.1.exp_probs_b.bias"),
    ],
)
def test_missing_tensor_is_named(family, drop, tmp_path):
    from freetokend.models.loader import CheckpointError

    over = {"mlp_only_layers": []} if family == "qwen3_next" else {}
    hf = make_tiny(family, tmp_path / "hf", seed=3, **over)[1]
    path = write_gguf(family, hf, tmp_path / "m.gguf", drop=(drop,))
    with pytest.raises(CheckpointError, match=f"missing tensor '{drop}'"):
        LLM(path, max_model_len=64)


@pytest.mark.parametrize("kind", ["f32", "q8_0"])
def test_qwen35moe_against_transformers_gguf_loader(
    kind, builtin_model_dir, tmp_path, experts_dequantized
):
    """transformers reads the same qwen35moe file with its own undoing of the converter's
    transforms (its name map, SubtractOne, LogNegate, tiled-to-grouped value heads)."""
    err = against_transformers_gguf_loader("qwen3_5_moe", tmp_path, kind, builtin_model_dir)
    assert err < (ATOL_BLOCKS if kind == "q8_0" else ATOL), (
        f"qwen35moe {kind} vs transformers' GGUF loader: {err}"
    )
