"""Decode as one captured graph (engine/graphs.py).

On the fake CUDA card: a decode step of the fused and offload backends has a static shape
path. The tracker records every device op (op, inputs' shapes or baked-in numbers, outputs'
shapes) of the function a graph captures, ``decode_forward``, and of the engine's entry,
``ModelRunner.forward``; steps of one batch bucket at other context lengths, page counts, tokens
and routed experts must record the same sequence, with no host sync. (Before the static form,
the KV write sliced its page at the row's position, ``slice(.., 5, 6)`` vs ``(.., 6, 7)``, and
attention read ``context_len`` keys, [6, 2, 16] vs [7, 2, 16]: 72 ops differed between two
consecutive steps.)

On the CPU stand-in (torch.cuda graphs cannot run there): the graph logic with the capture
injected, an eager stand-in that reruns the captured function on replay: bucket choice, padding
rows, static buffer filling, recapture after a resize, and the logged fallbacks. Its logits
equal the eager decode's.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from tiny_models import make_tiny

from freetokend import LLM
from freetokend.engine import graphs as g
from freetokend.engine.runner import Work
from freetokend.engine.sampler import SamplingParams
from freetokend.experts.fakecuda.tracker import OpRecorder
from freetokend.models.layers.attention import set_decode_kernel


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # qwen3_moe, top-4 of 8 experts: a batch of 8 routes 32 > 16 (the grouped path's size)
    d = tmp_path_factory.mktemp("decode-graphs")
    make_tiny("qwen3_moe", d, seed=5, max_position_embeddings=1024, num_experts_per_tok=4)
    return d


def _prefilled(llm: LLM, prompt_lens: list[int]) -> list[Work]:
    states = []
    for i, n in enumerate(prompt_lens):
        st = llm.runner.new_state()
        llm.runner.forward([Work(st, [3 + (i + j) % 50 for j in range(n)])])
        states.append(st)
    return [Work(st, [0]) for st in states]


def _record_step(llm: LLM, work: list[Work], tokens: list[int]) -> tuple[OpRecorder, OpRecorder]:
    """(the captured function's ops, the engine entry's ops) of one decode step each."""
    runner, tr = llm.runner, llm.fake_device.tracker
    for w in work:
        runner.reserve(w.state, w.state.num_tokens + 1)
    states = [w.state for w in work]
    pages = max(runner.kv.pages_for(st.num_tokens + 1) for st in states)
    host = g.pack_decode(states, tokens, runner.kv.page_size, len(work), g.width_for(pages))
    meta = host.to(runner.kv.device)
    syncs, sent = tr.syncs.total, tr.async_h2d
    with tr.record() as captured, runner.decode_scope(len(work)):
        logits = g.decode_forward(runner, meta)
    assert logits.shape == (len(work), llm.config.vocab_size)
    assert (tr.syncs.total, tr.async_h2d) == (syncs, sent)  # no sync, no copy inside
    # host tensors read inside: only the pinned expert pool, by the zero-copy fills (offload),
    # a fixed address (no copy of step data from the host)
    assert {e[0] for e in captured.host_inputs()} <= {"ftkernels.copy_rows.default"}
    for w, t in zip(work, tokens, strict=True):
        w.tokens = [t]
    with tr.record() as entry:
        runner.forward(work)  # the engine's path: one async copy of the metadata, then the same
    assert tr.syncs.total == syncs and tr.async_h2d == sent + 1
    return captured, entry


@pytest.mark.parametrize("kernel", ["torch", "triton"])
@pytest.mark.parametrize("backend", ["fused", "offload"])
def test_decode_step_has_a_static_shape_path(tiny_dir: Path, backend: str, kernel: str) -> None:
    old = set_decode_kernel(kernel)
    llm = LLM(tiny_dir, backend, accelerator="fake-cuda", vram_mib=1024, kv_tokens=1024)
    try:
        with llm.fake_device.in_thread():
            for batch, lens in ((2, [[4, 39], [20, 57]]), (8, [[3] * 8, list(range(9, 57, 6))])):
                first = _prefilled(llm, lens[0])
                second = _prefilled(llm, lens[1])
                recs = [
                    _record_step(llm, first, [5] * batch),  # one page of 16 and three
                    _record_step(llm, first, list(range(7, 7 + batch))),  # next positions
                    _record_step(llm, second, [9] * batch),  # other page counts, 2..4
                ]
                assert all(w.state.num_tokens < 64 for w in first + second)  # width 4 pages
                for captured, entry in recs[1:]:
                    assert recs[0][0].first_difference(captured) is None
                    assert recs[0][1].first_difference(entry) is None
                assert len(recs[0][0]) > 100  # the whole model, every layer's ops
    finally:
        set_decode_kernel(old)
        llm.close()


def test_recorder_sees_a_shape_that_follows_the_context() -> None:
    """The recorder tells a context-length-dependent read apart (the check can fail)."""
    from freetokend.experts.fakecuda import FakeCudaAccelerator

    with FakeCudaAccelerator(vram_mib=1024) as acc:
        pool = torch.zeros(64, 2, device="cuda")
        recs = []
        for n in (5, 6):
            with acc.tracker.record() as rec:
                (pool[:n] * 2).sum()
            recs.append(rec)
    diff = recs[0].first_difference(recs[1])
    assert diff is not None and "5" in diff and "6" in diff, diff


# ---- the graph logic, capture injected (CPU stand-in) ----------------------------------------
def test_buckets() -> None:
    assert [g.batch_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, None]
    assert [g.width_for(p) for p in (1, 4, 5, 8, 9, 33)] == [4, 4, 8, 8, 16, 64]
    assert g.width_for(33, max_pages=40) == 40
    assert g.width_buckets(40) == (4, 8, 16, 32, 40)
    assert g.width_buckets(2) == (2,)


def test_pack_decode_pads_rows_and_tables() -> None:
    from freetokend.kv.seq_state import SeqState

    a, b = SeqState(), SeqState()
    a.pages, a.num_tokens = [7], 3  # row 3 of page 7
    b.pages, b.num_tokens = [2, 5], 16  # position 16: row 0 of its second page
    meta = g.pack_decode([a, b], [11, 12], 16, rows=4, width=4, pad_page=9)
    assert meta.tolist() == [
        [11, 3, 4, 7 * 16 + 3, 7, 7, 7, 7],
        [12, 16, 17, 5 * 16, 2, 5, 2, 2],
        [0, 0, 1, 9 * 16, 9, 9, 9, 9],  # padding rows: the scratch page
        [0, 0, 1, 9 * 16, 9, 9, 9, 9],
    ]
    with pytest.raises(ValueError, match="over width"):
        g.pack_decode([b], [1], 16, rows=1, width=1)
    with pytest.raises(ValueError, match="scratch page"):
        g.pack_decode([a], [1], 16, rows=2, width=4)


class _EagerCapture:
    """A capture stand-in: runs the function once as a capture would (its output is the
    static output buffer), and on replay reruns it from what the static input holds."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.count, self.fail_at = 0, fail_at

    def __call__(self, fn):  # type: ignore[no-untyped-def]
        self.count += 1
        if self.count == self.fail_at:
            raise RuntimeError("operation not permitted when stream is capturing")
        out = fn()

        def replay() -> None:
            with torch.inference_mode():  # as the model's forward made ``out``
                out.copy_(fn())

        return g.Captured(replay, out)


