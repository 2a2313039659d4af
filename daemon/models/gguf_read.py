"""Reading a GGUF file's metadata and block tensors: what ``gguf_config``, ``gguf_arch`` and the
family modules' GGUF rules share.

``GgufMeta`` is what a family's metadata hook sees (llama.cpp's keys under ``<arch>.``, the
tensor table, and the generic fields already read); the rest are the pieces several families
use: the YaRN and partial-rotary rope fields, the sigmoid-router check, the shared-expert
tensor names and the ``(1 + w)`` norm offset. No family is named here, and torch is not
imported (the family registry is read by the config parser, which runs without it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .config import ConfigError

if TYPE_CHECKING:
    import torch

    from ..formats.gguf_file import GgufTensor

# a transform from the GGUF tensor back to our parameter's layout
Fix = Callable[["torch.Tensor"], "torch.Tensor"]
# (our parameter name under ``layers.N.``, the transform from the GGUF tensor, or None)
Target = tuple[str, Fix | None]

SIGMOID = 2  # llama.cpp's expert_gating_func for a sigmoid router

# llama.cpp's names of the shared expert's projections (blk.N.<key> -> layers.N.<ours>)
SHARED_EXPERT = {
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
}
# a sigmoid router's score-correction bias
SCORE_BIAS = {"exp_probs_b.bias": "mlp.score_bias"}


@dataclass(frozen=True)
class GgufMeta:
    """One file's metadata, as a family's metadata hook reads it."""

    arch: str  # general.architecture
    meta: dict[str, Any]  # every key, with its prefix
    tensors: dict[str, GgufTensor]
    source: str  # the file, for messages
    n: int  # decoder layers (block_count less the multi-token-prediction layers)
    head_dim: int  # the generic reading of attention.key_length
    # a tensor's values by name, for the few facts stored as a tensor (None: not readable)
    read: Callable[[str], Any] | None = None

    def get(self, key: str, default: Any = ...) -> Any:
        """``<arch>.<key>``; absent: ``default``, or a ConfigError without one."""
        v = self.meta.get(f"{self.arch}.{key}")
        if v is None:
            if default is ...:
                raise ConfigError(f"{self.source}: missing GGUF metadata key '{self.arch}.{key}'")
            return default
        return v

    def has(self, name: str) -> bool:
        return name in self.tensors


def yarn(m: GgufMeta, **extra: Any) -> dict[str, Any]:
    """The rope fields of a file's YaRN scaling (``rope.scaling.*``), or none without it."""
    if m.get("rope.scaling.type", None) != "yarn":
        return {}
    return {
        "rope_type": "yarn",
        "factor": float(m.get("rope.scaling.factor")),
        "original_max_position_embeddings": int(m.get("rope.scaling.original_context_length")),
        "beta_fast": float(m.get("rope.scaling.yarn_beta_fast", 32.0)),
        "beta_slow": float(m.get("rope.scaling.yarn_beta_slow", 1.0)),
        **extra,
    }


def plain_rope(m: GgufMeta, head_dim: int, rotary_dim: int) -> dict[str, Any]:
    """``rope_parameters`` for a rope over the first ``rotary_dim`` of each head (+ YaRN)."""
    rope: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": float(m.get("rope.freq_base", 10000.0)),
        "partial_rotary_factor": rotary_dim / head_dim,
    }
    rope.update(yarn(m))
    return rope


def sigmoid_router(m: GgufMeta) -> None:
    """Refuses a file whose router is not the sigmoid one its family has."""
    if int(m.get("expert_gating_func", SIGMOID)) != SIGMOID:
        raise ConfigError(f"{m.source}: {m.arch} with a softmax router is not supported")


def routerless_layers(m: GgufMeta) -> list[int]:
    """The layers without a router (``ffn_gate_inp``): dense MLP layers (``mlp_only_layers``)."""
    return [i for i in range(m.n) if not m.has(f"blk.{i}.ffn_gate_inp.weight")]


def minus_one(t: torch.Tensor) -> torch.Tensor:
    """Undoes a ``(1 + w)`` norm weight stored with the 1 added."""
    return t - 1
