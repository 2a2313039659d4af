"""The native dense projection (`ftdense`) against its plain-torch reference, and Linear's dispatch.

Tolerance: both sides compute in fp32 on the same bf16-rounded inputs, in a different summation
order; with weights scaled so outputs are of order 1 and at most a few thousand terms per dot
product, differences are ~1e-6, so rtol = atol = 1e-4 (a wrong row, token, lane or tail shifts
results by >= 1e-2).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from freetokend.models.layers.common import Linear, project
from freetokend.native import dense_native

pytestmark = pytest.mark.skipif(
    not dense_native.available(), reason="ftdense extension not built (pip install -e .)"
)

RTOL = ATOL = 1e-4
# emu512 runs the AVX-512 kernel bodies on emulated vectors (any CPU): covers their geometry.
ISAS = ["avx512", "avx2", "scalar", "emu512"]
# T < 8 takes the gemv kernel (tokens in pairs, then a lone one); T >= 8 the 16-token tiles.
TOKENS = [1, 2, 3, 7, 8, 17, 40]


@pytest.fixture(autouse=True)
def _restore_pool() -> Iterator[None]:
    yield
    dense_native.configure(2)


def _need(isa: str) -> None:
    import ftdense  # type: ignore[import-not-found]

    if isa != "emu512":
        try:
            dense_native.configure(2, isa=isa)
        except ValueError:
            pytest.skip(f"this CPU lacks {isa}")
    else:
        dense_native.configure(2, isa=isa)
    assert ftdense.isa() == isa


def _case(t: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(torch.bfloat16)
    return x, w


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("t", TOKENS)
def test_matches_reference(isa: str, t: int) -> None:
    _need(isa)
    # 300 rows: several gemv tasks (256 rows) and tile tasks (64 rows) plus partial ones;
    # K = 100 leaves a tail after the 16/32-wide gemv steps, K = 33 an odd input in the tiles.
    for n, k in [(300, 100), (5, 2048), (1, 33)]:
        x, w = _case(t, n, k)
        y = dense_native.linear(x, w)
        assert y.dtype == torch.float32 and y.shape == (t, n)
        torch.testing.assert_close(y, dense_native.linear_reference(x, w), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_thread_counts_agree(threads: int) -> None:
    dense_native.configure(threads)
    x, w = _case(9, 1000, 256, seed=3)
    ref = dense_native.linear_reference(x, w)
    for rows in (1, 9):  # gemv and tile paths
        torch.testing.assert_close(
            dense_native.linear(x[:rows], w), ref[:rows], rtol=RTOL, atol=ATOL
        )


def test_input_is_rounded_to_bf16_like_torch() -> None:
    """x.to(bf16) happens before the product, as in F.linear(x.bfloat16(), w)."""
    x = torch.full((1, 64), 1.0 + 2.0**-10)  # rounds to 1.0 in bf16
    w = torch.ones(1, 64, dtype=torch.bfloat16)
    assert dense_native.linear(x, w).item() == 64.0


def test_bias_and_bf16_input() -> None:
    x, w = _case(3, 70, 64, seed=5)
    b = torch.randn(70).to(torch.bfloat16)
    y = dense_native.linear(x.to(torch.bfloat16), w, b)
    torch.testing.assert_close(y, dense_native.linear_reference(x, w, b), rtol=RTOL, atol=ATOL)


def test_shape_mismatch_raises() -> None:
    x, w = _case(1, 4, 32)
    with pytest.raises(ValueError):
        dense_native.linear(x[:, :16], w)


@settings(max_examples=25, deadline=None)
@given(
    t=st.integers(1, 20),
    n=st.integers(1, 70),
    k=st.integers(1, 200),
    seed=st.integers(0, 1000),
)
def test_random_shapes(t: int, n: int, k: int, seed: int) -> None:
    x, w = _case(t, n, k, seed)
    torch.testing.assert_close(
        dense_native.linear(x, w), dense_native.linear_reference(x, w), rtol=RTOL, atol=ATOL
    )


@pytest.mark.parametrize("t", [1, 12])
def test_linear_module_dispatch(t: int) -> None:
    """Linear with a bf16 weight takes the native path; its result matches torch's bf16 linear up
    to torch's bf16 output rounding (2^-8 relative)."""
    lin = Linear(96, 48, torch.bfloat16, bias=True)
    x, w = _case(t, 48, 96, seed=7)
    with torch.no_grad():
        lin.weight.copy_(w)
        lin.bias.copy_(torch.linspace(-1, 1, 48))  # type: ignore[union-attr]
    assert dense_native.usable(x, lin.weight)
    y = lin(x)
    torch_path = F.linear(x.to(torch.bfloat16), w, lin.bias).float()
    torch.testing.assert_close(y, torch_path, rtol=2**-7, atol=2**-7)
    torch.testing.assert_close(
        y, dense_native.linear_reference(x, w, lin.bias), rtol=RTOL, atol=ATOL
    )


