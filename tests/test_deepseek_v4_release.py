"""DeepSeek-V4 checkpoints as released: the release's config.json keys, tensor names and formats.

The fixtures are the tiny transformers checkpoint (tests/tiny_models.py) rewritten into the
release layout by this file, which keeps its own codecs (not freetokend's) so that a layout
error on our side cannot cancel out:

- names: no ``model.`` prefix, ``embed.weight``, ``hc_head_fn`` / ``_base`` / ``_scale`` (the
  names transformers' conversion mapping for ``deepseek_v4`` renames from; the rest transformers
  already saves as released);
- config.json: the legacy keys ``DeepseekV4Config.__post_init__`` folds (``compress_ratios`` per
  layer, ``num_hash_layers``, ``qk_rope_head_dim``, a flat YaRN ``rope_scaling``) in place of
  ``layer_types`` / ``compress_rates`` / ``mlp_layer_types`` / ``partial_rotary_factor`` /
  nested ``rope_parameters``;
- FP8 dense weights (``quant_method: fp8``, ``scale_fmt: ue8m0``, ``weight_block_size``
  [128, 128]): ``X.weight`` float8_e4m3fn with ``X.scale`` float8_e8m0fnu per 128 x 128 block
  (partial at the edges), a power of two 2^ceil(log2(amax / 448));
- FP4 routed experts (``expert_dtype: fp4``): ``ffn.experts.E.wN.weight`` int8 [rows, cols / 2],
  two e2m1 codes a byte, element 2j in the low nibble (DeepSeek's inference/convert.py
  ``cast_e2m1fn_to_e4m3fn`` unpacks ``x & 0x0F`` then ``x >> 4``), and ``.scale``
  float8_e8m0fnu [rows, cols / 32], 2^ceil(log2(amax / 6)) per 32 inputs (model.py's
  ``fp4_block_size = 32``).

The oracle is transformers on the same weights dequantized back to float32 by this file
(transformers' own FP8 / FP4 reader, ``FineGrainedFP8Config(dequantize=True)``, gives exactly
the same logits from the fixture). The dense path then computes what transformers computes and
the experts stay packed, so the tolerances are test_engine_families's (fp32, summation order
only): logits within 2e-4 (measured 1.5e-6), 32 greedy tokens equal up to a near-tie of 1e-3
(none measured).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
from pathlib import Path

import pytest
import torch
from greedy_check import FP32_MARGIN, HfScorer, assert_greedy_agrees, hf_greedy
from runner_steps import logits_in_steps
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny

from freetokend import LLM
from freetokend.models import fp8_weights
from freetokend.models.config import ModelConfig
from freetokend.models.config_hf import read_config
from freetokend.models.families.deepseek_v4 import fold_legacy, v4_config
from freetokend.models.loader import _Source

ATOL = 2e-4  # fp32 weights on both sides (test_engine_families)

E2M1 = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
)
# the release's dense FP8 tensors: attention's projections and the shared expert
# (the compressors' wkv / wgate, the router, the indexer's weights_proj stay float)
FP8_NAMES = (
    "attn.wq_a.weight",
    "attn.wq_b.weight",
    "attn.wkv.weight",
    "attn.wo_a.weight",
    "attn.wo_b.weight",
    "attn.indexer.wq_b.weight",
    "ffn.shared_experts.w1.weight",
    "ffn.shared_experts.w2.weight",
    "ffn.shared_experts.w3.weight",
)
TOP = {
    "model.embed_tokens.weight": "embed.weight",
    "model.hc_head.hc_fn": "hc_head_fn",
    "model.hc_head.hc_base": "hc_head_base",
    "model.hc_head.hc_scale": "hc_head_scale",
}


# ---- the release's codecs, written here --------------------------------------------------------


def fp8_blocks(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, C] -> (float8_e4m3fn [R, C], ue8m0 scales [ceil(R/b), ceil(C/b)])."""
    r, c = w.shape
    rb, cb = math.ceil(r / block), math.ceil(c / block)
    scale = torch.empty(rb, cb)
    for i in range(rb):
        for j in range(cb):
            amax = float(w[i * block : (i + 1) * block, j * block : (j + 1) * block].abs().max())
            scale[i, j] = 2.0 ** math.ceil(math.log2(max(amax, 1e-30) / 448.0))
    full = scale.repeat_interleave(block, 0)[:r].repeat_interleave(block, 1)[:, :c]
    return (w / full).to(torch.float8_e4m3fn), scale.to(torch.float8_e8m0fnu)


