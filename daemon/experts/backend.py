"""MoE backends: who computes the routed experts of a MoE layer (DESIGN §1).

Every backend implements one call: the gate-weighted sum of the routed experts for a batch of
tokens, returned in fp32. Backends are chosen by name only at the CLI/config boundary
(`create_backend`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Protocol

import torch

from .banks import ActivationSpec, ExpertBanks, moe_reference

log = logging.getLogger(__name__)

BACKENDS = ("cpu", "fused", "offload", "hybrid", "auto")


class MoEBackend(Protocol):
    def forward(
        self, moe_layer: int, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """x [T, H]; expert_ids [T, K] (ids within the layer); weights [T, K] -> [T, H] fp32."""
        ...

    def begin_step(self, num_tokens: int, prefill: bool = False) -> None:
        """Called before a forward step of ``num_tokens`` tokens (prefill streaming starts here)."""
        ...

    def end_step(self) -> None:
        """Called after the step's last layer."""
        ...


class RoutingRecorder:
    """Wraps a backend and appends the routed ids of every (step, MoE layer) to a JSONL file, in
    the format `freetokend.experts.replay` reads: {"phase": "prefill"|"decode", "layer": L,
    "ids": [[expert ids of token 0], ...]}. A step that feeds any prompt chunk counts as prefill."""

    def __init__(self, inner: MoEBackend, path: str | Path) -> None:
        self.inner = inner
        self.path = Path(path)
        self._f = self.path.open("a", encoding="utf-8")
        self.phase = "prefill"

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def begin_step(self, num_tokens: int, prefill: bool = False) -> None:
        self.phase = "prefill" if prefill else "decode"
        self.inner.begin_step(num_tokens, prefill)

    def end_step(self) -> None:
        self.inner.end_step()
        self._f.flush()

    def forward(
        self, moe_layer: int, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        rec = {"phase": self.phase, "layer": moe_layer, "ids": expert_ids.tolist()}
        self._f.write(json.dumps(rec, separators=(",", ":")) + "\n")
        return self.inner.forward(moe_layer, x, expert_ids, weights)

    def close(self) -> None:
        self._f.close()


class CpuBackend:
    """Experts never leave host RAM; the native executor computes them from banks of any format
    it supports (bf16/fp32, fp8_block, mxfp4, nvfp4: see cpu_executor). When the extension is not
    built the torch reference runs instead, on an fp32 dequantised copy for quantised banks."""

    def __init__(
        self, banks: ExpertBanks, num_experts: int, act: ActivationSpec, threads: int | None = None
    ) -> None:
        self.banks = banks
        self.num_experts = num_experts
        self.act = act
        self.executor = None
        try:
            from .cpu_executor import CpuExecutor

            self.executor = CpuExecutor(banks, act, threads=threads)
        except (ImportError, ModuleNotFoundError) as e:
            log.warning("native CPU expert executor unavailable (%s); using the torch reference", e)
            if banks.format != "bf16":  # moe_reference reads float banks: 4 bytes per weight
                from .formats import dequantize_banks

                self.banks = dequantize_banks(banks)

    def begin_step(self, num_tokens: int, prefill: bool = False) -> None:
        pass

    def end_step(self) -> None:
        pass

    def forward(
        self, moe_layer: int, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        return self.forward_flat(
            x, expert_ids.to(torch.int32) + moe_layer * self.num_experts, weights
        )

    def forward_flat(
        self, x: torch.Tensor, flat_ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Routed-expert sum by flat ids [T, K] (-1 = skip the route)."""
        if self.executor is not None:
            return self.executor.forward(
                x.float().contiguous(),
                flat_ids.to(torch.int32).contiguous(),
                weights.float().contiguous(),
            )
        return moe_reference(x, flat_ids, weights, self.banks, self.act)


def create_backend(
    name: str,
    banks: ExpertBanks,
    num_layers: int,
    num_experts: int,
    act: ActivationSpec,
    *,
    accelerator: str = "auto",
    moe_slots: int | None = None,
    bandwidth: tuple[float, float] | None = None,
    threads: int | None = None,
) -> MoEBackend:
    """Builds the MoE backend named at the CLI/config boundary.

    auto: no accelerator -> cpu; with one -> offload, upgraded to hybrid when a bandwidth profile
    (B_P, B_H) says the CPU branch pays (B_H > B_P).
    """
    from .accelerator import StandinAccelerator, create_accelerator

    if name not in BACKENDS:
        raise ValueError(f"unknown MoE backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name == "auto":
        if accelerator == "standin" or (accelerator == "auto" and not torch.cuda.is_available()):
            name = "cpu"
        elif bandwidth is not None and bandwidth[1] > bandwidth[0]:
            name = "hybrid"
        else:
            name = "offload"
            if bandwidth is None:
                log.info(
                    "moe_backend auto: no bandwidth profile stored; using offload (run `ftctl bench bw`)"
                )
    if name == "cpu":
        return CpuBackend(banks, num_experts, act, threads=threads)
    from .device_backends import FusedBackend, OffloadBackend

    if banks.format != "bf16":
        # The accelerator backends compute from float banks (moe_reference, the Triton kernels):
        # quantized experts are dequantized once (e2m1 and e8m0 values are exact in bf16).
        from .formats import dequantize_banks

        log.warning(
            "moe_backend %s: %s experts are dequantized to bf16 (the cpu backend computes them "
            "packed)", name, banks.format,
        )  # fmt: skip
        f = dequantize_banks(banks)
        banks = ExpertBanks(
            f.gate_up.bfloat16(),
            f.down.bfloat16(),
            None if f.gate_up_bias is None else f.gate_up_bias.bfloat16(),
            None if f.down_bias is None else f.down_bias.bfloat16(),
        )

    acc = create_accelerator(accelerator)
    if name == "fused":
        return FusedBackend(banks, num_experts, act, acc)
    for t in banks.tensors().values():  # host pool filled first, registered (pinned) after
        acc.pin(t)
    slots = moe_slots if moe_slots is not None else _default_slots(banks, acc)
    cpu = CpuBackend(banks, num_experts, act, threads=threads) if name == "hybrid" else None
    if name == "hybrid" and bandwidth is None:
        log.info(
            "hybrid: no bandwidth profile stored; q* assumes B_P = B_H until `ftctl bench bw` runs"
        )
    if isinstance(acc, StandinAccelerator):
        log.info("accelerator: CPU stand-in (no GPU): the %s mechanism runs, not for speed", name)
    return OffloadBackend(
        banks,
        num_layers,
        num_experts,
        act,
        acc,
        slots,
        cpu=cpu,
        hybrid=name == "hybrid",
        bandwidth=bandwidth,
    )


def _default_slots(banks: ExpertBanks, acc: object) -> int:
    """Half of all experts, at least two full layers when the model has them."""
    return max(1, banks.num_flat // 2)
