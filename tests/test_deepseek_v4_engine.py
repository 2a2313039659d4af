"""DeepSeek-V4 under the engine (models/deepseek_v4_model.py ``DeepseekV4CausalLM``), beyond
what tests/test_engine_families.py checks for every family: what it loads where (hash tables as
buffers, routed experts in banks, MTP tensors skipped with one log line), that no fast path
picks it up, that a released sequence starts again from a fresh state; what the planner and the
slot budget count for its state; the prefix cache resuming from snapshots of that state (inside
an open compressor window too) exactly as a cold run, batched as one by one. Values against
transformers: test_engine_families -k deepseek_v4."""

from __future__ import annotations

import itertools
import logging

import pytest
import torch
from greedy_check import assert_greedy_agrees
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny

from freetokend import LLM
from freetokend.engine.graphs import static_decode_blocker
from freetokend.engine.plan import DECODE_ROWS, MIB, plan_model
from freetokend.engine.runner import Work
from freetokend.engine.sampler import SamplingParams
from freetokend.experts.backend import moe_activation_bytes
from freetokend.experts.banks import Activation, activation_of
from freetokend.models.deepseek_v4_model import DeepseekV4CausalLM, V4SeqState, entry_slots
from freetokend.models.layers.decode_lane import DecodeLane
from freetokend.models.model import kv_bytes_per_token


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("v4")
    _, hf = make_tiny("deepseek_v4", d, seed=3)
    # an MTP layer's tensors as the release names them: skipped by the loader
    sd = load_file(d / "model.safetensors")
    sd["mtp.0.enorm.weight"] = torch.ones(64)
    sd["mtp.0.ffn.experts.0.w1.weight"] = torch.ones(32, 64)
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    return d, hf


def test_loads_tables_banks_and_skips_mtp(tiny, caplog):
    d, hf = tiny
    with caplog.at_level(logging.INFO):
        llm = LLM(d, moe_backend="cpu", max_model_len=128, kv_tokens=256)
    model = llm.model
    assert isinstance(model, DeepseekV4CausalLM)
    assert llm.config.activation == "swiglu_clamp"
    assert activation_of(llm.config.activation) == Activation.SWIGLU_CLAMP
    # the hash layer's table is a buffer equal to transformers'; no routed expert is a parameter
    ours = model.layers[0].mlp.router.tid2eid
    assert "layers.0.mlp.router.tid2eid" in dict(model.named_buffers())
    assert torch.equal(ours, hf.model.layers[0].mlp.gate.tid2eid.long())
    assert not [n for n, _ in model.named_parameters() if ".experts." in n]
    banks = llm.runner.moe.banks
    assert banks.gate_up.shape == (4 * 8, 2 * 32, 64)
    w1 = hf.model.layers[2].mlp.experts.gate_up_proj[5, :32]  # layer 2, expert 5, gate rows
    assert torch.equal(banks.gate_up[2 * 8 + 5, :32], w1)
    msgs = [r.getMessage() for r in caplog.records]
    assert any("multi-token-prediction" in m and "skipped 2 tensors" in m for m in msgs), msgs
    assert llm.engine.prefix is not None  # on: resumes from snapshots (tests below)


def test_no_fast_path_takes_it(tiny):
    d, _ = tiny
    llm = LLM(d, moe_backend="cpu", max_model_len=128, kv_tokens=256)
    runner = llm.runner
    assert static_decode_blocker(llm.model) is not None and not runner.static_decode
    states = [runner.new_state()]
    assert DecodeLane.make(llm.model, runner.kv, runner.moe, states) is None
    assert llm.model.num_attention_layers == 0  # no paged-pool layer: the state is per sequence


def test_release_gives_a_fresh_state(tiny):
    d, _ = tiny
    llm = LLM(d, moe_backend="cpu", max_model_len=128, kv_tokens=256)
    runner = llm.runner
    ids = list(range(3, 23))
    st = runner.new_state()
    first = runner.forward([Work(st, ids)])
    assert st.v4 is not None and st.v4.num_tokens == st.num_tokens == 20
    runner.release(st)  # preempted: recomputed from its first token
    assert st.v4 is not None and st.v4.num_tokens == 0
    runner.reserve(st, 20)
    again = runner.forward([Work(st, ids)])
    runner.release(st)
    assert torch.equal(first, again)


