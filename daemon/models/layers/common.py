"""Small shared pieces: parameters allocated without initialisation, linear, RMSNorm.

The residual stream is fp32; weights stay in the checkpoint's dtype and each projection casts its
input to that dtype (the loader fills every parameter, so `torch.empty` never leaks garbage).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ...formats.gguf_dequant import dequantize
from ...native import dense_native, qlinear_native


def param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Weight(nn.Module):
    """A module holding one parameter named ``weight`` (keeps checkpoint names: ``conv1d.weight``,
    ``embed_tokens.weight``)."""

    def __init__(self, *shape: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = param(*shape, dtype=dtype)


class Embedding(Weight):
    """The token embedding ``weight`` [vocab, hidden], or a GGUF file's embedding kept in its
    blocks (``keep_blocks``): ``blocks`` [vocab, row bytes] uint8 of a type ``gguf_dequant``
    dequantizes, ``weight`` then empty (its dtype kept: the one rows are rounded to), and rows
    dequantized when first looked up (``fill``, as llama.cpp's get_rows reads the quantized
    tensor) into ``table`` [vocab, hidden], whose pages only the rows written take: the load
    dequantizes nothing (a second of CPU and 200 MB for a 50k vocabulary of hidden 2048), and a
    step whose tokens were all seen before reads ``table`` as it would the whole table (the
    native decode path's gather included: ``cpu_decode.HeadPlan``). Each row is bit for bit the
    row of the table dequantized whole and cast (blocks dequantize independently)."""

    def __init__(self, vocab: int, hidden: int, dtype: torch.dtype) -> None:
        super().__init__(vocab, hidden, dtype=dtype)
        self.hidden = hidden
        self.blocks: torch.Tensor | None = None
        self.block_type = ""
        self.table = torch.empty(0, dtype=dtype)  # blocks only
        self._filled: set[int] = set()  # rows of ``table`` written (blocks only)

    def keep_blocks(self, raw: torch.Tensor, type_name: str) -> None:
        """Holds the file's rows ``raw`` [vocab, row bytes] (uint8, contiguous) of ``type_name``
        in place of the float table."""
        assert raw.dtype == torch.uint8 and raw.dim() == 2 and raw.is_contiguous()
        dtype = self.weight.dtype
        self.blocks, self.block_type = raw, type_name
        self.table = torch.empty(raw.shape[0], self.hidden, dtype=dtype)  # never read unwritten
        self._filled = set()
        self.weight = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)

    def fill(self, ids: torch.Tensor) -> None:
        """Writes the rows ``ids`` (int64) not written before into ``table`` (blocks only; an id
        outside the vocabulary raises as indexing raises)."""
        if self.blocks is None:
            return
        seen = self._filled
        look = ids.tolist() if ids.numel() <= 64 else ids.unique().tolist()
        new = sorted({i for i in look if i not in seen})
        if not new:
            return
        idx = torch.tensor(new, dtype=torch.int64)
        vals = dequantize(self.blocks.index_select(0, idx), self.block_type)
        self.table.index_copy_(0, idx, vals.to(self.table.dtype))
        seen.update(new)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows ``ids`` (int64) as fp32 [n, hidden]."""
        if self.blocks is None:
            return self.weight.index_select(0, ids).float()
        self.fill(ids)
        return self.table.index_select(0, ids).float()


class Linear(nn.Module):
    """y = x W^T (+ b); output fp32.

    bf16 weights on the CPU go through the native projection (`dense_native`, fp32 accumulation
    of the bf16-rounded input): torch's CPU bf16 matmul is ~20x slower at decode batch sizes.
    """

    # the parameter a GGUF loader may keep in the file's blocks (``qweight``; gguf_loader)
    block_param = "weight"

    def __init__(self, d_in: int, d_out: int, dtype: torch.dtype, bias: bool = False) -> None:
        super().__init__()
        self.weight = param(d_out, d_in, dtype=dtype)
        self.bias = param(d_out, dtype=dtype) if bias else None
        # GGUF block rows once quantized (models/dense_quant.py); `weight` is then released.
        self.qweight: qlinear_native.QuantWeight | None = None

    def quantize_(self, fmt: str) -> None:
        """Replaces the float weight by ``fmt`` blocks (formats/gguf_blocks.py) computed by the native
        integer-dot kernels; `weight` becomes an empty placeholder of the same dtype."""
        w = self.weight.detach()
        self.qweight = qlinear_native.QuantWeight.from_float(w.float(), fmt)
        self.weight = nn.Parameter(torch.empty(0, dtype=w.dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None:
            return _quant_forward(x, self.qweight, self.bias)
        w = self.weight
        if dense_native.usable(x, w):
            return dense_native.linear(x, w, self.bias)
        return F.linear(x.to(w.dtype), w, self.bias).float()


def widen_kept_blocks(
    model: nn.Module, device: torch.device | None = None, dtype: torch.dtype | None = None
) -> None:
    """Every weight a GGUF load kept in its blocks outside `Linear` (a module's ``block_param``
    with a ``qweight``: DeepSeek-V4's grouped o_a_proj and hyper-connection mixes; MLA's kv_b
    parts, through the module's ``widen_blocks``) dequantized back into its float parameter on
    ``device``, in ``dtype`` (a module's ``block_dtype`` first, else the placeholder's): for the
    paths that read float weights only (the device placement, FTW folders). `Linear`'s own
    ``qweight`` is left to them."""
    for m in model.modules():
        widen = getattr(m, "widen_blocks", None)
        if widen is not None:
            widen(device, dtype)
        qw = getattr(m, "qweight", None)
        if qw is None or isinstance(m, Linear):
            continue
        attr: str = getattr(m, "block_param")  # noqa: B009 (a Module attribute, untyped)
        dt = getattr(m, "block_dtype", None) or dtype or getattr(m, attr).dtype
        setattr(m, attr, nn.Parameter(qw.dequantize(device).to(dt), requires_grad=False))
        setattr(m, "qweight", None)  # noqa: B010


def block_linear(
    x: torch.Tensor, qw: qlinear_native.QuantWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [T, K] @ qw^T (+ bias) -> [T, N] fp32: a weight held in GGUF blocks, computed as
    `Linear` computes its ``qweight``."""
    return _quant_forward(x.contiguous(), qw, bias)


def _quant_forward(
    x: torch.Tensor, qw: qlinear_native.QuantWeight, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [T, K] -> [T, N] fp32 with quantized weights: native integer dot products on the CPU,
    else (no extension, another device) the dequantized matrix."""
    if x.device.type == "cpu" and x.dim() == 2 and qlinear_native.available():
        return qlinear_native.qlinear(x, qw, bias)
    w = qw.dequantize().to(x.device)
    return F.linear(x.float(), w, None if bias is None else bias.float())


def project(x: torch.Tensor, layers: Sequence[Linear]) -> list[torch.Tensor]:
    """[layer(x) for layer in layers]; when every weight takes the native path, in one native
    call (one pool job, the input prepared once: q/k/v of attention, gate/up of an MLP)."""
    qws = [m.qweight for m in layers]
    if x.device.type == "cpu" and x.dim() == 2 and qlinear_native.available():
        if all(q is not None for q in qws):  # the input is quantized once for all of them
            return qlinear_native.qlinear_many(x, qws, [m.bias for m in layers])  # type: ignore[arg-type]
    if any(q is not None for q in qws):
        return [m(x) for m in layers]
    if dense_native.input_usable(x) and all(dense_native.weight_usable(m.weight) for m in layers):
        return dense_native.linear_many(x, [m.weight for m in layers], [m.bias for m in layers])
    return [m(x) for m in layers]


class RMSNorm(nn.Module):
    """RMSNorm in fp32; ``offset`` selects the (1 + w) form of Qwen3.5 / Qwen3-Next."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, offset: bool = False) -> None:
        super().__init__()
        self.weight = param(dim, dtype=dtype)
        self.eps = eps
        self.offset = offset
        self._scale: torch.Tensor | None = None  # fp32 (1 +) w, rebuilt when the weight changes
        self._scale_key: tuple[int, int, torch.device] | None = None

    def _fp32_scale(self) -> torch.Tensor:
        """The fp32 multiplier, cached: converting it every call costs an op per norm per layer."""
        w = self.weight
        try:
            # the storage's identity, not its data pointer (a fake device tensor has none)
            key = (w.untyped_storage()._cdata, w._version, w.device)
        except RuntimeError:  # an inference tensor has no version counter: do not cache
            key = None
        if key is None or key != self._scale_key or self._scale is None:
            # a copy even for fp32 weights: an alias would pin the weight (moving the module
            # between devices swaps parameters, which needs them unshared)
            scale = w.to(torch.float32, copy=True)
            self._scale = 1.0 + scale if self.offset else scale
            self._scale_key = key
        return self._scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x * rsqrt(mean(x^2) + eps) * scale, in fp32: natively on the CPU, else one torch op.
        xf, scale = x.float(), self._fp32_scale()
        if dense_native.rms_norm_usable(xf, scale):
            return dense_native.rms_norm(xf, scale, self.eps)
        return F.rms_norm(xf, (x.shape[-1],), scale, self.eps)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """gelu_pytorch_tanh (Gemma)."""
    return F.gelu(x, approximate="tanh")


class DenseMLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)), act SiLU (SwiGLU) or gelu-tanh (Gemma's GeGLU).
    Used for dense layers and shared experts."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, act: str = "silu") -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, inter, dtype)
        self.up_proj = Linear(hidden, inter, dtype)
        self.down_proj = Linear(inter, hidden, dtype)
        self.act = gelu_tanh if act == "gelu_tanh" else F.silu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project(x, (self.gate_proj, self.up_proj))
        return self.down_proj(self.act(gate) * up)


def dtype_of(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
