"""The native CPU executor on quantised expert banks (fp8_block, mxfp4, nvfp4) against the torch
reference: `formats.dequantize_banks` followed by `moe_reference`.

Tolerance: the kernels decode every code to its exact value and compute the same sums as the
reference in fp32, in another order: SIMD lanes and blocked sums, the scale of a block (fp8: 128
inputs, e2m1: one 32/64-input step) applied once to its partial sum instead of to each weight,
nvfp4's global scale folded into the block scales, the per-expert scatter, and libm expf against
torch's exp. Those are fp32 rounding differences of the terms summed, so they are measured
against the output's scale: |out - ref| <= 1e-5 * max|ref| + 1e-5 * |ref|. Worst seen over this
file's cases: 1.0e-6 * max|ref| (fp8, whose random codes span 2^-9..448 and cancel more). A
single row one code step off moves the output by far more (`test_tolerance_sees_one_code`).

Banks are random BYTES (every e4m3 / e2m1 code, subnormal fp8 scales, several e8m0 exponents),
so every code of every format goes through every decode path, not only the ones a quantiser
happens to produce; one test also runs banks made by `quantize_banks`.
"""

from __future__ import annotations

import math

import pytest
import torch
from native_support import need_isa, single_threaded_reference  # noqa: F401 (autouse fixture)

from freetokend.experts import cpu_executor
from freetokend.experts.backend import CpuBackend
from freetokend.experts.banks import Activation, ActivationSpec, ExpertBanks, moe_reference
from freetokend.experts.cpu_executor import CpuExecutor, available
from freetokend.experts.formats import allocate, dequantize_banks, quantize_banks

pytestmark = pytest.mark.skipif(
    not available(), reason="ftnative extension not built (pip install -e .)"
)

TOL = 1e-5
FORMATS = ["fp8_block", "mxfp4", "nvfp4"]
# emu512: the AVX-512 kernel bodies and decode sequences on emulated 16-lane vectors.
ISAS = ["avx512", "avx2", "scalar", "emu512"]
ACTS = {
    "silu": (ActivationSpec(Activation.SILU), False),
    # GPT-OSS with biases; a small limit so both clamps act on order-1 values
    "gptoss": (ActivationSpec(Activation.GPTOSS, alpha=1.702, limit=1.0), True),
    # DeepSeek-V4's clamped SwiGLU (no biases), both clamps binding
    "swiglu_clamp": (ActivationSpec(Activation.SWIGLU_CLAMP, limit=0.5), False),
}
PATHS = {"tiled": 1, "gemv": 1 << 30, "mixed": 6}  # tile_min_tokens
# (H, I) per format. fp8_block: partial 128-blocks in both dims (I = 136: gate and up each
# have a full and a partial block row), tails past the last 16/32-input vector step. e2m1: the
# gemv steps are 64 inputs (AVX2) or 32 (16 lanes); these sizes give full steps plus tails of
# 16, 32 or 48 inputs.
DIMS = {"fp8_block": (200, 136), "mxfp4": (96, 96), "nvfp4": (80, 112)}


def random_banks(fmt: str, n: int, h: int, i: int, bias: bool, seed: int = 0) -> ExpertBanks:
    """Banks of `fmt` filled with random bytes, scaled so that outputs are of order 1-10."""
    g = torch.Generator().manual_seed(seed)
    b = allocate(fmt, n, h, i, torch.float32, bias=bias)

    def fill_bytes(t: torch.Tensor, lo: int, hi: int) -> None:
        t.view(torch.uint8).copy_(torch.randint(lo, hi, t.shape, generator=g, dtype=torch.uint8))

    for name, k in (("gate_up", h), ("down", i)):
        w = getattr(b, name)
        fill_bytes(w, 0, 256)
        s = b.extra[f"{name}_scale"]
        if fmt == "fp8_block":
            u8 = w.view(torch.uint8)
            u8[(u8 & 0x7F) == 0x7F] &= 0xF0  # e4m3 NaN codes are never written
            # random e4m3 bytes have an rms of ~100
            s.copy_(torch.empty(s.shape).uniform_(0.5, 1.5, generator=g) / (100 * math.sqrt(k)))
        elif fmt == "mxfp4":  # e2m1 rms ~3; exponents around 2^-e0, two either side
            e0 = 127 - round(math.log2(3 * math.sqrt(k)))
            fill_bytes(s, e0 - 2, e0 + 3)
        else:  # positive e4m3 scales from subnormal to 448 (rms ~100), global per projection
            fill_bytes(s, 0x01, 0x7F)
            glob = b.extra[f"{name}_global"]
            glob.copy_(
                torch.empty(glob.shape).uniform_(0.5, 1.5, generator=g) / (300 * math.sqrt(k))
            )
    if bias:
        assert b.gate_up_bias is not None and b.down_bias is not None
        b.gate_up_bias.copy_(0.3 * torch.randn(b.gate_up_bias.shape, generator=g))
        b.down_bias.copy_(0.3 * torch.randn(b.down_bias.shape, generator=g))
    return b


