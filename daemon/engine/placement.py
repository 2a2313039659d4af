"""Where the dense part of a model lives and runs (ARCHITECTURE §4.6: dense weights and the KV pool in
VRAM, only the routed experts cached).

Two placements, chosen once at load from the resolved MoE backend:

- host (the ``cpu`` backend, no accelerator): weights, KV pool, recurrent state and sampling on
  the host; projections, norms and decode attention through the native CPU kernels
  (`dense_native`). This is the engine as it was before placement existed, unchanged.
- device (``fused``, ``offload``, ``hybrid``): embeddings, attention, norms, routers, shared
  experts, dense MLPs, lm_head, rope tables, the paged KV pool and the recurrent (DeltaNet)
  state live on the accelerator's device, and the forward runs torch ops there (the native host
  kernels are switched off by ``scope()``, so the CPU stand-in runs this same device code path).
  Quantized dense weights are dequantized to bf16 on the device. Sampling runs on the device
  with generators of the device; the host receives one small tensor of token ids per step
  (``fetch``, counted as a host sync on the fake device).

One object answers "where": the runner allocates the KV pool and recurrent state on
``Placement.device``, the engine creates its generators there and reads tokens back through
``fetch``. Layers need no placement checks: they make their tensors on their input's device.

Sizing: the dense weights must fit the card whole (``DenseDoesNotFit`` at load, with the numbers;
no silent fallback to the host). The KV pool's default on a card with a memory limit is a share
of what the dense weights leave (``DEVICE_KV_SHARE``); the expert slots are sized after it, from
what is left (``experts.backend.SlotBudget``). ``ftctl plan`` runs these same functions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..experts.accelerator import Accelerator
from ..models.layers.common import Linear, widen_kept_blocks
from ..models.layers.rope import Rope
from ..native import dense_native
from ..runtime import heartbeat
from .sampler import SamplingParams, make_generator

MIB = 1 << 20
# The default device KV pool: this share of the device memory left after the dense weights
# (the expert slots take the rest, less activations); `ftctl cache --kv` moves the split later.
DEVICE_KV_SHARE = 0.25
DEVICE_DTYPE = torch.bfloat16  # quantized dense weights are dequantized to this on the device


class DenseDoesNotFit(torch.OutOfMemoryError):
    """The dense weights (or the KV pool asked for) do not fit the accelerator's memory."""


