"""The Gated DeltaNet kernels (kernels/deltanet.py: the batched decode step and the chunked
prefill) against their torch references, the references against the model's recurrence and
chunked form, and the layer's kernel path against its torch path.

The kernel runs in the Triton interpreter on CPU tensors (ftkernels.interp), or compiled on CUDA
with FT_TEST_ACCELERATOR=cuda (tests/gpu/check.sh).

Tolerance: both sides compute in fp32 from the same inputs (bf16 inputs widen exactly), so they
differ in summation order only (~1e-6 after a few steps); a wrong head, state, layer or block
moves an output or a state by >= ~1e-2.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from freetokend.kv.seq_state import SeqState
from freetokend.models.batch import ForwardBatch, SeqChunk
from freetokend.models.config import ModelConfig
from freetokend.models.config_hf import read_config
from freetokend.models.layers import attention as attn
from freetokend.models.layers import deltanet as dn
from ftkernels import ops
from ftkernels.deltanet import (
    block_v,
    deltanet_decode,
    deltanet_decode_reference,
    deltanet_prefill,
    deltanet_prefill_reference,
    state_pointers,
)

CUDA = os.environ.get("FT_TEST_ACCELERATOR") == "cuda"
DEV = "cuda" if CUDA else "cpu"
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _inputs(
    n: int, kh: int, heads: int, dk: int, dv: int, dtype: torch.dtype, beta_dtype: torch.dtype,
    g: torch.Generator,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """One step's inputs as the layer makes them: q, k L2-normalised (q scaled), g < 0."""
    q = F.normalize(torch.randn(n, kh, dk, generator=g), dim=-1) * dk**-0.5
    k = F.normalize(torch.randn(n, kh, dk, generator=g), dim=-1)
    v = torch.randn(n, heads, dv, generator=g)
    gate = -torch.rand(n, heads, generator=g) * 2
    beta = torch.rand(n, heads, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype), gate.to(dtype), beta.to(beta_dtype)


def _states(n: int, layers: int, heads: int, dk: int, dv: int, g: torch.Generator) -> list:  # type: ignore[type-arg]
    return [torch.randn(layers, heads, dk, dv, generator=g) for _ in range(n)]


def _kernel(args: tuple[torch.Tensor, ...], states: list[torch.Tensor], layer: int) -> torch.Tensor:
    """The kernel on DEV; the states updated on DEV and copied back into ``states``."""
    dev_states = [s.to(DEV) for s in states]
    ptrs = state_pointers(dev_states).to(DEV)
    out = deltanet_decode(*(t.to(DEV) for t in args), dev_states, ptrs, layer).cpu()
    for s, d in zip(states, dev_states, strict=True):
        s.copy_(d.cpu())
    return out


