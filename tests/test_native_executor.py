"""The native CPU expert executor against the plain-torch reference (`moe_reference`).

Tolerance: both sides accumulate in fp32 but in a different order (SIMD lanes, blocked sums,
per-expert scatter), and the activation uses libm expf instead of torch's exp. With outputs of
order 1 and reductions over at most a few hundred terms, the differences seen are ~1e-6; the
checks use rtol = atol = 1e-4, far below any real bug (a wrong row, lane, bias or clamp shifts
results by >= 1e-2).
"""

from __future__ import annotations

import os
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from native_support import need_isa, single_threaded_reference  # noqa: F401 (autouse fixture)

from freetokend.experts import cpu_executor
from freetokend.experts.banks import Activation, ActivationSpec, ExpertBanks, moe_reference
from freetokend.experts.cpu_executor import CpuExecutor, available, supported_isas
from freetokend.runtime import cpu_isa

pytestmark = pytest.mark.skipif(
    not available(), reason="ftnative extension not built (pip install -e .)"
)

RTOL = ATOL = 1e-4
# emu512 runs the AVX-512 kernel bodies on emulated vectors, so their geometry (16 lanes, bf16
# chunks of 32) is tested even where the CPU lacks AVX-512.
ISAS = ["avx512", "avx2", "scalar", "emu512"]
DTYPES = [torch.float32, torch.bfloat16]
ACTS = {
    "silu": ActivationSpec(Activation.SILU),
    # a small limit so the clamps of GPT-OSS's SwiGLU are exercised with order-1 values
    "gptoss": ActivationSpec(Activation.GPTOSS, alpha=1.702, limit=1.0),
    "gelu_tanh": ActivationSpec(Activation.GELU_TANH),
    # DeepSeek-V4's clamped SwiGLU, clamps binding on order-1 values too
    "swiglu_clamp": ActivationSpec(Activation.SWIGLU_CLAMP, limit=0.5),
}
# tile_min_tokens: 1 = every expert takes the tiled (prefill) kernel, huge = every expert the
# streaming (decode) kernel, 6 = the default mix.
PATHS = {"tiled": 1, "gemv": 1 << 30, "mixed": 6}


def make_banks(
    n: int, h: int, i: int, dtype: torch.dtype, bias: bool, seed: int = 0
) -> ExpertBanks:
    g = torch.Generator().manual_seed(seed)
    return ExpertBanks(
        gate_up=(torch.randn(n, 2 * i, h, generator=g) / h**0.5).to(dtype),
        down=(torch.randn(n, h, i, generator=g) / i**0.5).to(dtype),
        gate_up_bias=(0.3 * torch.randn(n, 2 * i, generator=g)).to(dtype) if bias else None,
        down_bias=(0.3 * torch.randn(n, h, generator=g)).to(dtype) if bias else None,
    )


