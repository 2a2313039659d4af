"""DeepSeek Sparse Attention (models/layers/dsa.py): DeepSeek-V3.2 (``deepseek_v32``) and GLM-5
(``glm_moe_dsa``) beyond what tests/test_engine_families.py checks for every family.

The oracle first. transformers' DSA models (5.25) fold the indexer's top-k into the attention
mask; the indexer masks its scores with the causal mask before ``torch.topk``, so on the tiny
configs of tests/tiny_models.py (32 indexer heads, index_top-k 8, prompts of up to 48 tokens;
measured the same with 16) its full forward is causal (logits of a prefix equal the full
forward's within ~1.5e-6) and its prefill + cached decode equals its full forward within ~2e-6,
both families (`test_oracle_is_causal_and_its_cached_decode_equals_its_full_forward`). With 2
indexer heads the same comparisons disagree by 0.6 to 2.7 in the logits (and chunked prefill by
0.6 to 2.7 too): the index score is a weighted sum of
ReLUs, so many keys score exactly 0 (every head's dot product negative), those zeros tie at the
top-k boundary, and torch.topk picks among ties differently for the [S, T] full-forward scores
and the [1, T] decode scores. So the configs compared with transformers are checked to be
tie-free at the boundary (`test_tiny_configs_are_tie_free`: with 16 heads one query of the
family tests scored exactly 0 against all its keys, so the configs have 32), and our own selection breaks ties
towards the earlier position (`compressed.select_topk`), which keeps ours consistent with itself
even where ties abound (`test_few_indexer_heads_tie_and_ours_still_agrees_with_itself`).

What the mask does where a query sees at most index_topk keys: torch.topk then also picks
masked (future) positions, which the causal mask removes again, so such a query attends over
all its keys; past index_topk it attends over exactly the selected ones, itself only when
selected. Ours: the same (`test_selection_matters`, and the logits tests).

Tolerances, fp32 checkpoints: against transformers 2e-4 as the family tests (observed ~2e-6);
ours against ours 2e-5.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from call_counts import count_calls
from runner_steps import logits_in_steps
from tiny_models import make_tiny

from freetokend import LLM
from freetokend.engine.graphs import static_decode_blocker
from freetokend.engine.runner import Work
from freetokend.models.config import ConfigError
from freetokend.models.config_hf import from_dict
from freetokend.models.layers import cpu_decode, dsa
from freetokend.models.layers.compressed import select_topk
from freetokend.native import dense_native, sparse_native

DSA_FAMILIES = ("deepseek_v32", "glm_moe_dsa", "deepseek_v32:flat", "glm_moe_dsa:shared2")
ATOL_HF = 2e-4
ATOL_SELF = 2e-5


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(2, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def _hf_cached(hf, ids: list[int], prefill: int) -> torch.Tensor:
    """transformers' logits of every position: a prefill, then one token at a time."""
    with torch.no_grad():
        out = hf(torch.tensor([ids[:prefill]]), use_cache=True)
        rows, cache = [out.logits[0]], out.cache
        for t in ids[prefill:]:
            out = hf(torch.tensor([[t]]), cache=cache, use_cache=True)
            rows.append(out.logits[0])
            cache = out.cache
    return torch.cat(rows).float()


@pytest.fixture(scope="module", params=DSA_FAMILIES)
def tiny(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param.replace(":", "-"))
    _, hf = make_tiny(request.param, d, seed=3)
    return request.param, d, hf, LLM(d, moe_backend="cpu", max_model_len=256, kv_tokens=2048)


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_oracle_is_causal_and_its_cached_decode_equals_its_full_forward(family, tmp_path):
    _, hf = make_tiny(family, tmp_path, seed=3)
    ids = _ids(48, seed=1)
    full = _hf_logits(hf, ids)
    for n in (5, 9, 17, 30):
        assert (_hf_logits(hf, ids[:n]) - full[:n]).abs().max().item() < 1e-5
    assert (_hf_cached(hf, ids, 10) - full).abs().max().item() < 1e-5


