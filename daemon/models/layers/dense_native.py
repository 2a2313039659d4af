"""Native CPU dense projection (extension module `ftdense`, built from native/dense/).

    y = x.to(bfloat16) @ W^T  with fp32 accumulation and fp32 output,  W [N, K] bf16 (or fp32)

torch's CPU bf16 matmul runs at ~1 GB/s of weights for one token on AVX2 machines (it widens and
repacks per call), and decode is a pure weight stream; `ftdense` runs the expert executor's
bandwidth-bound gemv kernel for a few tokens and its register-tiled kernel for many, on a small
pool in which the calling thread takes part. The reference is `linear_reference` (plain torch).

When the extension is not built, `usable` is False and callers keep the torch path.
"""

from __future__ import annotations

from typing import Any

import torch

_native: Any
try:
    import ftdense as _native  # type: ignore[import-not-found,no-redef]
except ImportError:  # not built: Linear keeps its torch path
    _native = None

# Captured at import, before any decode step narrows torch's threads (engine/runner.py).
_DEFAULT_THREADS = torch.get_num_threads()
_DTYPES = (torch.bfloat16,)  # fp32 weights stay on torch: its fp32 gemv is near bandwidth already


def available() -> bool:
    """True when the `ftdense` extension is importable."""
    return _native is not None


def configure(threads: int | None = None, isa: str = "auto", spin_us: int = 50) -> None:
    """(Re)creates the pool: `threads` participants including the caller (default: torch's
    intra-op thread count at import), the kernels of `isa` ("auto", "avx512", "avx2", "scalar", or
    "emu512" in tests)."""
    if _native is None:
        raise ImportError("the native dense projection (extension module `ftdense`) is not built")
    _native.configure(threads or _DEFAULT_THREADS, spin_us, isa)


def usable(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `linear` takes x [T, K] and w [N, K]: extension built, CPU tensors, a bf16 weight
    that is contiguous, fp32 or bf16 input, no autograd."""
    return (
        _native is not None
        and w.dtype in _DTYPES
        and x.dim() == 2
        and x.dtype in (torch.float32, torch.bfloat16)
        and w.device.type == "cpu"
        and x.device.type == "cpu"
        and w.is_contiguous()
        and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
    )


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] -> [T, N] fp32 = x.to(w.dtype) @ w^T (+ bias), accumulated in fp32. Check
    `usable(x, w)` first."""
    t, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k:
        raise ValueError(f"x has {k} features but the weight expects {w.shape[1]}")
    if not _native.configured():
        configure()
    xf = x.float().contiguous()
    y = torch.empty(t, n, dtype=torch.float32)
    _native.linear(xf.data_ptr(), t, k, w.data_ptr(), True, n, y.data_ptr(), True)
    if bias is not None:
        y += bias
    return y


def linear_reference(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """What `linear` computes, in plain torch (fp32 math on the bf16-rounded input)."""
    y = x.to(w.dtype).float() @ w.float().t()
    return y + bias.float() if bias is not None else y
