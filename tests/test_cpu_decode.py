"""The native CPU decode path (models/layers/cpu_decode.py) against the generic layers, and its
small native steps (native/dense/decode_step.h) against their torch references.

The fast path calls the generic path's own kernels, so a decode step differs only where the
native top-k's softmax rounds differently from torch's (routing weights, last bits): logits
within 1e-4 (measured below 1e-5 on these models, whose logits are of order 1-5) and the same
greedy tokens, over several decode rows of different lengths at once. Both the bf16 path
(dense_native projections, ftnative's expert executor) and the GGUF-block path (q4_k_m preset:
integer dots, the block MoE) are covered; transformers checks the path too, through every test
that decodes a qualifying model on the cpu backend (test_engine_families and others).
"""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import make_tiny

from freetokend import LLM
from freetokend.engine.runner import Work
from freetokend.models.layers import cpu_decode, decode_lane
from freetokend.models.layers.moe import SparseMoE, route
from freetokend.native import dense_native, qlinear_native

pytestmark = pytest.mark.skipif(not qlinear_native.available(), reason="ftdense not built")
nat = dense_native._native
TOL = 1e-4
# prompt rows on the fast path against the generic prefill: bf16 steps of stored keys (see
# test_short_prompt_chunks_run_as_rows_of_the_fast_path)
CHUNK_TOL = 3e-2


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    # hidden 256, o_proj inputs 4 x 64: the q4_k_m preset quantizes every projection
    path, _ = make_tiny(
        "qwen3_moe",
        tmp_path_factory.mktemp("cpu-decode"),
        seed=3,
        dtype=torch.bfloat16,
        hidden_size=256,
        head_dim=64,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return path


def _decode(llm: LLM, prompts: list[list[int]], steps: int) -> tuple[torch.Tensor, list[list[int]]]:
    """Logits [steps, rows, vocab] of greedy decode steps of all prompts batched together; the
    prompts prefilled on the generic layers whatever the fast path's setting (the same keys
    for both paths' decode steps: a short prompt would run on the fast path as rows)."""
    runner = llm.runner
    states = [runner.new_state() for _ in prompts]
    old = cpu_decode.set_enabled(False)
    try:
        toks = [
            int(runner.forward([Work(st, p)])[0].argmax())
            for st, p in zip(states, prompts, strict=True)
        ]
    finally:
        cpu_decode.set_enabled(old)
    logits, tokens = [], []
    for _ in range(steps):
        lg = runner.forward([Work(st, [t]) for st, t in zip(states, toks, strict=True)])
        logits.append(lg.clone())
        toks = lg.argmax(-1).tolist()
        tokens.append(toks)
    for st in states:
        runner.release(st)
    return torch.stack(logits), tokens


@pytest.mark.parametrize("quantize", [None, "q4_k_m"])
def test_fast_path_matches_generic_layers(ckpt, quantize, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    llm = LLM(
        str(ckpt), moe_backend="cpu", quantize=quantize, prefix_cache=False, max_model_len=256
    )
    runs = [0]
    run = cpu_decode.DecodeStep.run

    experts: set[str] = set()

    def counted(self, plans, h):  # type: ignore[no-untyped-def]
        runs[0] += len(plans)
        experts.add("qmoe" if self.qmoe else "float" if self.float_experts else "callback")
        return run(self, plans, h)

    monkeypatch.setattr(cpu_decode.DecodeStep, "run", counted)
    finals, embeds = [0], [0]
    final, embed = cpu_decode.HeadPlan.final_norm, cpu_decode.HeadPlan.embed

    def counted_final(*args):  # type: ignore[no-untyped-def]
        y = final(*args)
        finals[0] += y is not None
        return y

    def counted_embed(*args):  # type: ignore[no-untyped-def]
        h = embed(*args)
        embeds[0] += h is not None
        return h

    monkeypatch.setattr(cpu_decode.HeadPlan, "final_norm", counted_final)
    monkeypatch.setattr(cpu_decode.HeadPlan, "embed", counted_embed)
    prompts = [[5, 17, 90, 3], [42] * 19, list(range(20, 60))]  # page-crossing lengths too
    old = cpu_decode.set_enabled(False)
    try:
        ref, ref_tokens = _decode(llm, prompts, 12)
    finally:
        cpu_decode.set_enabled(old)
    assert runs[0] == 0
    got, tokens = _decode(llm, prompts, 12)
    # every MoE layer (this model also has a dense-MLP layer, which keeps the generic path)
    moe_layers = sum(isinstance(layer.mlp, SparseMoE) for layer in llm.model.layers)
    assert 0 < moe_layers < llm.config.num_layers
    assert runs[0] == 12 * moe_layers  # each decode step took the fast path in each of them
    assert finals[0] == embeds[0] == 12  # and its embedding gather and last norm, once a step
    # the experts ran inside the native call on ftdense's pool: the block executor's QMoe, or
    # ftnative's float executor through its entry (executor_bridge.h)
    assert experts == {"qmoe" if quantize else "float"}
    assert tokens == ref_tokens
    assert (got - ref).abs().max().item() < TOL
    assert ref.abs().max().item() > 0.5  # real logits, not zeros


def _chunked(llm: LLM, plan: list[list[int]], prompts: list[list[int]]) -> list[torch.Tensor]:
    """Each prompt prefilled in the chunk sizes of its ``plan`` row, the chunks of all prompts
    in the same steps (the k-th chunk of each, beside the decode rows of the prompts already
    in), then 4 decode steps of all: every step's logits."""
    runner = llm.runner
    states = [runner.new_state() for _ in prompts]
    at = [0] * len(prompts)
    last: list[int | None] = [None] * len(prompts)
    out = []
    for k in range(max(len(c) for c in plan) + 4):
        work, who = [], []
        for i, (st, p) in enumerate(zip(states, prompts, strict=True)):
            if k < len(plan[i]):
                work.append(Work(st, p[at[i] : at[i] + plan[i][k]]))
                at[i] += plan[i][k]
            elif last[i] is not None:
                work.append(Work(st, [last[i]]))  # type: ignore[list-item]
            else:
                continue
            who.append(i)
        lg = runner.forward(work)
        out.append(lg.clone())
        for i, w, row in zip(who, work, lg, strict=True):
            if len(w.tokens) and (at[i] == len(prompts[i]) or k >= len(plan[i])):
                last[i] = int(row.argmax())
    for st in states:
        runner.release(st)
    return out


@pytest.mark.parametrize("quantize", [None, "q4_k_m"])
def test_short_prompt_chunks_run_as_rows_of_the_fast_path(ckpt, quantize, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A prompt chunk of up to CHUNK_ROWS tokens runs through the native step as that many
    rows, beside other prompts' chunks and decode rows: each row attends to its own sequence's
    keys up to its position (the chunk's earlier rows included, stored in the same layer call),
    across page boundaries (pages of 16). A prompt row's arithmetic is a decode row's, not the
    generic prefill's: its stored keys part from those in the last bits, and the KV pool keeps
    bf16, so where one crosses a rounding boundary the later rows see a bf16 step (measured
    up to 1.3e-2 in these logits, of order 1-5, with or without cpu_bf16_dot; the q4_k_m
    preset ~1e-6): every step's logits within CHUNK_TOL of the generic layers', the same greedy
    tokens but at a near-tie, and the prompt's logits as close to transformers' as the generic
    path's (a row attending to a wrong key set would part by far more). A step with a longer
    chunk keeps the generic path."""
    # the engine's defaults: on an AVX512-BF16 CPU bf16 activations and the bf16 attention,
    # whose decode rows take the generic prefill's kernel (the same bits)
    llm = LLM(
        str(ckpt), moe_backend="cpu", quantize=quantize, prefix_cache=False, max_model_len=256,
    )  # fmt: skip
    assert cpu_decode.CHUNK_ROWS == 4  # the plan below
    prompts = [list(range(3, 21)), [42] * 7, list(range(60, 63))]
    # 18 / 7 / 3 tokens in chunks of at most 4 (pages of 16: the first prompt's 4th chunk
    # crosses into its second page)
    plan = [[4, 3, 4, 4, 3], [1, 2, 4], [3]]
    old = cpu_decode.set_enabled(False)
    try:
        want = _chunked(llm, plan, prompts)
    finally:
        cpu_decode.set_enabled(old)
    rows: list[int] = []
    run = cpu_decode.DecodeStep.run

    def counted(self, plans, h):  # type: ignore[no-untyped-def]
        rows.append(self.t)
        return run(self, plans, h)

    monkeypatch.setattr(cpu_decode.DecodeStep, "run", counted)
    got = _chunked(llm, plan, prompts)
    moe_layers = sum(isinstance(layer.mlp, SparseMoE) for layer in llm.model.layers)
    # steps of 4+1+3, 3+2+1, 4+4+1, 4+1+1, 3+1+1 rows (the third prompt decodes from its
    # second step, the second from its fourth), then 4 decode steps of 3 (a native run a MoE
    # layer each)
    assert rows == [t for t in (8, 6, 9, 6, 5, 3, 3, 3, 3) for _ in range(moe_layers)]
    assert len(got) == len(want) == 9
    for g, w in zip(got, want, strict=True):
        assert (g - w).abs().max().item() < CHUNK_TOL
        top2 = w.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * CHUNK_TOL  # not a near-tie
        assert torch.equal(g.argmax(-1)[clear], w.argmax(-1)[clear])
    assert want[-1].abs().max().item() > 0.5  # real logits
    # the outside oracle: the first prompt's last logits, prefilled in chunks of at most 4
    # rows on the fast path, are as close to transformers' forward as the generic path's
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(ckpt), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([prompts[0]])).logits[0, -1]
    err_fast = (got[4][0] - ref).abs().max().item()  # step 5's first logits row: prompt 0
    err_generic = (want[4][0] - ref).abs().max().item()
    assert err_fast < err_generic + CHUNK_TOL, (err_fast, err_generic)
    # a chunk over CHUNK_ROWS keeps the generic path
    rows.clear()
    _chunked(llm, [[cpu_decode.CHUNK_ROWS + 1]], [list(range(cpu_decode.CHUNK_ROWS + 1))])
    assert rows == [1] * (4 * moe_layers)  # its decode steps only


@pytest.fixture(scope="module")
def all_moe(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    # every layer MoE: the whole forward (embedding, layers, last norm, lm_head) is native
    path, _ = make_tiny(
        "qwen3_moe", tmp_path_factory.mktemp("all-moe"), seed=5, dtype=torch.bfloat16,
        hidden_size=256, head_dim=64, num_attention_heads=4, num_key_value_heads=2,
        mlp_only_layers=[],
    )  # fmt: skip
    return path


class _CountedCalls:
    """ftdense with its decode_layers calls counted: True for a call with the model's ends."""

    def __init__(self) -> None:
        self.calls: list[bool] = []

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(nat, name)

    def decode_layers(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.calls.append(args[-1] is not None)
        return nat.decode_layers(*args, **kwargs)


@pytest.mark.parametrize("quantize", [None, "q4_k_m"])
def test_whole_forward_in_one_call_matches_part_by_part(all_moe, quantize, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    llm = LLM(
        str(all_moe), moe_backend="cpu", quantize=quantize, prefix_cache=False, max_model_len=512
    )
    assert (llm.model.lm_head.qweight is not None) == bool(quantize)
    counted = _CountedCalls()
    monkeypatch.setattr(dense_native, "_native", counted)
    # three rows, then one alone (its rope rows read from the table in place); the first prompt
    # so long that the lane's page tables (16 pages wide) grow during the steps
    prompts = [[i % 90 + 1 for i in range(250)], [42] * 19, list(range(20, 60))]

    def run(ends: bool) -> tuple[list[torch.Tensor], list[list[int]]]:
        seconds = torch.zeros(len(nat.decode_parts()), dtype=torch.float64)
        cpu_decode.set_timings(seconds)
        try:
            got, tokens = _decode(llm, prompts, 10)
            one, one_tokens = _decode(llm, prompts[2:], 4)
        finally:
            cpu_decode.set_timings(None)
        timed = dict(zip(nat.decode_parts(), seconds.tolist(), strict=True))
        # the embedding and lm_head timed as parts of the call when it runs them
        assert (timed.pop("embed") > 0) == (timed.pop("lm_head") > 0) == ends
        assert all(v > 0 for v in timed.values()), timed
        return [got, one], [*tokens, *one_tokens]

    lane, lane_tokens = run(True)  # the runner's lane: one call a step
    assert counted.calls == [True] * 14
    counted.calls.clear()
    monkeypatch.setattr(decode_lane.DecodeLane, "make", lambda *a: None)
    llm.runner._lane = llm.runner._no_lane = None
    whole, whole_tokens = run(True)  # the model's forward, every layer planned: one call a step
    assert counted.calls == [True] * 14
    counted.calls.clear()
    monkeypatch.setattr(cpu_decode.HeadPlan, "whole", lambda *a: None)
    parts, parts_tokens = run(False)  # the layers' call, the ends part by part
    assert counted.calls == [False] * 14
    assert lane_tokens == whole_tokens == parts_tokens
    for a, b, c in zip(lane, whole, parts, strict=True):
        assert torch.equal(a, b) and torch.equal(b, c)  # the same kernels on the same inputs
    assert parts[0].abs().max().item() > 0.5


def test_the_lane_follows_the_batch(all_moe, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # rows joining and leaving between steps: the runner's lane is made again for each new set
    llm = LLM(str(all_moe), moe_backend="cpu", prefix_cache=False, max_model_len=256)
    runner = llm.runner
    made = []
    make = decode_lane.DecodeLane.make

    def counted(*args):  # type: ignore[no-untyped-def]
        lane = make(*args)
        made.append(lane)
        return lane

    monkeypatch.setattr(decode_lane.DecodeLane, "make", counted)
    a, b = runner.new_state(), runner.new_state()
    ta = int(runner.forward([Work(a, [3, 4, 5])])[0].argmax())
    tb = int(runner.forward([Work(b, [7, 8])])[0].argmax())
    got = []
    for batch in ([a], [a], [a, b], [a, b], [b], [b], [a]):
        toks = {id(a): ta, id(b): tb}
        lg = runner.forward([Work(st, [toks[id(st)]]) for st in batch])
        got.append(lg.clone())
        for st, t in zip(batch, lg.argmax(-1).tolist(), strict=True):
            if st is a:
                ta = t
            else:
                tb = t
    assert len(made) == 4 and all(m is not None for m in made)  # [a], [a, b], [b], [a]
    # the same steps through the model's forward give the same logits
    monkeypatch.setattr(decode_lane.DecodeLane, "make", lambda *a: None)
    runner._lane = runner._no_lane = None
    runner.release(a)
    runner.release(b)
    a, b = runner.new_state(), runner.new_state()
    ta = int(runner.forward([Work(a, [3, 4, 5])])[0].argmax())
    tb = int(runner.forward([Work(b, [7, 8])])[0].argmax())
    for batch, want in zip(([a], [a], [a, b], [a, b], [b], [b], [a]), got, strict=True):
        toks = {id(a): ta, id(b): tb}
        lg = runner.forward([Work(st, [toks[id(st)]]) for st in batch])
        assert torch.equal(lg, want)
        for st, t in zip(batch, lg.argmax(-1).tolist(), strict=True):
            if st is a:
                ta = t
            else:
                tb = t


def test_float32_layers_keep_the_generic_path(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path, _ = make_tiny("qwen3_moe", tmp_path, seed=1)
    llm = LLM(str(path), moe_backend="cpu", dtype="float32", prefix_cache=False, max_model_len=64)
    llm.generate([1, 2, 3], 3, ignore_eos=True)
    assert all(layer.decode_plan() is None for layer in llm.model.layers)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_embed_rows_is_index_select_then_float(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(50, 72, generator=g) * 3).to(dtype)
    ids = torch.tensor([7, 0, 49, 7])
    y = torch.full((4, 72), float("nan"))
    nat.embed_rows(w.data_ptr(), dtype == torch.bfloat16, 50, 72, ids.data_ptr(), 4, y.data_ptr())
    assert torch.equal(y, w.index_select(0, ids).float())
    for bad in ([50], [-1], [3, 50]):  # nothing written before the check fails
        bad_ids = torch.tensor(bad)
        y.fill_(1.0)
        with pytest.raises(IndexError, match="outside the vocabulary"):
            nat.embed_rows(w.data_ptr(), False, 50, 72, bad_ids.data_ptr(), len(bad), y.data_ptr())
        assert bool((y == 1.0).all())


def test_add_rms_norm_is_add_then_rms_norm() -> None:
    g = torch.Generator().manual_seed(0)
    h, d = torch.randn(3, 96, generator=g), torch.randn(3, 96, generator=g)
    scale = torch.rand(96, generator=g) + 0.5
    want_h = h + d
    want = dense_native.rms_norm(want_h, scale, 1e-6)
    y = torch.empty(3, 96)
    nat.add_rms_norm(h.data_ptr(), d.data_ptr(), 3, 96, scale.data_ptr(), 1e-6, y.data_ptr())
    assert torch.equal(h, want_h) and torch.equal(y, want)
    ref = torch.nn.functional.rms_norm(want_h, (96,), scale, 1e-6)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("softmax_first", "renorm"), [(True, True), (True, False), (False, False)])
def test_route_topk_matches_route(softmax_first: bool, renorm: bool) -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 64, generator=g) * 3
    want_ids, want_w = route(logits, 6, softmax_first, renorm)
    ids = torch.empty(5, 6, dtype=torch.int32)
    w = torch.empty(5, 6)
    nat.route_topk(
        logits.data_ptr(), 5, 64, 6, softmax_first, renorm, 128, ids.data_ptr(), w.data_ptr()
    )
    assert torch.equal(ids.long() - 128, want_ids)
    torch.testing.assert_close(w, want_w, rtol=1e-6, atol=1e-7)
    # a tie keeps the lower expert first (torch.topk leaves the order of ties unspecified)
    logits[0, 40] = logits[0, 9] = 50.0
    nat.route_topk(
        logits.data_ptr(), 1, 64, 6, softmax_first, renorm, 0, ids.data_ptr(), w.data_ptr()
    )
    assert ids[0, :2].tolist() == [9, 40]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kv_store_is_the_pool_cast(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(2, 24, generator=g), torch.randn(2, 24, generator=g)
    k[0, 0], k[0, 1], v[1, 2] = math.nan, math.inf, 1.0 + 2**-9  # NaN, inf, a rounding tie
    kp, vp = torch.zeros(10, 24, dtype=dtype), torch.zeros(10, 24, dtype=dtype)
    slots = torch.tensor([7, 2], dtype=torch.int64)
    want_k, want_v = kp.clone(), vp.clone()
    want_k[slots], want_v[slots] = k.to(dtype), v.to(dtype)
    nat.kv_store(
        k.data_ptr(),
        v.data_ptr(),
        2,
        24,
        slots.data_ptr(),
        kp.data_ptr(),
        vp.data_ptr(),
        dtype == torch.bfloat16,
    )
    # bit for bit but NaN, whose payload torch's vectorised cast sets otherwise (0xFFFF)
    torch.testing.assert_close(kp, want_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(vp, want_v, rtol=0, atol=0)


@pytest.mark.parametrize("vocab", [1, 7, 16, 17, 50257])
def test_argmax_is_torch_argmax(vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(4, vocab, generator=g)
    x[1] = -math.inf
    if vocab > 3:
        x[2, vocab - 3] = x[2, vocab - 1] = 1e9  # ties: the first
        x[3, vocab // 2] = x[3, vocab - 1] = math.nan  # NaN is the largest: the first
    got = dense_native.argmax(x)
    assert got is not None and torch.equal(got, torch.argmax(x, dim=-1))


def test_step_buffers_are_reused_per_thread_and_row_count() -> None:
    import threading

    first = cpu_decode._step_buffers(3)
    first[("x", 8, torch.float32)] = torch.empty(3, 8)
    assert cpu_decode._step_buffers(3) is first  # the next step of 3 rows: the same buffers
    assert cpu_decode._step_buffers(2) is not first
    other: list[object] = []
    th = threading.Thread(target=lambda: other.append(cpu_decode._step_buffers(3)))
    th.start()
    th.join()
    assert other[0] is not first  # another engine thread never shares a step's buffers
    for t in range(10, 10 + cpu_decode._KEEP_ROW_COUNTS):  # row counts come and go
        cpu_decode._step_buffers(t)
    assert cpu_decode._step_buffers(3) is not first  # the oldest were dropped
    assert len(cpu_decode._local.by_rows) == cpu_decode._KEEP_ROW_COUNTS


def test_decode_layers_times_its_parts_when_asked(ckpt) -> None:  # type: ignore[no-untyped-def]
    llm = LLM(str(ckpt), moe_backend="cpu", prefix_cache=False, max_model_len=64)
    parts = nat.decode_parts()
    seconds = torch.zeros(len(parts), dtype=torch.float64)
    cpu_decode.set_timings(seconds)
    try:
        llm.generate([1, 2, 3], 4, ignore_eos=True)
    finally:
        cpu_decode.set_timings(None)
    timed = dict(zip(parts, seconds.tolist(), strict=True))
    # this model's dense-MLP layer keeps the ends outside the call (no whole forward)
    assert timed.pop("embed") == timed.pop("lm_head") == 0
    assert all(v > 0 for v in timed.values()), timed
    seen = seconds.clone()
    llm.generate([1, 2, 3], 4, ignore_eos=True)
    assert torch.equal(seconds, seen)  # switched off: nothing added
    with pytest.raises(ValueError, match="float64"):
        cpu_decode.set_timings(torch.zeros(len(parts)))


def test_decode_layer_specs_are_checked() -> None:
    w = torch.zeros(64, 64, dtype=torch.bfloat16)
    one = (False, 64, [w.data_ptr()], [64], [])
    scale = torch.ones(64)
    args = dict(
        hidden=64, heads=4, kv_heads=2, head_dim=16, attn_scale=0.25, window=0,
        scales=[scale.data_ptr()] * 2, eps=[1e-6] * 2,
        qkv=(False, 64, [w.data_ptr()] * 3, [64, 32, 32], []), o=one,
        router=(False, 64, [w.data_ptr()], [8], []), experts=8, top_k=2,
        softmax_first=True, renorm=False, moe_index=0, kv_layer=0,
    )  # fmt: skip
    layer = nat.DecodeLayer(**args)
    with pytest.raises(ValueError, match="norms"):
        nat.DecodeLayer(**{**args, "scales": [scale.data_ptr()] * 3, "eps": [1e-6] * 3})
    h = torch.zeros(1, 64)
    meta = torch.tensor([0, 0, 1], dtype=torch.int32)
    slots = torch.zeros(1, dtype=torch.int64)
    kv = torch.zeros(2, 4, 2, 16)
    step = dict(
        h=h.data_ptr(), t=1, cos=scale.data_ptr(), sin=scale.data_ptr(), rot=16,
        interleaved=False, slots=slots.data_ptr(), tables=meta.data_ptr(),
        rows=meta.data_ptr() + 4, lens=meta.data_ptr() + 8, width=1,
        kv=[(kv[0].data_ptr(), kv[1].data_ptr(), False, 1, 4)], num_experts=8,
    )  # fmt: skip
    with pytest.raises(ValueError, match="no experts"):
        nat.decode_layers([layer], **step, qmoe=None, float_experts=None, experts=None)
    with pytest.raises(ValueError, match="kv_layer"):
        nat.decode_layers(
            [layer], **{**step, "kv": []}, qmoe=None, float_experts=None, experts=print
        )
    bad_qkv = {**args, "qkv": (False, 64, [w.data_ptr()] * 3, [64, 64, 32], [])}
    with pytest.raises(ValueError, match="qkv rows"):
        nat.decode_layers(
            [nat.DecodeLayer(**bad_qkv)], **step, qmoe=None, float_experts=None, experts=print
        )
    calls: list[tuple[int, ...]] = []
    nat.decode_layers(
        [layer], **step, qmoe=None, float_experts=None, experts=lambda *a: calls.append(a)
    )  # zero weights: a step that runs, the experts called back once with t=1, k=2
    assert len(calls) == 1 and calls[0][4:] == (1, 2)
    ids = torch.zeros(1, dtype=torch.int64)
    logits = torch.zeros(1, 64)
    head = (w.data_ptr(), True, 64, ids.data_ptr(), scale.data_ptr(), 1e-6, one, logits.data_ptr())
    nat.decode_layers(
        [layer], **step, qmoe=None, float_experts=None, experts=lambda *a: None, ends=head
    )  # zero weights: zero logits
    assert not logits.any()
    with pytest.raises(ValueError, match="lm_head"):
        nat.decode_layers(
            [layer], **step, qmoe=None, float_experts=None, experts=print,
            ends=(*head[:6], (False, 32, [w.data_ptr()], [64], []), head[7]),
        )  # fmt: skip
    with pytest.raises(ValueError, match="need a layer"):
        nat.decode_layers([], **step, qmoe=None, float_experts=None, experts=print, ends=head)
    with pytest.raises(IndexError, match="outside the vocabulary"):
        bad = torch.full((1,), 64, dtype=torch.int64)
        nat.decode_layers(
            [layer], **step, qmoe=None, float_experts=None, experts=print,
            ends=(*head[:3], bad.data_ptr(), *head[4:]),
        )  # fmt: skip


def test_a_process_whose_first_forward_is_a_decode_step(ckpt) -> None:  # type: ignore[no-untyped-def]
    """A one-token prompt as a fresh process's first request is a decode step before any
    projection configured ftdense's pool: the fast path configures it (it raised "configure()
    was not called" before). In a child process: in this one, earlier tests configured it."""
    import subprocess
    import sys

    script = (
        "import sys; from freetokend import LLM; "
        f"llm = LLM({str(ckpt)!r}, 'cpu', max_model_len=64, kv_tokens=256); "
        "print(llm.generate([2], 3, ignore_eos=True))"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    fresh = eval(run.stdout.strip().splitlines()[-1])  # noqa: S307 - our child's printed list
    assert fresh == LLM(ckpt, "cpu", max_model_len=64, kv_tokens=256).generate(
        [2], 3, ignore_eos=True
    )