def _boundary_gaps(monkeypatch, llm: LLM, run) -> list[float]:
    """Runs ``run()`` with our indexer's top-k recording, for every query that sees more keys
    than the top-k, the gap between its k-th and (k+1)-th best scores."""
    gaps: list[float] = []

    def recording(scores: torch.Tensor, k: int) -> torch.Tensor:
        for row in scores:
            vals = row[torch.isfinite(row)].sort(descending=True).values
            if vals.numel() > k:
                gaps.append((vals[k - 1] - vals[k]).item())
        return select_topk(scores, k)

    def recording_native(*args, **kwargs):
        sel, scores = native_topk(*args, **kwargs)
        k = args[4]
        vals = scores.sort(descending=True).values
        if vals.numel() > k:
            gaps.append((vals[k - 1] - vals[k]).item())
        return sel, scores

    native_topk = sparse_native.index_topk
    monkeypatch.setattr(dsa, "select_topk", recording)
    monkeypatch.setattr(sparse_native, "index_topk", recording_native)
    run()
    return gaps


def test_tiny_configs_are_tie_free(tiny, monkeypatch):
    """No exact (or near) tie at the top-k boundary over what the family tests run (their
    prompts, 32 greedy tokens, the batch's prompts): the comparison with transformers hangs
    neither on torch.topk's tie order nor on rounding."""
    family, _, _, llm = tiny

    def run():
        logits_in_steps(llm, _ids(24, seed=1), [10] + [1] * 14)
        logits_in_steps(llm, _ids(40, seed=2), [7, 13, 20])
        g = torch.Generator().manual_seed(4)
        llm.generate(torch.randint(2, 97, (12,), generator=g).tolist(), max_tokens=32,
                     ignore_eos=True)  # fmt: skip
        for n in (3, 17, 9, 30):
            llm.generate(_ids(n, seed=10 + n), max_tokens=10, ignore_eos=True)

    gaps = _boundary_gaps(monkeypatch, llm, run)
    assert len(gaps) > 100, family
    assert min(gaps) > 1e-5, family