def _decode_logits(llm: LLM, prompts: list[list[int]], steps: int) -> list[torch.Tensor]:
    states = [llm.runner.new_state() for _ in prompts]
    for st, p in zip(states, prompts, strict=True):
        llm.runner.forward([Work(st, p)])
    out = []
    for i in range(steps):
        tokens = [(5 * i + j) % 60 + 3 for j in range(len(states))]
        out.append(
            llm.runner.forward([Work(st, [t]) for st, t in zip(states, tokens, strict=True)])
        )
    return out


@pytest.mark.parametrize("backend", ["fused", "offload"])
def test_replayed_steps_equal_eager_ones(tiny_dir: Path, backend: str) -> None:
    prompts = [list(range(3, 3 + n)) for n in (5, 30, 61)]  # a batch of 3: bucket 4, one pad row
    eager = LLM(tiny_dir, backend, accelerator="standin", kv_tokens=512)
    want = _decode_logits(eager, prompts, steps=6)  # 61 + 6 keys: widths 4 then 8 pages
    llm = LLM(tiny_dir, backend, accelerator="standin", kv_tokens=512)
    cap = _EagerCapture()
    graphs = g.DecodeGraphs(llm.runner, max_pages=16, capture=cap)
    assert graphs.capture_all() and cap.count == 4 * 3  # batches 1, 2, 4, 8 x widths 4, 8, 16
    llm.runner.graphs = graphs
    got = _decode_logits(llm, prompts, steps=6)
    assert graphs.replays == 6
    for a, b in zip(want, got, strict=True):
        assert a.shape == b.shape == (3, llm.config.vocab_size)
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)


