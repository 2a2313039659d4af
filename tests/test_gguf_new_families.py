"""GGUF files of the families of the new-families issue, as llama.cpp's converter writes them
(``gguf_convert``): GLM-4.5 / 4.6 / 4.7 (``glm4moe``: partial rotary as ``rope.dimension_count``,
the router's correction bias as ``exp_probs_b``, leading dense layers, the nextn layer appended
after the decoder layers), MiniMax-M2 (``minimax-m2``: q/k norms over all heads, the correction
bias, ``rotary_dim``), and GLM-4.7-Flash, which llama.cpp writes as ``deepseek2`` and which must
load as our ``glm4_moe_lite`` family (GLM's anchors and parsers), told by its GLM pre-tokenizer,
name or chat markup; and Gemma-4 with its MoE block (``gemma4``: per-layer-type head dims
and KV heads, V = K global layers, the proportional rope as ``rope_freqs``, the router's scales,
fused gate/up experts).

F32 files: logits within fp32 tolerance of the HF checkpoint and transformers' greedy tokens.
Quantized files: against transformers on the file's own dequantized weights (see test_gguf.py).
"""

from __future__ import annotations

import gguf
import pytest
import torch
from gguf_files import (
    against_transformers_gguf_loader,
    assert_kept_rows_are_the_files,
    dequantized_reference,
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
from huggingface_hub.errors import StrictDataclassFieldValidationError
from tiny_models import VARIANTS, make_tiny

from freetokend import LLM
from freetokend.models.families.deepseek_v3 import is_glm_flash
from freetokend.models.families.glm4_moe import GLM_ANCHORS
from freetokend.models.registry import family_spec
from freetokend.server.parsers.registry import ToolSyntax, detect_syntax

ATOL = 2e-4
ATOL_BLOCKS = 2e-3  # projections kept in GGUF blocks (see test_gguf.py)
# MLA (GLM-4.7-Flash) with blocks: one activation rounding to the other int8 code moves a token's
# logits by up to 0.03 there (test_gguf_hybrid_mla.py), so the rows are checked exactly instead
ATOL_BLOCKS_MLA = 0.1
CASES = (
    "glm4_moe",
    "glm4_moe:flat",
    "minimax_m2",
    "minimax_m2:k3",
    "glm4_moe_lite",
    "gemma4",
    "gemma4:wide",
)
# Gemma-4's second config without per-layer input embeddings (not read from GGUF) or KV sharing
# (transformers' forward needs per-layer inputs with it): global layers with their own V and the
# sliding layers' KV head count, a wider window, no softcap, tied embeddings, top-3
_OVER = {
    "gemma4:wide": dict(
        VARIANTS["gemma4:ple"],
        hidden_size_per_layer_input=0,
        num_kv_shared_layers=0,
        use_double_wide_mlp=False,
    )
}
_FLASH = {"tokenizer.ggml.pre": "glm4"}  # what llama.cpp's converter writes for GLM's tokenizer


def _tiny(case: str, d, seed: int = 3):
    family = case.split(":")[0]
    over = _OVER.get(case, VARIANTS.get(case, {}))
    return family, make_tiny(family, d / "hf", seed=seed, **over)[1]


def _hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():  # transformers' own greedy decoding, with its caches
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids) :].tolist()


def _meta(family: str) -> dict[str, str] | None:
    return _FLASH if family == "glm4_moe_lite" else None


@pytest.fixture(scope="module", params=CASES)
def f32(request, tmp_path_factory):
    case = request.param
    d = tmp_path_factory.mktemp(f"gguf-{case.replace(':', '-')}")
    family, hf = _tiny(case, d)
    path = write_gguf(family, hf, d / f"{family}-F32.gguf", "f32", meta=_meta(family))
    return family, hf, path, LLM(path, max_model_len=256, kv_tokens=2048)


