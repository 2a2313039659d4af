"""What llama.cpp's converter did to a GGUF file's block tensors, undone: the names only some
architectures carry and the transforms that bring a tensor back to the HF layout our
parameters keep.

The facts are the families' (``FamilySpec.gguf``, ``families/``): each names its extra block
keys, the transform of a key (the llama Q/K permutation, the hybrids' ``+1`` norms, ...), the
keys that fill several parameters or are read together into one. This module applies them to
the shared table (``gguf_loader``'s); no family is named here.
"""

from __future__ import annotations

from .config import ModelConfig
from .families.spec import GgufJoin, GgufRules
from .gguf_read import SHARED_EXPERT, Fix, Target
from .registry import GGUF_ARCHITECTURES

__all__ = [
    "Fix",
    "Target",
    "block_key",
    "block_targets",
    "joins",
    "split_gate_up",
    "top_fix",
    "top_name",
]


def _rules(arch: str) -> GgufRules:
    rules = GGUF_ARCHITECTURES[arch].gguf
    assert rules is not None  # the table holds the families with GGUF rules
    return rules


def block_targets(arch: str, cfg: ModelConfig, key: str, common: dict[str, str]) -> list[Target]:
    """Where the GGUF block tensor ``blk.N.<key>`` goes (``common``: the names every
    architecture shares); [] for a tensor read with another (``joins``).
    KeyError: a tensor this architecture does not have."""
    rules = _rules(arch)
    if rules.block_split is not None:
        parts = rules.block_split(cfg, key)
        if parts is not None:
            return parts
    name = rules.block[key] if key in rules.block else common[key]
    return [(name, rules.block_fix(cfg, key) if rules.block_fix is not None else None)]


def top_name(arch: str, name: str) -> str | None:
    """Our parameter for a top-level tensor only this architecture has (None: not one)."""
    return _rules(arch).top.get(name)


def top_fix(arch: str, name: str) -> Fix | None:
    """The transform of a top-level tensor (the hybrids' final (1 + w) norm)."""
    return _rules(arch).top_fix.get(name)


def joins(arch: str) -> tuple[GgufJoin, ...]:
    """The block tensors this architecture reads together into one parameter."""
    return _rules(arch).joins


def split_gate_up(cfg: ModelConfig) -> dict[str, Fix]:
    """The gate and up halves of a fused ``ffn_gate_up_exps`` [E, 2I, H] (the converter's
    ``--fuse-gate-up-exps``: gate rows, then up rows)."""
    i = cfg.moe_intermediate_size
    return {"gate": lambda t: t[:, :i], "up": lambda t: t[:, i:]}


def block_key(arch: str, ours: str) -> str | None:
    """The GGUF block key that fills our parameter ``ours`` (under ``layers.N.``) in ``arch``,
    for messages; None where the shared table names it."""
    spec = GGUF_ARCHITECTURES.get(arch)
    rules = spec.gguf if spec is not None else None
    if rules is not None and ours in rules.message_keys:
        return rules.message_keys[ours]
    for table in (SHARED_EXPERT, rules.block if rules is not None else {}):
        for key, name in table.items():
            if name == ours:
                return key
    return None