def fp8_decode(q: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    r, c = q.shape
    full = scale.float().repeat_interleave(block, 0)[:r].repeat_interleave(block, 1)[:, :c]
    return q.float() * full


def fp4_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, C] -> (int8 [R, C/2], low nibble first; ue8m0 scales [R, C/32])."""
    r, c = w.shape
    blocks = w.reshape(r, c // 32, 32)
    amax = blocks.abs().amax(-1).clamp(min=1e-30)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 6.0)))
    x = (blocks / scale.unsqueeze(-1)).reshape(r, c)
    codes = (x.unsqueeze(-1) - E2M1).abs().argmin(-1).to(torch.uint8)  # nearest value
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.view(torch.int8), scale.to(torch.float8_e8m0fnu)


def fp4_decode(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    u = packed.view(torch.uint8)
    vals = torch.stack([E2M1[(u & 0x0F).long()], E2M1[(u >> 4).long()]], dim=-1)
    vals = vals.reshape(u.shape[0], u.shape[1] * 2)
    return vals * scale.float().repeat_interleave(32, dim=1)


# ---- fixtures ------------------------------------------------------------------------------------


def release_config(hf: dict) -> dict:
    """config.json with the release's legacy keys in place of transformers' folded ones."""
    out = {
        k: v
        for k, v in hf.items()
        if k
        not in (
            "layer_types",
            "compress_rates",
            "mlp_layer_types",
            "partial_rotary_factor",
            "rope_parameters",
        )
    }
    rates = hf["compress_rates"]
    out["compress_ratios"] = [
        0 if t == "sliding_attention" else rates[t] for t in hf["layer_types"]
    ] + [0]  # and the MTP layer's, as the release lists it
    out["num_hash_layers"] = hf["mlp_layer_types"].count("hash_moe")
    out["qk_rope_head_dim"] = int(hf["head_dim"] * hf["partial_rotary_factor"])
    comp = hf["rope_parameters"]["compress"]
    out["rope_scaling"] = {
        "type": comp["rope_type"],
        **{
            k: v
            for k, v in comp.items()
            if k not in ("rope_type", "rope_theta", "partial_rotary_factor", "attention_factor")
        },
    }
    out["rope_theta"] = hf["rope_parameters"]["main"]["rope_theta"]
    out["compress_rope_theta"] = comp["rope_theta"]
    return out


def release_names(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {TOP.get(k, k.removeprefix("model.")): v for k, v in sd.items()}


def write_release(src: Path, dst: Path, quantize: bool) -> dict[str, torch.Tensor]:
    """``src`` (transformers' save) in the release layout at ``dst``; returns the float32
    tensors transformers should run on (``src``'s names; the quantized ones dequantized)."""
    dst.mkdir()
    saved = load_file(src / "model.safetensors")
    out, oracle = {}, dict(saved)
    inverse = {v: k for k, v in TOP.items()}
    for name, t in release_names(saved).items():
        orig = inverse.get(name, name if name == "head.weight" else "model." + name)
        base = name.removesuffix(".weight")
        if quantize and name.endswith(FP8_NAMES):
            q, s = fp8_blocks(t.float())
            out[name], out[base + ".scale"] = q, s
            oracle[orig] = fp8_decode(q, s)
        elif quantize and ".ffn.experts." in name:
            q, s = fp4_blocks(t.float())
            out[name], out[base + ".scale"] = q, s
            oracle[orig] = fp4_decode(q, s)
        else:
            out[name] = t
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = release_config(json.loads((src / "config.json").read_text()))
    if quantize:
        cfg["quantization_config"] = {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "scale_fmt": "ue8m0",
            "weight_block_size": [128, 128],
        }
        cfg["expert_dtype"] = "fp4"
    (dst / "config.json").write_text(json.dumps(cfg))
    return oracle


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("v4-hf")
    _, hf = make_tiny("deepseek_v4", d, seed=3)
    return d, hf


@pytest.fixture(scope="module")
def quantized(tiny, tmp_path_factory):
    """(release-layout FP8 / FP4 checkpoint, transformers on its dequantized weights)."""
    import transformers as tf

    d, _ = tiny
    root = tmp_path_factory.mktemp("v4-release")
    oracle_sd = write_release(d, root / "release", quantize=True)
    ref = root / "oracle"
    shutil.copytree(d, ref)
    save_file(oracle_sd, ref / "model.safetensors", metadata={"format": "pt"})
    hf = tf.DeepseekV4ForCausalLM.from_pretrained(ref, dtype=torch.float32).eval()
    return root / "release", hf


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 97, (n,), generator=g).tolist()


# ---- (1) config.json -----------------------------------------------------------------------------


def _same_config(a: ModelConfig, b: ModelConfig) -> None:
    for f in dataclasses.fields(ModelConfig):
        if f.name not in ("raw", "expert_format"):
            assert getattr(a, f.name) == getattr(b, f.name), f.name


def test_release_config_reads_as_transformers_saved(tiny, tmp_path):
    d, _ = tiny
    hf_cfg = json.loads((d / "config.json").read_text())
    rel = release_config(hf_cfg)
    assert "layer_types" not in rel and rel["compress_ratios"] == [0, 4, 8, 4, 0]
    assert v4_config(rel) == v4_config(hf_cfg)
    (tmp_path / "config.json").write_text(json.dumps(rel))
    _same_config(read_config(tmp_path), read_config(d))


def test_flash_config_folds_as_transformers_does():
    """V4-Flash's geometry in the release's spelling (rates 4 / 128, an entry for the MTP
    layer, YaRN on the compress rope): transformers' own folding gives the same V4Config."""
    import transformers as tf

    rel = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "num_hidden_layers": 6,
        "compress_ratios": [0, 0, 4, 128, 4, 128, 0],
        "num_hash_layers": 2,
        "qk_rope_head_dim": 64,
        "head_dim": 512,
        "rope_theta": 10000,
        "compress_rope_theta": 160000,
        "rope_scaling": {
            "type": "yarn",
            "factor": 16,
            "beta_fast": 32,
            "beta_slow": 1,
            "original_max_position_embeddings": 65536,
        },
        "max_position_embeddings": 1048576,
    }
    theirs = tf.DeepseekV4Config(**{k: v for k, v in rel.items() if k != "architectures"})
    folded = ("layer_types", "mlp_layer_types", "compress_rates", "partial_rotary_factor")
    folded += ("rope_parameters", "qk_rope_head_dim")
    defaults = {k: v for k, v in tf.DeepseekV4Config().to_dict().items() if k not in folded}
    ours = fold_legacy({**defaults, **rel})
    assert ours["layer_types"] == theirs.layer_types
    assert ours["mlp_layer_types"] == theirs.mlp_layer_types
    assert ours["compress_rates"] == theirs.compress_rates
    assert ours["partial_rotary_factor"] == theirs.partial_rotary_factor
    assert v4_config(ours) == v4_config(theirs.to_dict())


