"""Routed experts in GGUF block formats on the CPU, with integer dot products (extension
`ftdense`, native/dense/qmoe.h).

    out[t] = sum_k weights[t, k] * expert_{flat_ids[t, k]}(x[t])      (routes with id -1 skipped)

for banks of a block format of ``formats.FORMATS`` ("q8_0", "q4_k", "q4_k/q8_0", ...: raw GGUF
rows, the type of each projection in ``ExpertFormat.block_types``) or of a per-layer one
("layers:q4_k/q6_k*2,q4_k,...", ``formats.layered_format``: each layer's banks and types are
handed to the native call, which reads flat id f's rows from layer f / E's bank in that layer's
types, so one call may mix layers of different types). The weights never widen to
floats: each token's input is quantised to int8 per 32 inputs once per call and shared by every
expert it routes to, each route's activation once before ``down``, and every weight row is an
exact integer dot product per block with the scales applied in fp32 (vpdpbusd on AVX512-VNNI,
maddubs on AVX2, plain C++ otherwise). A projection reads about half (q8_0) or a quarter (q4_k)
of bf16's bytes. Measured per core on an AVX-512 VNNI machine (one Qwen3-30B-geometry layer,
top-8), the q4_k row kernel costs ~4.1 ms of CPU per decoded token against ~5.7 for the bf16
executor and ~3.0 for mxfp4: the row kernels (qdot_*.cpp), not memory, bound it there.

It runs on ftdense's pool (the one the dense projections use, ``dense_native.configure``), so
dense and expert work share one set of threads instead of two pools spinning against each other.

``block_moe_reference`` is the same computation in plain torch (the same activation
quantisation, exact integer products), the oracle of the tests; over ``formats.dequantize_banks``
``banks.moe_reference`` differs from both by the activations' int8 rounding only.
"""

from __future__ import annotations

import torch

from ..formats import gguf_blocks, gguf_interleave
from ..native import dense_native, qlinear_native
from .banks import ActivationSpec, ExpertBanks, activate
from .formats import (
    expert_rows,
    expert_tensors,
    get_format,
    interleave_banks,
    interleaves,
    layer_experts,
    layer_pair,
)

Tensor = torch.Tensor


def is_block_format(name: str) -> bool:
    """Whether ``name`` is a GGUF block expert format (one this executor computes)."""
    return get_format(name).in_blocks


def available() -> bool:
    """True when `ftdense` is built with the block MoE kernels."""
    return qlinear_native.available() and hasattr(dense_native._native, "QMoe")


