"""Gated DeltaNet linear attention (Qwen3.5 / Qwen3.6 hybrids).

Per value head the state S [k_dim, v_dim] evolves per token t as
    S <- exp(g_t) * S;   S <- S + k_t (beta_t * (v_t - k_t^T S))^T;   o_t = q_t^T S
with q, k L2-normalised and q scaled by k_dim^-1/2. Prefill uses the chunked (WY) form of the
same recurrence; single-token decode uses the recurrence itself. Both read and update the
sequence's RecurrentState in place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...engine.batch import ForwardBatch
from ...kv.seq_state import RecurrentState
from ..config import ModelConfig
from .common import Linear, Weight, param

_CHUNK = 64


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

    def _mix(
        self, qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, st: RecurrentState
    ) -> torch.Tensor:
        n = qkv.shape[0]
        mixed = self._conv(qkv, st)
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = _l2norm(q.reshape(n, self.kh, self.dk))
        k = _l2norm(k.reshape(n, self.kh, self.dk))
        rep = self.vh // self.kh
        if rep > 1:
            q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
        q = q * self.dk**-0.5
        v = v.reshape(n, self.vh, self.dv)
        beta = torch.sigmoid(b)
        g = -self.A_log.float().exp() * F.softplus(a + self.dt_bias.float())
        rule = delta_rule_recurrent if n == 1 else delta_rule_chunked
        o, st.ssm[self.lin_layer] = rule(q, k, v, g, beta, st.ssm[self.lin_layer])
        return o  # [n, vh, dv]

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        qkv, z = self.in_proj_qkv(x), self.in_proj_z(x)
        a, b = self.in_proj_a(x), self.in_proj_b(x)
        o = torch.empty(x.shape[0], self.vh, self.dv, device=x.device)
        for ch in batch.chunks:
            rows = slice(ch.start, ch.start + ch.length)
            st = ch.state.recurrent
            assert st is not None, "linear attention needs a recurrent state"
            o[rows] = self._mix(qkv[rows], a[rows], b[rows], st)
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm.weight.float()
        o = o * F.silu(z.view_as(o))
        return self.out_proj(o.reshape(x.shape[0], -1))
