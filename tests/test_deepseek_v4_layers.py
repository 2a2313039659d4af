"""DeepSeek-V4's layers and model (models/deepseek_v4_model.py, layers/{hyper,compressed,
v4_attention,v4_routing}.py) against transformers' DeepseekV4ForCausalLM, on tiny checkpoints.

The tiny config has all three attention layer types (sliding, CSA at rate 4, HCA at rate 8), a
hash-routed MoE layer, 3 hyper-connection streams and a window of 8; prompts of 40 tokens span
several windows of each rate, and the indexer's top-3 is smaller than the 10 entries a query
sees at the end. Weights are drawn with a raised initializer range and perturbed (norms, biases,
sinks, router correction bias, compressor position biases, a random hash table) so routing and
selection are not near ties.

The oracle (transformers' full forward against its own prefill + cached decode) agrees within
2e-6 on this config, with 16 indexer heads. With 1, 2 or 4 indexer heads the same comparison
disagrees by 0.4-0.8 in the logits: the indexer score is a weighted sum of ReLUs, so with few
heads many entries score exactly 0 (all heads' dot products negative), those zeros tie at the
top-k boundary (36 / 21 / 2 boundary ties over this prompt's CSA queries with 1 / 2 / 4 heads, 0
with 16), and torch.topk's choice among ties differs between the [S, T] full-forward scores and
the [1, T] decode scores. `test_indexer_scores_are_tie_free` checks the margin on the config used
here; our own selection breaks ties towards the earlier entry (`compressed.select_topk`), so ours
stays consistent with itself even with one indexer head (`test_few_indexer_heads_...`).

Tolerances, fp32 checkpoints: module outputs and logits 1e-4 against transformers (observed
~2e-6; the sums run in another order); ours against ours (full vs incremental / chunked) 2e-5.
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from call_counts import count_calls
from safetensors.torch import load_file
from tiny_models import hf_config, perturb

from freetokend.models.deepseek_v4_model import (
    CSA,
    HCA,
    SLIDING,
    DeepseekV4LM,
    V4SeqState,
    checkpoint_name,
    load_checkpoint,
    v4_config,
)
from freetokend.models.layers import compressed
from freetokend.models.layers.compressed import select_topk, visible_entries
from freetokend.models.layers.rope import inv_frequencies
from freetokend.models.layers.v4_attention import V4Attention, V4AttentionState
from freetokend.native import dense_native, sparse_native

ATOL_HF = 1e-4
ATOL_SELF = 2e-5
TOPK = 3


def _hf_config(**over):
    """tiny_models' deepseek_v4 config (every attention type, a hash layer, 3 streams, window
    8, the indexer's top-TOPK with 16 heads), with ``over``."""
    return hf_config("deepseek_v4", **over)


def _hf_model(seed: int = 3, **over):
    import transformers as tf

    cfg = _hf_config(**over)
    torch.manual_seed(seed)
    m = tf.DeepseekV4ForCausalLM(cfg).eval()
    perturb(m, seed + 1)
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("position_bias"):  # 2-d: perturb() leaves it at its zero init
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        for name, b in m.named_buffers():
            if name.endswith("tid2eid"):  # zero-initialised: every token to expert 0 twice
                e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
                rows = [torch.randperm(e, generator=g)[:k] for _ in range(cfg.vocab_size)]
                b.copy_(torch.stack(rows))
    return m


def _ours_from(hf, d: Path) -> DeepseekV4LM:
    hf.save_pretrained(d)
    ours = DeepseekV4LM(v4_config(json.loads((d / "config.json").read_text())))
    load_checkpoint(ours, load_file(d / "model.safetensors"))
    return ours


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # tiny ops: one thread is faster than two spinning ones on a shared machine
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    hf = _hf_model()
    return hf, _ours_from(hf, tmp_path_factory.mktemp("v4"))


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(2, 97, (n,), generator=torch.Generator().manual_seed(seed))


def _hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(ids[None], use_cache=False).logits[0].float()


def _ours_logits(ours: DeepseekV4LM, ids: torch.Tensor, split: list[int]) -> torch.Tensor:
    st, rows, pos = ours.new_state(), [], 0
    for size in split:
        lg, st = ours(ids[pos : pos + size], st)
        rows.append(lg)
        pos += size
    assert pos == ids.shape[0] and st.num_tokens == pos
    return torch.cat(rows)


def _rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# -- the oracle and the config -------------------------------------------------------------