def test_a_step_without_logits_rows(tiny):
    """A prefill chunk that wants no logits (a long prompt's first chunks, or a chunk cut at a
    snapshot point) runs: the last hyper-connection head over zero rows."""
    d, _ = tiny
    llm = LLM(d, moe_backend="cpu", max_model_len=128, kv_tokens=256, prefix_cache=False)
    runner = llm.runner
    st = runner.new_state()
    out = runner.forward([Work(st, list(range(3, 12)), want_logits=False)])
    assert out.shape == (0, 97) and st.num_tokens == 9
    runner.release(st)


# ---- accounting: what a V4 sequence holds beside the KV pool -------------------------------------

# the tiny config: window 8 (7 keys) of head_dim 32 in 4 layers; CSA (rate 4) compressor width 64
# with a [4, 32] overlap, its indexer width 32 with a [4, 16] overlap; HCA (rate 8) width 32
PER_TOKEN = 2 * 4 * (32 + 16) // 4 + 4 * 32 // 8  # the entries: 112 bytes per token
PER_SEQ = (
    4 * 7 * 32 * 4 + 2 * (2 * 3 * 64 * 4 + 2 * 4 * 32 * 4) + 2 * (2 * 3 * 32 * 4 + 2 * 4 * 16 * 4)
)
PER_SEQ += 2 * 7 * 32 * 4  # the HCA layer's open window


def test_state_bytes_are_what_the_state_holds(tiny):
    """The model's formula for a sequence's state (its entries in the pool's pages, not in
    the state) equals the tensors' bytes at every length (prefill, then decode steps through
    open and closing windows), within the per-sequence bound the planner uses; the entries'
    page regions are the per-token bytes."""
    d, _ = tiny
    llm = LLM(d, moe_backend="cpu", max_model_len=128, kv_tokens=256, prefix_cache=False)
    model, runner = llm.model, llm.runner
    assert isinstance(model, DeepseekV4CausalLM)
    assert model.state_bytes_per_token() == PER_TOKEN
    assert model.state_bytes_per_seq() == PER_SEQ
    assert kv_bytes_per_token(model) == PER_TOKEN  # no pool layer: the entries alone
    # pages of 16 tokens: 4 rows of CSA entries (rate 4), 2 of HCA (rate 8) a page
    assert model.pool_regions(16) == [(4, 32), (4, 16), (2, 32), (4, 32), (4, 16)]
    pool = runner.kv
    assert [tuple(t.shape[1:]) for t in pool.regions] == [
        (4, 32),
        (4, 16),
        (2, 32),
        (4, 32),
        (4, 16),
    ]
    kv = pool.k
    assert isinstance(kv, torch.Tensor)
    assert pool.nbytes == 2 * kv.numel() * kv.element_size() + pool.num_pages * 16 * PER_TOKEN
    # pages of 4: one row a page for either rate (HCA's every other page unused)
    assert model.state_bytes_per_token(4) == (2 * 4 * (32 + 16) + 4 * 32) // 4
    st = runner.new_state()
    assert st.v4 is not None and st.v4.nbytes == model.state_bytes(0) == 0
    runner.forward([Work(st, list(range(3, 16)))])  # 13 tokens
    for t in range(16, 40):
        assert isinstance(st.v4, V4SeqState)
        n = st.v4.num_tokens
        assert st.v4.nbytes == model.state_bytes(n), n
        assert st.v4.nbytes <= PER_SEQ
        csa = st.v4.layers[1].compressor
        assert csa is not None and csa.entries.shape[0] == 0 and csa.stored == n // 4
        runner.forward([Work(st, [t])])
    runner.release(st)


