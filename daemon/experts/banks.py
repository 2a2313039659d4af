"""Expert banks: the runtime layout of a model's routed experts (ARCHITECTURE §4.1).

Every bank is one tensor whose first dimension is ``flat_id = layer_index * num_experts + expert``
(``layer_index`` counts MoE layers only). The host pool, the slot cache and the CPU executor all
address experts by that id, whatever the checkpoint's layout was.

Shapes (bf16 or fp32; quantised formats add their own scale banks, see ``formats.py``):
    gate_up      [N, 2 * I, H]   rows [0, I) are the gate projection, rows [I, 2I) the up projection
                                 (GPT-OSS's interleaved gate/up is de-interleaved at load time)
    down         [N, H, I]
    gate_up_bias [N, 2 * I]      optional (GPT-OSS)
    down_bias    [N, H]          optional (GPT-OSS)
where N = num_moe_layers * num_experts, H = hidden size, I = moe intermediate size.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from .disk_tier import DiskTier


class Activation(enum.IntEnum):
    """The expert activation. The integer value is what the native executor receives."""

    SILU = 0  # silu(gate) * up
    GPTOSS = 1  # clamped SwiGLU of GPT-OSS: see `activate`
    GELU_TANH = 2  # gelu_pytorch_tanh(gate) * up (Gemma-4)
    SWIGLU_CLAMP = 3  # silu(min(gate, limit)) * clamp(up, -limit, limit) (DeepSeek-V4)


@dataclass(frozen=True)
class ActivationSpec:
    kind: Activation = Activation.SILU
    alpha: float = 1.702  # GPT-OSS only
    limit: float = 7.0  # GPT-OSS and SWIGLU_CLAMP


class Filling(Protocol):
    """Rows still being written into the banks (formats/gguf_early.py ``EarlyFill``)."""

    def wait(self) -> None:
        """Returns once every row is in; raises what stopped the fill."""

    def wait_layer(self, moe_layer: int) -> None:
        """Returns once MoE layer ``moe_layer``'s rows are in; raises what stopped the fill."""

    def done(self) -> bool:
        """Whether the fill has ended."""


@dataclass
class ExpertBanks:
    """All routed experts of one model, flat_id-major.

    ``format`` names the expert format (``formats.FORMATS``); for a quantised one ``gate_up`` and
    ``down`` hold the packed/quantised weights and ``extra`` its scale banks, flat_id-major too.
    The shape properties below read ``gate_up``/``down`` as float banks: for a packed format use
    ``formats.get_format(banks.format)`` instead.
    """

    gate_up: torch.Tensor
    down: torch.Tensor
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    format: str = "bf16"
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    # GGUF block banks whose q4_k / q6_k projections have their rows interleaved by 8 per expert
    # (``formats.interleave_banks``, for the native kernels); ``formats.expert_tensors`` undoes it
    interleaved: bool = False
    # the disk tier (experts/disk_tier.py): the weight banks hold no data (meta tensors; biases
    # stay resident) and the experts are read from this source into a RAM cache on demand
    disk: DiskTier | None = None
    # the fill still writing the experts' rows where the load returned before it ended
    # (formats/gguf_early.py: the daemon serves while the pool is read); None: every row is in
    filling: Filling | None = None

    def wait_filled(self) -> None:
        """Returns once every expert's rows are in (``filling``); raises what stopped the
        fill. A reader of the banks other than the cpu backend's layer by layer calls it first."""
        if self.filling is not None:
            self.filling.wait()
            self.filling = None

    @property
    def num_flat(self) -> int:
        if self.format.startswith("layers:"):
            # per-layer block banks (formats.layered_format): one gate_up bank per block type,
            # ``gate_up`` and ``gate_up.<type>`` (in ``extra``), each holding the experts of its
            # layers; together they hold every flat id once
            return sum(
                int(t.shape[0])
                for name, t in self.all_tensors().items()
                if name.partition(".")[0] == "gate_up"
            )
        return int(self.gate_up.shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.gate_up.shape[2])

    @property
    def intermediate_size(self) -> int:
        return int(self.down.shape[2])

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"gate_up": self.gate_up, "down": self.down}
        if self.gate_up_bias is not None:
            out["gate_up_bias"] = self.gate_up_bias
        if self.down_bias is not None:
            out["down_bias"] = self.down_bias
        return out

    def all_tensors(self) -> dict[str, torch.Tensor]:
        """``tensors()`` plus the format's scale banks (``extra``)."""
        return {**self.tensors(), **self.extra}

    def nbytes_per_expert(self) -> int:
        """Bytes of one expert in every bank, scale banks of a quantised format included
        (per-layer block banks: the mean over experts, rounded up)."""
        if self.format.startswith("layers:"):
            total = sum(t.numel() * t.element_size() for t in self.all_tensors().values())
            return -(-total // self.num_flat)
        return sum(t[0].numel() * t.element_size() for t in self.all_tensors().values())


def activation_of(name: str) -> Activation:
    """ModelConfig.activation -> the expert activation."""
    return {
        "gptoss": Activation.GPTOSS,
        "gelu_tanh": Activation.GELU_TANH,
        "swiglu_clamp": Activation.SWIGLU_CLAMP,
    }.get(name, Activation.SILU)


def activate(gate_up: torch.Tensor, spec: ActivationSpec) -> torch.Tensor:
    """[T, 2I] -> [T, I], in the dtype of the input (callers pass fp32)."""
    inter = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :inter], gate_up[..., inter:]
    if spec.kind == Activation.SILU:
        return torch.nn.functional.silu(gate) * up
    if spec.kind == Activation.GELU_TANH:
        return torch.nn.functional.gelu(gate, approximate="tanh") * up
    gate = gate.clamp(max=spec.limit)
    up = up.clamp(min=-spec.limit, max=spec.limit)
    if spec.kind == Activation.SWIGLU_CLAMP:
        return torch.nn.functional.silu(gate) * up
    glu = gate * torch.sigmoid(gate * spec.alpha)
    return (up + 1) * glu


def moe_reference(
    x: torch.Tensor,
    flat_ids: torch.Tensor,
    weights: torch.Tensor,
    banks: ExpertBanks,
    act: ActivationSpec,
) -> torch.Tensor:
    """Plain-torch reference of the routed-expert sum, computed in fp32.

    x        [T, H]  activations
    flat_ids [T, K]  int, flat expert ids; -1 means "skip this route"
    weights  [T, K]  gate weights (already normalised as the family wants)
    returns  [T, H]  fp32: sum_k weights[t, k] * expert_{flat_ids[t, k]}(x[t])

    Each route's term is kept apart and the K terms of a token are summed in route order, so the
    result does not depend on the numbering of ``flat_ids`` (slot ids of a slot cache change with
    every eviction and resize; an order by id would round differently after each).
    """
    xf = x.float()
    ids = flat_ids.long()
    routed = torch.zeros(*ids.shape, x.shape[1], dtype=torch.float32, device=x.device)
    for fid in torch.unique(ids).tolist():
        if fid < 0:
            continue
        tok, slot = torch.nonzero(ids == fid, as_tuple=True)
        h = xf[tok] @ banks.gate_up[fid].float().t()
        if banks.gate_up_bias is not None:
            h = h + banks.gate_up_bias[fid].float()
        y = activate(h, act) @ banks.down[fid].float().t()
        if banks.down_bias is not None:
            y = y + banks.down_bias[fid].float()
        routed[tok, slot] = y * weights[tok, slot].float().unsqueeze(-1)
    return routed.sum(dim=1)