def test_config_covers_every_mechanism(pair):
    hf, ours = pair
    cfg = ours.cfg
    assert set(cfg.layer_types) == {SLIDING, CSA, HCA}
    assert cfg.compress_rates == (0, 4, 8, 4) and any(cfg.hash_layers)
    assert cfg.hc_mult >= 2 and cfg.rope_compress.kind == "yarn"
    # a 40-token prompt: longer than the window, several windows of each rate, and more
    # visible CSA entries at its end than the indexer keeps
    assert 40 > cfg.sliding_window and 40 // 8 >= 4
    assert int(visible_entries(torch.tensor(39), 4)) > cfg.index_topk


def test_oracle_cached_decode_equals_full_forward(pair):
    """transformers against itself: prefill 20 then 20 tokens one by one with its cache."""
    hf, _ = pair
    ids = _ids(40, seed=1)
    full = _hf_logits(hf, ids)
    with torch.no_grad():
        out = hf(ids[None, :20], use_cache=True)
        rows, cache = [out.logits[0]], out.cache
        for i in range(20, 40):
            out = hf(ids[None, i : i + 1], cache=cache, use_cache=True)
            rows.append(out.logits[0])
            cache = out.cache
    assert (torch.cat(rows) - full).abs().max().item() < 1e-5


def _hf_index_scores(hf, ids: torch.Tensor) -> list[torch.Tensor]:
    """transformers' indexer scores [S, T] of every CSA layer in a full forward."""
    got: list[torch.Tensor] = []
    hooks = [
        layer.self_attn.compressor.indexer.scorer.register_forward_hook(
            lambda mod, args, out: got.append(out[0].detach().clone())
        )
        for layer in hf.model.layers
        if layer.self_attn.layer_type == CSA
    ]
    try:
        _hf_logits(hf, ids)
    finally:
        for h in hooks:
            h.remove()
    return got


def _boundary_margins(scores: list[torch.Tensor], rate: int, k: int) -> torch.Tensor:
    """Score gap between the k-th and (k+1)-th best visible entries of every query that sees
    more than k entries."""
    gaps = []
    for s in scores:
        for t in range(s.shape[0]):
            vis = (t + 1) // rate
            if vis > k:
                top = s[t, :vis].sort(descending=True).values
                gaps.append(top[k - 1] - top[k])
    return torch.stack(gaps)


def test_indexer_scores_are_tie_free(pair):
    """No exact (or near) ties at the top-k boundary over the longest sequence compared here
    (the 40-token prompt and 32 greedy tokens): the comparison with transformers does not hang
    on torch.topk's undefined tie order, nor on rounding differences."""
    hf, ours = pair
    ids = torch.cat([_ids(40, seed=4), _ids(32, seed=5)])
    gaps = _boundary_margins(_hf_index_scores(hf, ids), 4, TOPK)
    assert gaps.numel() > 50
    assert gaps.min().item() > 1e-5


def test_few_indexer_heads_tie_and_ours_still_agrees_with_itself(tmp_path):
    """One indexer head: many exact-zero scores tie at the top-k boundary (transformers'
    full and cached forwards then disagree: see the module docstring). Our tie-break makes the
    selection a function of the scores, so our incremental and chunked runs equal our full one."""
    hf = _hf_model(index_n_heads=1)
    ids = _ids(40, seed=1)
    gaps = _boundary_margins(_hf_index_scores(hf, ids), 4, TOPK)
    assert (gaps == 0).sum().item() > 5
    ours = _ours_from(hf, tmp_path)
    full = _ours_logits(ours, ids, [40])
    assert (_ours_logits(ours, ids, [20] + [1] * 20) - full).abs().max().item() < ATOL_SELF
    assert (_ours_logits(ours, ids, [3, 6, 1, 17, 13]) - full).abs().max().item() < ATOL_SELF


# -- module by module ------------------------------------------------------------------------


def test_hyper_connections_match(pair):
    hf, ours = pair
    streams = _rand(1, 12, 3, 64, seed=7)
    for i in (0, 2):
        for name in ("attn_hc", "ffn_hc"):
            post, comb, collapsed = getattr(hf.model.layers[i], name)(streams)
            x, p, c = getattr(ours.layers[i], name)(streams[0])
            for a, b in ((collapsed[0], x), (post[0], p), (comb[0], c)):
                assert (a - b).abs().max().item() < ATOL_HF
    head = hf.model.hc_head(streams)[0]
    assert (head - ours.hc_head(streams[0])).abs().max().item() < ATOL_HF


