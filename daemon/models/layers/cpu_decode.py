"""Decode steps on the CPU with the native kernels called back to back, no torch op between them.

At one token a step's arithmetic is small next to what Python and torch's dispatch cost per op:
the generic layer (attention.py, moe.py) runs some 40 torch ops and module calls per layer
besides its kernels, measured at 0.8 ms a layer on a 2-core Sapphire Rapids VM (a 4-layer model
with tiny weights decoded at 4.4 ms a token). A run of standard attention + MoE layers decodes
here in one call into ``ftdense`` (native/dense/decode_layers.h), which makes the layer's dozen
kernel calls itself on step buffers of its own:

    x = norm(h); q, k, v = qkv(x); q, k = head norms; q, k = rope; store k, v in the pool;
    a = decode attention; o = o_proj(a); h += o, x = norm(h) (one call); logits = router(x);
    ids, w = top-k (native); m = experts(x, ids, w); h += m

Before, Python made those calls one by one: about 0.15 ms a step of interpreter work and argument
conversion on the decode benchmark's 4-layer model (Q4_K_M file), with every core but the
caller's idle meanwhile. The kernels are the generic path's own (dense_native, qlinear_native, the
MoE executors, run inside the call on ftdense's pool: the float executor's too, through
native/src/executor_bridge.h, where before each layer handed the cores to its own pool and back),
so the step computes the same numbers but for the routing weights:
the native top-k's softmax rounds differently from torch's in the last bits
(tests/test_cpu_decode.py bounds the logits' difference and checks the greedy tokens).
``plan_for`` says which layers qualify; any other layer, and every step that is not all decode
rows and short prompt chunks (``CHUNK_ROWS``: a chunk's tokens run as rows) on the CPU, takes
the generic path. When every layer qualifies, the call also gathers the
embedding rows first and runs the last norm and lm_head after (`HeadPlan.whole`); the engine's
runner then decodes consecutive steps of the same rows through a lane (decode_lane.py).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, cast

import torch

from ...experts.backend import CpuBackend
from ...native import dense_native, qlinear_native
from ..batch import ForwardBatch
from ..config import RopeConfig
from .attention import Attention
from .common import Embedding, Linear, RMSNorm
from .moe import SparseMoE

if TYPE_CHECKING:
    from ...experts.backend import CpuBackend
    from ..model import DecoderLayer

Tensor = torch.Tensor
# One projection group as decode_layers takes it: (GGUF blocks?, K, weight addresses, rows,
# GGUF type codes).
Proj = tuple[bool, int, list[int], list[int], list[int]]


def _project(mods: list[Linear]) -> Proj | None:
    """Every module of ``mods`` computed from the same input in one native call (the generic
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
        return True, k, ptrs, rows, codes
    ws = [m.weight for m in mods]
    if any(q is not None for q in qws) or not all(
        dense_native.weight_usable(w) and w.shape[1] == k for w in ws
    ):
        return None
    return False, k, [w.data_ptr() for w in ws], [int(w.shape[0]) for w in ws], []


class LayerPlan:
    """One qualifying decoder layer as ``ftdense.DecodeLayer``: its weights and norm scales as
    addresses. It holds the tensors behind those addresses (they stay valid while it lives); the
    model's weights do not change after load on the CPU (placement moves them to a device, where
    the fast path does not run), and the norms' fp32 scales are taken once, here."""

    def __init__(
        self, layer: DecoderLayer, attn: Attention, moe: SparseMoE, qkv: Proj, o: Proj, router: Proj
    ) -> None:
        # attn and moe hold the projections' tensors; no reference back to the layer, so an
        # unloaded model's weights go with its last reference
        self.attn, self.moe = attn, moe
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        if attn.qk_norm == "head":
            norms += [attn.q_norm, attn.k_norm]
        self.scales = [n._fp32_scale() for n in norms]
        self.native = dense_native._native.DecodeLayer(
            hidden=qkv[1],
            heads=attn.heads,
            kv_heads=attn.kv_heads,
            head_dim=attn.head_dim,
            attn_scale=attn.scale,
            window=attn.window or 0,
            scales=[s.data_ptr() for s in self.scales],
            eps=[n.eps for n in norms],
            qkv=qkv,
            o=o,
            router=router,
            experts=router[3][0],
            top_k=moe.top_k,
            softmax_first=moe.kind == "softmax",
            renorm=moe.renorm,
            moe_index=moe.moe_index,
            kv_layer=attn.kv_layer,
        )


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
    rows, the KV pool's layers and the MoE executor; ``run`` decodes a run of layers."""

    def __init__(
        self,
        batch: ForwardBatch,
        moe: CpuBackend,
        cos: Tensor,
        sin: Tensor,
        rot: int,
        interleaved: bool,
    ) -> None:
        # one row a token: a chunk of n prompt tokens is n rows at consecutive positions of one
        # sequence (its page table each), every row's key stored before any row attends
        rows = [(ch, ch.context_len + i) for ch in batch.chunks for i in range(ch.length)]
        self.t = len(rows)
        self.num_experts = moe.num_experts
        self._executor = moe.executor  # what the addresses point into
        self.qmoe, self.float_experts, self.experts, self.tier = experts_of(moe.executor)
        ps = batch.kv.page_size
        pages = [batch.kv.pages_for(pos + 1) for _, pos in rows]
        self.width = width = max(pages)
        t = self.t
        # one int32 tensor: the page tables [t, width] (zero padded), each row's start, each
        # row's context length after this token; one int64 tensor: the KV slots. Two tensors
        # built from lists a step, not a zeros and a tensor per row: each torch op costs tens of
        # microseconds here (caches cold after the weight streams)
        ints: list[int] = []
        for (ch, _), n in zip(rows, pages, strict=True):
            ints += ch.state.pages[:n]
            ints += [0] * (width - n)
        ints += [ch.start + pos - ch.context_len for ch, pos in rows]
        ints += [pos + 1 for _, pos in rows]
        slots = [ch.state.pages[pos // ps] * ps + pos % ps for ch, pos in rows]
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
        self.kv = kv_layers(batch.kv)

    def run(self, plans: list[LayerPlan], h: Tensor, ends: Any = None) -> None:
        """Decodes ``h`` [t, hidden] (fp32, contiguous) through ``plans``' layers, in place, in
        one native call; ``ends``: the model's ends as `HeadPlan.whole` passes them (None:
        the layers alone)."""
        dense_native._native.decode_layers(
            [p.native for p in plans], h.data_ptr(), self.t, self.cos, self.sin, self.rot,
            self.interleaved, self.slots, self.tables, self.rows, self.lens, self.width, self.kv,
            self.num_experts, self.qmoe, self.float_experts, self.experts, timings(), ends,
            tier=self.tier,
        )  # fmt: skip

    def tensor(self, name: str, cols: int, dtype: torch.dtype = torch.float32) -> Tensor:
        """This step's [t, cols] buffer ``name``: the same tensor for every step of ``t`` rows
        on this thread (reused, not zeroed)."""
        key = (name, cols, dtype)
        b = self._bufs.get(key)
        if b is None:
            b = self._bufs[key] = torch.empty(self.t, cols, dtype=dtype)
        return b


def experts_of(executor: Any) -> tuple[Any, Any, Any, Any]:
    """decode_layers' (qmoe, float_experts, experts, tier) for a MoE executor: the experts run
    inside the call on ftdense's pool, a GGUF-block executor's native spec or ftnative's float
    executor through its entry (native/src/executor_bridge.h); any other executor's (x, ids, w,
    out, t, k) address call is made back through Python. The disk tier's executor
    (experts/disk_tier.py ``native_tier``): its slots' spec, its call back for a layer with an
    expert not resident, and its fast path's ``tier``."""
    native_tier = getattr(executor, "native_tier", None)
    fast = native_tier() if native_tier is not None else None
    if fast is not None:
        return fast[0], None, executor.forward_addresses, fast[1]
    spec = getattr(executor, "native_spec", None)
    entry = getattr(executor, "native_entry", None)
    qmoe = spec() if spec is not None else None
    float_experts = entry() if entry is not None and qmoe is None else None
    experts = executor.forward_addresses if qmoe is None and float_experts is None else None
    return qmoe, float_experts, experts, None


# The KV pool's layers as decode_layers takes them, for the last pool seen: (k, v, bf16, pages,
# page size) per layer. A uniform pool is one tensor [layers, pages, page_size, ...] per K and
# V, its layers at a fixed stride from its base; a pool of per-layer tensors lists them.
_kv_seen: list[tuple[tuple[int, ...], list[tuple[int, int, bool, int, int]]]] = []


def kv_layers(kv: Any) -> list[tuple[int, int, bool, int, int]]:
    k, v = kv.k, kv.v
    bf16 = kv.dtype == torch.bfloat16
    ks = k if isinstance(k, list) else [k]
    key = (id(kv), bf16, *(x.data_ptr() for x in ks), *(s for x in ks for s in x.shape))
    seen = _kv_seen[0] if _kv_seen else None
    if seen is not None and seen[0] == key:
        return seen[1]
    if isinstance(k, list):
        out = [
            (kp.data_ptr(), vp.data_ptr(), bf16, int(kp.shape[0]), int(kp.shape[1]))
            for kp, vp in zip(k, v, strict=True)
        ]
    else:
        kb, vb = k.data_ptr(), v.data_ptr()
        kl, vl = k.stride(0) * k.element_size(), v.stride(0) * v.element_size()
        pages, size = int(k.shape[1]), int(k.shape[2])
        out = [(kb + i * kl, vb + i * vl, bf16, pages, size) for i in range(int(k.shape[0]))]
    _kv_seen[:] = [(key, out)]
    return out


# decode_layers' part timings (tests/bench/profile_decode.py): 0, or the address of a float64
# tensor of len(ftdense.decode_parts()) seconds the calls add to.
_timings = [0]


def timings() -> int:
    """What decode_layers' ``timings`` argument is now: 0, or the `set_timings` tensor's
    address."""
    return _timings[0]


def set_timings(seconds: Tensor | None) -> None:
    """Have every decode step add its parts' times to ``seconds`` (float64, contiguous, one per
    ``ftdense.decode_parts()``; it must outlive the steps), or stop with None."""
    if seconds is not None:
        parts = len(dense_native._native.decode_parts())
        if (
            seconds.dtype != torch.float64
            or seconds.numel() != parts
            or not seconds.is_contiguous()
        ):
            raise ValueError(f"timings must be a contiguous float64 tensor of {parts} values")
    _timings[0] = seconds.data_ptr() if seconds is not None else 0


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
    model, Q4_K_M file). When every layer has a plan, `whole` runs them inside the layers' call
    with lm_head too (the step one native call from token ids to logits). Like `LayerPlan`, it
    holds the tensors behind its addresses; `matches` says whether the model still has them (a
    module moved between devices gets new ones)."""

    def __init__(
        self, embed: Tensor, norm: RMSNorm, lm_head: Linear, in_blocks: Embedding | None = None
    ) -> None:
        """``in_blocks``: the embedding module where it holds GGUF blocks (``embed`` empty): the
        native gather reads its ``table``, each step's rows written first (``Embedding.fill``)."""
        self.embed_w, self.norm_w = embed, getattr(norm, "weight", None)
        self.in_blocks = in_blocks
        if in_blocks is not None:
            assert in_blocks.blocks is not None and in_blocks.weight is embed
            embed = in_blocks.table
        self.lm_w = _weight_of(lm_head)
        # lm_head as decode_layers projects it: GGUF blocks or bf16 rows on the CPU, no bias
        self.lm: Proj | None = None
        if lm_head.qweight is None or lm_head.qweight.raw.device.type == "cpu":
            self.lm = _project([lm_head])
        self.lm_rows = sum(self.lm[3]) if self.lm is not None else 0
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

    def matches(self, embed: Tensor, norm: RMSNorm, lm_head: Linear) -> bool:
        return (
            embed is self.embed_w
            and getattr(norm, "weight", None) is self.norm_w
            and _weight_of(lm_head) is self.lm_w
        )

    def whole(
        self, step: DecodeStep, plans: list[LayerPlan], token_ids: Tensor, rows: int
    ) -> Tensor | None:
        """The step's logits [t, vocab] fp32 from one native call: the embedding rows, every
        layer of ``plans`` (the model's, all of them), the last norm and lm_head. None where
        that does not apply (an end the native call cannot run, or logits not wanted for every
        row): the caller goes part by part."""
        if not self.whole_ok or rows != step.t or not self._ids_usable(step, token_ids):
            return None
        logits = torch.empty(step.t, self.lm_rows, dtype=torch.float32)
        step.run(plans, step.tensor("h", self.dim), self.ends(token_ids, logits))
        return logits

    def ends(self, token_ids: Tensor, logits: Tensor) -> tuple[Any, ...]:
        """decode_layers' ``ends`` (DecodeEnds): the rows of ``token_ids`` (int64, contiguous)
        gathered first, lm_head's output written to ``logits`` (fp32 [t, lm_rows]) last."""
        if self.in_blocks is not None:
            self.in_blocks.fill(token_ids)
        return (
            self.embed_ptr, self.bf16, self.vocab, token_ids.data_ptr(), self.scale_ptr,
            self.eps, self.lm, logits.data_ptr(),
        )  # fmt: skip

    @property
    def whole_ok(self) -> bool:
        """Whether both ends can run inside the layers' call (`whole`, the runner's lane)."""
        return self.lm is not None and self.scale is not None and self.embed_ok

    def _ids_usable(self, step: DecodeStep, token_ids: Tensor) -> bool:
        return (
            self.embed_ok
            and token_ids.dtype == torch.int64
            and token_ids.device.type == "cpu"
            and token_ids.is_contiguous()
            and token_ids.shape[0] == step.t
        )

    def embed(self, step: DecodeStep, token_ids: Tensor) -> Tensor | None:
        """The step's rows of the embedding as fp32 [t, hidden] (a step buffer: the layers update
        it in place, nothing reads it after the step), or None where the gather does not apply
        (the caller indexes the weight)."""
        if not self._ids_usable(step, token_ids):
            return None
        if self.in_blocks is not None:
            self.in_blocks.fill(token_ids)
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


def _weight_of(lm: Linear) -> object:
    """What holds a projection's weight: its GGUF blocks when quantized, else the tensor."""
    return lm.qweight if lm.qweight is not None else lm.weight


_enabled = [True]


def enabled() -> bool:
    """Whether the fast path is on (`set_enabled`)."""
    return _enabled[0]


def set_enabled(on: bool) -> bool:
    """Switch the fast path on or off process-wide (tests and benchmarks compare the two);
    returns the previous setting."""
    old, _enabled[0] = _enabled[0], on
    return old


def on_cpu(embed: Tensor, kv: Any, moe: Any) -> bool:
    """Whether decode steps can take the fast path at all: it is on, the native kernels are
    built, and the embedding (where the residual stream is), the KV pool (bf16 or fp32) and a
    CPU backend's native-callable experts are on the CPU."""

    return (
        _enabled[0]
        and dense_native._on()
        and qlinear_native.available()
        and embed.device.type == "cpu"
        and type(moe) is CpuBackend
        and hasattr(moe.executor, "forward_addresses")
        and kv.device.type == "cpu"
        and kv.dtype in (torch.bfloat16, torch.float32)
    )


# A prompt chunk of up to this many tokens runs through the native decode step as that many rows
# (each at its position, attending to its sequence's keys through its own): the chunks a paced
# prompt gets beside decoding streams (engine/pacing.py) are a few tokens, and the generic layers
# cost a step a fixed few ms of Python and per-op dispatch. Past a few rows the generic path won
# (measured with the fp32 attention kernels): its prefill attention reads a block of keys once for
# all the chunk's rows where the fp32 decode attention reads them once a row (the bf16-dot one
# takes a chunk's rows together, native/dense/decode_attention.h). One request of a prompt of 8192
# tokens restored plus n new ones, Q4_K_M bench file (4 layers, Qwen3-30B-A3B geometry), AMD EPYC
# Zen 4 VM, 2 threads, medians of 3 (tests/bench/profile_chunk.py): n = 2 / 4 / 8 / 16 rows 20.8 /
# 36.8 / 68.4 / 123 ms here against 26.2 / 40.4 / 61.6 / ~108 on the generic layers. A row's
# arithmetic is a decode row's: it parts from the generic path's in the last bits (the router's
# softmax; with the fp32 attention kernels, the attention's order; under cpu_bf16_attention the
# decode attention runs the rows as the prefill kernel's chunk, the same bits), as a decode row
# beside a prompt always has (tests/test_cpu_batch_invariance.py's tolerances).
CHUNK_ROWS = 4


def start(
    batch: ForwardBatch, embed: Tensor, cos: Tensor, sin: Tensor, rope_cfg: RopeConfig
) -> DecodeStep | None:
    """A `DecodeStep` when this forward is a step the fast path can run: every chunk one row, or
    a few (at most ``CHUNK_ROWS``: a paced prompt's chunk beside decoding streams, a prompt's
    short tail) run as that many rows; the residual stream (where the embedding ``embed`` is:
    the model's fp32 rows of it), KV pool and MoE executor on the CPU with native kernels on."""
    if batch.decode is not None or not all(ch.length <= CHUNK_ROWS for ch in batch.chunks):
        return None
    moe = batch.moe
    if not on_cpu(embed, batch.kv, moe):
        return None
    if cast("CpuBackend", moe).filling and any(ch.length > 1 for ch in batch.chunks):
        return None  # a prompt step computes each layer once its experts are in (``forward``)
    rot = rope_cfg.rotary_dim
    if rot == 0 or cos.shape[-1] != rot // 2:
        return None
    c, s = cos.float().contiguous(), sin.float().contiguous()
    dense_native.ensure_configured()  # a process's first forward may be this step
    return DecodeStep(batch, cast("CpuBackend", moe), c, s, rot, rope_cfg.interleaved)