def test_fp32_weights_stay_on_torch() -> None:
    x = torch.randn(2, 16)
    assert not dense_native.usable(x, torch.randn(4, 16))
    assert not dense_native.usable(x.unsqueeze(0), torch.randn(4, 16).bfloat16())


def test_concurrent_callers() -> None:
    """The GIL is released during a call: callers on other threads run inline, correctly."""
    import threading

    dense_native.configure(2)
    cases = [_case(t, 700, 256, seed=s) for s, t in enumerate([1, 3, 9, 20] * 2)]
    refs = [dense_native.linear_reference(x, w) for x, w in cases]
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for _ in range(20):
                x, w = cases[i]
                torch.testing.assert_close(dense_native.linear(x, w), refs[i], rtol=RTOL, atol=ATOL)
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(cases))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors[0]


@pytest.mark.parametrize("t", [1, 3, 20])
def test_linear_many_matches_each(t: int) -> None:
    """Several weights over one input in one call: each output as if computed alone (gemv and
    tile paths; a 1-row weight; a bias on one of them)."""
    x, wq = _case(t, 300, 96, seed=11)
    _, wk = _case(t, 40, 96, seed=12)
    _, wv = _case(t, 1, 96, seed=13)
    b = torch.randn(40).to(torch.bfloat16)
    ys = dense_native.linear_many(x, [wq, wk, wv], [None, b, None])
    refs = [
        dense_native.linear_reference(x, wq),
        dense_native.linear_reference(x, wk, b),
        dense_native.linear_reference(x, wv),
    ]
    for y, r in zip(ys, refs, strict=True):
        torch.testing.assert_close(y, r, rtol=RTOL, atol=ATOL)


def test_project_native_and_fallback() -> None:
    layers = [Linear(64, n, torch.bfloat16) for n in (32, 16)]
    for m in layers:
        with torch.no_grad():
            m.weight.copy_(torch.randn_like(m.weight, dtype=torch.float32) / 8)
    x = torch.randn(2, 64)
    for y, m in zip(project(x, layers), layers, strict=True):
        torch.testing.assert_close(y, m(x), rtol=RTOL, atol=ATOL)
    mixed = [layers[0], Linear(64, 8, torch.float32)]
    with torch.no_grad():
        mixed[1].weight.copy_(torch.randn(8, 64))
    assert not dense_native.weight_usable(mixed[1].weight)
    for y, m in zip(project(x, mixed), mixed, strict=True):
        torch.testing.assert_close(y, m(x), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("shape", [(1, 2048), (3, 32, 128), (5, 7), (2, 0, 16)])
def test_rms_norm_matches_torch(shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, generator=g) * 3
    scale = torch.randn(shape[-1], generator=g)
    assert dense_native.rms_norm_usable(x, scale)
    y = dense_native.rms_norm(x, scale, 1e-6)
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * scale
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    strided = x.transpose(0, -1)  # not contiguous: copied first
    torch.testing.assert_close(
        dense_native.rms_norm(strided, torch.ones(strided.shape[-1]), 1e-6),
        strided * torch.rsqrt(strided.pow(2).mean(-1, keepdim=True) + 1e-6),
        rtol=1e-5,
        atol=1e-5,
    )


def test_rms_norm_module_matches_formula() -> None:
    from freetokend.models.layers.common import RMSNorm

    for offset in (False, True):
        norm = RMSNorm(64, 1e-6, torch.bfloat16, offset)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(64))
        x = torch.randn(4, 64)
        w = norm.weight.float()
        ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + w if offset else w)
        torch.testing.assert_close(norm(x), ref, rtol=1e-5, atol=1e-5)
