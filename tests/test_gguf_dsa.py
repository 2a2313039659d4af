"""GGUF files of the DSA families as llama.cpp's converter writes them (``gguf_convert``):
DeepSeek-V3.2 (``deepseek32``) and GLM-5 (``glm-dsa``), DeepSeek-V3's MLA tensors (kv_b split
into ``attn_k_b`` / ``attn_v_b``) plus the Lightning Indexer's (``blk.N.indexer.*``, as they
are), its geometry under ``attention.indexer.*`` and, for GLM-5, the indexer layers as
``attention.indexer.types`` (a shared layer has no indexer tensors) and the nextn layer after
the decoder layers.

F32 files: logits within 1e-4 of transformers (the tiny DSA configs are tie-free: 32 indexer
heads, tests/test_dsa.py), greedy tokens those of the HF folder loaded by us. Quantized files:
against transformers on the file's own dequantized weights, the projections we keep in blocks
computed in it as our kernels do (see test_gguf.py)."""

from __future__ import annotations

import gguf
import pytest
from gguf_files import (
    dequantized_reference,
    int_dot_reference,
    write_gguf,
)
from gguf_files import (
    hf_logits as _hf_logits,
)
from gguf_files import (
    prompt as _prompt,
)
from tiny_models import VARIANTS, make_tiny

from freetokend import LLM
from freetokend.formats.gguf_file import GgufFile
from freetokend.models.config import ConfigError
from freetokend.models.gguf_config import config_from_gguf, hf_fields
from freetokend.models.loader import model_config

ATOL = 1e-4  # the F32 tolerance; measured ~2e-6
# projections kept in Q8_0 blocks against transformers computing them as the kernels do:
# measured <= 1e-6 (test_gguf_hybrid_mla.py allows 5e-2 for an int8 input flipped at a rounding
# boundary; none flips here, and a flip that changed the indexer's selection would show far above)
ATOL_BLOCKS = 5e-2
CASES = ("deepseek_v32", "glm_moe_dsa", "glm_moe_dsa:shared2", "glm_moe_dsa:mtp")
_OVER = {"glm_moe_dsa:mtp": {"num_nextn_predict_layers": 1}}
ARCH = {"deepseek_v32": "deepseek32", "glm_moe_dsa": "glm-dsa"}
INDEXER = ("attn_q_b.weight", "attn_k.weight", "k_norm.weight", "k_norm.bias", "proj.weight")


def _tiny(case: str, d, seed: int = 3):
    family = case.split(":")[0]
    over = _OVER.get(case, VARIANTS.get(case, {}))
    return family, make_tiny(family, d / "hf", seed=seed, **over)[1]


@pytest.fixture(scope="module", params=CASES)
def f32(request, tmp_path_factory):
    case = request.param
    d = tmp_path_factory.mktemp(f"gguf-{case.replace(':', '-')}")
    family, hf = _tiny(case, d)
    path = write_gguf(family, hf, d / f"{family}-F32.gguf", "f32")
    return family, hf, path, LLM(path, max_model_len=256, kv_tokens=2048)


def test_file_has_the_converters_layout(f32):
    family, hf, path, _ = f32
    r = gguf.GGUFReader(path)
    names = {t.name for t in r.tensors}
    arch = ARCH[family]
    assert bytes(r.fields["general.architecture"].parts[-1]).decode() == arch
    c = hf.config
    shared = [k == "shared" for k in getattr(c, "indexer_types", None) or []]
    for i in range(c.num_hidden_layers):
        has = {f"blk.{i}.indexer.{k}" for k in INDEXER} <= names
        assert has != (shared[i] if shared else False), (i, shared)
        assert {f"blk.{i}.attn_k_b.weight", f"blk.{i}.attn_v_b.weight"} <= names
    assert not any("kv_b" in n or "e_score_correction" in n or "indexer.wq" in n for n in names)
    heads = int(r.fields[f"{arch}.attention.indexer.head_count"].parts[-1][0])
    assert heads == c.index_n_heads
    if shared:
        kinds = r.fields[f"{arch}.attention.indexer.types"]
        assert [bool(kinds.parts[j][0]) for j in kinds.data] == [not s for s in shared]
    mtp = getattr(c, "num_nextn_predict_layers", 0) or 0
    if mtp:  # the nextn layer, counted in block_count after the decoder layers
        assert f"blk.{c.num_hidden_layers}.nextn.eh_proj.weight" in names
    assert int(r.fields[f"{arch}.block_count"].parts[-1][0]) == c.num_hidden_layers + mtp


def test_f32_logits_match_transformers(f32):
    family, hf, _, llm = f32
    assert llm.config.family == family and llm.config.torch_dtype == "float32"
    ids = _prompt(40, seed=1)  # longer than index_topk: the selection matters
    assert len(ids) > llm.config.index_topk
    err = (llm.logits(ids) - _hf_logits(hf, ids)).abs().max().item()
    assert err < ATOL, f"{family}: max |logit diff| {err}"