def test_sinkhorn_steps_match(pair):
    """Peaked comb logits (their scale x8), where Sinkhorn-Knopp is still far from converged
    after its 20 steps: one step more or less moves comb by ~1e-3, so this pins the steps."""
    hf, ours = pair
    theirs, mine = copy.deepcopy(hf.model.layers[1].attn_hc), copy.deepcopy(ours.layers[1].attn_hc)
    with torch.no_grad():
        theirs.scale[2] *= 8.0
        mine.scale[2] *= 8.0
    streams = _rand(1, 12, 3, 64, seed=17)
    _, comb, _ = theirs(streams)
    assert (comb[0] - mine(streams[0])[2]).abs().max().item() < 1e-5


def _inputs(hf, ours, i: int, n: int, seed: int):
    """A layer's normed attention input [n, hidden], its q residual, positions, and the rope
    (ours, and transformers' cos / sin) of its kind."""
    x = hf.model.layers[i].input_layernorm(_rand(1, n, 64, seed=seed))
    pos = torch.arange(n)
    kind = ours.cfg.layer_types[i]
    rope = ours.rope_main if kind == SLIDING else ours.rope_compress
    label = "main" if kind == SLIDING else "compress"
    hf_cs = hf.model.rotary_emb(x, position_ids=pos[None], layer_type=label)
    with torch.no_grad():
        q_res = hf.model.layers[i].self_attn.q_a_norm(hf.model.layers[i].self_attn.q_a_proj(x))
    return x, q_res, pos, rope, hf_cs


@pytest.mark.parametrize("i", [1, 2])  # CSA (overlapping windows) and HCA
def test_compressor_entries_match(pair, i):
    hf, ours = pair
    x, q_res, pos, rope, _ = _inputs(hf, ours, i, 37, seed=8)
    comp = hf.model.layers[i].self_attn.compressor
    with torch.no_grad():
        ref, _ = comp(x, q_res, pos[None], None, i)
    mine = ours.layers[i].self_attn.compressor
    assert mine is not None
    st = mine(x[0], mine.empty_state(), rope)
    assert st.entries.shape[0] == ref.shape[2] == 37 // mine.rate
    assert (st.entries - ref[0, 0]).abs().max().item() < ATOL_HF
    # the same tokens in pieces (cut inside open windows): the same entries and open window
    st2, p = mine.empty_state(), 0
    for size in (3, 6, 1, 14, 13):
        st2 = mine(x[0, p : p + size], st2, rope)
        p += size
    assert (st2.entries - st.entries).abs().max().item() < ATOL_SELF
    assert st2.num_tokens == st.num_tokens == 37
    assert st2.kv.shape == st.kv.shape and (st2.kv - st.kv).abs().max().item() < ATOL_SELF


def test_indexer_selection_matches(pair):
    hf, ours = pair
    i = 1
    x, q_res, pos, rope, _ = _inputs(hf, ours, i, 40, seed=9)
    indexer = hf.model.layers[i].self_attn.compressor.indexer
    with torch.no_grad():
        ref = indexer(x, q_res, pos[None], None, i)[0]  # [S, k], -1 = none
    mine = ours.layers[i].self_attn.indexer
    assert mine is not None
    cos, sin = rope.cos_sin(pos)
    chosen, st = mine(x[0], q_res[0], pos, mine.compressor.empty_state(), rope, cos, sin)
    scores = mine.scores(x[0], q_res[0], pos, st.entries, cos, sin)
    vis = visible_entries(pos, 4)
    for t in range(40):
        want = sorted(v for v in ref[t].tolist() if v >= 0)
        assert sorted(v for v in chosen[t].tolist() if v >= 0) == want, t
        if vis[t] > TOPK:  # tie-free here too
            top = scores[t].sort(descending=True).values
            assert (top[TOPK - 1] - top[TOPK]).item() > 1e-5
    assert (vis > TOPK).sum() > 20  # the selection is a strict subset for most queries