def test_file_has_the_converters_layout(f32):
    family, hf, path, _ = f32
    r = gguf.GGUFReader(path)
    names = {t.name for t in r.tensors}
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    want = {"glm4_moe": "glm4moe", "minimax_m2": "minimax-m2", "gemma4": "gemma4"}
    assert arch == want.get(family, "deepseek2")
    c = hf.config
    if family == "gemma4":
        assert {"rope_freqs.weight", "blk.0.ffn_gate_up_exps.weight"} <= names
        assert {"blk.0.ffn_gate_inp.scale", "blk.0.ffn_down_exps.scale"} <= names
        assert not any("ffn_gate_exps" in n or "router" in n for n in names)
        full = [i for i, t in enumerate(c.layer_types) if t == "full_attention"]
        v_eq_k = c.attention_k_eq_v
        assert all((f"blk.{i}.attn_v.weight" in names) != v_eq_k for i in full)
        return
    layer = len(c.mlp_layer_types) - 1 if family == "glm4_moe_lite" else c.num_hidden_layers - 1
    assert f"blk.{layer}.exp_probs_b.bias" in names
    assert not any("e_score_correction" in n for n in names)
    if family == "glm4_moe":  # the nextn layer, counted in block_count after the decoder layers
        n = c.num_hidden_layers
        assert f"blk.{n}.nextn.eh_proj.weight" in names and f"blk.{n}.attn_q.weight" in names
        assert int(r.fields["glm4moe.block_count"].parts[-1][0]) == n + 1
        rot = int(r.fields["glm4moe.rope.dimension_count"].parts[-1][0])
        assert rot == int(c.head_dim * c.rope_parameters["partial_rotary_factor"]) < c.head_dim
    if family == "minimax_m2":  # q/k norms over all heads at once
        shapes = {t.name: tuple(t.shape) for t in r.tensors}
        assert shapes["blk.0.attn_q_norm.weight"] == (c.num_attention_heads * c.head_dim,)


def test_f32_logits_match_the_hf_checkpoint(f32):
    family, hf, _, llm = f32
    assert llm.config.family == family and llm.config.torch_dtype == "float32"
    ids = _prompt(32, seed=1)
    err = (llm.logits(ids) - _hf_logits(hf, ids)).abs().max().item()
    assert err < ATOL, f"{family}: max |logit diff| {err}"


def test_f32_greedy_tokens_match_transformers(f32):
    family, hf, _, llm = f32
    ids = _prompt(10, seed=4)
    assert llm.generate(ids, max_tokens=24, ignore_eos=True) == _hf_greedy(hf, ids, 24), family


def test_config_from_the_metadata_matches_the_hf_folder(f32):
    """The GGUF's metadata gives the ModelConfig the HF folder gives (router, groups, dense
    layers, partial rotary, shared expert, MTP count), field for field."""
    from freetokend.models.config_hf import read_config

    family, hf, path, llm = f32
    folder = read_config(path.parent / "hf")
    ours = llm.config
    for field in (
        "num_layers",
        "moe_layers",
        "rope",
        "router_kind",
        "n_group",
        "topk_group",
        "routed_scaling_factor",
        "norm_topk_prob",
        "shared_expert_intermediate_size",
        "shared_expert_gated",
        "qk_norm",
        "attention_bias",
        "o_proj_bias",
        "head_dim",
        "num_kv_heads",
    ):
        want = getattr(folder, field)  # (the file keeps floats as float32)
        want = pytest.approx(want, rel=1e-6) if isinstance(want, float) else want
        assert getattr(ours, field) == want, field
    if family == "glm4_moe":
        assert ours.num_mtp_layers == folder.num_mtp_layers == 1
    if family == "gemma4":
        for field in (
            "layer_types",
            "sliding_window",
            "layer_head_dims",
            "layer_kv_heads",
            "attention_k_eq_v",
            "rope_full",
            "final_logit_softcapping",
            "num_kv_shared_layers",
        ):
            assert getattr(ours, field) == getattr(folder, field), field


@pytest.mark.parametrize("kind", ["bf16", "q8_0"])
@pytest.mark.parametrize("case", ["glm4_moe", "minimax_m2", "glm4_moe_lite", "gemma4"])
def test_quantized_file_matches_its_dequantized_weights(case, kind, tmp_path, experts_dequantized):
    family, hf = _tiny(case, tmp_path)
    path = write_gguf(family, hf, tmp_path / f"m-{kind}.gguf", kind, meta=_meta(family))
    llm = LLM(path, max_model_len=256, kv_tokens=2048, dtype="float32")
    assert llm.config.family == family
    dequantized_reference(family, hf, path)  # hf now holds exactly the file's weights
    kept = int_dot_reference(hf, llm)  # ... and computes the kept blocks as our kernels do
    assert ("lm_head" in kept) == (kind == "q8_0"), kept
    assert_kept_rows_are_the_files(hf, llm, kept, family)
    ids = _prompt(24, seed=2)
    err = (llm.logits(ids) - _hf_logits(hf, ids)).abs().max().item()
    tol = ATOL_BLOCKS_MLA if family == "glm4_moe_lite" else ATOL_BLOCKS
    assert err < (tol if kept else ATOL), f"{family} {kind}: max |logit diff| {err}"