def test_plan_counts_the_state(tiny):
    """`ftctl plan` counts V4's entries with the KV pool's tokens and its windows per decode
    row, on the card and on the host; the slot budget of a V4 engine on a card reserves them."""
    d, _ = tiny
    on_card = plan_model(d, vram_mib=1024, ram_mib=1 << 20, backend="offload")
    assert on_card.fits, on_card.reason
    assert on_card.parts_mib["kv_cache"] == on_card.kv_tokens * PER_TOKEN / MIB > 0
    assert on_card.parts_mib["model_state"] == DECODE_ROWS * PER_SEQ / MIB
    assert on_card.placement["model_state"] == "cuda"
    host = plan_model(d, vram_mib=1024, ram_mib=1 << 20, backend="cpu")
    assert host.parts_mib["kv_cache"] == host.kv_tokens * PER_TOKEN / MIB > 0
    llm = LLM(d, "offload", accelerator="fake-cuda", vram_mib=1024, kv_tokens=512, max_batch=4)
    try:
        assert llm.slot_budget.kv_bytes_per_token == PER_TOKEN
        assert llm.slot_budget.kv_reserve_tokens == 512
        # the snapshots' budget (V4's state lives on the card) and 4 sequences' fixed state
        cfg, ec = llm.config, llm.engine_config
        act = moe_activation_bytes(ec.max_step_tokens, cfg.top_k, 64, 32)
        snapshots = int(ec.snapshot_budget_mb * 2**20)
        assert llm.slot_budget.activation_bytes == act + snapshots + 4 * PER_SEQ
    finally:
        llm.close()


# ---- the prefix cache: resuming from snapshots of SeqState.v4 -------------------------------------


def _serve(llm, prompts, gen=4):
    """Runs prompts together: (generated ids, their top-3 logprobs, cached prompt tokens) each."""
    eng = llm.engine
    rids = [f"r{next(_ids)}" for _ in prompts]
    for rid, p in zip(rids, prompts, strict=True):
        eng.add_request(rid, list(p), SamplingParams(max_tokens=gen, ignore_eos=True, logprobs=3))
    out = {r: ([], [], 0) for r in rids}
    while eng.has_unfinished():
        for o in eng.step():
            ids, tops, _ = out[o.request_id]
            ids.append(o.token_id)
            tops.append(o.top_logprobs)
            out[o.request_id] = (ids, tops, o.num_cached_tokens)
    return [out[r] for r in rids]


_ids = itertools.count()
BASE = [(7 * i + 3) % 90 + 5 for i in range(23)]


def test_prefix_cache_on_with_snapshots(tiny):
    d, _ = tiny
    llm = LLM(d, moe_backend="cpu", max_model_len=128, kv_tokens=256, snapshot_policy="interval:5")
    prefix = llm.engine.prefix
    assert prefix is not None and prefix.hybrid and prefix.snapshots is not None
    assert prefix.state_bytes is not None and prefix.state_bytes(40) == llm.model.state_bytes(40)


# A prefill cut elsewhere runs matmuls of other shapes: its logits differ in the last float
# bits (measured ~3e-7 here); the same cuts give the same bits.
TOL = 1e-5


def _close(a, b, atol=TOL):
    """Two _serve results: the same tokens, each step's top logprobs within ``atol``."""
    assert a[0] == b[0]
    for ta, tb in zip(a[1], b[1], strict=True):
        assert [i for i, _ in ta] == [i for i, _ in tb]
        assert max(abs(x - y) for (_, x), (_, y) in zip(ta, tb, strict=True)) < atol


