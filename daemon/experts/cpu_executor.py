"""The native CPU expert executor (extension module `ftnative`, built from native/).

Computes one MoE layer's routed-expert sum on the CPU, straight from the host banks:

    out[t] = sum_k weights[t, k] * expert_{flat_ids[t, k]}(x[t])      (routes with id -1 skipped)

with the same math as `freetokend.experts.banks.moe_reference` (fp32 accumulation). Each distinct
expert's weights are streamed once per call by a persistent pool of pinned worker threads; the
kernels are AVX-512, AVX2 or scalar, picked at run time.

The expert format is read from ``banks.format`` (`freetokend.experts.formats`): "bf16" banks are
fp32 or bf16 floats; "fp8_block", "mxfp4" and "nvfp4" banks are computed straight from their
packed weights and scale banks (``banks.extra``), dequantised inside the kernels' inner loops,
never as a whole expert. Their results equal `moe_reference` over `formats.dequantize_banks`
up to fp32 rounding (summation order; a block's scale applied to its partial sum). Per core they
are compute-bound (~10 Gweights/s on Zen 3 against ~20 for bf16), so they pay off where memory
bandwidth, not core count, limits the bf16 path.

Tensors cross into C++ as raw addresses (`Tensor.data_ptr()`) plus shapes: nothing is copied, so
this wrapper checks dtype, shape, device and contiguity first and keeps the bank tensors alive for
the executor's lifetime.

When the extension is not built, constructing a `CpuExecutor` raises ImportError; callers fall
back to `moe_reference`.
"""

from __future__ import annotations

from typing import Any

import torch

from ..runtime import cpu_isa
from .banks import ActivationSpec, ExpertBanks
from .formats import get_format

_native: Any
_import_error: ImportError | None
try:
    import ftnative as _native  # type: ignore[import-not-found,no-redef]

    _import_error = None
except ImportError as e:  # extension not built: callers use the torch reference
    _native = None
    _import_error = e

# "avx512bf16": avx512 whose bf16 banks take the vdpbf16ps kernels (x and each act row rounded to
# bf16, fp32 sums); opt-in: "auto" keeps the fp32-activation path.
ISAS = ("auto", "avx512bf16", "avx512", "avx2", "scalar")
# The AVX-512 kernel bodies on emulated 16-lane vectors (slow, any CPU): lets the tests cover the
# AVX-512 code geometry on machines without AVX-512. Never picked by "auto".
# "emubf16": the bf16-dot contracts in plain C++ (the executor's bf16 layouts on any CPU).
TEST_ISAS = ("emu512", "emubf16")
_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1}
# Quantised expert formats the native kernels compute (the `qformat` codes of `ftnative`).
QUANT_FORMATS = {"fp8_block": 0, "mxfp4": 1, "nvfp4": 2}
_SCALE_BANKS = ("gate_up_scale", "down_scale", "gate_up_global", "down_global")


def available() -> bool:
    """True when the `ftnative` extension is importable."""
    return _native is not None


def supported_isas() -> list[str]:
    """ISA paths this CPU can run, best first (empty when the extension is not built)."""
    return list(_native.supported_isas()) if _native is not None else []


def _require_native() -> None:
    if _native is None:
        raise ImportError(
            "the native CPU expert executor (extension module `ftnative`) is not built; "
            "build it with `pip install -e .` (needs a C++17 compiler and pybind11), or use "
            "freetokend.experts.banks.moe_reference"
        ) from _import_error


