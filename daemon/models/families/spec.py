"""The per-family table the weight loader is driven by."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FamilySpec:
    # (regex, replacement) applied in order to checkpoint names (prefix already stripped) to get
    # our parameter names.
    renames: tuple[tuple[str, str], ...] = ()
    # checkpoint tensors deliberately not loaded (regexes on the full checkpoint name)
    ignore: tuple[str, ...] = ()
    # fused expert tensors stored as x @ W ([E, H, 2I] with gate/up interleaved, down [E, I, H]),
    # as GPT-OSS does; otherwise as W x ([E, 2I, H] gate rows then up rows, down [E, H, I]).
    experts_transposed_interleaved: bool = False