def test_resume_inside_an_open_window_equals_a_cold_run(tiny):
    """A request sharing 13 tokens with an earlier one resumes at its snapshot at 10 (inside an
    open window of both rates, 4 and 8: 10 = 2 * 4 + 2 = 8 + 2). Its tokens, logprobs and
    logits equal, exactly, a cold run's cut at the same points (a fresh engine with the same
    snapshot policy: chunks end at 5, 10, 15), and those of a cold run in one chunk within TOL;
    so do the logits after its own snapshot at 15."""
    d, _ = tiny
    kw = dict(moe_backend="cpu", max_model_len=128, kv_tokens=256, page_size=4)
    warm = LLM(d, snapshot_policy="interval:5", **kw)
    [(_, _, cached)] = _serve(warm, [BASE])
    assert cached == 0
    prefix = warm.engine.prefix
    assert prefix is not None and prefix.snapshots is not None
    assert {5, 10, 15, 20} <= prefix.snapshots.positions()
    edited = BASE[:13] + [50, 51, 52, 53, 54, 55, 56]
    # the engine: cached tokens reported, the same tokens and logprobs as without the cache
    [resumed] = _serve(warm, [edited])
    assert resumed[2] == 10
    assert prefix.snapshots.restored == 1
    [fresh] = _serve(LLM(d, snapshot_policy="interval:5", **kw), [edited])
    assert fresh[2] == 0 and resumed[:2] == fresh[:2]
    cold = LLM(d, prefix_cache=False, **kw)
    [one_chunk] = _serve(cold, [edited])
    _close(resumed, one_chunk)
    # the logits of the fed suffix: restored at 15 (the edited request's own snapshot; 15 =
    # 3 * 4 + 3 = 8 + 7), then 5 tokens in one chunk, against a fresh state fed [0, 5),
    # [5, 10), [10, 15) (as the snapshot was taken), then the same 5
    runner = warm.runner
    st = runner.new_state()
    assert prefix.restore(edited, st) == 15
    assert isinstance(st.v4, V4SeqState) and st.v4.num_tokens == st.num_tokens == 15
    csa, hca = st.v4.layers[1].compressor, st.v4.layers[2].compressor
    assert csa is not None and hca is not None
    assert (csa.kv.shape[0], hca.kv.shape[0]) == (3, 7)  # open windows restored
    got = runner.forward([Work(st, edited[15:], all_logits=True)])
    prefix.release(edited, st)
    runner.release(st)
    st = cold.runner.new_state()
    for a in (0, 5, 10):
        cold.runner.forward([Work(st, edited[a : a + 5], want_logits=False)])
    want = cold.runner.forward([Work(st, edited[15:], all_logits=True)])
    cold.runner.release(st)
    assert torch.equal(got, want)
    assert (got - cold.logits(edited)[15:]).abs().max().item() < TOL


def test_batched_equals_one_by_one_with_the_prefix_cache(tiny):
    """Prompts sharing prefixes (at, inside and across compressor windows) served one by one
    (each resuming from the snapshots of the ones before) equal them served as one batch and
    the cold engine's: the same tokens, logprobs within TOL (a batch's matmuls have other
    shapes); preempted and re-admitted on a small pool too."""
    d, _ = tiny
    prompts = [
        BASE,
        BASE[:8] + [60, 61, 62, 63, 64, 65, 66, 67, 68],  # resumes at 5
        BASE[:17] + [70, 71, 72],  # resumes at 15
        BASE + [80, 81],  # resumes at 20
    ]
    kw = dict(moe_backend="cpu", max_model_len=128, page_size=4, snapshot_policy="interval:5")
    one = LLM(d, kv_tokens=256, **kw)
    alone = [_serve(one, [p])[0] for p in prompts]
    assert [c for _, _, c in alone] == [0, 5, 15, 20]
    batched = _serve(LLM(d, kv_tokens=256, **kw), prompts)
    assert [c for _, _, c in batched] == [0, 0, 0, 0]  # nothing released yet to resume from
    cold = LLM(d, moe_backend="cpu", max_model_len=128, kv_tokens=256, prefix_cache=False)
    want = _serve(cold, prompts)
    for a, b, c in zip(alone, batched, want, strict=True):
        _close(a, b)
        _close(a, c)
    # a pool of 12 pages (48 tokens): the batch preempts, the victims resume from snapshots
    small = LLM(d, kv_tokens=48, **kw)
    tight = _serve(small, prompts)
    assert small.engine.scheduler.preemptions > 0
    for a, c in zip(tight, want, strict=True):
        _close(a, c)