def _shapes(banks: ExpertBanks) -> tuple[list[tuple[int, int, int, int]], int, int, int, int]:
    """-> (per layer (gate_up address, down address, gate_up code, down code), E, N, H, I), the
    banks checked against their schema (one layer of N experts for a single pair of types)."""
    fmt = get_format(banks.format)
    if not fmt.in_blocks:
        raise ValueError(f"{banks.format!r} is not a GGUF block expert format")
    if banks.gate_up.dim() != 3 or banks.down.dim() != 3:
        raise ValueError("gate_up must be [N, 2I, bytes] and down [N, H, bytes]")
    n, inter, h = banks.num_flat, banks.gate_up.shape[1] // 2, banks.down.shape[1]
    tensors = banks.all_tensors()
    shapes = fmt.shapes(n, h, inter, torch.float32)
    if set(shapes) != set(banks.extra) | {"gate_up", "down"}:
        raise ValueError(f"{banks.format} banks must be {sorted(shapes)}, got {sorted(tensors)}")
    for name, (shape, dtype) in shapes.items():
        t = tensors[name]
        if t.device.type != "cpu" or t.dtype != dtype or not t.is_contiguous():
            raise TypeError(f"{name} must be a contiguous CPU {dtype} tensor")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    for name, b, bshape in (
        ("gate_up_bias", banks.gate_up_bias, (n, 2 * inter)),
        ("down_bias", banks.down_bias, (n, h)),
    ):
        if b is None:
            continue
        if b.device.type != "cpu" or b.dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"{name} must be a CPU float32 or bfloat16 tensor")
        if tuple(b.shape) != bshape or not b.is_contiguous():
            raise ValueError(f"{name} must be a contiguous {list(bshape)} tensor")

    def code(proj: str, qtype: str, rows: int) -> int:  # the kernels' code of the bank's layout
        if banks.interleaved and interleaves(proj, qtype, rows):
            return gguf_interleave.INTERLEAVED_CODES[qtype]
        return gguf_blocks.QTYPE_CODES[qtype]

    if fmt.layer_types is None:
        gu, dn = fmt.block_types or ("", "")
        layers = [
            (
                banks.gate_up.data_ptr(),
                banks.down.data_ptr(),
                code("gate_up", gu, 2 * inter),
                code("down", dn, h),
            )
        ]
        return layers, int(n), int(n), int(h), int(inter)
    e = layer_experts(banks)
    layers = []
    for li, (gu, dn) in enumerate(fmt.layer_types):
        gu_rows, dn_rows = (expert_rows(banks, p, li * e, e) for p in ("gate_up", "down"))
        layers.append(
            (
                gu_rows.data_ptr(),
                dn_rows.data_ptr(),
                code("gate_up", gu, 2 * inter),
                code("down", dn, h),
            )
        )
    return layers, e, int(n), int(h), int(inter)