def _greedy(llm: LLM, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """n greedy tokens after ``prompt`` (prefilled in one step, then one token a step, driven
    on this thread) and the logits of each step."""
    runner, st, ids, rows = llm.runner, llm.runner.new_state(), list(prompt), []
    try:
        runner.reserve(st, len(prompt) + n)
        work = prompt
        for _ in range(n):
            rows.append(runner.forward([Work(st, work)])[-1])
            work = [int(rows[-1].argmax())]
            ids += work
        return ids[len(prompt) :], torch.stack(rows)
    finally:
        runner.release(st)


@pytest.mark.skipif(not dense_native.available(), reason="ftdense extension not built")
def test_native_decode_equals_the_torch_path(tiny, monkeypatch):
    """Decode rows on the CPU take the native indexer and the absorbed sparse attention
    (`sparse_native`); the torch path (``torch_only``: what other devices run) gives the same
    logits within fp32 rounding and the same 32 greedy tokens, past the top-k and on the
    shared-indexer layers."""
    family, _, _, llm = tiny
    calls = count_calls(monkeypatch, sparse_native, "index_topk", "sparse_attention")
    prompt = _ids(12, seed=21)
    tokens, logits = _greedy(llm, prompt, 32)
    assert calls["index_topk"] > 0 and calls["sparse_attention"] > 0, family
    with dense_native.torch_only():
        calls_before = dict(calls)
        want_tokens, want = _greedy(llm, prompt, 32)
        assert calls == calls_before  # the torch path took none
    assert tokens == want_tokens, family
    assert (logits - want).abs().max().item() < ATOL_SELF, family


def test_selection_matters(tiny, tmp_path):
    """The tiny configs' top-k changes the logits: the same weights with a top-k past every
    prompt (dense MLA) give other logits, and ours follow transformers' sparse ones."""
    family, _, hf, llm = tiny
    _, dense = make_tiny(family, tmp_path, seed=3, index_topk=4096)
    ids = _ids(40, seed=2)
    sparse = _hf_logits(hf, ids)
    assert (_hf_logits(dense, ids) - sparse).abs().max().item() > 1e-2
    assert (logits_in_steps(llm, ids, [40]) - sparse[-1:]).abs().max().item() < ATOL_HF


def test_prefix_cache_reuses_index_keys(tiny):
    """A request whose prompt extends a cached one reads the cached pages (latents and index
    keys) and generates what a fresh engine does."""
    family, d, _, llm = tiny
    base = _ids(30, seed=7)
    llm.generate(base, max_tokens=4, ignore_eos=True)
    longer = base + _ids(9, seed=8)
    got = llm.generate(longer, max_tokens=12, ignore_eos=True)
    fresh = LLM(d, moe_backend="cpu", max_model_len=256, kv_tokens=2048)
    assert got == fresh.generate(longer, max_tokens=12, ignore_eos=True), family
    assert llm.engine.stats().prompt_tokens_cached_total > 0


def test_pool_rows_hold_index_keys_beside_the_latents(tiny):
    """Each layer's pool row: the latent and rotated key, plus the index key where the layer has
    an indexer (GLM-5's shared layers have none); the fast paths refuse the sparse layers."""
    family, _, _, llm = tiny
    cfg, model = llm.config, llm.model
    base = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    shared = cfg.index_shared
    assert any(shared) == family.startswith("glm_moe_dsa")
    want = [(1, base + (0 if s else cfg.index_head_dim)) for s in shared]
    assert llm.runner.kv.layer_shapes == want
    for layer, s in zip(model.layers, shared, strict=True):
        assert isinstance(layer.self_attn, dsa.SparseMLAttention)
        assert (layer.self_attn.indexer is None) == s
        assert cpu_decode.plan_for(layer) is None
    assert static_decode_blocker(model) is not None


def test_tie_break_lowest_position_first():
    """Equal index scores select the earlier position, whether the query is scored in a
    prefill chunk (a [n, c] score block) or alone at decode (c = its position + 1)."""
    scores = torch.tensor([[0.5, 0.0, 0.0, 0.7, 0.0, 0.0, float("-inf")]])
    assert select_topk(scores, 3).tolist() == [[3, 0, 1]]
    raw = {**_BASE, "architectures": ["DeepseekV32ForCausalLM"], "q_lora_rank": 24}
    cfg = from_dict({**raw, "index_n_heads": 2, "index_head_dim": 8, "index_topk": 4})
    ix = dsa.LightningIndexer(cfg, torch.float32)
    n = 12
    # every query's dot products: positive with keys 3 and 7 (3 above 7), negative (ReLU'd to
    # exactly 0, a tie) with all the others
    keys = -torch.rand(n, 8) - 0.1
    keys[3], keys[7] = 3.0, 2.0
    q, w = torch.ones(n, 2, 8), torch.ones(n, 2)
    chunk = ix.select(q, w, keys, 0)
    for p in range(n):
        alone = ix.select(q[p : p + 1], w[p : p + 1], keys[: p + 1], p)
        assert alone.tolist() == chunk[p : p + 1, : alone.shape[1]].tolist()
    assert chunk[2].tolist() == [0, 1, 2, -1]  # fewer keys than the top-k: all, then padding
    assert chunk[5].tolist() == [3, 0, 1, 2]
    assert chunk[11].tolist() == [3, 7, 0, 1]


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_few_indexer_heads_tie_and_ours_still_agrees_with_itself(family, tmp_path, monkeypatch):
    """Two indexer heads: exact-zero scores tie at the top-k boundary (transformers' full and
    cached forwards then disagree, see the module docstring). Ours selects by score, then
    position, so its incremental, chunked and batched runs equal its full one."""
    make_tiny(family, tmp_path, seed=3, index_n_heads=2)
    llm = LLM(tmp_path, moe_backend="cpu", max_model_len=256, kv_tokens=2048)
    ids = _ids(40, seed=1)
    ends = (14, 23, 31, 40)
    full: list[torch.Tensor] = []  # the last logits of one forward over each prefix
    gaps = _boundary_gaps(
        monkeypatch, llm, lambda: full.extend(logits_in_steps(llm, ids[:n], [n])[-1] for n in ends)
    )
    assert sum(g == 0 for g in gaps) > 5
    steps = logits_in_steps(llm, ids, [12] + [1] * 28)  # positions 11..39
    for n, want in zip(ends, full, strict=True):
        assert (steps[n - 12] - want).abs().max().item() < ATOL_SELF
    assert (
        logits_in_steps(llm, ids, [3, 6, 1, 17, 13])[-1] - full[-1]
    ).abs().max().item() < ATOL_SELF
    prompts = [_ids(n, seed=20 + n) for n in (5, 23, 31)]
    alone = [llm.generate(p, max_tokens=8, ignore_eos=True) for p in prompts]
    assert llm.generate(prompts, max_tokens=8, ignore_eos=True) == alone


# -- config ---------------------------------------------------------------------------------

_BASE = dict(
    vocab_size=97,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=4,
    num_hidden_layers=6,
    n_routed_experts=16,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    kv_lora_rank=16,
    qk_nope_head_dim=12,
    qk_rope_head_dim=8,
    v_head_dim=10,
)


@pytest.mark.parametrize(
    "arch,over",
    [
        ("DeepseekV32ForCausalLM", {}),
        ("GlmMoeDsaForCausalLM", {}),
        ("GlmMoeDsaForCausalLM", {"index_topk_freq": 3, "index_skip_topk_offset": 1}),
        ("GlmMoeDsaForCausalLM", {"index_topk_pattern": "FSSFFS"}),
    ],
)
def test_absent_fields_default_as_in_transformers(arch, over):
    import transformers as tf

    cls = tf.DeepseekV32Config if arch.startswith("Deepseek") else tf.GlmMoeDsaConfig
    hf = cls(**_BASE, **over)
    ours = from_dict({**_BASE, **over, "architectures": [arch]})
    assert ours.rope.interleaved
    assert ours.q_lora_rank == hf.q_lora_rank
    assert (ours.n_group, ours.topk_group) == (hf.n_group, hf.topk_group)
    assert ours.routed_scaling_factor == hf.routed_scaling_factor
    assert ours.shared_expert_intermediate_size == 32 * hf.n_shared_experts
    assert ours.moe_layers == tuple(k == "sparse" for k in hf.mlp_layer_types)
    assert (ours.index_topk, ours.index_n_heads, ours.index_head_dim) == (
        hf.index_topk,
        hf.index_n_heads,
        hf.index_head_dim,
    )
    assert ours.rms_norm_eps == hf.rms_norm_eps
    assert ours.index_rope_interleaved == arch.startswith("Glm")
    kinds = getattr(hf, "indexer_types", None) or ["full"] * 6
    assert ours.index_shared == tuple(k == "shared" for k in kinds)
    assert ours.num_mtp_layers == 1  # transformers ignores model.layers.<n> of both


@pytest.mark.parametrize(
    "over,message",
    [
        ({"indexer_types": ["shared"] + ["full"] * 5}, "layer 0 has no indexer"),
        ({"indexer_types": ["full"] * 5}, "indexer_types"),
        ({"q_lora_rank": None}, "q_lora_rank"),
        ({"index_head_dim": 4}, "index_head_dim"),
        ({"layer_types": ["sliding_attention"] * 6}, "layer_types"),
    ],
)
def test_refused_configs(over, message):
    with pytest.raises(ConfigError, match=message):
        from_dict({**_BASE, **over, "architectures": ["GlmMoeDsaForCausalLM"]})


def test_saved_configs_read_back(tmp_path: Path):
    """transformers' written config.json (``indexed_attention`` layer types, listed indexer
    types and MLP layer types) reads as the config it was made from."""
    import json

    for family in ("deepseek_v32", "glm_moe_dsa:shared2"):
        d = tmp_path / family.replace(":", "-")
        make_tiny(family, d, seed=1)
        raw = json.loads((d / "config.json").read_text())
        assert set(raw["layer_types"]) == {"indexed_attention"}
        cfg = from_dict(raw)
        assert cfg.layer_types == ("full_attention",) * cfg.num_layers
        kinds = raw.get("indexer_types") or ["full"] * cfg.num_layers
        assert cfg.index_shared == tuple(k == "shared" for k in kinds)
        assert cfg.index_shared or family == "deepseek_v32"


def test_output_syntax_and_anchors():
    """DeepSeek-V3.2: DSML function calls and <think>, its turn markup as anchors. GLM-5:
    GLM-4.7's syntax and anchors (its own template could not be checked offline)."""
    from freetokend.models.families.deepseek_markup import DEEPSEEK_DSML_ANCHORS
    from freetokend.models.families.glm4_moe import GLM_ANCHORS
    from freetokend.models.registry import family_spec
    from freetokend.server.parsers.registry import ReasoningSyntax, ToolSyntax, family_default

    v32, glm5 = family_default("deepseek_v32"), family_default("glm_moe_dsa")
    assert (v32.tools, v32.reasoning) == (ToolSyntax.DEEPSEEK_DSML_V3_2, ReasoningSyntax.THINK)
    assert (glm5.tools, glm5.reasoning) == (ToolSyntax.GLM_XML, ReasoningSyntax.THINK)
    assert family_spec("deepseek_v32").anchors == DEEPSEEK_DSML_ANCHORS
    assert family_spec("glm_moe_dsa").anchors == GLM_ANCHORS
