"""GGUF files of DeepSeek-V4 as llama.cpp's converter writes them (``deepseek4``, reproduced in
tests/gguf_convert.py): the release's tensors renamed one for one (hyper-connection weights,
the compressors' and the indexer's, ``output_hc_*``), the routed experts repacked to MXFP4
(always: the converter's output type does not apply to them), the hash layers' ``tid2eid`` as
an I32 table with their unused router bias dropped, and the release's config keys under
llama.cpp's names (compress ratios per layer, hash layer count, hyper-connection count,
SwiGLU clamps per layer, the compress rope's base and the YaRN keys).

The oracle is transformers on the file's own weights dequantized (the experts' MXFP4 values).
With the experts dequantized at load too, an F32 file agrees within 1e-4 (measured 1.4e-6).
Kept in their MXFP4 blocks the experts' inputs are quantized to int8 per 32 values, as llama.cpp
does: measured median over positions of max |dlogit| 6.8e-3, one position at 0.26, top-1 equal
everywhere. The Q8_0 file's dense projections in blocks, computed in transformers as our
kernels do (``int_dot_reference``): most positions within 1e-6, those reading one compressed
entry whose int8 input rounds the other way up to 0.27 (measured), top-1 equal."""

from __future__ import annotations

import dataclasses

import gguf
import pytest
from gguf_files import dequantized_reference, int_dot_reference, write_gguf
from gguf_files import hf_logits as _hf_logits
from gguf_files import prompt as _prompt
from tiny_models import make_tiny

from freetokend import LLM
from freetokend.models.families.deepseek_v4 import v4_config
from freetokend.models.loader import model_config

ATOL = 1e-4
IDS = _prompt(40, seed=1)  # several windows of 8 and compressed entries at rates 4 and 8


def _compare(llm, hf) -> tuple[float, float, float]:
    a, b = llm.logits(IDS), _hf_logits(hf, IDS)
    per_pos = (a - b).abs().amax(-1)
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    return agree, per_pos.max().item(), per_pos.median().item()


@pytest.fixture(scope="module")
def f32(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf-deepseek-v4")
    hf = make_tiny("deepseek_v4", d / "hf", seed=3)[1]
    path = write_gguf("deepseek_v4", hf, d / "v4-F32.gguf", "f32")
    dequantized_reference("deepseek_v4", hf, path)  # the experts' MXFP4 values
    return hf, path


def test_file_has_the_converters_layout(f32):
    hf, path = f32
    r = gguf.GGUFReader(path)
    types = {t.name: t.tensor_type.name for t in r.tensors}
    c = hf.config
    assert bytes(r.fields["general.architecture"].parts[-1]).decode() == "deepseek4"
    assert {"output_hc_fn.weight", "blk.1.hc_attn_fn.weight", "blk.1.hc_ffn_scale.weight"} <= set(
        types
    )
    assert {"blk.1.attn_compressor_ape.weight", "blk.1.indexer_compressor_kv.weight"} <= set(types)
    assert "blk.2.indexer.proj.weight" not in types  # HCA: no indexer
    assert types["blk.0.ffn_gate_tid2eid.weight"] == "I32"
    assert "blk.0.exp_probs_b.bias" not in types and "blk.1.exp_probs_b.bias" in types
    assert {t for n, t in types.items() if "_exps." in n} == {"MXFP4"}
    ratios = r.fields["deepseek4.attention.compress_ratios"]
    assert [int(ratios.parts[j][0]) for j in ratios.data] == [0, 4, 8, 4]
    assert int(r.fields["deepseek4.hash_layer_count"].parts[-1][0]) == 1
    assert int(r.fields["deepseek4.hyper_connection.count"].parts[-1][0]) == c.hc_mult


def test_config_from_the_metadata_matches_the_hf_folder(f32):
    _, path = f32
    ours = v4_config(model_config(path).raw)
    ref = v4_config(model_config(path.parent / "hf").raw)
    # the file keeps the epsilons as float32
    assert (ours.rms_norm_eps, ours.hc_eps) == pytest.approx((ref.rms_norm_eps, ref.hc_eps))
    same = dict(torch_dtype=ref.torch_dtype, rms_norm_eps=ref.rms_norm_eps, hc_eps=ref.hc_eps)
    assert dataclasses.replace(ours, **same) == ref


def test_f32_file_with_experts_dequantized_matches_transformers(f32, experts_dequantized):
    hf, path = f32
    llm = LLM(path, max_model_len=256, kv_tokens=2048, dtype="float32")
    assert llm.config.family == "deepseek_v4"
    _, err, _ = _compare(llm, hf)
    assert err < ATOL, f"max |logit diff| {err}"


def test_mxfp4_experts_stay_in_their_blocks(f32):
    hf, path = f32
    llm = LLM(path, max_model_len=256, kv_tokens=2048, dtype="float32")
    assert llm.banks.format == "mxfp4/mxfp4"
    agree, err, med = _compare(llm, hf)
    assert agree == 1.0 and med < 2e-2, (agree, err, med)
    out = llm.generate(IDS[:12], max_tokens=8, ignore_eos=True)
    assert len(out) == 8


def test_q8_0_file_matches_its_dequantized_weights(tmp_path, experts_dequantized):
    hf = make_tiny("deepseek_v4", tmp_path / "hf", seed=3)[1]
    path = write_gguf("deepseek_v4", hf, tmp_path / "v4-Q8_0.gguf", "q8_0")
    llm = LLM(path, max_model_len=256, kv_tokens=2048, dtype="float32")
    dequantized_reference("deepseek_v4", hf, path)
    kept = int_dot_reference(hf, llm)
    assert any("compressor" in n for n in kept) and any("o_b_proj" in n for n in kept), kept
    agree, err, med = _compare(llm, hf)
    assert agree == 1.0 and med < 1e-4, (agree, err, med)


def test_disk_tier_reads_the_hash_layers_experts_when_the_step_starts(f32):
    """With the experts left in the file (a RAM cache of about one layer's), a hash layer's
    experts are read when the step starts (``known_routes`` -> ``TieredExecutor.read_known``),
    before the layers ahead of it run: the same tokens as the resident pool (the same kernels
    on the same bytes), and those reads were used. V4 has no router the tier's own prediction
    reads (``router_predictor``), so every read ahead here is a known one."""
    _, path = f32
    kw = dict(max_model_len=256, kv_tokens=2048, dtype="float32", prefix_cache=False)
    want = LLM(path, **kw).generate(IDS[:12], max_tokens=8, ignore_eos=True)
    tiered = LLM(path, "cpu", expert_cache_mb=0.03, **kw)
    tier = tiered.moe.tier
    assert tier is not None and tier.cache.slots < tiered.banks.num_flat
    known: list[list[int]] = []
    read_known = tier.read_known

    def recorded(flat_ids, keep):
        known.append(sorted(set(flat_ids.flatten().tolist())))
        read_known(flat_ids, keep)

    tier.read_known = recorded
    assert tiered.generate(IDS[:12], max_tokens=8, ignore_eos=True) == want
    hash_layer = tiered.config.moe_layer_index[0]  # the tiny config's hash layer is layer 0
    e = tiered.config.num_experts
    assert known and all(f // e == hash_layer for ids in known for f in ids)
    c = tier.counters
    assert c["read_ahead"] > 0 and c["read_ahead_hits"] > 0, c