@pytest.mark.parametrize(
    "n,kh,heads,dk,dv,dtype,beta_dtype",
    [
        (1, 2, 2, 16, 16, torch.float32, torch.float32),  # one sequence, one block
        (3, 2, 4, 16, 32, torch.float32, torch.bfloat16),  # GQA 2, dk != dv, bf16 beta (model)
        (2, 4, 4, 32, 16, torch.float32, torch.float32),  # q/k already repeated, dk > dv
        (2, 1, 3, 8, 24, torch.float32, torch.float32),  # GQA 3, dv not a power of two
        (2, 2, 4, 16, 16, torch.bfloat16, torch.bfloat16),  # bf16 inputs
    ],
)
def test_kernel_matches_reference(
    n: int, kh: int, heads: int, dk: int, dv: int, dtype: torch.dtype, beta_dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(n * 31 + heads + dk)
    args = _inputs(n, kh, heads, dk, dv, dtype, beta_dtype, g)
    states = _states(n, 3, heads, dk, dv, g)
    ref_states = [s.clone() for s in states]
    got = _kernel(args, states, layer=1)
    want = deltanet_decode_reference(*args, ref_states, 1)
    assert got.dtype == torch.float32 and got.shape == (n, heads, dv)
    torch.testing.assert_close(got, want, **TOL)
    for s, r in zip(states, ref_states, strict=True):
        torch.testing.assert_close(s, r, **TOL)


def test_block_v_splits_wide_values_over_programs() -> None:
    """dv 128 at dk 128 takes four programs per head (the compile test's no-spill tile); a
    narrow dv one. The interpreted cases above cover more than one block (dk 8, dv 24: BV 32,
    masked; dk 32, dv 16)."""
    assert block_v(128, 128) == 32 and block_v(256, 128) == 16 and block_v(16, 16) == 16
    g = torch.Generator().manual_seed(4)
    args = _inputs(2, 2, 2, 64, 160, torch.float32, torch.float32, g)  # BV 64: 3 blocks
    assert block_v(64, 160) == 64
    states = _states(2, 1, 2, 64, 160, g)
    ref_states = [s.clone() for s in states]
    torch.testing.assert_close(
        _kernel(args, states, 0), deltanet_decode_reference(*args, ref_states, 0), **TOL
    )
    for s, r in zip(states, ref_states, strict=True):
        torch.testing.assert_close(s, r, **TOL)


def test_state_continues_over_steps_and_other_layers_stay() -> None:
    """Four steps in a row, the states carried in place: outputs and states follow the
    reference; the layers the step does not name are untouched."""
    g = torch.Generator().manual_seed(9)
    n, kh, heads, dk, dv = 3, 2, 4, 16, 32
    states = _states(n, 4, heads, dk, dv, g)
    before = [s.clone() for s in states]
    ref_states = [s.clone() for s in states]
    for step in range(4):
        args = _inputs(n, kh, heads, dk, dv, torch.float32, torch.bfloat16, g)
        layer = 2 if step % 2 else 0
        got = _kernel(args, states, layer)
        want = deltanet_decode_reference(*args, ref_states, layer)
        torch.testing.assert_close(got, want, **TOL)
    for s, r, b in zip(states, ref_states, before, strict=True):
        torch.testing.assert_close(s, r, **TOL)
        assert torch.equal(s[1], b[1]) and torch.equal(s[3], b[3])
        assert (s[0] - b[0]).abs().max() > 1e-2


def test_kernel_detects_a_swapped_state() -> None:
    """The tolerance sees one sequence reading another's state (the test can fail)."""
    g = torch.Generator().manual_seed(3)
    args = _inputs(2, 2, 2, 16, 16, torch.float32, torch.float32, g)
    states = _states(2, 1, 2, 16, 16, g)
    got = _kernel(args, [s.clone() for s in states], 0)
    want = deltanet_decode_reference(*args, states[::-1], 0)
    assert (got - want).abs().max() > 1e-2


def test_reference_is_the_model_recurrence() -> None:
    """The reference equals the model's `delta_rule_recurrent` of one token per sequence, with
    q and k repeated per value head as the layer does."""
    g = torch.Generator().manual_seed(1)
    n, kh, heads, dk, dv = 3, 2, 6, 8, 16
    args = _inputs(n, kh, heads, dk, dv, torch.float32, torch.bfloat16, g)
    states = _states(n, 2, heads, dk, dv, g)
    model_states = [s[1].clone() for s in states]
    got = deltanet_decode_reference(*args, states, 1)
    q, k, v, gate, beta = args
    for b in range(n):
        o, st = dn.delta_rule_recurrent(
            q[b : b + 1].repeat_interleave(3, dim=1), k[b : b + 1].repeat_interleave(3, dim=1),
            v[b : b + 1], gate[b : b + 1], beta[b : b + 1], model_states[b],
        )  # fmt: skip
        torch.testing.assert_close(got[b], o[0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(states[b][1], st, rtol=1e-6, atol=1e-6)


# -- the chunked prefill ----------------------------------------------------------------------


def _prefill(args: tuple[torch.Tensor, ...], state: torch.Tensor, chunk: int) -> torch.Tensor:
    dev_state = state.to(DEV)
    out = deltanet_prefill(*(t.to(DEV) for t in args), dev_state, chunk=chunk).cpu()
    state.copy_(dev_state.cpu())
    return out


@pytest.mark.parametrize(
    "n,kh,heads,dk,dv,chunk,dtype,decay",
    [
        (37, 1, 2, 16, 32, 16, torch.float32, 2.0),  # GQA 2, dk != dv, 3 chunks, the last partial
        (5, 2, 4, 16, 16, 32, torch.float32, 2.0),  # shorter than one chunk, GQA 2
        (40, 4, 4, 32, 16, 16, torch.float32, 2.0),  # q/k already repeated, dk > dv
        (20, 2, 4, 48, 24, 16, torch.float32, 2.0),  # dk over two dk blocks (masked), dv 24
        (33, 2, 2, 16, 16, 16, torch.bfloat16, 2.0),  # bf16 inputs
        (24, 1, 2, 16, 16, 16, torch.float32, 30.0),  # strong decay: e^c underflows in a chunk
    ],
)
def test_prefill_matches_reference(
    n: int, kh: int, heads: int, dk: int, dv: int, chunk: int, dtype: torch.dtype, decay: float
) -> None:
    g = torch.Generator().manual_seed(n + dk)
    q, k, v, gate, beta = _inputs(n, kh, heads, dk, dv, dtype, dtype, g)
    args = (q, k, v, (gate.float() * decay / 2).to(dtype), beta)
    state = torch.randn(heads, dk, dv, generator=g)
    ref_state = state.clone()
    got = _prefill(args, state, chunk)
    want = deltanet_prefill_reference(*args, ref_state)
    assert got.dtype == torch.float32 and got.shape == (n, heads, dv)
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(state, ref_state, **TOL)


def test_prefill_reference_is_the_model_chunked_form() -> None:
    """The token-by-token reference equals the model's `delta_rule_chunked` (64-token chunks,
    q and k repeated as the layer does): the prefill kernel computes what the model does."""
    g = torch.Generator().manual_seed(8)
    n, kh, heads, dk, dv = 70, 2, 4, 16, 8
    args = _inputs(n, kh, heads, dk, dv, torch.float32, torch.bfloat16, g)
    state = torch.randn(heads, dk, dv, generator=g)
    model_state = state.clone()
    got = deltanet_prefill_reference(*args, state)
    q, k, v, gate, beta = args
    o, st = dn.delta_rule_chunked(
        q.repeat_interleave(2, dim=1), k.repeat_interleave(2, dim=1), v, gate, beta, model_state
    )
    torch.testing.assert_close(got, o, **TOL)
    torch.testing.assert_close(state, st, **TOL)


def test_prefill_then_decode_continue_the_state() -> None:
    """A prompt through the prefill kernel, then decode steps through the decode kernel on the
    same state tensor: the model's chunked form then its recurrence give the same."""
    g = torch.Generator().manual_seed(12)
    kh, heads, dk, dv = 1, 2, 16, 16
    ssm = torch.zeros(2, heads, dk, dv)
    ref = torch.zeros(heads, dk, dv)
    prompt = _inputs(21, kh, heads, dk, dv, torch.float32, torch.float32, g)
    got = [_prefill(prompt, ssm[1], 16)]
    q, k, v, gate, beta = prompt
    rep = heads // kh
    o, ref = dn.delta_rule_chunked(
        q.repeat_interleave(rep, 1), k.repeat_interleave(rep, 1), v, gate, beta, ref
    )
    want = [o]
    for _ in range(3):
        step = _inputs(1, kh, heads, dk, dv, torch.float32, torch.float32, g)
        got.append(_kernel(step, [ssm], 1))
        q, k, v, gate, beta = step
        o, ref = dn.delta_rule_recurrent(
            q.repeat_interleave(rep, 1), k.repeat_interleave(rep, 1), v, gate, beta, ref
        )
        want.append(o)
    torch.testing.assert_close(torch.cat(got), torch.cat(want), **TOL)
    torch.testing.assert_close(ssm[1], ref, **TOL)
    assert not ssm[0].any()


def test_bad_inputs_are_refused() -> None:
    g = torch.Generator().manual_seed(2)
    args = _inputs(2, 2, 4, 8, 8, torch.float32, torch.float32, g)
    states = _states(2, 1, 4, 8, 8, g)
    with pytest.raises(ValueError, match="2 states for 1 rows|states for"):
        deltanet_decode_reference(*(t[:1] for t in args), states, 0)
    with pytest.raises(ValueError, match="layer 1"):
        deltanet_decode_reference(*args, states, 1)
    with pytest.raises(ValueError, match="contiguous fp32"):
        state_pointers([states[0], states[1].double()])
    with pytest.raises(ValueError, match="contiguous fp32"):
        state_pointers([states[0], states[1].transpose(2, 3)])


def test_fake_impl_on_the_fake_device() -> None:
    """Under FakeTensorMode the op gives o's shape on the device and launches nothing; a state
    table on the host is refused as a launch would be."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=False):
        dev = torch.device("cuda")
        qk = torch.empty(5, 16, 128, device=dev)
        v = torch.empty(5, 32, 128, device=dev)
        gb = torch.empty(5, 32, device=dev)
        states = [torch.empty(48, 32, 128, 128, device=dev) for _ in range(5)]
        table = state_pointers(states)  # no data pointer read (fake tensors hold no memory)
        assert table.shape == (5,) and table.dtype == torch.int64
        ptrs = torch.empty(5, dtype=torch.int64, device=dev)
        out = ops.deltanet_decode(qk, qk, v, gb, gb.bfloat16(), states, ptrs, 47)
        assert out.shape == (5, 32, 128) and out.dtype == torch.float32
        assert out.device.type == "cuda"
        with pytest.raises(RuntimeError, match="different devices"):
            ops.deltanet_decode(qk, qk, v, gb, gb, states, ptrs.cpu(), 0)


# -- the layer --------------------------------------------------------------------------------


@pytest.fixture
def kernel_knob(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The setting at triton, the kernel allowed on CPU tensors (the interpreter)."""
    monkeypatch.setattr(dn, "_KERNEL_DEVICES", ("cuda", "cpu"))
    old = attn.set_decode_kernel("triton")
    yield
    attn.set_decode_kernel(old)


def _layer(tmp_path: Path, family: str) -> tuple[ModelConfig, dn.GatedDeltaNet]:
    from tiny_models import make_tiny

    make_tiny(family, tmp_path, seed=1)
    cfg = read_config(tmp_path)
    layer = dn.GatedDeltaNet(cfg, 1, torch.float32)
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return cfg, layer


def _batch(cfg: ModelConfig, lengths: list[int], seed: int) -> ForwardBatch:
    g = torch.Generator().manual_seed(seed)
    chunks, row = [], 0
    for n in lengths:
        st = dn.GatedDeltaNet.new_state(cfg, 2)
        st.conv.copy_(torch.randn(st.conv.shape, generator=g))
        st.ssm.copy_(torch.randn(st.ssm.shape, generator=g) * 0.1)
        chunks.append(SeqChunk(row, n, 7 if n == 1 else 0, SeqState(recurrent=st)))
        row += n
    return ForwardBatch(
        token_ids=torch.zeros(row, dtype=torch.long), positions=torch.zeros(row, dtype=torch.long),
        chunks=chunks, kv=None, moe=None, logits_rows=torch.zeros(0, dtype=torch.long),  # type: ignore[arg-type]
    )  # fmt: skip


def _copy(batch: ForwardBatch) -> ForwardBatch:
    chunks = []
    for ch in batch.chunks:
        assert ch.state.recurrent is not None
        st = SeqState(recurrent=ch.state.recurrent.clone())
        chunks.append(SeqChunk(ch.start, ch.length, ch.context_len, st))
    return ForwardBatch(batch.token_ids, batch.positions, chunks, batch.kv, batch.moe,
                        batch.logits_rows)  # fmt: skip


def _assert_states_close(batch: ForwardBatch, ref: ForwardBatch, rtol: float, atol: float) -> None:
    """Recurrent states within the tolerance, conv states equal."""
    for a, b in zip(batch.chunks, ref.chunks, strict=True):
        sa, sb = a.state.recurrent, b.state.recurrent
        assert sa is not None and sb is not None
        torch.testing.assert_close(sa.ssm, sb.ssm, rtol=rtol, atol=atol)
        assert torch.equal(sa.conv, sb.conv)


@pytest.mark.parametrize(
    "family,lengths", [("qwen3_5_moe", [1, 1, 1]), ("qwen3_next", [1, 5, 1, 1])], ids=str
)
def test_layer_decode_rows_go_through_the_kernel(
    tmp_path: Path, kernel_knob: None, monkeypatch: pytest.MonkeyPatch, family: str,
    lengths: list[int],
) -> None:  # fmt: skip
    """With the setting at triton the layer's decode rows take one op call for the batch, a
    prefill chunk beside them one call of the prefill op, and give the torch path's outputs,
    conv and recurrent states."""
    cfg, layer = _layer(tmp_path, family)
    assert layer.vh > layer.kh  # the GQA layout the kernel indexes itself
    batch = _batch(cfg, lengths, seed=len(lengths))
    ref = _copy(batch)
    x = torch.randn(sum(lengths), cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    calls: list[int] = []
    prefills: list[int] = []
    real, real_prefill = ops.deltanet_decode, ops.deltanet_prefill

    def counting(*args):  # type: ignore[no-untyped-def]
        calls.append(args[0].shape[0])
        return real(*args)

    def counting_prefill(*args):  # type: ignore[no-untyped-def]
        prefills.append(args[0].shape[0])
        return real_prefill(*args)

    monkeypatch.setattr(ops, "deltanet_decode", counting)
    monkeypatch.setattr(ops, "deltanet_prefill", counting_prefill)
    got = layer(x, batch)
    assert calls == [sum(n == 1 for n in lengths)]
    assert prefills == [n for n in lengths if n > 1]
    attn.set_decode_kernel("torch")
    want = layer(x, ref)
    assert len(calls) == 1 and len(prefills) == len([n for n in lengths if n > 1])
    torch.testing.assert_close(got, want, **TOL)
    _assert_states_close(batch, ref, **TOL)


def test_layer_on_the_host_keeps_the_torch_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The setting changes nothing for host tensors (the cpu backend): no kernel there, and
    the torch path's outputs and states, bit for bit."""
    cfg, layer = _layer(tmp_path, "qwen3_5_moe")
    batch = _batch(cfg, [1, 3, 1], seed=1)
    ref = _copy(batch)
    x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    monkeypatch.setattr(ops, "deltanet_decode", None)  # a call would fail
    monkeypatch.setattr(ops, "deltanet_prefill", None)
    old = attn.set_decode_kernel("triton")
    try:
        got = layer(x, batch)
        attn.set_decode_kernel("torch")
        want = layer(x, ref)
    finally:
        attn.set_decode_kernel(old)
    assert torch.equal(got, want)
    _assert_states_close(batch, ref, rtol=0.0, atol=0.0)


# -- the fake CUDA tier -----------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_fake_cuda_engine_decodes_through_the_kernel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, family: str
) -> None:
    """The setting on the fake card: every DeltaNet layer runs each prompt through the prefill
    op and calls the decode op (their fake impls) once per decode step for both sequences; the step still reads the host once and makes no
    blocking host -> device copy; the state table crosses in one more asynchronous copy per
    step (beside the runner's metadata and the attention kernel's tables)."""
    from tiny_models import make_tiny

    from freetokend import LLM
    from freetokend.engine.sampler import SamplingParams

    make_tiny(family, tmp_path, seed=3)
    calls: list[int] = []
    real = ops.deltanet_decode

    def counting(*args):  # type: ignore[no-untyped-def]
        calls.append(args[0].shape[0])
        return real(*args)

    prefills: list[int] = []
    real_prefill = ops.deltanet_prefill

    def counting_prefill(*args):  # type: ignore[no-untyped-def]
        prefills.append(args[0].shape[0])
        return real_prefill(*args)

    monkeypatch.setattr(ops, "deltanet_decode", counting)
    monkeypatch.setattr(ops, "deltanet_prefill", counting_prefill)
    old = attn.set_decode_kernel("triton")
    llm = LLM(tmp_path, "fused", accelerator="fake-cuda", vram_mib=1024, kv_tokens=512)
    try:
        tr = llm.fake_device.tracker
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        llm.engine.add_request("a", list(range(3, 43)), params)
        llm.engine.add_request("b", list(range(5, 20)), params)
        llm.engine.step()  # the prompts: the prefill op per sequence and layer, no decode row
        assert calls == []
        layers = sum(isinstance(m, dn.GatedDeltaNet) for m in llm.model.modules())
        assert layers > 0
        assert sorted(prefills) == sorted([40, 15] * layers)
        for _ in range(2):
            before, async_before = Counter(tr.syncs.by_kind), tr.async_h2d
            llm.engine.step()
            assert Counter(tr.syncs.by_kind) - before == Counter(d2h=1)
            # the runner's metadata, the attention kernel's tables, the DeltaNet state table
            assert tr.async_h2d - async_before == 3
        assert calls == [2] * (2 * layers)
    finally:
        llm.close()
        attn.set_decode_kernel(old)


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_standin_tokens_equal_with_the_kernel(
    tmp_path: Path, kernel_knob: None, monkeypatch: pytest.MonkeyPatch, family: str
) -> None:
    """The whole model on the CPU stand-in (the device code path), the kernel interpreted for
    every DeltaNet decode row: greedy tokens of two sequences decoding together equal the torch
    path's, and the kernel ran."""
    from tiny_models import make_tiny

    from freetokend import LLM

    make_tiny(family, tmp_path, seed=5)
    prompts = [list(range(3, 16)), list(range(20, 25))]
    calls: list[int] = []
    real = ops.deltanet_decode

    def counting(*args):  # type: ignore[no-untyped-def]
        calls.append(args[0].shape[0])
        return real(*args)

    monkeypatch.setattr(ops, "deltanet_decode", counting)
    kw = dict(max_model_len=64, kv_tokens=256, accelerator="standin")
    got = LLM(tmp_path, "fused", **kw).generate(prompts, max_tokens=5, ignore_eos=True)
    assert 2 in calls
    attn.set_decode_kernel("torch")
    n = len(calls)
    want = LLM(tmp_path, "fused", **kw).generate(prompts, max_tokens=5, ignore_eos=True)
    assert len(calls) == n
    assert got == want