def make_routes(
    t: int, k: int, n: int, h: int, seed: int = 1, skip: float = 0.2
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [t, h] fp32, flat ids [t, k] int32 with ~`skip` of them -1, weights [t, k] fp32."""
    g = torch.Generator().manual_seed(seed)
    x = 2 * torch.randn(t, h, generator=g)
    ids = torch.randint(0, n, (t, k), generator=g, dtype=torch.int32)
    ids[torch.rand(t, k, generator=g) < skip] = -1
    w = torch.rand(t, k, generator=g)
    return x, ids, w


def check(ex: CpuExecutor, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> None:
    out = ex.forward(x, ids, w)
    ref = moe_reference(x, ids, w, ex.banks, ex.act)
    assert out.shape == ref.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=RTOL, atol=ATOL)


# H = 70 and I = 37 leave tails everywhere: SIMD chunks, row blocks, odd tile inputs.
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("path", list(PATHS))
def test_matches_reference(isa: str, dtype: torch.dtype, act: str, bias: bool, path: str) -> None:
    need_isa(isa)
    n, h, i, k = 12, 70, 37, 4
    ex = CpuExecutor(
        make_banks(n, h, i, dtype, bias), ACTS[act], isa=isa, tile_min_tokens=PATHS[path]
    )
    assert ex.isa == isa
    for t in (1, 3, 16, 70):  # with 12 experts, T = 16 and 70 route many tokens to each
        check(ex, *make_routes(t, k, n, h, seed=t))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_larger_blocks_and_threads(isa: str, dtype: torch.dtype) -> None:
    """Several row blocks per expert in both phases, and more workers than cores."""
    need_isa(isa)
    n, h, i = 16, 256, 160
    banks = make_banks(n, h, i, dtype, bias=True, seed=3)
    for threads in (1, 3):
        ex = CpuExecutor(banks, ACTS["silu"], threads=threads, isa=isa)
        assert ex.threads == threads
        for t in (1, 5, 40):
            check(ex, *make_routes(t, 8, n, h, seed=10 + t))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("path", list(PATHS))
def test_duplicates_and_skips(isa: str, path: str) -> None:
    need_isa(isa)
    n, h, i = 5, 48, 24
    ex = CpuExecutor(
        make_banks(n, h, i, torch.bfloat16, True),
        ACTS["gptoss"],
        isa=isa,
        tile_min_tokens=PATHS[path],
    )
    x, _, w = make_routes(70, 3, n, h)
    same = torch.full((70, 3), 2, dtype=torch.int32)  # every route to one expert, twice per token
    same[:, 1] = -1
    same[5] = 4
    check(ex, x, same, w)
    none = torch.full((70, 3), -1, dtype=torch.int32)  # nothing routed: zeros, not garbage
    assert torch.equal(ex.forward(x, none, w), torch.zeros(70, h))
    ids = torch.randint(0, n, (70, 3), dtype=torch.int32)
    ids[::7] = -1  # some tokens with every route skipped
    out = ex.forward(x, ids, w)
    assert torch.equal(out[::7], torch.zeros_like(out[::7]))
    check(ex, x, ids, w)


def test_auto_isa_and_empty_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cpu_isa.ENV, raising=False)  # "auto" as the CPU picks it (make test-isas)
    ex = CpuExecutor(make_banks(3, 16, 8, torch.float32, False), ACTS["silu"])
    assert ex.isa == supported_isas()[0]
    assert supported_isas()[-1] == "scalar"
    x, ids, w = make_routes(0, 2, 3, 16)
    assert ex.forward(x, ids, w).shape == (0, 16)


def test_concurrent_callers() -> None:
    """Calls from several Python threads are serialised, each gets its own correct result."""
    n, h, i = 8, 64, 32
    # the best fp32-activation path: "avx512bf16" rounds x to bf16 (test_native_bf16dot.py)
    isa = next(i for i in supported_isas() if i != "avx512bf16")
    ex = CpuExecutor(make_banks(n, h, i, torch.bfloat16, False), ACTS["silu"], isa=isa)
    batches = [make_routes(t, 4, n, h, seed=t) for t in (1, 2, 9, 30)]
    results: dict[int, torch.Tensor] = {}

    def run(j: int) -> None:
        for _ in range(5):
            results[j] = ex.forward(*batches[j])

    threads = [threading.Thread(target=run, args=(j,)) for j in range(len(batches))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for j, (x, ids, w) in enumerate(batches):
        ref = moe_reference(x, ids, w, ex.banks, ex.act)
        torch.testing.assert_close(results[j], ref, rtol=RTOL, atol=ATOL)


def test_validation_errors() -> None:
    banks = make_banks(4, 32, 16, torch.float32, False)
    with pytest.raises(ValueError, match="isa"):
        CpuExecutor(banks, ACTS["silu"], isa="neon")
    missing = [isa for isa in ISAS[:3] if isa not in supported_isas()]
    if missing:
        with pytest.raises(RuntimeError, match="cannot run"):
            CpuExecutor(banks, ACTS["silu"], isa=missing[0])
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        CpuExecutor(ExpertBanks(banks.gate_up.half(), banks.down.half()), ACTS["silu"])
    with pytest.raises(TypeError, match="same dtype"):
        CpuExecutor(ExpertBanks(banks.gate_up, banks.down.bfloat16()), ACTS["silu"])
    with pytest.raises(ValueError, match="shape"):
        CpuExecutor(ExpertBanks(banks.gate_up, banks.down[:, :, :8].contiguous()), ACTS["silu"])
    with pytest.raises(ValueError, match="contiguous"):
        CpuExecutor(
            ExpertBanks(banks.gate_up.transpose(1, 2).contiguous().transpose(1, 2), banks.down),
            ACTS["silu"],
        )
    ex = CpuExecutor(banks, ACTS["silu"])
    x, ids, w = make_routes(3, 2, 4, 32)
    with pytest.raises(TypeError, match="int32"):
        ex.forward(x, ids.long(), w)
    with pytest.raises(TypeError, match="float32"):
        ex.forward(x.double(), ids, w)
    with pytest.raises(ValueError, match="contiguous"):
        ex.forward(x, ids.t().contiguous().t(), w)
    with pytest.raises(ValueError, match="shape"):
        ex.forward(x[:, :16].contiguous(), ids, w)
    with pytest.raises(IndexError, match="outside"):
        ex.forward(x, torch.tensor([[0, 4]] * 3, dtype=torch.int32), w)
    with pytest.raises(IndexError, match="outside"):
        ex.forward(x, torch.tensor([[0, -2]] * 3, dtype=torch.int32), w)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_raises() -> None:
    """The workers stay in the parent; a child must get an error, not a hang."""
    ex = CpuExecutor(make_banks(2, 16, 8, torch.float32, False), ACTS["silu"])
    batch = make_routes(2, 1, 2, 16)
    ex.forward(*batch)
    pid = os.fork()
    if pid == 0:  # child: exit 0 only if the call raised the fork error
        try:
            ex.forward(*batch)
        except RuntimeError as e:
            os._exit(0 if "forked" in str(e) else 2)
        os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    check(ex, *batch)  # the parent is unaffected


def test_missing_extension_raises_import_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_executor, "_native", None)
    assert not cpu_executor.available() and cpu_executor.supported_isas() == []
    with pytest.raises(ImportError, match="moe_reference"):
        CpuExecutor(make_banks(2, 8, 4, torch.float32, False), ACTS["silu"])


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 6),
    h=st.integers(1, 80),
    i=st.integers(1, 50),
    t=st.integers(0, 24),
    k=st.integers(1, 4),
    bf16=st.booleans(),
    act=st.sampled_from(list(ACTS)),
    bias=st.booleans(),
    tile_min=st.integers(1, 8),
    isa=st.sampled_from(ISAS),
    seed=st.integers(0, 2**16),
)
def test_random_shapes(
    n: int,
    h: int,
    i: int,
    t: int,
    k: int,
    bf16: bool,
    act: str,
    bias: bool,
    tile_min: int,
    isa: str,
    seed: int,
) -> None:
    if isa != "emu512" and isa not in supported_isas():
        isa = "scalar"
    dtype = torch.bfloat16 if bf16 else torch.float32
    ex = CpuExecutor(
        make_banks(n, h, i, dtype, bias, seed),
        ACTS[act],
        threads=2,
        isa=isa,
        tile_min_tokens=tile_min,
    )
    check(ex, *make_routes(t, k, n, h, seed=seed + 1, skip=0.3))
