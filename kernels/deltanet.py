"""Gated DeltaNet on the device (models/layers/deltanet.py): the batched single-token decode
step, and the chunked prefill of one sequence (``deltanet_prefill``, below).

Per sequence b and value head h, with the state S [dk, dv] fp32 of that sequence's layer:
    S <- exp(g) S;   S <- S + k (beta (v - k^T S))^T;   o = q^T S
(``delta_rule_recurrent`` of the model with one token). q and k come L2-normalised, q scaled.

Layout: q, k [n, kh, dk] (kh key heads; value head h reads key head h // (H / kh), as the
model's ``repeat_interleave``: already repeated q / k are kh = H); v [n, H, dv]; g, beta [n, H]
(any float dtype, widened to fp32); the output o [n, H, dv] fp32. Each sequence keeps its own
recurrent state tensor ``ssm`` [L, H, dk, dv] fp32 contiguous (freetokend.kv.seq_state), so
one launch serves the whole batch through a table of those tensors' addresses (int64 [n], built
once per batch on the host by ``state_pointers``, sent with the step's other metadata): program
(b, h, j) reads the state of layer ``layer`` at ``ptrs[b] + layer * H * dk * dv``, updates it in
place and writes o[b, h, j * BV : (j + 1) * BV].

Grid (n, H, dv / BV): a program holds a [dk, BV] fp32 tile of one head's state in registers;
the update is column-wise independent (k^T S and q^T S reduce over dk only), so the dv blocks
never meet. ``deltanet_decode_reference`` computes the same in plain torch (a loop over
sequences); ``deltanet_prefill_reference`` the recurrence token by token. Kernels and references
run in the Triton interpreter on CPU tensors (tests, ``interp.for_device``).
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from .interp import for_device

NUM_WARPS = 4


def block_v(dk: int, dv: int) -> int:
    """State columns per program: a [dk, BV] fp32 tile of 4096 values (32 per thread at 4
    warps), at most dv's power of two; more programs, not wider tiles, fill the card (the step
    is memory bound: the state is read and written once). The register budget decides (compile
    test, dk 128): BV 32 takes 95 registers on sm_86 / sm_90, BV 64 159-168, BV 16 55."""
    return max(1, min(triton.next_power_of_2(dv), max(16, 4096 // triton.next_power_of_2(dk))))


# the layer offset changes per layer: never specialised (layer 0 would be another kernel)
@triton.jit(do_not_specialize=["layer_off"])
def _recurrent_step_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, states_ptr, o_ptr, layer_off,
                   H: tl.constexpr, HK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                   BK: tl.constexpr, BV: tl.constexpr):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    j = tl.program_id(2)
    hk = h // (H // HK)
    kk = tl.arange(0, BK)
    km = kk < DK
    vv = j * BV + tl.arange(0, BV)
    vm = vv < DV
    q = tl.load(q_ptr + (b * HK + hk) * DK + kk, mask=km, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + (b * HK + hk) * DK + kk, mask=km, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + (b * H + h) * DV + vv, mask=vm, other=0.0).to(tl.float32)
    decay = tl.exp(tl.load(g_ptr + b * H + h).to(tl.float32))
    beta = tl.load(beta_ptr + b * H + h).to(tl.float32)
    base = tl.load(states_ptr + b).to(tl.pointer_type(tl.float32))
    sp = base + layer_off + h.to(tl.int64) * (DK * DV) + kk[:, None] * DV + vv[None, :]
    sm = km[:, None] & vm[None, :]
    s = tl.load(sp, mask=sm, other=0.0) * decay  # [BK, BV]
    pred = tl.sum(s * k[:, None], axis=0)  # k^T S, [BV]
    delta = (v - pred) * beta
    s = s + k[:, None] * delta[None, :]
    o = tl.sum(s * q[:, None], axis=0)
    tl.store(sp, s, mask=sm)
    tl.store(o_ptr + (b * H + h) * DV + vv, o, mask=vm)


def state_pointers(states: list[torch.Tensor]) -> torch.Tensor:
    """The kernel's state table on the host: int64 [n] addresses of the states' first element
    (zeros for fake tensors, which hold no memory: the fake CUDA tier launches nothing)."""
    from torch._subclasses.fake_tensor import is_fake

    for s in states:  # what the kernel's address arithmetic assumes; once per batch
        if s.dtype != torch.float32 or not s.is_contiguous() or s.shape != states[0].shape:
            raise ValueError(
                f"states must be contiguous fp32 of one shape: {s.dtype}{tuple(s.shape)} "
                f"beside {tuple(states[0].shape)}"
            )
        if s.device != states[0].device:
            raise RuntimeError(f"states on different devices: {states[0].device}, {s.device}")
    return torch.tensor([0 if is_fake(s) else s.data_ptr() for s in states], dtype=torch.int64)


def _check(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: list[torch.Tensor],
    layer: int,
    every_state: bool = True,
) -> None:
    """Shapes and dtypes; ``every_state`` False checks the first state only (the launcher, per
    layer: ``state_pointers`` checked them all once for the batch)."""
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3:
        raise ValueError(
            f"q, k [n, kh, dk] and v [n, H, dv] expected, got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    n, kh, dk = q.shape
    heads, dv = v.shape[1], v.shape[2]
    if v.shape[0] != n or heads % kh:
        raise ValueError(f"{n} rows of {kh} key heads against v {tuple(v.shape)}")
    if g.shape != (n, heads) or beta.shape != (n, heads):
        raise ValueError(
            f"g and beta must be ({n}, {heads}): {tuple(g.shape)}, {tuple(beta.shape)}"
        )
    if len(states) != n:
        raise ValueError(f"{len(states)} states for {n} rows")
    for s in states if every_state else states[:1]:
        if s.dim() != 4 or tuple(s.shape[1:]) != (heads, dk, dv) or not 0 <= layer < s.shape[0]:
            raise ValueError(
                f"state {tuple(s.shape)} is not [L, {heads}, {dk}, {dv}] with layer {layer}"
            )
        if s.dtype != torch.float32 or not s.is_contiguous():
            raise ValueError(f"states must be contiguous fp32, got {s.dtype}")


def deltanet_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: list[torch.Tensor],
    state_ptrs: torch.Tensor,
    layer: int,
) -> torch.Tensor:
    """One decode step of every row; returns o [n, H, dv] fp32 and updates layer ``layer`` of
    each row's state in place. Everything stays on the device (no host read).

    q, k [n, kh, dk]; v [n, H, dv]; g, beta [n, H]; states: row b's ``ssm`` [L, H, dk, dv]
    fp32 contiguous; state_ptrs int64 [n] on the device, ``state_pointers(states)``.
    """
    _check(q, k, v, g, beta, states, layer, every_state=False)
    n, kh, dk = (int(x) for x in q.shape)
    heads, dv = int(v.shape[1]), int(v.shape[2])
    out = torch.empty(n, heads, dv, dtype=torch.float32, device=v.device)
    if n == 0:
        return out
    if v.device.type != "cpu" and triton.knobs.runtime.interpret:
        # TRITON_INTERPRET=1 with device tensors: the interpreter copies the arguments to the
        # host, but the table holds device addresses; the reference computes the same
        out.copy_(deltanet_decode_reference(q, k, v, g, beta, states, layer))
        return out
    bv = block_v(dk, dv)
    qc, kc, vc, gc, bc = (t.contiguous() for t in (q, k, v, g, beta))
    mod = for_device(sys.modules[__name__], v.device)
    mod._recurrent_step_kernel[(n, heads, triton.cdiv(dv, bv))](
        qc, kc, vc, gc, bc, state_ptrs, out, layer * heads * dk * dv,
        H=heads, HK=kh, DK=dk, DV=dv, BK=triton.next_power_of_2(dk), BV=bv,
        num_warps=NUM_WARPS,
    )  # fmt: skip
    return out


def deltanet_decode_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: list[torch.Tensor],
    layer: int,
) -> torch.Tensor:
    """``deltanet_decode`` in plain torch: the recurrence per sequence, fp32, the states
    updated in place."""
    _check(q, k, v, g, beta, states, layer)
    rep = v.shape[1] // q.shape[1]
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for b, st in enumerate(states):
        qb, kb = (t[b].float().repeat_interleave(rep, dim=0) for t in (q, k))  # [H, dk]
        s = st[layer] * g[b].float().exp()[:, None, None]
        pred = torch.einsum("hk,hkv->hv", kb, s)
        delta = (v[b].float() - pred) * beta[b].float()[:, None]
        s = s + kb[:, :, None] * delta[:, None, :]
        out[b] = torch.einsum("hk,hkv->hv", qb, s)
        st[layer].copy_(s)
    return out


# -- prefill: one sequence's chunk of tokens, the chunked (WY) form --------------------------
# The same function as the recurrence over n tokens (the model's ``delta_rule_chunked``), one
# launch per sequence's chunk with grid (H, dv / BV): each program carries its columns of one
# head's state through the chunks in order.

# Tokens per inner step, warps and the dk block of the products over dk. The register budget
# decides (compile test, dk = dv = 128, BV 32, fp32 IEEE dots): chunks of 32 at 8 warps take
# 94-128 registers; chunks of 64 spill on every target (255 registers and 250-800 B of stack at
# 4 or 8 warps), chunks of 32 at 4 warps reach 255 (and spill with KB 16).
PREFILL_CHUNK = 32
PREFILL_WARPS = 8
PREFILL_KB = 32


# the length is never specialised (a 16-multiple or a 1-token chunk would be another kernel)
@triton.jit(do_not_specialize=["n"])
def _prefill_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, s_ptr, o_ptr, n,
                    H: tl.constexpr, HK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                    KB: tl.constexpr, BV: tl.constexpr, C: tl.constexpr):  # fmt: skip
    """Program (h, j): columns [j BV, (j + 1) BV) of head h's state over all n tokens, C at a
    time. Per chunk with cumulative log-decay c: T = (I + A)^-1 (A_ij = beta_i e^(c_i - c_j)
    k_i.k_j, j < i) by forward substitution, V' = T (beta V - beta e^c K S),
    O = e^c Q S + tril(e^(c_i - c_j) Q K^T) V', S <- e^(c_last) S + (e^(c_last - c) K)^T V'.
    Nothing of dk's width stays live: the products over dk run in blocks of KB (K, Q and the
    state's rows loaded per block), and the state is updated in place in its own memory block
    by block (it is this program's alone). fp32 IEEE dots."""
    h = tl.program_id(0)
    j = tl.program_id(1)
    hk = h // (H // HK)
    vv = j * BV + tl.arange(0, BV)
    vm = vv < DV
    r = tl.arange(0, C)
    lower = r[:, None] >= r[None, :]  # j <= i
    eye = (r[:, None] == r[None, :]).to(tl.float32)
    s_base = s_ptr + h.to(tl.int64) * (DK * DV)
    for c0 in range(0, n, C):
        t = (c0 + r).to(tl.int64)
        tm = t < n
        vmask = tm[:, None] & vm[None, :]
        vc = tl.load(v_ptr + (t * H + h)[:, None] * DV + vv[None, :], mask=vmask,
                     other=0.0).to(tl.float32)  # fmt: skip
        gc = tl.load(g_ptr + t * H + h, mask=tm, other=0.0).to(tl.float32)
        bc = tl.load(beta_ptr + t * H + h, mask=tm, other=0.0).to(tl.float32)
        c = tl.cumsum(gc, axis=0)
        # pass 1 over dk: K K^T, Q K^T, K S, Q S
        kk_ = tl.zeros([C, C], dtype=tl.float32)
        qk_ = tl.zeros([C, C], dtype=tl.float32)
        ks = tl.zeros([C, BV], dtype=tl.float32)
        qs = tl.zeros([C, BV], dtype=tl.float32)
        for d0 in range(0, DK, KB):
            d = d0 + tl.arange(0, KB)
            dm = d < DK
            off = (t * HK + hk)[:, None] * DK + d[None, :]
            m = tm[:, None] & dm[None, :]
            kc = tl.load(k_ptr + off, mask=m, other=0.0).to(tl.float32)  # [C, KB]
            qc = tl.load(q_ptr + off, mask=m, other=0.0).to(tl.float32)
            sb = tl.load(s_base + d[:, None] * DV + vv[None, :], mask=dm[:, None] & vm[None, :],
                         other=0.0)  # fmt: skip
            kk_ += tl.dot(kc, tl.trans(kc), input_precision="ieee")
            qk_ += tl.dot(qc, tl.trans(kc), input_precision="ieee")
            ks += tl.dot(kc, sb, input_precision="ieee")
            qs += tl.dot(qc, sb, input_precision="ieee")
        # e^(c_i - c_j) on and below the diagonal (<= 1 there: g <= 0), 0 above
        decay = tl.exp(tl.where(lower, c[:, None] - c[None, :], float("-inf")))
        a = tl.where(lower, kk_ * decay * bc[:, None], 0.0) * (1.0 - eye)  # strictly lower
        tinv = eye
        for i in range(1, C):  # row i of T: e_i - sum_{j<i} A_ij T_j (rows j < i final)
            row = tl.sum(tl.where(r[:, None] == i, a, 0.0), axis=0)  # A_i. [C]
            upd = tl.sum(row[:, None] * tinv, axis=0)
            tinv = tl.where(r[:, None] == i, tinv - upd[None, :], tinv)
        ec = tl.exp(c)
        vn = tl.dot(tinv, (vc - ks * ec[:, None]) * bc[:, None], input_precision="ieee")
        o = qs * ec[:, None] + tl.dot(qk_ * decay, vn, input_precision="ieee")
        tl.store(o_ptr + (t * H + h)[:, None] * DV + vv[None, :], o, mask=vmask)
        c_last = tl.sum(gc, axis=0)  # padded tokens add 0
        kdec = tl.exp(c_last - c)
        tl.debug_barrier()  # every thread's pass-1 reads of the state before it is rewritten
        # pass 2 over dk: the state's rows
        for d0 in range(0, DK, KB):
            d = d0 + tl.arange(0, KB)
            dm = d < DK
            m = tm[:, None] & dm[None, :]
            kc = tl.load(k_ptr + (t * HK + hk)[:, None] * DK + d[None, :], mask=m,
                         other=0.0).to(tl.float32)  # fmt: skip
            sp = s_base + d[:, None] * DV + vv[None, :]
            smask = dm[:, None] & vm[None, :]
            sb = tl.load(sp, mask=smask, other=0.0) * tl.exp(c_last)
            sb += tl.dot(tl.trans(kc * kdec[:, None]), vn, input_precision="ieee")
            tl.store(sp, sb, mask=smask)
        tl.debug_barrier()  # the new state written before the next chunk reads it


def _check_prefill(q, k, v, g, beta, state) -> None:  # type: ignore[no-untyped-def]
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[0] != q.shape[0]:
        raise ValueError(f"q, k [n, kh, dk], v [n, H, dv]: {tuple(q.shape)}, {tuple(v.shape)}")
    n, kh, dk = q.shape
    heads, dv = v.shape[1], v.shape[2]
    if heads % kh or g.shape != (n, heads) or beta.shape != (n, heads):
        raise ValueError(f"{kh} key heads, g {tuple(g.shape)}, beta {tuple(beta.shape)}")
    if tuple(state.shape) != (heads, dk, dv) or state.dtype != torch.float32:
        raise ValueError(f"state must be fp32 ({heads}, {dk}, {dv}), got {tuple(state.shape)}")
    if not state.is_contiguous():
        raise ValueError("state must be contiguous")


def deltanet_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = PREFILL_CHUNK,
) -> torch.Tensor:
    """n tokens of one sequence; returns o [n, H, dv] fp32 and updates ``state`` [H, dk, dv]
    (fp32, contiguous: one layer of the sequence's ``ssm``) in place. q, k [n, kh, dk];
    v [n, H, dv]; g, beta [n, H]. One launch, grid (H, dv / BV)."""
    _check_prefill(q, k, v, g, beta, state)
    n, kh, dk = (int(x) for x in q.shape)
    heads, dv = int(v.shape[1]), int(v.shape[2])
    out = torch.empty(n, heads, dv, dtype=torch.float32, device=v.device)
    if n == 0:
        return out
    bv = max(16, block_v(dk, dv))
    qc, kc, vc, gc, bc = (t.contiguous() for t in (q, k, v, g, beta))
    mod = for_device(sys.modules[__name__], v.device)
    mod._prefill_kernel[(heads, triton.cdiv(dv, bv))](
        qc, kc, vc, gc, bc, state, out, n,
        H=heads, HK=kh, DK=dk, DV=dv, KB=PREFILL_KB, BV=bv, C=chunk, num_warps=PREFILL_WARPS,
    )  # fmt: skip
    return out


def deltanet_prefill_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """``deltanet_prefill`` in plain torch: the recurrence token by token, fp32, the state
    updated in place."""
    _check_prefill(q, k, v, g, beta, state)
    rep = v.shape[1] // q.shape[1]
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    s = state.clone()
    for t in range(q.shape[0]):
        qt, kt = (x[t].float().repeat_interleave(rep, dim=0) for x in (q, k))
        s = s * g[t].float().exp()[:, None, None]
        delta = (v[t].float() - torch.einsum("hk,hkv->hv", kt, s)) * beta[t].float()[:, None]
        s = s + kt[:, :, None] * delta[:, None, :]
        out[t] = torch.einsum("hk,hkv->hv", qt, s)
    state.copy_(s)
    return out