def test_indexer_scores_in_query_blocks(pair, monkeypatch):
    """The indexer scores its queries in blocks (the [block, heads, entries] dot products
    within ``INDEX_SCORE_BYTES``): blocks of 1 and 3 queries choose what one block does."""
    hf, ours = pair
    x, q_res, pos, rope, _ = _inputs(hf, ours, 1, 40, seed=9)
    mine = ours.layers[1].self_attn.indexer
    assert mine is not None
    cos, sin = rope.cos_sin(pos)
    empty = mine.compressor.empty_state()
    whole, _ = mine(x[0], q_res[0], pos, empty, rope, cos, sin)
    e = 40 // mine.rate
    for rows in (1, 3):
        monkeypatch.setattr(compressed, "INDEX_SCORE_BYTES", 4 * mine.heads * e * rows)
        got, st = mine(x[0], q_res[0], pos, empty, rope, cos, sin)
        assert st.entries.shape[0] == e
        assert torch.equal(got, whole), rows


@pytest.mark.parametrize("i", [0, 1, 2])  # sliding, CSA, HCA
def test_attention_matches(pair, i):
    hf, ours = pair
    n = 37
    x, _, pos, rope, hf_cs = _inputs(hf, ours, i, n, seed=10 + i)
    allowed = (pos[None] <= pos[:, None]) & (pos[None] > pos[:, None] - 8)
    mask = torch.zeros(n, n).masked_fill(~allowed, float("-inf"))[None, None]
    label = "main" if i == 0 else "compress"
    with torch.no_grad():
        ref, _ = hf.model.layers[i].self_attn(x, {label: hf_cs}, pos[None], mask, cache=None)
    attn = ours.layers[i].self_attn
    cos, sin = rope.cos_sin(pos)
    out, _ = attn(x[0], 0, attn.empty_state(), rope, cos, sin)
    assert (out - ref[0]).abs().max().item() < ATOL_HF


def test_selected_prefill_equals_masked(pair, monkeypatch):
    """CSA prefill reads each query's window and its chosen entries only
    (`V4Attention._attend_selected`, blocks of queries with the entries gathered); the masked
    reference (every entry scored, masked to the chosen) gives the same outputs and states, on
    a prompt where the top-3 is a strict subset of the entries, for several chunkings and
    block sizes (blocks of 1, 2 and 5 queries, and one block)."""
    hf, ours = pair
    i, n = 1, 40
    x, _, pos, rope, _ = _inputs(hf, ours, i, n, seed=30)
    attn = ours.layers[i].self_attn
    assert attn.indexer is not None and attn.indexer.topk == TOPK
    assert (visible_entries(pos, attn.rate) > TOPK).sum() > 20
    masked_calls = []
    reference = V4Attention._attend_masked

    def counted(self, *a, **k):
        masked_calls.append(self)
        return reference(self, *a, **k)

    monkeypatch.setattr(V4Attention, "_attend_masked", counted)

    def run(split: list[int]) -> tuple[torch.Tensor, V4AttentionState]:
        st, outs, p = attn.empty_state(), [], 0
        for size in split:
            cos, sin = rope.cos_sin(pos[p : p + size])
            o, st = attn(x[0, p : p + size], p, st, rope, cos, sin)
            outs.append(o)
            p += size
        return torch.cat(outs), st

    k, d = TOPK, attn.head_dim
    for split in ([40], [3, 6, 1, 17, 13], [13, 27], [9, 31]):
        monkeypatch.setattr(attn, "masked_prefill", True)
        masked_calls.clear()
        want, want_st = run(split)
        assert len(masked_calls) == len(split)
        for block in (1, 2, 5, n):
            monkeypatch.setattr(attn, "masked_prefill", False)
            monkeypatch.setattr(attn, "selected_block", block * k * d)
            masked_calls.clear()
            got, st = run(split)
            assert not masked_calls  # the selected path alone
            assert (got - want).abs().max().item() < ATOL_SELF, (split, block)
            assert torch.equal(st.window, want_st.window)
    # the model's logits too (the other layers' paths unchanged)
    ids = _ids(40, seed=31)
    monkeypatch.setattr(attn, "masked_prefill", True)
    want_logits = _ours_logits(ours, ids, [40])
    monkeypatch.setattr(attn, "masked_prefill", False)
    monkeypatch.setattr(attn, "selected_block", 3 * k * d)
    got_logits = _ours_logits(ours, ids, [17, 23])
    assert (got_logits - want_logits).abs().max().item() < ATOL_SELF