def make_routes(
    t: int, k: int, n: int, h: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [t, h], ids [t, k] int32 with ~20% -1 (token 0 routes nowhere when t > 1), weights."""
    g = torch.Generator().manual_seed(seed)
    x = 2 * torch.randn(t, h, generator=g)
    ids = torch.randint(0, n, (t, k), generator=g, dtype=torch.int32)
    ids[torch.rand(t, k, generator=g) < 0.2] = -1
    ids[0, -1] = -1
    if t > 1:
        ids[0] = -1
    return x, ids, torch.rand(t, k, generator=g)


def assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    scale = float(ref.abs().max()) if ref.numel() else 1.0
    torch.testing.assert_close(out, ref, rtol=TOL, atol=TOL * max(scale, 1e-3))


def check(ex: CpuExecutor, deq: ExpertBanks, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    x, ids, w = batch
    out = ex.forward(x, ids, w)
    assert out.shape == (x.shape[0], ex.hidden_size) and out.dtype == torch.float32
    assert_matches(out, moe_reference(x, ids, w, deq, ex.act))
    return out


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("path", list(PATHS))
def test_matches_reference(isa: str, fmt: str, act: str, path: str) -> None:
    need_isa(isa)
    n, k = 8, 4
    h, i = DIMS[fmt]
    spec, bias = ACTS[act]
    banks = random_banks(fmt, n, h, i, bias)
    ex = CpuExecutor(banks, spec, threads=1, isa=isa, tile_min_tokens=PATHS[path])
    assert ex.isa == isa
    deq = dequantize_banks(banks)
    for t in (1, 3, 17):
        out = check(ex, deq, make_routes(t, k, n, h, seed=t))
        if t > 1:
            assert torch.equal(out[0], torch.zeros(h))  # every route of token 0 is -1


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_blocks_straddle_and_threads(isa: str, fmt: str) -> None:
    """fp8: H = 300 gives down-phase row blocks of 48 rows with 1 thread, so a task's rows
    straddle a 128-row scale block; several up-phase row blocks; 2 and 3 workers."""
    need_isa(isa)
    n = 6
    h, i = {"fp8_block": (300, 160), "mxfp4": (128, 160), "nvfp4": (144, 176)}[fmt]
    banks = random_banks(fmt, n, h, i, bias=True, seed=5)
    deq = dequantize_banks(banks)
    for threads in (1, 3):
        ex = CpuExecutor(banks, ACTS["silu"][0], threads=threads, isa=isa, tile_min_tokens=6)
        for t in (2, 20):
            check(ex, deq, make_routes(t, 3, n, h, seed=20 + t))


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_by_quantize_banks(fmt: str) -> None:
    """Banks as the checkpoint loader makes them (quantize_banks of float weights, bf16 biases)."""
    n, h, i = 6, 160, 96
    g = torch.Generator().manual_seed(7)
    dense = ExpertBanks(
        torch.randn(n, 2 * i, h, generator=g) / h**0.5,
        torch.randn(n, h, i, generator=g) / i**0.5,
        (0.3 * torch.randn(n, 2 * i, generator=g)).bfloat16(),
        (0.3 * torch.randn(n, h, generator=g)).bfloat16(),
    )
    banks = quantize_banks(dense, fmt)
    deq = dequantize_banks(banks)
    spec = ACTS["gptoss"][0]
    for isa in ("auto", "scalar"):
        ex = CpuExecutor(banks, spec, threads=2, isa=isa)
        for t in (1, 17):
            check(ex, deq, make_routes(t, 4, n, h, seed=30 + t))
    # and the quantised layer stays near the float one: within the weights' relative errors,
    # which roughly add up (the bound of test_expert_formats.test_quantized_banks_reference_moe)
    x, ids, w = make_routes(17, 4, n, h, seed=47)
    exact = moe_reference(x, ids, w, dense, spec)
    eps = sum(
        float((q - d).norm() / d.norm())
        for q, d in ((deq.gate_up, dense.gate_up), (deq.down, dense.down))
    )
    assert float((ex.forward(x, ids, w) - exact).norm() / exact.norm()) < 1.5 * eps


@pytest.mark.parametrize("fmt", FORMATS)
def test_tolerance_sees_one_code(fmt: str) -> None:
    """The tolerance is tight enough to see one row of one expert one code step off: every
    weight of a down row set to one typical value (fp8 32, e2m1 2), then to the next code."""
    n, (h, i) = 2, DIMS[fmt]
    banks = random_banks(fmt, n, h, i, bias=False, seed=9)
    x, ids, w = make_routes(3, 2, n, h, seed=9)
    ids[:] = 1
    ex = CpuExecutor(banks, ACTS["silu"][0], threads=1, isa="scalar")
    row = banks.down[1].view(torch.uint8)[5]
    base = 0x60 if fmt == "fp8_block" else 0x44  # fp8 0x61 = 36; e2m1 low nibble 5 = 3.0
    row.fill_(base)
    assert_matches(ex.forward(x, ids, w), moe_reference(x, ids, w, dequantize_banks(banks), ex.act))
    out = ex.forward(x, ids, w)
    row.fill_(base + 1)
    ref = moe_reference(x, ids, w, dequantize_banks(banks), ex.act)
    with pytest.raises(AssertionError):
        assert_matches(out, ref)


def test_cpu_backend_runs_quantised_banks_natively() -> None:
    n_layers, n_exp, (h, i) = 2, 4, DIMS["mxfp4"]
    banks = random_banks("mxfp4", n_layers * n_exp, h, i, bias=False, seed=11)
    be = CpuBackend(banks, n_exp, ACTS["silu"][0], threads=1)
    assert be.executor is not None
    x, ids, w = make_routes(5, 2, n_exp, h, seed=11)
    deq = dequantize_banks(banks)
    router_ids = ids.clamp(min=0)  # a router never emits -1; flat ids of layer 1 are ids + 4
    out = be.forward(1, x, router_ids, w)
    assert_matches(out, moe_reference(x, router_ids + n_exp, w, deq, be.act))
    flat = torch.where(ids >= 0, ids + n_exp, ids)
    assert_matches(be.forward_flat(x, flat, w), moe_reference(x, flat, w, deq, be.act))


def test_cpu_backend_fallback_dequantises(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the extension the torch reference runs, on dequantised (not packed) weights."""
    monkeypatch.setattr(cpu_executor, "_native", None)
    h, i = DIMS["nvfp4"]
    banks = random_banks("nvfp4", 3, h, i, bias=True, seed=13)
    be = CpuBackend(banks, 3, ACTS["gptoss"][0])
    assert be.executor is None
    x, ids, w = make_routes(4, 2, 3, h, seed=13)
    ref = moe_reference(x, ids, w, dequantize_banks(banks), be.act)
    torch.testing.assert_close(be.forward_flat(x, ids, w), ref, rtol=0, atol=0)


def test_validation_errors() -> None:
    spec = ACTS["silu"][0]
    banks = random_banks("nvfp4", 2, 32, 32, bias=False)
    missing = ExpertBanks(banks.gate_up, banks.down, format="nvfp4", extra=dict(banks.extra))
    del missing.extra["down_global"]
    with pytest.raises(ValueError, match="down_global"):
        CpuExecutor(missing, spec)
    wrong = ExpertBanks(banks.gate_up, banks.down, format="mxfp4", extra=dict(banks.extra))
    with pytest.raises(ValueError, match="mxfp4 banks must be"):
        CpuExecutor(wrong, spec)
    bad_dtype = ExpertBanks(banks.gate_up, banks.down, format="nvfp4", extra=dict(banks.extra))
    bad_dtype.extra["down_scale"] = banks.extra["down_scale"].view(torch.uint8)
    with pytest.raises(TypeError, match="down_scale"):
        CpuExecutor(bad_dtype, spec)
    bad_shape = ExpertBanks(banks.gate_up, banks.down, format="nvfp4", extra=dict(banks.extra))
    bad_shape.extra["gate_up_scale"] = banks.extra["gate_up_scale"][:, :8].contiguous()
    with pytest.raises(ValueError, match="gate_up_scale must have shape"):
        CpuExecutor(bad_shape, spec)
    with pytest.raises(ValueError, match="multiples of 32"):
        odd = ExpertBanks(
            torch.zeros(2, 32, 24, dtype=torch.uint8),  # H = 48
            torch.zeros(2, 48, 8, dtype=torch.uint8),
            format="mxfp4",
        )
        CpuExecutor(odd, spec)
    with pytest.raises(ValueError, match="unknown expert format"):
        CpuExecutor(ExpertBanks(banks.gate_up, banks.down, format="int3"), spec)