@dataclass(frozen=True)
class Placement:
    """Where the dense part runs: ``acc`` None is the host placement."""

    device: torch.device
    acc: Accelerator | None = None

    @property
    def on_device(self) -> bool:
        return self.acc is not None

    def scope(self) -> contextlib.AbstractContextManager[None]:
        """Around a forward step: on a device, the native host kernels are off (torch ops)."""
        return dense_native.torch_only() if self.on_device else contextlib.nullcontext()

    def fetch(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the host: on a device one device -> host copy (a host sync)."""
        if self.acc is None or t.device.type == "cpu":
            return t
        return self.acc.to_host(t, torch.device("cpu"))

    def generator(self, params: SamplingParams) -> torch.Generator | None:
        """The seeded generator of a request, on the device its logits are sampled on."""
        return make_generator(params, self.device)


HOST = Placement(torch.device("cpu"))


def _dense_linears(model: nn.Module) -> Iterator[Linear]:
    for m in model.modules():
        if isinstance(m, Linear):
            yield m


def dense_device_bytes(model: nn.Module) -> int:
    """Device bytes of the dense weights: every parameter once (tied embeddings once), a
    quantized projection counted at its bf16 size (it is dequantized on the device)."""
    seen: set[int] = set()
    total = 0
    for m in model.modules():  # Linear, and the modules that hold blocks like it
        qw = getattr(m, "qweight", None)
        if qw is not None:
            seen.add(id(getattr(m, str(getattr(m, "block_param")))))  # noqa: B009
            total += qw.rows * qw.cols * DEVICE_DTYPE.itemsize
        for part in getattr(m, "kv_b_blocks", None) or ():  # MLA's kv_b in blocks
            total += sum(w.rows * w.cols for w in part) * DEVICE_DTYPE.itemsize
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return total


def _ropes(model: nn.Module) -> list[Rope]:
    return [r for r in vars(model).values() if isinstance(r, Rope)]


def check_fits(need: int, acc: Accelerator, what: str) -> None:
    """Raises ``DenseDoesNotFit`` naming ``what``, its size and the device's free memory when
    ``need`` bytes exceed it (no check on a device without a memory limit: the stand-in)."""
    info = acc.mem_get_info()
    if info is None or need <= info[0]:
        return
    free, total = info
    raise DenseDoesNotFit(
        f"{what} do not fit the device: {need / MIB:.0f} MiB needed, {free / MIB:.0f} MiB free "
        f"of {total / MIB:.0f} MiB; `ftctl plan --model DIR --vram SIZE` shows what fits "
        f"(or serve with --moe-backend cpu)"
    )


def place_dense(model: nn.Module, acc: Accelerator) -> Placement:
    """Moves the dense part of ``model`` to ``acc``'s device (a model built on the meta device,
    as ``ftctl plan`` builds it, gets uninitialised device storage). Raises ``DenseDoesNotFit``
    before allocating anything when the weights cannot fit."""
    dev = acc.device
    check_fits(dense_device_bytes(model), acc, "the dense weights (bf16 where quantized)")
    widen_kept_blocks(model, dev, DEVICE_DTYPE)
    for lin in _dense_linears(model):
        qw = lin.qweight
        if qw is None:
            continue
        # the packed blocks cross once; the bf16 matrix is made there
        w = qw.dequantize(dev).to(DEVICE_DTYPE)
        lin.weight = nn.Parameter(w, requires_grad=False)
        lin.qweight = None
    if any(p.is_meta for p in model.parameters()):
        model.to_empty(device=dev)
        for rope in _ropes(model):
            rope.to(dev)
    else:
        _move(model, dev)
    return Placement(dev, acc)


def _move(model: nn.Module, dev: torch.device) -> None:
    """Every parameter and buffer to ``dev`` as a new tensor (tied weights stay tied: one copy
    per original), and the rope tables. Not ``model.to``: for tensor subclasses (the fake
    device's) it swaps tensors in place, which anything holding a reference forbids."""
    moved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (original, its copy)

    def copy(t: torch.Tensor, param: bool) -> torch.Tensor:
        if id(t) not in moved:  # the original is kept in the map: its id cannot be reused
            new = t.detach().to(dev)
            moved[id(t)] = (t, nn.Parameter(new, requires_grad=False) if param else new)
        return moved[id(t)][1]

    with torch.no_grad():
        for mod in model.modules():
            heartbeat.beat()  # parking a large model's dense weights: progress per module
            for name, p in mod._parameters.items():
                if p is not None:
                    mod._parameters[name] = copy(p, True)  # type: ignore[assignment]
            for name, b in mod._buffers.items():
                if b is not None:
                    mod._buffers[name] = copy(b, False)
    for rope in _ropes(model):
        rope.to(dev)


def park_dense(model: nn.Module, placement: Placement) -> None:
    """An idle (parked) model's dense weights go to the host, freeing their device memory for
    the active model; ``unpark_dense`` brings them back (no weight file is read)."""
    if placement.on_device and placement.device.type != "cpu":
        _move(model, torch.device("cpu"))


def unpark_dense(model: nn.Module, placement: Placement) -> None:
    """Undoes ``park_dense``; raises ``DenseDoesNotFit`` (nothing moved) when the device has no
    room for the weights now."""
    if placement.acc is None or placement.device.type == "cpu":
        return
    if next(model.parameters()).device == placement.device:
        return
    check_fits(dense_device_bytes(model), placement.acc, "the dense weights")
    _move(model, placement.device)


def kv_tokens_for(
    requested: int | None, kv_bytes_per_token: int, acc: Accelerator | None, default: int
) -> int:
    """KV pool tokens: ``requested`` when given (on a card: checked to fit what is free now),
    else ``default`` on the host or a device without a memory limit, else ``DEVICE_KV_SHARE`` of
    the card's free memory (call it after ``place_dense``), at most ``default``."""
    info = acc.mem_get_info() if acc is not None else None
    if requested is not None:
        if acc is not None:
            check_fits(requested * kv_bytes_per_token, acc, f"KV pages for {requested} tokens")
        return requested
    if info is None or kv_bytes_per_token == 0:
        return default
    return max(1, min(default, int(info[0] * DEVICE_KV_SHARE) // kv_bytes_per_token))


def device_snapshot_bytes(model: Any, budget: int, on_device: bool) -> int:
    """Device bytes the state snapshots may take: their budget when the state lives on the
    device (a model with linear-attention layers, or with its own state: DeepSeek-V4), else 0."""
    stateful = int(getattr(model, "num_linear_layers", 0)) > 0 or bool(model.own_state)
    return budget if on_device and stateful else 0


def device_state_bytes(model: Any, rows: int, on_device: bool) -> int:
    """Device bytes the model's own per-sequence state takes beside the KV pool for ``rows``
    sequences in flight, past what grows per token (counted with the pool's tokens,
    ``kv_bytes_per_token``): DeepSeek-V4's windows and open compressor windows; 0 on the host
    or for a model without its own state."""
    return rows * int(model.state_bytes_per_seq()) if on_device else 0


def placement_of(model: nn.Module) -> dict[str, str]:
    """Device type of each dense part present in ``model`` (``ftctl plan`` and the tests)."""
    parts: dict[str, list[str]] = {
        "embeddings": ["embed_tokens"],
        "attention": ["self_attn", "linear_attn"],
        "norms": ["norm"],
        "router": ["router"],
        "shared_experts": ["shared_expert"],
        "dense_mlp": ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"],
        "lm_head": ["lm_head"],
    }
    out: dict[str, str] = {}
    named = list(model.named_parameters())
    for part, keys in parts.items():
        devs = {p.device.type for n, p in named if any(k in n for k in keys)}
        if devs:
            out[part] = devs.pop() if len(devs) == 1 else "mixed"
    return out