def test_release_quantization_config(tmp_path, tiny):
    d, _ = tiny
    cfg = json.loads((d / "config.json").read_text())
    q = {"quant_method": "fp8", "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
    for where in ("top", "nested"):
        c = {**cfg, "quantization_config": dict(q)}
        if where == "top":
            c["expert_dtype"] = "fp4"
        else:
            c["quantization_config"]["expert_dtype"] = "fp4"  # transformers folds it there
        (tmp_path / "config.json").write_text(json.dumps(c))
        assert read_config(tmp_path).expert_format == "mxfp4"
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "quantization_config": q}))
    with pytest.raises(Exception, match="FP8 routed experts"):
        read_config(tmp_path)


# ---- (2) names -----------------------------------------------------------------------------------


def test_release_names_load_in_transformers_and_here(tiny, tmp_path):
    """The fixture's names are the release's: transformers' conversion mapping reads them with
    nothing missing or unexpected and gives the original model; we read every one of them."""
    import transformers as tf

    d, hf = tiny
    write_release(d, tmp_path / "rel", quantize=False)
    names = set(load_file(tmp_path / "rel" / "model.safetensors"))
    assert {"embed.weight", "head.weight", "hc_head_fn", "layers.0.hc_attn_fn"} <= names
    assert "layers.0.ffn.experts.7.w2.weight" in names and not any(
        n.startswith("model.") for n in names
    )
    # transformers reads the release names (its config in its own form: it does not know a
    # compress ratio of 8)
    shutil.copy(d / "config.json", tmp_path / "rel-tf-config.json")
    tf_dir = tmp_path / "tf"
    tf_dir.mkdir()
    (tf_dir / "model.safetensors").symlink_to(tmp_path / "rel" / "model.safetensors")
    shutil.copy(d / "config.json", tf_dir / "config.json")
    theirs, info = tf.DeepseekV4ForCausalLM.from_pretrained(tf_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = _prompt(12, 5)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
        assert torch.equal(theirs.eval()(torch.tensor([ids])).logits[0], want)
    llm = LLM(tmp_path / "rel", moe_backend="cpu", max_model_len=128, kv_tokens=256)
    got = logits_in_steps(llm, ids, [6] + [1] * 6)  # the last position of each step
    assert (got - want[5:]).abs().max().item() < ATOL


# ---- (3), (4) FP8 dense, FP4 experts -------------------------------------------------------------


def test_widen_partial_blocks():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(200, 300, generator=g) * 0.05
    q, s = fp8_blocks(w)
    assert s.shape == (2, 3)
    out = torch.empty(200, 300, dtype=torch.bfloat16)
    fp8_weights.widen(q, s, (128, 128), out)
    assert torch.equal(out, fp8_decode(q, s).to(torch.bfloat16))
    assert torch.equal(
        fp8_weights.widen(q, s.view(torch.uint8), (128, 128), out.float()), fp8_decode(q, s)
    )


def test_fp8_dense_and_fp4_experts_match_transformers(quantized, monkeypatch, caplog):
    ckpt, hf = quantized
    read = _Source.read

    def no_expert_copy(self):  # every routed expert goes straight into its bank
        assert ".ffn.experts." not in self.info.name, self.info.name
        return read(self)

    monkeypatch.setattr(_Source, "read", no_expert_copy)
    with caplog.at_level(logging.INFO):
        llm = LLM(ckpt, moe_backend="cpu", max_model_len=128, kv_tokens=256)
    monkeypatch.undo()
    assert llm.config.expert_format == "mxfp4"
    b = llm.banks
    assert b.format == "mxfp4" and b.gate_up.dtype == torch.uint8
    # the bank holds the file's bytes: layer 2 expert 5's up rows, layer 3 expert 1's down scales
    sd = load_file(ckpt / "model.safetensors")
    assert torch.equal(
        b.gate_up[2 * 8 + 5, 32:], sd["layers.2.ffn.experts.5.w3.weight"].view(torch.uint8)
    )
    assert torch.equal(
        b.extra["down_scale"][3 * 8 + 1], sd["layers.3.ffn.experts.1.w2.scale"].view(torch.uint8)
    )
    assert not [n for n, _ in llm.model.named_parameters() if ".experts." in n]
    msgs = [r.getMessage() for r in caplog.records if "FP8 dense weights" in r.getMessage()]
    n_fp8 = sum(t.dtype == torch.float8_e4m3fn for t in sd.values())
    assert n_fp8 == 34  # 8 a layer, and the 2 CSA layers' indexer wq_b
    assert len(msgs) == 1 and f"{n_fp8} FP8 dense weights" in msgs[0] and "RAM" in msgs[0], msgs
    # a widened weight equals the fixture's dequantized one
    wq = llm.model.layers[1].self_attn.q_b_proj.weight
    assert torch.equal(
        wq, fp8_decode(sd["layers.1.attn.wq_b.weight"], sd["layers.1.attn.wq_b.scale"])
    )

    ids = _prompt(24, 1)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    ours = logits_in_steps(llm, ids, [10] + [1] * 14)
    assert (ours - ref[9:]).abs().max().item() < ATOL

    prompt = _prompt(12, 4)
    got = llm.generate(prompt, max_tokens=32, ignore_eos=True)
    want = hf_greedy(hf, prompt, 32)
    assert_greedy_agrees([got], [want], [prompt], HfScorer(hf), FP32_MARGIN, "v4 release")


def test_transformers_dequantizes_the_fixture_as_we_do(quantized, tiny, tmp_path):
    """transformers' own reader of the release's formats (FineGrainedFP8Config with
    dequantize: its FP8 block scales and FP4 unpacking) gives the oracle's logits exactly: the
    fixture's codecs are the release's as transformers reads them."""
    import transformers as tf

    ckpt, oracle = quantized
    d, _ = tiny
    (tmp_path / "model.safetensors").symlink_to(ckpt / "model.safetensors")
    cfg = json.loads((d / "config.json").read_text())  # its own form (no compress ratio 8)
    cfg["quantization_config"] = json.loads((ckpt / "config.json").read_text())[
        "quantization_config"
    ]
    cfg["expert_dtype"] = "fp4"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    qc = tf.FineGrainedFP8Config(dequantize=True, weight_block_size=[128, 128], scale_fmt="ue8m0")
    theirs = tf.DeepseekV4ForCausalLM.from_pretrained(
        tmp_path, quantization_config=qc, dtype=torch.float32
    ).eval()
    ids = torch.tensor([_prompt(24, 1)])
    with torch.no_grad():
        assert torch.equal(theirs(ids).logits, oracle(ids).logits)


def test_transformers_scale_names_and_float_scales(quantized, tmp_path):
    """The dense scales under transformers' name (``weight_scale_inv``) and as float32 (V3's
    form) load to the same weights."""
    ckpt, _ = quantized
    shutil.copy(ckpt / "config.json", tmp_path / "config.json")
    sd = load_file(ckpt / "model.safetensors")
    out = {}
    for k, v in sd.items():
        dense = k.endswith(".scale") and ".ffn.experts." not in k
        out[k.replace(".scale", ".weight_scale_inv") if dense else k] = v.float() if dense else v
    save_file(out, tmp_path / "model.safetensors", metadata={"format": "pt"})
    a = LLM(ckpt, moe_backend="cpu", max_model_len=64, kv_tokens=128)
    b = LLM(tmp_path, moe_backend="cpu", max_model_len=64, kv_tokens=128)
    pa, pb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    assert pa.keys() == pb.keys() and all(torch.equal(pa[n], pb[n]) for n in pa)


def test_broken_release_tensors_are_named(quantized, tmp_path):
    from freetokend.models.loader import CheckpointError

    ckpt, _ = quantized
    sd = load_file(ckpt / "model.safetensors")
    for broken, match in (
        ({k: v for k, v in sd.items() if k != "layers.1.attn.wq_a.scale"}, "wq_a.weight.*scales"),
        ({**sd, "layers.2.ffn.experts.3.w1.weight": torch.zeros(32, 64)}, "experts.3.w1.weight"),
        ({**sd, "layers.2.attn.wq_b.scale": sd["layers.2.attn.wq_b.scale"][:, :0]}, "wq_b"),
    ):
        d = tmp_path / str(len(list(tmp_path.iterdir())))
        d.mkdir()
        shutil.copy(ckpt / "config.json", d / "config.json")
        save_file(broken, d / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(CheckpointError, match=match):
            LLM(d, moe_backend="cpu", max_model_len=64, kv_tokens=128)


def test_scales_in_another_shard(quantized, tmp_path):
    """Sharded as the release is: a weight's scales may sit in another file."""
    ckpt, _ = quantized
    shutil.copy(ckpt / "config.json", tmp_path / "config.json")
    sd = load_file(ckpt / "model.safetensors")
    shards = {"a.safetensors": {}, "b.safetensors": {}}
    for k, v in sd.items():
        shards["b.safetensors" if k.endswith(".scale") else "a.safetensors"][k] = v
    for f, t in shards.items():
        save_file(t, tmp_path / f, metadata={"format": "pt"})
    index = {"weight_map": {k: f for f, t in shards.items() for k in t}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    a = LLM(ckpt, moe_backend="cpu", max_model_len=64, kv_tokens=128)
    b = LLM(tmp_path, moe_backend="cpu", max_model_len=64, kv_tokens=128)
    pa, pb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    ba, bb = a.banks.all_tensors(), b.banks.all_tensors()
    assert all(torch.equal(ba[n], bb[n]) for n in ba)