def test_f32_greedy_tokens_match_the_hf_folder(f32):
    family, _, path, llm = f32
    ids = _prompt(10, seed=4)
    ref = LLM(path.parent / "hf", max_model_len=256, kv_tokens=2048, dtype="float32")
    want = ref.generate(ids, max_tokens=24, ignore_eos=True)
    assert llm.generate(ids, max_tokens=24, ignore_eos=True) == want, family


def test_config_from_the_metadata_matches_the_hf_folder(f32):
    family, _, path, llm = f32
    ref = model_config(path.parent / "hf")
    fields = (
        "family moe_layers num_experts top_k norm_topk_prob moe_intermediate_size "
        "q_lora_rank kv_lora_rank qk_nope_head_dim qk_rope_head_dim v_head_dim n_group "
        "topk_group routed_scaling_factor num_heads rope index_topk "
        "index_n_heads index_head_dim index_rope_interleaved index_shared router_kind"
    ).split()
    for f in fields:
        assert getattr(llm.config, f) == getattr(ref, f), f


@pytest.mark.parametrize("case", ["deepseek_v32", "glm_moe_dsa:shared2"])
@pytest.mark.parametrize("kind", ["bf16", "q8_0"])
def test_quantized_file_matches_its_dequantized_weights(case, kind, tmp_path, experts_dequantized):
    family, hf = _tiny(case, tmp_path)
    path = write_gguf(family, hf, tmp_path / f"m-{kind}.gguf", kind)
    types = {t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert kind.upper() in types, types
    llm = LLM(path, max_model_len=256, kv_tokens=2048, dtype="float32")
    dequantized_reference(family, hf, path)
    kept = int_dot_reference(hf, llm)
    assert bool(kept) == (kind == "q8_0"), kept
    if kept:  # the indexer's key and weights projections among them (wq_b's 24-wide rows: F16)
        assert any(".indexer.wk" in n for n in kept), kept
        assert any(".indexer.weights_proj" in n for n in kept), kept
    ids = _prompt(24, seed=2)
    err = (llm.logits(ids) - _hf_logits(hf, ids)).abs().max().item()
    assert err < (ATOL_BLOCKS if kept else ATOL), f"{case} {kind}: max |logit diff| {err}"


def test_q8_0_experts_stay_in_blocks(tmp_path):
    family, hf = _tiny("deepseek_v32", tmp_path)
    path = write_gguf(family, hf, tmp_path / "m-Q8_0.gguf", "q8_0")
    llm = LLM(path, max_model_len=256, kv_tokens=2048, dtype="float32")
    assert llm.banks.format == "q8_0"
    out = llm.generate(_prompt(12, seed=5), max_tokens=8, ignore_eos=True)
    assert len(out) == 8


def _glm_file(tmp_path, **over):
    hf = make_tiny("glm_moe_dsa", tmp_path / "hf", seed=3, **over)[1]
    path = write_gguf("glm_moe_dsa", hf, tmp_path / "m.gguf", "f32")
    with GgufFile(path) as f:
        return dict(f.metadata), dict(f.tensors)


def test_glm_dsa_without_indexer_types_reads_as_llama_cpp(tmp_path):
    """No ``attention.indexer.types`` (GLM-5 / 5.1 files): every layer full below a 1M context;
    from 1M on, GLM-5.2's released pattern (the first two full, then one in four)."""
    over = dict(VARIANTS["glm_moe_dsa:shared2"], indexer_types=["full"] * 4)
    meta, tensors = _glm_file(tmp_path, **over)
    del meta["glm-dsa.attention.indexer.types"]
    cfg = config_from_gguf(meta, tensors, "float32", "m.gguf")
    assert cfg.index_shared == (False,) * 4
    meta["glm-dsa.context_length"] = 1048576
    cfg = config_from_gguf(meta, tensors, "float32", "m.gguf")
    assert cfg.index_shared == (False, False, False, True)


def test_glm_dsa_indexer_types_of_another_length_are_refused(tmp_path):
    meta, tensors = _glm_file(tmp_path)
    meta["glm-dsa.attention.indexer.types"] = [True, False]
    with pytest.raises(ConfigError, match="indexer.types"):
        hf_fields(meta, tensors, "float32", "m.gguf")


def test_deepseek32_softmax_router_is_refused(tmp_path):
    hf = make_tiny("deepseek_v32", tmp_path / "hf", seed=3)[1]
    path = write_gguf("deepseek_v32", hf, tmp_path / "m.gguf", "f32")
    with GgufFile(path) as f:
        meta, tensors = dict(f.metadata), dict(f.tensors)
    assert "deepseek32.expert_gating_func" not in meta  # transformers' config: no scoring_func
    meta["deepseek32.expert_gating_func"] = 1
    with pytest.raises(ConfigError, match="softmax router"):
        hf_fields(meta, tensors, "float32", "m.gguf")