@pytest.mark.parametrize("backend", ["offload", "hybrid"])
def test_hash_layers_move_their_experts_when_the_step_starts(tiny, backend):
    """A hash layer's experts follow from the token ids: the step plans them before layer 0
    (``known_routes``) and the copies land while the layers before it run. Checked on the
    stand-in: the cpu backend's greedy tokens (up to a near tie: its experts run natively, the
    stand-in's in torch), with the early plan and without;
    the early lookups counted apart; when the hash layer itself runs, every one of its
    routes is resident (nothing left to copy: the reserved slots survived the layers in
    between); no slot stays reserved after the steps."""
    d, _ = tiny
    prompts = [BASE[:6], BASE[3:9]]
    kw = dict(max_model_len=128, kv_tokens=256, prefix_cache=False)
    ref = LLM(d, moe_backend="cpu", **kw)
    want = [ids for ids, _, _ in _serve(ref, prompts, gen=6)]
    runs = {}
    for early in (True, False):
        llm = LLM(d, moe_backend=backend, accelerator="standin", moe_slots=10, **kw)
        be = llm.moe
        moe_index = llm.config.moe_layer_index
        hash_layers = [
            moe_index[i] for i, la in enumerate(llm.model._layers) if la.mlp.router.is_hash
        ]
        assert hash_layers, "the tiny config has a hash layer"
        if not early:
            be.known_routes = lambda moe_layer, expert_ids: None
        calls: list[tuple[int, int]] = []  # (layer, copies) of every slot-cache lookup
        lookup = be.cache.decode_step

        def recorded(flat_ids, layer, lookup=lookup, calls=calls):
            plan = lookup(flat_ids, layer)
            calls.append((layer, int(plan.num_copies[0])))
            return plan

        be.cache.decode_step = recorded
        runs[early] = (_serve(llm, prompts, gen=6), calls, be.counters)
        assert not be._known and int(be.cache.state.reserved.sum()) == 0
    for early in (True, False):  # the stand-in's torch experts, the cpu backend's native ones
        got = [ids for ids, _, _ in runs[early][0]]
        assert_greedy_agrees(got, want, prompts, ref, what=f"{backend}, early plans {early}")
    _, calls, counters = runs[True]
    early_fills = 0
    for layer in hash_layers:
        mine = [copies for lay, copies in calls if lay == layer]
        early_calls, own = mine[0::2], mine[1::2]  # the early plan, then the layer's own lookup
        assert len(early_calls) == len(own) > 0
        assert sum(early_calls) > 0 and sum(own) == 0
        early_fills += sum(early_calls)
    assert counters["prefetch_fills"] == early_fills
    assert counters["prefetch_hits"] + counters["prefetch_misses"] > 0
    _, calls_off, counters_off = runs[False]
    assert counters_off["prefetch_fills"] == 0
    # without the early plan: the same lookups less the early ones (half the hash layers')
    assert len(calls_off) == len(calls) - sum(lay in hash_layers for lay, _ in calls) // 2


# ---- the entries in the KV pages: a snapshot's size, resumes at page granularity -----------------