def _check_bank(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got {t.device}")
    if t.dtype not in _DTYPE_CODE:
        raise TypeError(f"{name} must be float32 or bfloat16, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_quant_banks(banks: ExpertBanks) -> tuple[int, int, int]:
    """Checks packed weights and scale banks against the format's schema -> (N, H, I)."""
    if banks.format not in QUANT_FORMATS:
        get_format(banks.format)  # unknown: the error lists the known formats
        raise ValueError(f"the native executor cannot compute expert format {banks.format!r}")
    if banks.gate_up.dim() != 3 or banks.down.dim() != 3:
        raise ValueError("gate_up must be [N, 2I, *] and down [N, H, *]")
    n, inter, h = banks.gate_up.shape[0], banks.gate_up.shape[1] // 2, banks.down.shape[1]
    specs = get_format(banks.format).specs(h, inter, torch.float32)  # raises on misfit dims
    tensors = {"gate_up": banks.gate_up, "down": banks.down, **banks.extra}
    if set(tensors) != set(specs):
        raise ValueError(
            f"{banks.format} banks must be {sorted(specs)}, got {sorted(tensors)} "
            "(scale banks go in ExpertBanks.extra)"
        )
    for name, (shape, dtype) in specs.items():
        t = tensors[name]
        if t.device.type != "cpu" or t.dtype != dtype:
            raise TypeError(f"{name} must be a CPU {dtype} tensor, got {t.dtype} on {t.device}")
        if tuple(t.shape) != (n, *shape):
            raise ValueError(f"{name} must have shape {[n, *shape]}, got {list(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    return int(n), int(h), int(inter)


def _check_banks(banks: ExpertBanks) -> tuple[int, int, int, torch.dtype]:
    """Checks every bank of ``banks`` -> (N, H, I, bias dtype)."""
    if banks.format != "bf16":
        n, h, inter = _check_quant_banks(banks)
    else:
        if banks.gate_up.dim() != 3 or banks.down.dim() != 3:
            raise ValueError("gate_up must be [N, 2I, H] and down [N, H, I]")
        n, two_i, h = (int(d) for d in banks.gate_up.shape)
        inter = two_i // 2
        _check_bank("gate_up", banks.gate_up, (n, 2 * inter, h))
        _check_bank("down", banks.down, (n, h, inter))
        if banks.down.dtype != banks.gate_up.dtype:
            raise TypeError("gate_up and down must have the same dtype")
    bias_dtype = torch.float32
    if banks.gate_up_bias is not None:
        _check_bank("gate_up_bias", banks.gate_up_bias, (n, 2 * inter))
        bias_dtype = banks.gate_up_bias.dtype
    if banks.down_bias is not None:
        _check_bank("down_bias", banks.down_bias, (n, h))
        if banks.gate_up_bias is not None and banks.down_bias.dtype != bias_dtype:
            raise TypeError("gate_up_bias and down_bias must have the same dtype")
        bias_dtype = banks.down_bias.dtype
    return n, h, inter, bias_dtype


def _check_input(name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    if t.device.type != "cpu" or t.dtype != dtype:
        raise TypeError(f"{name} must be a CPU {dtype} tensor, got {t.dtype} on {t.device}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


class CpuExecutor:
    """Routed-expert sum of one MoE layer on the CPU, over all experts in `banks`.

    banks    format "bf16": gate_up [N, 2I, H], down [N, H, I] (fp32 or bf16, same dtype);
             format "fp8_block", "mxfp4" or "nvfp4": the packed banks and scale banks of that
             schema (`formats.FORMATS`); optional gate_up_bias [N, 2I] and down_bias [N, H]
             (fp32 or bf16, same dtype); CPU, contiguous
    act      the expert activation (SILU or GPT-OSS clamped SwiGLU), fused before `down`
    threads  worker threads, each pinned to its own physical core; None = one per physical core
    isa      "auto" (best available), or force "avx512bf16", "avx512", "avx2" or "scalar"; forcing
             a path this CPU lacks raises RuntimeError. "avx512bf16" is "avx512" with bf16 banks
             on vdpbf16ps (activations rounded to bf16: see `bf16_dot`); force "avx512" for the
             fp32-activation kernels
    tile_min_tokens  experts with at least this many routes in a call use the tiled (prefill)
             kernel, fewer use the streaming matrix-vector kernel (decode); 12 is the measured
             bf16 crossover on Zen 3 (the tiled kernel pads each expert's tokens to 16s)
    spin_us  how long idle workers spin for the next call before sleeping (they are pinned, so a
             spin takes that core from whatever else runs there); 0, the default, sleeps at
             once. A model's next call to the executor comes a layer later, after the dense
             projections on ftdense's own pool, which a spinning worker slows: with one worker
             per core, a 48-layer model of tiny weights decoded at 3.4-4.4 ms a token at 0 and
             4.6-6.1 ms at 20 us (four paired runs, 2 cores, Zen 4). A sleeping worker wakes in
             ~5-20 us, small next to a real layer's streaming.
    """

    def __init__(
        self,
        banks: ExpertBanks,
        act: ActivationSpec,
        threads: int | None = None,
        isa: str = "auto",
        *,
        tile_min_tokens: int = 12,
        spin_us: int = 0,
    ) -> None:
        _require_native()
        isa = cpu_isa.resolve(isa, supported_isas())  # FREETOKEN_CPU_ISA forces "auto"
        if isa not in ISAS + TEST_ISAS:
            raise ValueError(f"isa must be one of {', '.join(ISAS)}; got {isa!r}")
        if isa in ISAS[1:] and isa not in supported_isas():
            raise RuntimeError(
                f"this CPU cannot run the {isa!r} path; it supports {', '.join(supported_isas())}"
            )
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1 or None, got {threads}")
        if tile_min_tokens < 1:
            raise ValueError(f"tile_min_tokens must be >= 1, got {tile_min_tokens}")
        n, h, inter, bias_dtype = _check_banks(banks)
        quant = banks.format != "bf16"
        self.banks = banks  # keeps the tensors alive: the executor holds their addresses
        self.act = act
        self.hidden_size = int(h)
        self._exec = _native.Executor(
            gate_up=banks.gate_up.data_ptr(),
            down=banks.down.data_ptr(),
            gate_up_bias=0 if banks.gate_up_bias is None else banks.gate_up_bias.data_ptr(),
            down_bias=0 if banks.down_bias is None else banks.down_bias.data_ptr(),
            weight_dtype=0 if quant else _DTYPE_CODE[banks.gate_up.dtype],
            bias_dtype=_DTYPE_CODE[bias_dtype],
            num_flat=int(n),
            hidden=int(h),
            inter=int(inter),
            act=int(act.kind),
            alpha=float(act.alpha),
            limit=float(act.limit),
            threads=threads or 0,
            isa=isa,
            tile_min_tokens=tile_min_tokens,
            spin_us=spin_us,
            qformat=QUANT_FORMATS[banks.format] if quant else -1,
            **{n: banks.extra[n].data_ptr() if n in banks.extra else 0 for n in _SCALE_BANKS},
        )

    @property
    def isa(self) -> str:
        """The ISA path in use ("avx512bf16", "avx512", "avx2" or "scalar"; "emu512", "emubf16"
        in tests)."""
        return str(self._exec.isa)

    @property
    def bf16_dot(self) -> bool:
        """Whether bf16 banks run the bf16-dot kernels (isa "avx512bf16", or "emubf16" in tests):
        x and each act row are rounded to bf16, sums stay fp32."""
        return bool(self._exec.bf16_dot)

    @property
    def threads(self) -> int:
        return int(self._exec.threads)

    def forward(
        self, x: torch.Tensor, flat_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """x [T, H] fp32, flat_ids [T, K] int32 (-1 = skip), weights [T, K] fp32 -> [T, H] fp32.

        Releases the GIL while the workers run. Raises IndexError for ids outside [-1, N).
        """
        if x.dim() != 2 or flat_ids.dim() != 2:
            raise ValueError("x must be [T, H] and flat_ids [T, K]")
        t, k = flat_ids.shape
        _check_input("x", x, torch.float32, (t, self.hidden_size))
        _check_input("flat_ids", flat_ids, torch.int32, (t, k))
        _check_input("weights", weights, torch.float32, (t, k))
        out = torch.empty(t, self.hidden_size, dtype=torch.float32)
        self._exec.forward(
            x.data_ptr(), flat_ids.data_ptr(), weights.data_ptr(), out.data_ptr(), t, k
        )
        return out

    def native_entry(self) -> tuple[int, int]:
        """(function address, executor address) with which another native module runs this
        executor's call on its own thread pool (native/src/executor_bridge.h; the decode step of
        models/layers/cpu_decode.py, on ftdense's pool); valid while this executor lives."""
        return tuple(self._exec.forward_on_entry)  # type: ignore[return-value]

    def forward_addresses(self, x: int, ids: int, w: int, out: int, t: int, k: int) -> None:
        """``forward`` on raw addresses the caller has checked (models/layers/cpu_decode.py):
        x [t, H] fp32, ids [t, k] int32, w [t, k] fp32, out [t, H] fp32."""
        self._exec.forward(x, ids, w, out, t, k)
