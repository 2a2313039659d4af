"""Gated DeltaNet linear attention (Qwen3.5 / Qwen3.6 hybrids).

Per value head the state S [k_dim, v_dim] evolves per token t as
    S <- exp(g_t) * S;   S <- S + k_t (beta_t * (v_t - k_t^T S))^T;   o_t = q_t^T S
with q, k L2-normalised and q scaled by k_dim^-1/2. Prefill uses the chunked (WY) form of the
same recurrence; single-token decode uses the recurrence itself. Both read and update the
sequence's RecurrentState in place.

Decode rows on a GPU with the ``attention_kernel`` setting at "triton" (attention.decode_kernel:
one process-wide switch for the device decode kernels) take one launch per layer of the batched
recurrent step (kernels/deltanet.py, the custom op ftkernels::deltanet_decode) for every decode
row of the batch, each sequence's state updated in place through a table of state addresses
sent once per batch; the causal conv before it runs batched over those rows too (a fixed number
of torch ops per layer, not a few per sequence). A prefill chunk takes one launch of the chunked
kernel (ftkernels::deltanet_prefill) on its sequence's state. Otherwise (the default, and always
on the host) the torch recurrence runs per sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...kv.seq_state import RecurrentState
from ...runtime import staging
from ..batch import ForwardBatch, SeqChunk
from ..config import ModelConfig
from .attention import decode_kernel
from .common import Linear, Weight, param

_CHUNK = 64

# where the "triton" setting applies: a GPU (and the fake CUDA device, where the op's fake impl
# runs); tests add "cpu" (the kernel in the Triton interpreter)
_KERNEL_DEVICES = ("cuda",)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def delta_rule_recurrent(q, k, v, g, beta, state):  # type: ignore[no-untyped-def]
    """q, k [n, H, dk]; v [n, H, dv]; g, beta [n, H]; state [H, dk, dv] -> (o [n, H, dv], state)."""
    outs = []
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        pred = torch.einsum("hk,hkv->hv", k[t], state)
        delta = (v[t] - pred) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        outs.append(torch.einsum("hk,hkv->hv", q[t], state))
    return torch.stack(outs), state


def delta_rule_chunked(q, k, v, g, beta, state, chunk: int = _CHUNK):  # type: ignore[no-untyped-def]
    """The same function as `delta_rule_recurrent`, computed a chunk of tokens at a time.

    Within a chunk with cumulative log-decay c_i, the updates are condensed by solving the unit
    lower-triangular system (I + A) U = beta V, (I + A) W = beta exp(c) K with
    A_ij = beta_i exp(c_i - c_j) k_i.k_j (j < i); then v'_i = U_i - W_i S0,
    o_i = exp(c_i) q_i S0 + sum_{j<=i} exp(c_i - c_j) (q_i.k_j) v'_j and
    S_end = exp(c_last) S0 + sum_j exp(c_last - c_j) k_j v'_j^T.
    """
    n, heads, dk = q.shape
    pad = (-n) % chunk
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, 0, 0, pad)) for t in (g, beta))
    nc = (n + pad) // chunk
    # -> [H, nc, C, ...]
    q, k, v = (t.transpose(0, 1).reshape(heads, nc, chunk, -1) for t in (q, k, v))
    g, beta = (t.transpose(0, 1).reshape(heads, nc, chunk) for t in (g, beta))
    c = g.cumsum(-1)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (c.unsqueeze(-1) - c.unsqueeze(-2)).masked_fill(~lower, float("-inf")).exp()
    kb = k * beta.unsqueeze(-1)
    system = (kb @ k.transpose(-1, -2)) * decay  # diag ignored by unitriangular
    u = torch.linalg.solve_triangular(
        system, v * beta.unsqueeze(-1), upper=False, unitriangular=True
    )
    w = torch.linalg.solve_triangular(
        system, kb * c.exp().unsqueeze(-1), upper=False, unitriangular=True
    )
    attn = (q @ k.transpose(-1, -2)) * decay
    q_dec = q * c.exp().unsqueeze(-1)
    k_dec = k * (c[..., -1:] - c).exp().unsqueeze(-1)
    last = c[..., -1].exp()
    out = torch.empty_like(v)
    for i in range(nc):
        vn = u[:, i] - w[:, i] @ state
        out[:, i] = q_dec[:, i] @ state + attn[:, i] @ vn
        state = state * last[:, i, None, None] + k_dec[:, i].transpose(-1, -2) @ vn
    out = out.reshape(heads, nc * chunk, -1)[:, :n].transpose(0, 1)
    return out, state


class _DecodeStates:
    """The decode rows of one forward batch for the recurrent step kernel, built once per batch
    by its first DeltaNet layer: their chunks and state tensors, and on the device in one
    asynchronous copy (runtime/staging) their rows (int64, for index_select / index_copy) and
    the states' addresses (the kernel's table)."""

    def __init__(self, batch: ForwardBatch, device: torch.device) -> None:
        # deferred: triton (the ftkernels GPU kernels)
        from ftkernels.deltanet import state_pointers

        self.chunks: list[SeqChunk] = [ch for ch in batch.chunks if ch.length == 1]
        self.n = len(self.chunks)
        self.all_rows = self.n == sum(ch.length for ch in batch.chunks)  # rows 0..n-1 in order
        states = []
        for ch in self.chunks:
            assert ch.state.recurrent is not None, "linear attention needs a recurrent state"
            states.append(ch.state.recurrent.ssm)
        self.states: list[torch.Tensor] = states
        self.convs: list[torch.Tensor] = [ch.state.recurrent.conv for ch in self.chunks]  # type: ignore[union-attr]
        rows = torch.tensor([ch.start for ch in self.chunks], dtype=torch.int64)
        meta = staging.to_device(torch.stack([rows, state_pointers(states)]), device)
        self.index, self.ptrs = meta[0], meta[1]


def _decode_states(batch: ForwardBatch, device: torch.device) -> _DecodeStates:
    """The batch's `_DecodeStates`, built by its first DeltaNet layer."""
    dec = batch.derived.get("deltanet_decode_states")
    if dec is None:
        dec = batch.derived["deltanet_decode_states"] = _DecodeStates(batch, device)
    return dec  # type: ignore[no-any-return]


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, lin_layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.lin_layer = lin_layer
        self.kh, self.vh = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = self.kh * self.dk, self.vh * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = cfg.linear_conv_kernel
        hid = cfg.hidden_size
        self.in_proj_qkv = Linear(hid, self.conv_dim, dtype)
        self.in_proj_z = Linear(hid, self.value_dim, dtype)
        self.in_proj_b = Linear(hid, self.vh, dtype)
        self.in_proj_a = Linear(hid, self.vh, dtype)
        self.conv1d = Weight(self.conv_dim, 1, self.kernel, dtype=dtype)
        self.dt_bias = param(self.vh, dtype=dtype)
        self.A_log = param(self.vh, dtype=dtype)
        self.norm = Weight(
            self.dv, dtype=dtype
        )  # gated RMSNorm per value head (plain w, not 1 + w)
        self.eps = cfg.rms_norm_eps
        self.out_proj = Linear(self.value_dim, hid, dtype)

    @staticmethod
    def new_state(
        cfg: ModelConfig, num_linear_layers: int, device: torch.device | None = None
    ) -> RecurrentState:
        """A zero state on ``device`` (where the dense part runs; default the host)."""
        kd = cfg.linear_num_key_heads * cfg.linear_key_head_dim
        conv_dim = 2 * kd + cfg.linear_num_value_heads * cfg.linear_value_head_dim
        conv = torch.zeros(num_linear_layers, conv_dim, cfg.linear_conv_kernel - 1, device=device)
        ssm = torch.zeros(
            num_linear_layers,
            cfg.linear_num_value_heads,
            cfg.linear_key_head_dim,
            cfg.linear_value_head_dim,
            device=device,
        )
        return RecurrentState(conv, ssm)

    def _conv(self, x: torch.Tensor, st: RecurrentState) -> torch.Tensor:
        """Causal depthwise conv + SiLU over x [n, C], continuing from the stored last inputs."""
        prev = st.conv[self.lin_layer]  # [C, kernel - 1]
        xc = torch.cat([prev, x.t()], dim=1)  # [C, kernel - 1 + n]
        st.conv[self.lin_layer] = xc[:, xc.shape[1] - (self.kernel - 1) :]
        w = self.conv1d.weight.float()
        return F.silu(F.conv1d(xc.unsqueeze(0), w, groups=self.conv_dim)[0]).t()  # [n, C]

    def _rule_inputs(
        self, mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """q, k [n, kh, dk] (L2-normalised, q scaled; not repeated per value head), v
        [n, vh, dv], g and beta [n, vh] from the conv output [n, C] and the a / b projections."""
        n = mixed.shape[0]
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = _l2norm(q.reshape(n, self.kh, self.dk)) * self.dk**-0.5
        k = _l2norm(k.reshape(n, self.kh, self.dk))
        v = v.reshape(n, self.vh, self.dv)
        beta = torch.sigmoid(b)
        g = -self.A_log.float().exp() * F.softplus(a + self.dt_bias.float())
        return q, k, v, g, beta

    def _mix(
        self,
        qkv: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        st: RecurrentState,
        kernel: bool = False,
    ) -> torch.Tensor:
        n = qkv.shape[0]
        q, k, v, g, beta = self._rule_inputs(self._conv(qkv, st), a, b)
        if kernel:  # the chunked form as one launch (kernels/deltanet.py)
            # deferred: triton (the ftkernels GPU kernels)
            from ftkernels.ops import deltanet_prefill

            return deltanet_prefill(q, k, v, g, beta, st.ssm[self.lin_layer])
        rep = self.vh // self.kh
        if rep > 1:
            q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
        rule = delta_rule_recurrent if n == 1 else delta_rule_chunked
        o, st.ssm[self.lin_layer] = rule(q, k, v, g, beta, st.ssm[self.lin_layer])
        return o  # [n, vh, dv]

    def _decode(
        self, qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dec: _DecodeStates
    ) -> torch.Tensor:
        """The decode rows through the recurrent step kernel: the conv batched over the rows,
        then one launch for all rows; o [n, vh, dv] fp32 in ``dec``'s row order."""
        # deferred: triton (the ftkernels GPU kernels)
        from ftkernels.ops import deltanet_decode

        if not dec.all_rows:
            qkv, a, b = (t.index_select(0, dec.index) for t in (qkv, a, b))
        mixed = self._conv_decode(qkv, dec.convs)
        q, k, v, g, beta = self._rule_inputs(mixed, a, b)
        return deltanet_decode(q, k, v, g, beta, dec.states, dec.ptrs, self.lin_layer)

    def _conv_decode(self, x: torch.Tensor, convs: list[torch.Tensor]) -> torch.Tensor:
        """`_conv` of one token for each of n sequences at once: x [n, C], convs each row's
        conv state [L, C, kernel - 1] (updated in place) -> [n, C]. A fixed number of launches
        for the batch (one gather, one multi-tensor copy back) instead of a few per sequence."""
        prev = torch.stack([c[self.lin_layer] for c in convs])  # [n, C, kernel - 1]
        xn = x.unsqueeze(-1).to(prev.dtype)
        xc = torch.cat([prev, xn], dim=-1)  # [n, C, kernel]
        kept = torch.cat([prev[:, :, 1:], xn], dim=-1)  # the new states, each contiguous
        torch._foreach_copy_([c[self.lin_layer] for c in convs], list(kept.unbind(0)))
        w = self.conv1d.weight.float()[:, 0]  # [C, kernel]
        return F.silu((xc * w).sum(-1))

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        qkv, z = self.in_proj_qkv(x), self.in_proj_z(x)
        a, b = self.in_proj_a(x), self.in_proj_b(x)
        o = torch.empty(x.shape[0], self.vh, self.dv, device=x.device)
        kernel = decode_kernel() == "triton" and x.device.type in _KERNEL_DEVICES
        for ch in batch.chunks:
            if kernel and ch.length == 1:
                continue
            rows = slice(ch.start, ch.start + ch.length)
            st = ch.state.recurrent
            assert st is not None, "linear attention needs a recurrent state"
            o[rows] = self._mix(qkv[rows], a[rows], b[rows], st, kernel)
        if kernel and any(ch.length == 1 for ch in batch.chunks):
            dec = _decode_states(batch, x.device)
            res = self._decode(qkv, a, b, dec)
            if dec.all_rows:
                o = res
            else:
                o.index_copy_(0, dec.index, res)
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm.weight.float()
        o = o * F.silu(z.view_as(o))
        return self.out_proj(o.reshape(x.shape[0], -1))
