"""The Triton kernels as torch custom ops, each with a fake (shape-only) implementation.

Callers on the device path go through these ops rather than launching the kernels directly:
on a real GPU the op runs the kernel; under ``FakeTensorMode`` (the fake CUDA device of tests
and ``ftctl plan``) the fake implementation gives outputs of the right shape, dtype and device
without launching anything, so the code around the kernels runs as it does on a GPU.
"""

from __future__ import annotations

import torch

# slot-cache state tensors in the order of ``SlotState`` (see freetokend.experts.slot_cache)
_STATE = (
    "slot_of",
    "id_of_slot",
    "last_used",
    "last_visit",
    "reserved",
    "freq",
    "visits",
    "step",
    "fill_ratio",
    "stats",
)


@torch.library.custom_op("ftkernels::copy_rows", mutates_args=("dst",))
def copy_rows(
    dst: torch.Tensor,
    src: torch.Tensor,
    dst_idx: torch.Tensor,
    src_idx: torch.Tensor,
    count: torch.Tensor,
) -> None:
    """dst[dst_idx[i]] <- src[src_idx[i]] for i < count[0] (``moe_decode.copy_rows``)."""
    from . import moe_decode

    moe_decode.copy_rows(dst, src, dst_idx, src_idx, count)


@copy_rows.register_fake
def _(dst, src, dst_idx, src_idx, count) -> None:  # type: ignore[no-untyped-def]
    if dst.dtype != src.dtype or dst.shape[1:] != src.shape[1:]:
        raise ValueError(
            f"row mismatch: {dst.dtype}{tuple(dst.shape)} vs {src.dtype}{tuple(src.shape)}"
        )
    _same_device(dst, dst_idx, src_idx, count)


@torch.library.custom_op("ftkernels::moe_decode", mutates_args=())
def moe_decode(
    x: torch.Tensor,
    slot_ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    gate_up_bias: torch.Tensor | None,
    down_bias: torch.Tensor | None,
    act: int,
    alpha: float,
    limit: float,
) -> torch.Tensor:
    """Routed-expert sum from slot banks, [T, H] fp32 (``moe_decode.moe_decode``)."""
    from . import moe_decode as k

    return k.moe_decode(
        x, slot_ids, weights, gate_up, down, gate_up_bias, down_bias, act, alpha, limit
    )


@moe_decode.register_fake
def _(x, slot_ids, weights, gate_up, down, gate_up_bias, down_bias, act, alpha, limit):  # type: ignore[no-untyped-def]
    _same_device(x, slot_ids, weights, gate_up, down)
    t, k = slot_ids.shape
    r, h_dim, i_dim = t * k, down.shape[1], down.shape[2]
    # the kernel's fp32 work buffers: activations [R, I] and route outputs [R, H]
    x.new_empty((r, i_dim), dtype=torch.float32)
    y = x.new_empty((r, h_dim), dtype=torch.float32)
    return y.new_empty((t, h_dim))