@pytest.mark.parametrize("i", [0, 1])  # hash routing, learned routing with correction bias
def test_router_and_moe_match(pair, i):
    hf, ours = pair
    x = _rand(1, 24, 64, seed=20 + i)
    ids = _ids(24, seed=21)
    block = hf.model.layers[i].mlp
    with torch.no_grad():
        if block.is_hash:
            _, w_ref, e_ref = block.gate(x, ids[None])
        else:
            _, w_ref, e_ref = block.gate(x)
        y_ref = block(x, input_ids=ids[None])[0]
    mine = ours.layers[i].mlp
    assert mine.router.is_hash == block.is_hash
    e, w = mine.router(x[0], ids)
    order_ref, order = e_ref.argsort(-1), e.argsort(-1)
    assert torch.equal(e_ref.gather(1, order_ref), e.gather(1, order))
    assert (w_ref.gather(1, order_ref) - w.gather(1, order)).abs().max().item() < ATOL_HF
    assert (mine(x[0], ids) - y_ref).abs().max().item() < ATOL_HF


# -- the whole model -----------------------------------------------------------------------


def test_logits_match_transformers(pair):
    hf, ours = pair
    ids = _ids(40, seed=1)
    ref = _hf_logits(hf, ids)
    assert (_ours_logits(ours, ids, [40]) - ref).abs().max().item() < ATOL_HF
    # prefill 20, then token by token
    assert (_ours_logits(ours, ids, [20] + [1] * 20) - ref).abs().max().item() < ATOL_HF


def test_incremental_and_chunked_equal_full_forward(pair):
    _, ours = pair
    ids = _ids(40, seed=2)
    full = _ours_logits(ours, ids, [40])
    # cuts at 3, 9, 10, 27: inside open windows of both rates (4 and 8) and of the window
    for split in ([20] + [1] * 20, [3, 6, 1, 17, 13], [1] * 40):
        assert (_ours_logits(ours, ids, split) - full).abs().max().item() < ATOL_SELF, split


def test_state_is_not_mutated(pair):
    """A forward returns a new state and leaves the one it got as it was (so a caller can keep
    a snapshot, e.g. at a prefix-cache anchor)."""
    _, ours = pair
    ids = _ids(23, seed=6)
    _, st = ours(ids[:13], ours.new_state())
    snap = st.clone()
    a, _ = ours(ids[13:], st)
    b, _ = ours(ids[13:], st)
    assert torch.equal(a, b)
    for s, t in zip(st.layers, snap.layers, strict=True):
        assert torch.equal(s.window, t.window)
        if s.compressor is not None and t.compressor is not None:
            assert torch.equal(s.compressor.entries, t.compressor.entries)
            assert torch.equal(s.compressor.kv, t.compressor.kv)


def _hf_greedy(hf, ids: torch.Tensor, n: int) -> list[int]:
    """Greedy tokens by full forwards without a cache (independent of its cache logic)."""
    seq = ids.tolist()
    for _ in range(n):
        seq.append(int(_hf_logits(hf, torch.tensor(seq))[-1].argmax()))
    return seq[ids.shape[0] :]


def _our_greedy(ours: DeepseekV4LM, ids: torch.Tensor, n: int) -> list[int]:
    st: V4SeqState = ours.new_state()
    lg, st = ours(ids, st)
    out = [int(lg[-1].argmax())]
    while len(out) < n:
        lg, st = ours(torch.tensor(out[-1:]), st)
        out.append(int(lg[-1].argmax()))
    return out


def test_greedy_tokens_identical(pair):
    hf, ours = pair
    ids = _ids(40, seed=4)
    ref = _hf_greedy(hf, ids, 32)
    assert len(set(ref)) > 3  # not a degenerate repeat
    assert _our_greedy(ours, ids, 32) == ref


@pytest.mark.skipif(not dense_native.available(), reason="ftdense extension not built")
def test_native_decode_equals_the_torch_path(pair, monkeypatch):
    """Decode tokens on the CPU take the native indexer and sparse attention (`sparse_native`,
    every layer type: the window alone, HCA's entries, CSA's chosen ones); the torch path
    (``torch_only``: what other devices run) gives the same logits within fp32 rounding and
    the same 32 greedy tokens."""
    _, ours = pair
    calls = count_calls(monkeypatch, sparse_native, "index_topk", "sparse_attention")
    ids = _ids(40, seed=4)
    split = [12] + [1] * 28
    native, tokens = _ours_logits(ours, ids, split), _our_greedy(ours, ids, 32)
    assert calls["index_topk"] > 0 and calls["sparse_attention"] > 0
    with dense_native.torch_only():
        before = dict(calls)
        want, want_tokens = _ours_logits(ours, ids, split), _our_greedy(ours, ids, 32)
        assert calls == before  # the torch path took none
    assert (native - want).abs().max().item() < ATOL_SELF
    assert tokens == want_tokens