@pytest.mark.parametrize(
    "family, over",
    [
        ("glm4_moe", dict(hidden_size=256, intermediate_size=64)),
        ("minimax_m2", dict(hidden_size=256)),
    ],
)
def test_k_quant_mix_matches_its_dequantized_weights(family, over, tmp_path, experts_dequantized):
    """A Q4_K_M-like file (Q4_K rows, Q6_K for output / attn_v / down experts, Q4_0 / Q5_0 /
    Q8_0 for rows shorter than 256), as real GLM / MiniMax Q4_K_M files mix them."""
    hf = make_tiny(family, tmp_path / "hf", seed=3, **over)[1]
    _, rows = kmix_logit_errors(family, hf, tmp_path, {"Q4_K", "Q6_K", "Q4_0"})
    # an activation rounding to the other int8 code moves one position's logits by up to 0.03
    # (seen once for MiniMax here); a misplaced block moves every position
    close = (rows < ATOL_BLOCKS).float().mean().item()
    assert close >= 0.9 and rows.max() < 0.1, f"{family} Q4_K_M mix: {close:.2f}, {rows.max()}"


def test_q8_0_experts_stay_in_blocks(tmp_path):
    """Without the dequantizing fixture, GLM's Q8_0 experts load into q8_0 banks and the model
    stays close to transformers on the float weights (int8 quantization error only)."""
    family, hf = _tiny("glm4_moe", tmp_path)
    ref = _hf_logits(hf, ids := _prompt(24, seed=2))
    path = write_gguf(family, hf, tmp_path / "m-Q8_0.gguf", "q8_0")
    llm = LLM(path, max_model_len=256, kv_tokens=2048, dtype="float32")
    assert llm.banks.format == "q8_0"
    err = (llm.logits(ids) - ref).abs().max().item()
    assert err < 0.1 * ref.abs().max().item(), err