@torch.library.custom_op(
    "ftkernels::slot_decode_step",
    mutates_args=_STATE,  # type: ignore[arg-type]
)
def slot_decode_step(
    slot_of: torch.Tensor,
    id_of_slot: torch.Tensor,
    last_used: torch.Tensor,
    last_visit: torch.Tensor,
    reserved: torch.Tensor,
    freq: torch.Tensor,
    visits: torch.Tensor,
    step: torch.Tensor,
    fill_ratio: torch.Tensor,
    stats: torch.Tensor,
    flat_ids: torch.Tensor,
    layer: int,
    num_experts: int,
    policy: int,
    idx_bits: int,
    prio_max: int,
    freq_cap: int,
    freq_shift: int,
    key_max: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One slot-cache decode step (``slot_cache.decode_step_triton``); returns (slot_ids
    [T, K], cpu_ids [T, K], copy_src_flat [N], copy_dst_slot [N], num_copies [1]), int32."""
    from types import SimpleNamespace

    from .slot_cache import decode_step_triton

    st = SimpleNamespace(**dict(zip(_STATE, (
        slot_of, id_of_slot, last_used, last_visit, reserved, freq, visits, step, fill_ratio,
        stats,
    ), strict=True)))  # fmt: skip
    return decode_step_triton(
        st,  # type: ignore[arg-type]
        flat_ids,
        layer,
        num_experts,
        policy,
        idx_bits=idx_bits,
        prio_max=prio_max,
        freq_cap=freq_cap,
        freq_shift=freq_shift,
        key_max=key_max,
    )


@slot_decode_step.register_fake
def _(
    slot_of,
    id_of_slot,
    last_used,
    last_visit,
    reserved,
    freq,
    visits,
    step,
    fill_ratio,
    stats,
    flat_ids,
    *rest,
):  # type: ignore[no-untyped-def]
    _same_device(slot_of, id_of_slot, flat_ids)
    n = flat_ids.numel()

    def out(*shape: int) -> torch.Tensor:
        return flat_ids.new_empty(shape, dtype=torch.int32)

    return out(*flat_ids.shape), out(*flat_ids.shape), out(n), out(n), out(1)


@torch.library.custom_op("ftkernels::paged_decode_attention", mutates_args=())
def paged_decode_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    rows: torch.Tensor,
    max_len: int,
    scale: float,
    window: int | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Decode attention of q[rows] over their KV pages, [n, heads, d] in q's dtype
    (``paged_attention.paged_decode_attention``)."""
    from . import paged_attention as k

    return k.paged_decode_attention(
        q, k_pages, v_pages, tables, lens, rows, max_len, scale, window, sinks
    )


@paged_decode_attention.register_fake
def _(q, k_pages, v_pages, tables, lens, rows, max_len, scale, window, sinks):  # type: ignore[no-untyped-def]
    from . import paged_attention as k

    k._check(q, k_pages, v_pages, tables, lens, rows, sinks)
    _same_device(q, k_pages, v_pages, tables, lens, rows, *([] if sinks is None else [sinks]))
    n, heads, d = rows.shape[0], q.shape[1], q.shape[2]
    keys = max_len if window is None else min(max_len, window)
    splits, _ = k.splits_for(n, k_pages.shape[2], keys, d)
    # the kernel's fp32 workspace
    for shape in k.workspace_shapes(n, heads, d, splits):
        q.new_empty(shape, dtype=torch.float32)
    return q.new_empty((n, heads, d))


@torch.library.custom_op("ftkernels::deltanet_decode", mutates_args=("states",))
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
    """One Gated DeltaNet decode step of every row, o [n, H, dv] fp32; updates layer ``layer``
    of each row's state in place (``deltanet.deltanet_decode``: the kernel reaches the states
    through ``state_ptrs``; ``states`` names them so that the mutation is declared)."""
    from . import deltanet as k_

    return k_.deltanet_decode(q, k, v, g, beta, states, state_ptrs, layer)


@deltanet_decode.register_fake
def _(q, k, v, g, beta, states, state_ptrs, layer):  # type: ignore[no-untyped-def]
    from . import deltanet as k_

    k_._check(q, k, v, g, beta, states, layer, every_state=False)
    _same_device(v, q, k, g, beta, state_ptrs, *states[:1])
    if state_ptrs.shape != (q.shape[0],) or state_ptrs.dtype != torch.int64:
        raise ValueError(f"state_ptrs must be int64 ({q.shape[0]},), got {state_ptrs.dtype}")
    return v.new_empty(v.shape, dtype=torch.float32)


@torch.library.custom_op("ftkernels::deltanet_prefill", mutates_args=("state",))
def deltanet_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """n tokens of one sequence through Gated DeltaNet, o [n, H, dv] fp32; updates ``state``
    [H, dk, dv] in place (``deltanet.deltanet_prefill``)."""
    from . import deltanet as k_

    return k_.deltanet_prefill(q, k, v, g, beta, state)


@deltanet_prefill.register_fake
def _(q, k, v, g, beta, state):  # type: ignore[no-untyped-def]
    from . import deltanet as k_

    k_._check_prefill(q, k, v, g, beta, state)
    _same_device(v, q, k, g, beta, state)
    return v.new_empty(v.shape, dtype=torch.float32)


def _same_device(*ts: torch.Tensor) -> None:
    """What a launch on a GPU requires: every pointer on the device of the first tensor."""
    dev = ts[0].device
    for t in ts[1:]:
        if t.device != dev:
            raise RuntimeError(f"kernel arguments on different devices: {dev} and {t.device}")
