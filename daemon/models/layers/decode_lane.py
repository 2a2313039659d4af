"""Consecutive decode steps of the same rows on the CPU, one native call each (the runner's
decode lane).

When every layer of a model takes the native decode path and both its ends do
(layers/cpu_decode.py: `HeadPlan.whole`), a decode step is one call into ``ftdense`` from the
token ids to the logits. Going through the model's forward still builds a batch, a
`cpu_decode.DecodeStep` and its buffers each step: some 0.3 ms of Python a step on caches cold
after the weight streams, measured on the decode benchmark's 4-layer model. The engine's runner
(engine/runner.py) keeps a `DecodeLane` instead while its decode batch stays the same rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ...native import dense_native
from ..model import CausalLM
from . import cpu_decode

if TYPE_CHECKING:
    from ...experts.backend import CpuBackend
    from .cpu_decode import HeadPlan, LayerPlan
    from .rope import Rope

Tensor = torch.Tensor


class DecodeLane:
    """Decode steps of ``states``' rows (one token each, the logits of each) while they stay
    the same rows: their token ids, positions, KV slots, page tables and lengths live in tensors
    of the lane's own, written in place each step, and a lone row's rope rows are read from the
    table itself. ``make`` says whether a model qualifies (every layer planned, both ends
    native); ``fits`` whether the lane runs the next step of a batch."""

    # page-table width grows in these steps (pages a row), so a long decode rebuilds it rarely
    _WIDTH_STEP = 16

    def __init__(
        self,
        kv: Any,
        moe: CpuBackend,
        states: list[Any],
        rope: Rope,
        head: HeadPlan,
        plans: list[LayerPlan],
    ) -> None:
        self.kv, self.moe, self.head = kv, moe, head
        self.executor = moe.executor  # what the addresses point into
        self.states = list(states)
        self.plans = plans  # holds the addresses' tensors
        self.natives = [p.native for p in plans]
        self.qmoe, self.float_experts, self.experts, self.tier = cpu_decode.experts_of(moe.executor)
        self.num_experts = moe.num_experts
        self.rope = rope
        self.rot = rope.cfg.rotary_dim
        self.interleaved = rope.cfg.interleaved
        t = self.t = len(states)
        self.ids = torch.zeros(t, dtype=torch.int64)
        self.pos = torch.zeros(t, dtype=torch.int64)
        self.slots = torch.zeros(t, dtype=torch.int64)
        self.h = torch.empty(t, head.dim)
        half = self.rot // 2
        self.cos_rows = torch.empty(t, half)
        self.sin_rows = torch.empty(t, half)
        self._ids, self._pos, self._slots = self.ids.numpy(), self.pos.numpy(), self.slots.numpy()
        self._tables(max(len(st.pages) for st in states))

    def _tables(self, pages: int) -> None:
        """(Re)makes the int32 tensor of page tables [t, width], row starts and lengths."""
        t, step = self.t, self._WIDTH_STEP
        self.width = width = max(step, -(-pages // step) * step)
        self.meta = torch.zeros(t * width + 2 * t, dtype=torch.int32)
        self._meta = self.meta.numpy()
        self._meta[t * width : t * width + t] = range(t)
        self._pages: list[list[int]] = [[] for _ in range(t)]  # what each table row holds
        at = self.meta.data_ptr()
        self.tables, self.rows, self.lens = at, at + t * width * 4, at + (t * width + t) * 4

    @classmethod
    def make(cls, model: Any, kv: Any, moe: Any, states: list[Any]) -> DecodeLane | None:
        """A lane for decode steps of ``states``' rows, or None where the model's forward must
        run them (a layer or an end off the native path, the pool or experts elsewhere)."""

        if type(model) is not CausalLM or not cpu_decode.on_cpu(model.embed_tokens.weight, kv, moe):
            return None
        if model.rope.cfg.rotary_dim == 0 or model.rope.inv_freq.device.type != "cpu":
            return None
        layers = model._decoder_layers
        plans = [p for p in (layer.decode_plan() for layer in layers) if p is not None]
        head = model.decode_head()
        if len(plans) != len(layers) or not head.whole_ok:
            return None
        dense_native.ensure_configured()  # a process's first forward may be this step
        return cls(kv, moe, states, model.rope, head, plans)

    def fits(self, model: Any, kv: Any, moe: Any, states: list[Any]) -> bool:
        """Whether this lane runs the next step of ``states``: the same rows in the same order,
        the same model ends, KV pool and experts, the fast path still on."""
        return (
            cpu_decode.enabled()
            and len(states) == self.t
            and all(a is b for a, b in zip(states, self.states, strict=True))
            and kv is self.kv
            and moe is self.moe
            and moe.executor is self.executor
            and model.decode_head() is self.head
        )

    def forward(self, tokens: list[int]) -> Tensor:
        """Logits [t, vocab] fp32 of one decode step: row i feeds ``tokens[i]`` after its
        state's cached tokens (the pages for it reserved; the caller counts it cached after)."""
        ps = self.kv.page_size
        t, width = self.t, self.width
        need = max(len(st.pages) for st in self.states)
        if need > width:
            self._tables(need)
            width = self.width
        top = 0
        for i, st in enumerate(self.states):
            p = st.num_tokens
            pages = st.pages
            if pages != self._pages[i]:
                row = self._meta[i * width : (i + 1) * width]
                row[:] = 0
                row[: len(pages)] = pages
                self._pages[i] = list(pages)
            self._ids[i] = tokens[i]
            self._pos[i] = p
            self._slots[i] = pages[p // ps] * ps + p % ps
            self._meta[t * width + t + i] = p + 1
            top = max(top, p)
        cos, sin = self.rope.table(top)
        if t == 1:  # the table's row itself: [1, rot / 2] contiguous
            off = top * cos.shape[1] * cos.element_size()
            c, s = cos.data_ptr() + off, sin.data_ptr() + off
        else:
            torch.index_select(cos, 0, self.pos, out=self.cos_rows)
            torch.index_select(sin, 0, self.pos, out=self.sin_rows)
            c, s = self.cos_rows.data_ptr(), self.sin_rows.data_ptr()
        logits = torch.empty(t, self.head.lm_rows, dtype=torch.float32)
        dense_native._native.decode_layers(
            self.natives, self.h.data_ptr(), t, c, s, self.rot, self.interleaved,
            self.slots.data_ptr(), self.tables, self.rows, self.lens, width,
            cpu_decode.kv_layers(self.kv), self.num_experts, self.qmoe, self.float_experts,
            self.experts, cpu_decode.timings(), self.head.ends(self.ids, logits),
            tier=self.tier,
        )  # fmt: skip
        return logits