@pytest.mark.parametrize("page", [1, 3, 4, 6, 16])
@pytest.mark.parametrize("rate", [1, 2, 4, 8, 128])
def test_entry_slots_place_each_entry_in_its_closing_tokens_page(page, rate):
    """Entry w sits in the page of its closing token (w + 1) * rate - 1, in a row below
    ceil(page / rate), no two entries in the same (page, row); entries from an offset are
    the same slots."""
    n = max(40, 5 * page // rate + 1)
    pages, rows = entry_slots(0, n, rate, page)
    closing = (torch.arange(n) + 1) * rate - 1
    assert torch.equal(pages, closing // page)
    assert int(rows.min()) >= 0 and int(rows.max()) < -(-page // rate)
    assert len(set(zip(pages.tolist(), rows.tolist(), strict=True))) == n
    p2, r2 = entry_slots(7, n, rate, page)
    assert torch.equal(p2, pages[7:]) and torch.equal(r2, rows[7:])


def test_a_snapshots_bytes_do_not_grow_with_its_position(tiny):
    """Snapshots along a 52-token prompt hold the windows' keys and the open compressor
    windows only (the entries are in the KV pages): each within ``state_bytes_per_seq``, at
    ``state_bytes(pos)``, and two at the same phase of every window (10 and 50: 40 tokens
    apart, a multiple of both rates, past the sliding window) hold the same bytes; the store
    counts them so."""
    d, _ = tiny
    llm = LLM(d, moe_backend="cpu", max_model_len=128, kv_tokens=256, snapshot_policy="interval:5")
    model = llm.model
    assert isinstance(model, DeepseekV4CausalLM)
    prompt = [(5 * i + 1) % 90 + 5 for i in range(52)]
    _serve(llm, [prompt], gen=1)
    store = llm.engine.prefix.snapshots
    snaps = {s.pos: s for s in store.snapshots()}
    assert set(range(5, 52, 5)) <= set(snaps)
    for pos, snap in snaps.items():
        assert snap.state.nbytes == model.state_bytes(pos) <= model.state_bytes_per_seq(), pos
        hca = snap.state.layers[2].compressor
        assert hca.entries.shape[0] == 0 and hca.stored == pos // 8  # in the pages
    assert snaps[10].state.nbytes == snaps[50].state.nbytes
    assert store.used == sum(s.state.nbytes for s in snaps.values())
    # what the whole state (entries held) would have cost there: it grows with the position
    whole = [sum(la.self_attn.state_bytes(p) for la in model._layers) for p in (10, 50)]
    assert whole[1] - whole[0] == 40 * PER_TOKEN


def test_resume_late_inside_an_open_window_and_a_page_equals_a_cold_run(tiny):
    """Pages of 16 tokens: a request sharing 45 tokens with an earlier 60-token one resumes at
    its snapshot at 42 (inside an open window of both rates, 42 = 10 * 4 + 2 = 5 * 8 + 2, and
    inside page 2, copied on write with its entry rows), its entries up to there read from the
    earlier request's pages. Greedy tokens and logprobs equal, exactly, a fresh engine's with
    the same snapshot points (the same prefill cuts), and a cold run's in one chunk within
    TOL; so do the logits after its own snapshot at 49 against a cold state cut as it was."""
    d, _ = tiny
    kw = dict(moe_backend="cpu", max_model_len=128, kv_tokens=256)
    first = [(11 * i + 2) % 90 + 5 for i in range(60)]
    edited = first[:45] + [40, 41, 42, 43, 44, 45]
    warm = LLM(d, snapshot_policy="interval:7", **kw)
    _serve(warm, [first])
    [resumed] = _serve(warm, [edited], gen=3)
    prefix = warm.engine.prefix
    assert resumed[2] == 42 and prefix.snapshots.restored == 1
    [fresh] = _serve(LLM(d, snapshot_policy="interval:7", **kw), [edited], gen=3)
    assert fresh[2] == 0 and resumed[:2] == fresh[:2]
    cold = LLM(d, prefix_cache=False, **kw)
    _close(resumed, _serve(cold, [edited], gen=3)[0])
    runner = warm.runner
    st = runner.new_state()
    assert prefix.restore(edited, st) == 49  # its own snapshot: 49 = 12 * 4 + 1 = 3 * 16 + 1
    assert isinstance(st.v4, V4SeqState)
    csa = st.v4.layers[1].compressor
    assert csa is not None and (csa.stored, csa.entries.shape[0], csa.kv.shape[0]) == (12, 0, 1)
    got = runner.forward([Work(st, edited[49:], all_logits=True)])
    prefix.release(edited, st)
    runner.release(st)
    st = cold.runner.new_state()
    for a in range(0, 49, 7):
        cold.runner.forward([Work(st, edited[a : a + 7], want_logits=False)])
    want = cold.runner.forward([Work(st, edited[49:], all_logits=True)])
    cold.runner.release(st)
    assert torch.equal(got, want)
    assert (got - cold.logits(edited)[49:]).abs().max().item() < TOL