def test_mtp_layer_is_skipped_with_one_log_line(tmp_path, caplog):
    family, hf = _tiny("glm4_moe", tmp_path)
    path = write_gguf(family, hf, tmp_path / "glm.gguf")
    with caplog.at_level("INFO", logger="freetokend.models.gguf_loader"):
        llm = LLM(path, max_model_len=64, kv_tokens=256)
    assert llm.config.num_layers == hf.config.num_hidden_layers
    lines = [r.message for r in caplog.records if "multi-token-prediction" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "skipped" in caplog.text and "1 multi-token-prediction layer" in caplog.text


@pytest.mark.parametrize(
    "meta, flash",
    [
        ({"tokenizer.ggml.pre": "glm4"}, True),
        ({"general.basename": "GLM-4.7-Flash"}, True),
        ({"tokenizer.chat_template": "[gMASK]<sop>{% for m in messages %}<|assistant|>"}, True),
        ({"tokenizer.ggml.pre": "deepseek-v3", "general.basename": "DeepSeek-V3"}, False),
        ({}, False),
    ],
)
def test_glm_flash_written_as_deepseek2_is_told_apart(meta, flash):
    assert is_glm_flash({"general.architecture": "deepseek2", **meta}) is flash
    assert not is_glm_flash({"general.architecture": "glm4moe", **meta})


def test_glm_flash_gguf_gets_glm_anchors_and_parsers(tmp_path, builtin_model_dir):
    """The same deepseek2 file loads as glm4_moe_lite when its tokenizer is GLM's (GLM's
    anchor tokens and tool-call syntax), as deepseek_v3 otherwise; the numbers agree."""
    from freetokend.engine.tokenizer import Tokenizer

    vocab = Tokenizer.from_dir(builtin_model_dir).vocab_size
    hf = make_tiny("glm4_moe_lite", tmp_path / "hf", seed=3, vocab_size=vocab)[1]
    kw = dict(max_model_len=64, kv_tokens=256)
    flash = write_gguf(
        "glm4_moe_lite", hf, tmp_path / "flash.gguf", tokenizer=builtin_model_dir, pre="glm4"
    )
    ds = write_gguf(
        "glm4_moe_lite", hf, tmp_path / "ds.gguf", tokenizer=builtin_model_dir, pre="deepseek-v3"
    )
    a, b = LLM(flash, **kw), LLM(ds, **kw)
    assert (a.config.family, b.config.family) == ("glm4_moe_lite", "deepseek_v3")
    assert family_spec(a.config.family).anchors == GLM_ANCHORS
    kinds = set(a._anchor_ids().values())
    assert {"end_of_thinking", "tool_call_start", "tool_call_end"} <= kinds, kinds
    # DeepSeek-V3's anchors are Kimi-K2's markers: of those the built-in tokenizer has only
    # <|im_end|> and </think> (GLM's tool-call tags are no anchors of it)
    assert sorted(b._anchor_ids().values()) == ["end_of_thinking", "end_of_turn"]
    assert detect_syntax(a.config.family, "").tools is ToolSyntax.GLM_XML
    assert detect_syntax(b.config.family, "").tools is ToolSyntax.NONE
    ids = torch.randint(2, vocab, (16,), generator=torch.Generator().manual_seed(5)).tolist()
    err = (a.logits(ids) - _hf_logits(hf, ids)).abs().max().item()
    assert err < ATOL, err


def test_gemma4_per_layer_input_embeddings_are_refused(tmp_path):
    """E2B / E4B's per-layer input embeddings are not read from GGUF: a clear error, not a
    model that computes something else."""
    from freetokend.formats.gguf_file import GgufFile
    from freetokend.models.config import ConfigError
    from freetokend.models.gguf_config import hf_fields

    family, hf = _tiny("gemma4", tmp_path)
    path = write_gguf(family, hf, tmp_path / "g.gguf")
    with GgufFile(path) as f:
        assert hf_fields(f.metadata, f.tensors, "float32", str(path))["top_k_experts"] == 2
        meta = {**f.metadata, "gemma4.embedding_length_per_layer_input": 8}
        with pytest.raises(ConfigError, match="per-layer input embeddings"):
            hf_fields(meta, f.tensors, "float32", str(path))


# transformers' GGUF loader (5.24) cannot read Gemma-4 MoE files: strict, so a transformers that
# learns them turns the case into a failure that asks for the xfail to go.
_TF_GEMMA4 = pytest.mark.xfail(
    strict=True,
    raises=StrictDataclassFieldValidationError,
    reason="transformers' gemma4 GGUF map takes attention.head_count_kv as the config's "
    "num_key_value_heads, and files whose layer types differ in KV heads (26B-A4B's, this one's) "
    "store it per layer: a list, which Gemma4TextConfig refuses. Past it, the map has no MoE "
    "keys (expert_count, expert_used_count, expert_feed_forward_length), no sliding pattern, "
    "no sliding head dim, no rope bases or softcapping, and there is no Gemma-4 tensor "
    "processor: experts.gate_up_proj / down_proj and layer_scalar are looked up without the "
    "file's '.weight', router.scale / per_expert_scale have no GGUF name, so they stay random",
)


@pytest.mark.parametrize(
    "family, kind",
    [
        ("minimax_m2", "f32"),
        ("minimax_m2", "q8_0"),
        ("minimax_m2", "kmix"),
        *(pytest.param("gemma4", k, marks=_TF_GEMMA4) for k in ("f32", "q8_0")),
    ],
)
def test_against_transformers_gguf_loader(
    family, kind, builtin_model_dir, tmp_path, experts_dequantized
):
    """transformers reads the same file with its own metadata map (MiniMax-M2's sigmoid router
    from expert_gating_func, its routing bias by default), name map and dequantizers."""
    over = {"hidden_size": 256} if kind == "kmix" else {}
    err = against_transformers_gguf_loader(family, tmp_path, kind, builtin_model_dir, **over)
    # K-quant rows: one int8 input (per 256) flipped across a rounding boundary moves logits by
    # ~2e-2 (test_gguf.py's ATOL_BLOCKS); measured 2.4e-6 here, 1.0e-6 for F32 and 4.8e-7 for Q8_0
    tol = {"f32": ATOL, "q8_0": ATOL_BLOCKS, "kmix": 5e-2}[kind]
    assert err < tol, f"{family} {kind} vs transformers' GGUF loader: {err}"