class BlockExecutor:
    """Routed-expert sum of one MoE layer over block-format ``banks`` (CPU, contiguous; biases
    optional, fp32 or bf16). ``isa`` "" runs ftdense's configured path; "vnni", "avx2" or
    "scalar" force one (tests). ``chunk_bytes``: quantised input bytes per token chunk of an
    expert with many routes (prefill), sized to stay in L2. ``interleave``: regroup the q4_k
    and q6_k banks' rows in place for the faster kernels (``formats.interleave_banks``), for banks that
    nothing else reads raw (the cpu backend's)."""

    def __init__(
        self,
        banks: ExpertBanks,
        act: ActivationSpec,
        isa: str = "",
        chunk_bytes: int = 256 << 10,
        interleave: bool = False,
    ) -> None:
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        if not available():
            raise ImportError("the native dense extension `ftdense` is not built")
        if interleave:  # the banks are this executor's alone (formats.interleave_banks)
            interleave_banks(banks)
        layers, per_layer, n, h, inter = _shapes(banks)
        biases = [b for b in (banks.gate_up_bias, banks.down_bias) if b is not None]
        if len({b.dtype for b in biases}) > 1:
            raise TypeError("gate_up_bias and down_bias must have the same dtype")
        if isa and isa not in qlinear_native.isas():
            raise RuntimeError(
                f"this CPU cannot run the {isa!r} path; it runs {qlinear_native.isas()}"
            )
        dense_native.ensure_configured()
        self.banks = banks  # keeps the tensors alive: the native side holds their addresses
        self.act = act
        self.isa_request = isa
        self.hidden_size = h
        self._moe = dense_native._native.QMoe(
            gate_up=0,  # every layer's addresses and types are in ``layers``
            down=0,
            gate_up_type=0,
            down_type=0,
            gate_up_bias=0 if banks.gate_up_bias is None else banks.gate_up_bias.data_ptr(),
            down_bias=0 if banks.down_bias is None else banks.down_bias.data_ptr(),
            bias_bf16=bool(biases) and biases[0].dtype == torch.bfloat16,
            num_flat=n,
            hidden=h,
            inter=inter,
            act=int(act.kind),
            alpha=float(act.alpha),
            limit=float(act.limit),
            chunk_bytes=chunk_bytes,
            layers=layers,
            layer_experts=per_layer,
        )

    @property
    def threads(self) -> int:
        """Threads of ftdense's pool (the caller included)."""
        return int(dense_native._native.threads())

    @property
    def isa(self) -> str:
        """The integer-dot path calls run on ("vnni", "avx2" or "scalar")."""
        return self.isa_request or qlinear_native.configured_isa()

    def forward(
        self, x: Tensor, flat_ids: Tensor, weights: Tensor, order: Tensor | None = None
    ) -> Tensor:
        """x [T, H] fp32, flat_ids [T, K] int32 (-1 = skip), weights [T, K] fp32 -> [T, H] fp32.
        Releases the GIL while it runs; IndexError for ids outside [-1, N). ``order`` [T, K]
        int32 (>= 0 where an id is not -1): the key a token's route terms are summed in instead
        of the ids (the disk tier's slots pass the experts' own ids: the pool's sums)."""
        if x.dim() != 2 or flat_ids.dim() != 2 or weights.shape != flat_ids.shape:
            raise ValueError("x must be [T, H], flat_ids and weights [T, K]")
        if order is not None and order.shape != flat_ids.shape:
            raise ValueError("order must be [T, K] like flat_ids")
        t, k = flat_ids.shape
        if x.shape != (t, self.hidden_size):
            raise ValueError(f"x must be [{t}, {self.hidden_size}], got {list(x.shape)}")
        x = x.float().contiguous()
        flat_ids = flat_ids.to(torch.int32).contiguous()
        weights = weights.float().contiguous()
        out = torch.empty(t, self.hidden_size, dtype=torch.float32)
        if order is not None:
            order = order.to(torch.int32).contiguous()
        self._moe.forward(
            x.data_ptr(),
            flat_ids.data_ptr(),
            weights.data_ptr(),
            out.data_ptr(),
            t,
            k,
            self.isa_request,
            0 if order is None else order.data_ptr(),
        )
        return out

    def native_spec(self) -> object | None:
        """The ``ftdense.QMoe`` this executor calls, for a caller that runs it inside its own
        native call on ftdense's configured kernels (models/layers/cpu_decode.py), or None when
        this executor asked for another ISA than the configured one."""
        return self._moe if not self.isa_request else None

    def forward_addresses(
        self, x: int, ids: int, w: int, out: int, t: int, k: int, order: int = 0
    ) -> None:
        """``forward`` on raw addresses the caller has checked (models/layers/cpu_decode.py):
        x [t, H] fp32, ids [t, k] int32, w [t, k] fp32, out [t, H] fp32, order 0 or [t, k]
        int32."""
        self._moe.forward(x, ids, w, out, t, k, self.isa_request, order)


def block_moe_reference(
    x: Tensor, flat_ids: Tensor, weights: Tensor, banks: ExpertBanks, act: ActivationSpec
) -> Tensor:
    """What ``BlockExecutor.forward`` computes, in plain torch: x and each route's activation
    quantised as the kernels do (gguf_blocks.quantize_act), exact integer block products
    (gguf_blocks.qdot_reference), biases and gate weights in fp32, route terms summed per token."""
    xf = x.float()
    ids = flat_ids.long()
    routed = torch.zeros(*ids.shape, x.shape[1], dtype=torch.float32)
    for fid in torch.unique(ids).tolist():
        if fid < 0:
            continue
        tok, slot = torch.nonzero(ids == fid, as_tuple=True)
        gu, dn = layer_pair(banks, fid)
        w = expert_tensors(banks, fid)
        h = gguf_blocks.qdot_reference(w["gate_up"], gu, xf[tok])
        if banks.gate_up_bias is not None:
            h = h + banks.gate_up_bias[fid].float()
        y = gguf_blocks.qdot_reference(w["down"], dn, activate(h, act))
        if banks.down_bias is not None:
            y = y + banks.down_bias[fid].float()
        routed[tok, slot] = y * weights[tok, slot].float().unsqueeze(-1)
    return routed.sum(dim=1)
