"""Decode steps on the CPU with the native kernels called back to back, no torch op between them.

At one token a step's arithmetic is small next to what Python and torch's dispatch cost per op:
the generic layer (attention.py, moe.py) runs some 40 torch ops and module calls per layer
besides its kernels, measured at 0.8 ms a layer on a 2-core Sapphire Rapids VM (a 4-layer model
with tiny weights decoded at 4.4 ms a token). A standard attention + MoE layer decoded here
makes about a dozen calls into ``ftdense`` instead, each on raw addresses of buffers allocated
once per step:

    x = norm(h); q, k, v = qkv(x); q, k = head norms; q, k = rope; store k, v in the pool;
    a = decode attention; o = o_proj(a); h += o, x = norm(h) (one call); logits = router(x);
    ids, w = top-k (native); m = experts(x, ids, w); h += m

The kernels are the generic path's own (dense_native, qlinear_native, the MoE executors), so
the step computes the same numbers but for the routing weights: the native top-k's softmax
rounds differently from torch's in the last bits (tests/test_cpu_decode.py bounds the logits'
difference and checks the greedy tokens). ``plan_for`` says which layers qualify; any other
layer, and every step that is not all decode rows on the CPU, takes the generic path.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ...engine.batch import ForwardBatch
from ..config import RopeConfig
from . import dense_native, qlinear_native
from .attention import Attention
from .common import Linear, RMSNorm
from .moe import SparseMoE

if TYPE_CHECKING:
    from ...experts.backend import CpuBackend
    from ..model import DecoderLayer

Tensor = torch.Tensor
# A projection group on addresses: (input address, rows T, output addresses) -> None.
Project = Callable[[int, int, list[int]], None]


def _project(mods: list[Linear]) -> Project | None:
    """One native call computing every module of ``mods`` from the same input (the generic
    path's ``project``), or None when they do not all take the same native path (bias-free:
    GGUF blocks in the models' input order, or bf16 weights)."""
    if any(m.bias is not None for m in mods):
        return None
    k = mods[0].qweight.cols if mods[0].qweight is not None else mods[0].weight.shape[-1]
    qws = [m.qweight for m in mods]
    if all(q is not None and q.in_perm is None and q.cols == k for q in qws):
        ptrs = [q.raw.data_ptr() for q in qws]  # type: ignore[union-attr]
        rows = [q.rows for q in qws]  # type: ignore[union-attr]
        codes = [q.code for q in qws]  # type: ignore[union-attr]
        qlinear = dense_native._native.qlinear

        def run_q(x: int, t: int, ys: list[int], _keep: object = qws) -> None:
            qlinear(x, t, k, ptrs, rows, codes, ys, "")

        return run_q
    ws = [m.weight for m in mods]
    if any(q is not None for q in qws) or not all(
        dense_native.weight_usable(w) and w.shape[1] == k for w in ws
    ):
        return None
    wptrs = [w.data_ptr() for w in ws]
    wrows = [w.shape[0] for w in ws]
    linear = dense_native._native.linear

    def run_bf16(x: int, t: int, ys: list[int], _keep: object = ws) -> None:
        linear(x, t, k, wptrs, wrows, ys, True, True)

    return run_bf16


def _rows(m: Linear) -> int:
    return m.qweight.rows if m.qweight is not None else int(m.weight.shape[0])


class LayerPlan:
    """One qualifying decoder layer's weights as addresses and the native calls that decode it.
    It holds the tensors behind those addresses (they stay valid while it lives); the model's
    weights do not change after load on the CPU (placement moves them to a device, where the
    fast path does not run), and the norms' fp32 scales are taken once, here."""

    def __init__(
        self,
        layer: DecoderLayer,
        attn: Attention,
        moe: SparseMoE,
        qkv: Project,
        o: Project,
        router: Project,
    ) -> None:
        # attn and moe hold the projections' tensors (the closures keep them too); no reference
        # back to the layer, so an unloaded model's weights go with its last reference
        self.attn, self.moe = attn, moe
        self.qkv, self.o, self.router = qkv, o, router
        self.hidden = _rows(attn.o_proj)
        self.q_rows, self.kv_rows = _rows(attn.q_proj), _rows(attn.k_proj)
        self.experts = _rows(moe.router)
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        if attn.qk_norm == "head":
            norms += [attn.q_norm, attn.k_norm]
        self.scales = [n._fp32_scale() for n in norms]
        self.eps = [n.eps for n in norms]
        self.scale_ptrs = [s.data_ptr() for s in self.scales]

    def run(self, h: Tensor, step: DecodeStep) -> None:
        """Decodes ``h`` [T, hidden] (fp32, contiguous) through the layer, in place."""
        nat = dense_native._native
        a, m, t = self.attn, self.moe, step.t
        heads, kvh, d, hid = a.heads, a.kv_heads, a.head_dim, self.hidden
        x, q, k, v = (
            step.buf(n, c)
            for n, c in (("x", hid), ("q", self.q_rows), ("k", self.kv_rows), ("v", self.kv_rows))
        )
        nat.rms_norm(h.data_ptr(), t, hid, self.scale_ptrs[0], self.eps[0], x)
        self.qkv(x, t, [q, k, v])
        if a.qk_norm == "head":
            nat.rms_norm(q, t * heads, d, self.scale_ptrs[2], self.eps[2], q)
            nat.rms_norm(k, t * kvh, d, self.scale_ptrs[3], self.eps[3], k)
        qr, kr = step.buf("qr", self.q_rows), step.buf("kr", self.kv_rows)
        rot, inter = step.rot, step.interleaved
        nat.rope(q, t, heads, d, rot, inter, step.cos, step.sin, qr)
        nat.rope(k, t, kvh, d, rot, inter, step.cos, step.sin, kr)
        kp, vp, num_pages, page_size = step.kv_layer(a.kv_layer)
        bf16 = step.kv_bf16
        nat.kv_store(kr, v, t, kvh * d, step.slots, kp, vp, bf16)
        att = step.buf("att", self.q_rows)
        nat.decode_attention(
            qr, t, att, heads, t, step.rows, step.lens, step.tables, step.width,
            kp, vp, bf16, num_pages, page_size, kvh, d, a.scale, a.window or 0, 0,
        )  # fmt: skip
        o = step.buf("o", hid)
        self.o(att, t, [o])
        nat.add_rms_norm(h.data_ptr(), o, t, hid, self.scale_ptrs[1], self.eps[1], x)
        logits = step.buf("logits", self.experts)
        self.router(x, t, [logits])
        ids, w = step.buf("ids", m.top_k, torch.int32), step.buf("w", m.top_k)
        offset = m.moe_index * step.num_experts
        nat.route_topk(
            logits, t, self.experts, m.top_k, m.kind == "softmax", m.renorm, offset, ids, w
        )
        out = step.buf("moe", hid)
        step.experts(x, ids, w, out, t, m.top_k)
        nat.add_rows(h.data_ptr(), out, t * hid)


def plan_for(layer: DecoderLayer) -> LayerPlan | None:
    """The layer's plan when it qualifies: softmax attention without biases, gates, clipping,
    sinks or a full-width qk norm, and a MoE block with a softmax router, no bias, no shared
    expert, every projection group on one native path."""
    attn, moe = layer.self_attn, layer.mlp
    if type(attn) is not Attention or type(moe) is not SparseMoE:
        return None
    if attn.gated or attn.clip is not None or attn.sinks is not None:
        return None
    if attn.qk_norm not in ("none", "head"):
        return None
    if moe.kind not in ("softmax", "topk_softmax") or moe.shared_expert is not None:
        return None
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    if attn.qk_norm == "head":
        norms += [attn.q_norm, attn.k_norm]
    if not all(type(n) is RMSNorm for n in norms):
        return None
    qkv = _project([attn.q_proj, attn.k_proj, attn.v_proj])
    o = _project([attn.o_proj])
    router = _project([moe.router])
    if qkv is None or o is None or router is None:
        return None
    return LayerPlan(layer, attn, moe, qkv, o, router)


class DecodeStep:
    """What every layer of one decode step shares: the rows' KV slots and page tables, the rope
    rows, and fp32 buffers allocated once per step (layers of one model have the same shapes)."""

    def __init__(
        self,
        batch: ForwardBatch,
        moe: CpuBackend,
        cos: Tensor,
        sin: Tensor,
        rot: int,
        interleaved: bool,
    ) -> None:
        chunks = batch.chunks
        self.t = len(chunks)
        self.kv = batch.kv
        self.num_experts = moe.num_experts
        # (x, ids, w, out, t, k) addresses -> None: the expert executor's native call
        self.experts: Callable[[int, int, int, int, int, int], None] = (
            moe.executor.forward_addresses  # type: ignore[attr-defined]
        )
        ps = batch.kv.page_size
        pages = [batch.kv.pages_for(ch.context_len + 1) for ch in chunks]
        self.width = width = max(pages)
        t = self.t
        # one int32 tensor: the page tables [t, width] (zero padded), each row's start, each
        # row's context length after this token; one int64 tensor: the KV slots. Two tensors
        # built from lists a step, not a zeros and a tensor per row: each torch op costs tens of
        # microseconds here (caches cold after the weight streams)
        ints: list[int] = []
        for ch, n in zip(chunks, pages, strict=True):
            ints += ch.state.pages[:n]
            ints += [0] * (width - n)
        ints += [ch.start for ch in chunks]
        ints += [ch.context_len + 1 for ch in chunks]
        slots = [ch.state.pages[ch.context_len // ps] * ps + ch.context_len % ps for ch in chunks]
        meta = torch.tensor(ints, dtype=torch.int32)
        self._keep = (meta, torch.tensor(slots, dtype=torch.int64), cos, sin)
        at, size = meta.data_ptr(), meta.element_size()
        self.tables = at
        self.rows = at + t * width * size
        self.lens = at + (t * width + t) * size
        self.slots = self._keep[1].data_ptr()
        self.cos, self.sin = cos.data_ptr(), sin.data_ptr()
        self.rot, self.interleaved = rot, interleaved
        self._bufs = _step_buffers(t)
        kv = batch.kv
        self.kv_bf16 = kv.dtype == torch.bfloat16
        # a uniform pool is one tensor [layers, pages, page_size, ...] per K and V: a layer's
        # pages are at a fixed stride from its base, no select op a layer and step
        k, v = kv.k, kv.v
        if isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor):
            self._k_base, self._v_base = k.data_ptr(), v.data_ptr()
            self._k_layer = k.stride(0) * k.element_size()
            self._v_layer = v.stride(0) * v.element_size()
            self._pages = (int(k.shape[1]), int(k.shape[2]))

    def kv_layer(self, layer: int) -> tuple[int, int, int, int]:
        """Pool layer ``layer``'s K and V addresses, its pages and page size."""
        k = self.kv.k
        if isinstance(k, list):
            kp, vp = k[layer], self.kv.v[layer]
            return kp.data_ptr(), vp.data_ptr(), int(kp.shape[0]), int(kp.shape[1])
        return (
            self._k_base + layer * self._k_layer,
            self._v_base + layer * self._v_layer,
            *self._pages,
        )

    def tensor(self, name: str, cols: int, dtype: torch.dtype = torch.float32) -> Tensor:
        """This step's [t, cols] buffer ``name``: the same tensor for every step of ``t`` rows
        on this thread (reused, not zeroed)."""
        key = (name, cols, dtype)
        b = self._bufs.get(key)
        if b is None:
            b = self._bufs[key] = torch.empty(self.t, cols, dtype=dtype)
        return b

    def buf(self, name: str, cols: int, dtype: torch.dtype = torch.float32) -> int:
        """The address of this step's [t, cols] buffer ``name``."""
        return self.tensor(name, cols, dtype).data_ptr()


# Step buffers by row count, per thread (two engine threads may decode at once): a decode step
# allocated some 15 of them, each torch.empty a cold-cache op. Nothing outlives its step: the
# layers read and write them in place and the final norm's output is consumed by lm_head within
# the same forward. A few row counts are kept (batches come and go), the oldest dropped.
_KEEP_ROW_COUNTS = 4
_local = threading.local()


def _step_buffers(t: int) -> dict[tuple[str, int, torch.dtype], Tensor]:
    by_rows: dict[int, dict[tuple[str, int, torch.dtype], Tensor]] | None = getattr(
        _local, "by_rows", None
    )
    if by_rows is None:
        by_rows = _local.by_rows = {}
    bufs = by_rows.pop(t, None)
    if bufs is None:
        bufs = {}
        while len(by_rows) >= _KEEP_ROW_COUNTS:
            del by_rows[next(iter(by_rows))]
    by_rows[t] = bufs  # the most recent last
    return bufs


class HeadPlan:
    """The model's two ends on fast-path steps: the embedding gather (one native call into a step
    buffer, no index_select and float()) and the last norm (one native call with its fp32 scale
    taken once, not looked up in the norm's cache a step: that lookup alone measured 26 us a step
    with caches cold after the weight streams, the gather 62-74 us, in the decode benchmark's
    model, Q4_K_M file). Like `LayerPlan`, it holds the tensors behind its addresses; `matches`
    says whether the model still has them (a module moved between devices gets new ones)."""

    def __init__(self, embed: Tensor, norm: RMSNorm) -> None:
        self.embed_w, self.norm_w = embed, getattr(norm, "weight", None)
        self.embed_ok = (
            embed.device.type == "cpu"
            and embed.dim() == 2
            and embed.dtype in (torch.bfloat16, torch.float32)
            and embed.is_contiguous()
        )
        self.vocab, self.dim = int(embed.shape[0]), int(embed.shape[-1])
        self.embed_ptr = embed.data_ptr() if self.embed_ok else 0
        self.bf16 = embed.dtype == torch.bfloat16
        scale = norm._fp32_scale() if type(norm) is RMSNorm else None
        self.scale = scale if scale is not None and scale.device.type == "cpu" else None
        self.scale_ptr = self.scale.data_ptr() if self.scale is not None else 0
        self.eps = float(getattr(norm, "eps", 0.0))

    def matches(self, embed: Tensor, norm: RMSNorm) -> bool:
        return embed is self.embed_w and getattr(norm, "weight", None) is self.norm_w

    def embed(self, step: DecodeStep, token_ids: Tensor) -> Tensor | None:
        """The step's rows of the embedding as fp32 [t, hidden] (a step buffer: the layers update
        it in place, nothing reads it after the step), or None where the gather does not apply
        (the caller indexes the weight)."""
        if (
            not self.embed_ok
            or token_ids.dtype != torch.int64
            or token_ids.device.type != "cpu"
            or not token_ids.is_contiguous()
            or token_ids.shape[0] != step.t
        ):
            return None
        h = step.tensor("h", self.dim)
        dense_native._native.embed_rows(
            self.embed_ptr, self.bf16, self.vocab, self.dim, token_ids.data_ptr(), step.t,
            h.data_ptr(),
        )  # fmt: skip
        return h

    def final_norm(self, step: DecodeStep, h: Tensor, rows: int) -> Tensor | None:
        """The model's last norm when every row's logits are wanted, as one native call into a
        step buffer: no gather of the rows, no module call. ``rows``: how many logits rows the
        batch wants; each chunk of a decode step is one row and wants at most its own, in order,
        so ``rows == t`` means all of them. None where it does not apply: the caller gathers and
        calls the module."""
        if rows != step.t or self.scale is None or not h.is_contiguous():
            return None
        y = step.tensor("final", self.dim)
        dense_native._native.rms_norm(
            h.data_ptr(), step.t, self.dim, self.scale_ptr, self.eps, y.data_ptr()
        )
        return y


_enabled = [True]


def set_enabled(on: bool) -> bool:
    """Switch the fast path on or off process-wide (tests and benchmarks compare the two);
    returns the previous setting."""
    old, _enabled[0] = _enabled[0], on
    return old


def start(
    batch: ForwardBatch, embed: Tensor, cos: Tensor, sin: Tensor, rope_cfg: RopeConfig
) -> DecodeStep | None:
    """A `DecodeStep` when this forward is a decode step the fast path can run: every chunk one
    row, the residual stream (where the embedding ``embed`` is: the model's fp32 rows of it), KV
    pool and MoE executor on the CPU with native kernels on."""
    from ...experts.backend import CpuBackend

    if (
        not _enabled[0]
        or batch.decode is not None
        or not dense_native._on()
        or not qlinear_native.available()
    ):
        return None
    if embed.device.type != "cpu" or not all(ch.length == 1 for ch in batch.chunks):
        return None
    moe = batch.moe
    if type(moe) is not CpuBackend or not hasattr(moe.executor, "forward_addresses"):
        return None
    if batch.kv.device.type != "cpu" or batch.kv.dtype not in (torch.bfloat16, torch.float32):
        return None
    rot = rope_cfg.rotary_dim
    if rot == 0 or cos.shape[-1] != rot // 2:
        return None
    c, s = cos.float().contiguous(), sin.float().contiguous()
    return DecodeStep(batch, moe, c, s, rot, rope_cfg.interleaved)