def test_fallbacks_are_logged(tiny_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    llm = LLM(tiny_dir, "offload", accelerator="standin", kv_tokens=512)
    caplog.set_level(logging.INFO, logger="freetokend.engine.graphs")
    failing = g.DecodeGraphs(llm.runner, max_pages=8, capture=_EagerCapture(fail_at=3))
    assert not failing.capture_all() and not failing.graphs
    assert "capture failed (RuntimeError" in caplog.text and "without graphs" in caplog.text
    assert failing.run([llm.runner.new_state()], [3]) is None  # eager from then on

    graphs = g.DecodeGraphs(llm.runner, max_pages=4, batches=(1, 2), capture=_EagerCapture())
    assert graphs.capture_all()
    assert "captured batch buckets [1, 2] x page-table widths [4]" in caplog.text
    llm.runner.graphs = graphs
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    llm.engine.add_request("a", list(range(3, 60)), params)  # 57 tokens
    for _ in range(10):
        llm.engine.step()  # the prompt, then decode past 64 keys (4 pages)
    assert "above the widest table" in caplog.text
    replays = graphs.replays
    assert replays == 7  # positions 57..63 (58..64 keys) replay, 64 and 65 do not
    for r in "bcd":
        llm.engine.add_request(r, [4, 5, 6], SamplingParams(max_tokens=2, ignore_eos=True))
    llm.engine.step()  # the prompts: eager
    assert graphs.replays == replays
    caplog.clear()
    llm.engine.step()
    llm.engine.step()
    assert caplog.text.count("above the largest bucket") <= 1  # logged once per reason


def test_a_resize_recaptures(tiny_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    from freetokend.engine.resize import resize_expert_slots

    caplog.set_level(logging.INFO, logger="freetokend.engine.graphs")
    llm = LLM(tiny_dir, "offload", accelerator="standin", kv_tokens=512)
    cap = _EagerCapture()
    graphs = g.DecodeGraphs(llm.runner, max_pages=4, batches=(1,), capture=cap)
    assert graphs.capture_all() and cap.count == 1
    llm.runner.graphs = graphs
    st = llm.runner.new_state()
    llm.runner.forward([Work(st, [3, 4, 5])])
    llm.runner.forward([Work(st, [6])])
    resize_expert_slots(llm.moe, 4)  # new slot banks: the graph's addresses are stale
    llm.runner.forward([Work(st, [7])])
    assert cap.count == 2 and graphs.replays == 2 and "recapturing" in caplog.text


def test_graphs_stay_off_where_they_cannot_run(
    tiny_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="freetokend.engine.build")
    llm = LLM(tiny_dir, "fused", accelerator="standin", kv_tokens=256, cuda_graphs=True)
    assert llm.runner.graphs is None and "cuda graphs: off (the dense part runs on cpu" in (
        caplog.text
    )
    model = llm.model
    assert g.graphs_blocker("hybrid", torch.device("cuda"), model) == (
        "hybrid joins its CPU share on the host in every MoE layer"
    )
    assert g.graphs_blocker("offload", torch.device("cuda"), model) is None


@pytest.mark.parametrize("window,sinks", [(None, False), (5, False), (None, True), (7, True)])
def test_masked_decode_is_attend_over_the_rows_keys(window: int | None, sinks: bool) -> None:
    """The static torch decode over whole page tables equals `attend` over each row's own keys,
    also when the pages past a row's keys hold NaN (never written: any bits)."""
    from freetokend.models.layers.attention import attend, masked_decode

    gen = torch.Generator().manual_seed(0)
    pages, ps, kvh, heads, d = 12, 4, 2, 6, 8
    kp = torch.full((pages, ps, kvh, d), float("nan"))
    vp = torch.full((pages, ps, kvh, d), float("nan"))
    lens = [3, 9, 16]
    tables = torch.tensor([[4, 4, 4, 4], [0, 7, 2, 0], [1, 3, 5, 6]], dtype=torch.int32)
    for row, n in enumerate(lens):
        for p in range(n):
            page = int(tables[row, p // ps])
            kp[page, p % ps] = torch.randn(kvh, d, generator=gen)
            vp[page, p % ps] = torch.randn(kvh, d, generator=gen)
    q = torch.randn(len(lens), heads, d, generator=gen)
    sk = torch.randn(heads, generator=gen) if sinks else None
    got = masked_decode(q, kp, vp, tables, torch.tensor(lens), 0.3, window, sk)
    for row, n in enumerate(lens):
        idx = tables[row].long()
        k, v = kp[idx].flatten(0, 1)[:n], vp[idx].flatten(0, 1)[:n]
        first = 0 if window is None else max(0, n - window)
        want = attend(q[row : row + 1], k[first:], v[first:], n - 1 - first, 0.3, window, sk)
        torch.testing.assert_close(got[row : row + 1], want, rtol=1e-5, atol=1e-5)