def test_compress_rope_at_release_geometry():
    """The compress rope's YaRN frequencies at V4-Flash's geometry (rope dim 64 of 512, theta
    160000, factor 16 over 65536 positions), where the correction range's truncation matters:
    transformers 5.25 always truncates for V4 (it reads ``truncate`` from the outer
    {"main", "compress"} dict), and never scales cos / sin (attention_factor forced to 1)."""
    import transformers as tf
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rp = {
        "rope_type": "yarn",
        "factor": 16.0,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,  # ignored by transformers, see above
    }
    c = tf.DeepseekV4Config(
        head_dim=512,
        partial_rotary_factor=64 / 512,
        max_position_embeddings=1048576,
        num_hidden_layers=2,
        rope_parameters=rp,
    )
    ref, factor = ROPE_INIT_FUNCTIONS["yarn"](c, None, layer_type="compress")
    ours = v4_config(c.to_dict()).rope_compress
    assert factor == 1.0 and ours.attention_factor == 1.0 and ours.truncate
    assert torch.equal(inv_frequencies(ours), ref)
    assert not torch.equal(inv_frequencies(replace(ours, truncate=False)), ref)


# -- our top-k tie-break and names ------------------------------------------------------------


def test_topk_ties_go_to_the_earlier_entry():
    inf = float("inf")
    s = torch.tensor(
        [
            [0.0, 1.0, 0.0, 1.0, 0.0, -inf],  # ties at 1 and at 0: lowest index first
            [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],  # all tied: the first k
            [2.0, -inf, -inf, -inf, -inf, -inf],  # fewer selectable than k: -1 pads
            [-1.0, -1.0, 3.0, -1.0, 3.0, -1.0],
        ]
    )
    got = select_topk(s, 3).tolist()
    assert got == [[1, 3, 0], [0, 1, 2], [0, -1, -1], [2, 4, 0]]
    # larger rows (a vectorised sort path): still index order among ties
    big = torch.zeros(2, 1000)
    big[1, 500:] = 1.0
    assert select_topk(big, 4).tolist() == [[0, 1, 2, 3], [500, 501, 502, 503]]
    assert select_topk(s, 10).shape == (4, 6)  # k is capped by the entries


def test_checkpoint_names():
    assert checkpoint_name("model.layers.3.attn.indexer.compressor.ape") == (
        "layers.3.self_attn.indexer.compressor.position_bias"
    )
    assert checkpoint_name("layers.0.hc_ffn_fn") == "layers.0.ffn_hc.fn"
    assert checkpoint_name("hc_head_scale") == "hc_head.scale"
    assert checkpoint_name("layers.2.ffn.gate.bias") == "layers.2.mlp.router.score_bias"
    assert checkpoint_name("layers.2.ffn.experts.5.w1.weight") is None  # stacked by the loader
    assert checkpoint_name("mtp.0.enorm.weight") is None
    with pytest.raises(KeyError):
        checkpoint_name("layers.0.attn.wq.weight")


@pytest.mark.skipif(not dense_native.available(), reason="ftdense extension not built")
def test_grouped_output_projection_native_bf16(monkeypatch):
    """The grouped low-rank output projection with bf16 weights on the CPU runs each group
    through the native dense kernel: x rounded to bf16 times the group's block, accumulated in
    fp32 (torch's bf16 einsum also rounds its output to bf16: 2^-9 relative)."""
    from freetokend.models.layers.v4_attention import GroupedLinear

    g = torch.Generator().manual_seed(5)
    layer = GroupedLinear(96, 40, 3, torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(layer.weight.shape, generator=g))
    x = torch.randn(7, 3, 96, generator=g)
    calls = count_calls(monkeypatch, dense_native, "linear")
    with torch.no_grad():
        y = layer(x)
    assert calls["linear"] == 3
    w = layer.weight.float().view(3, 40, 96)
    want = torch.einsum("ngi,goi->ngo", x.bfloat16().float(), w).reshape(7, 120)
    assert y.dtype == torch.float32 and y.shape == (7, 120)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-4)
    with dense_native.torch_only(), torch.no_grad():
        ref = layer(x)
    assert calls["linear"] == 3  # the torch path took none
    torch.testing.assert_close(y, ref, rtol=1e-2, atol=5e-2)
