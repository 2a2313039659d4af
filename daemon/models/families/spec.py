"""The per-family table the weight loader is driven by."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from ..config import ModelConfig

# (config, our parameter name after renames, tensor) -> [(our parameter name, tensor), ...]
Converter = Callable[["ModelConfig", str, "torch.Tensor"], list[tuple[str, "torch.Tensor"]]]


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
    # (regex on our name, converter): checkpoint tensors that split or reorder into our parameters
    converters: tuple[tuple[str, Converter], ...] = ()
    # semantic anchors (ARCHITECTURE §5.2): token string -> kind. A recurrent-state snapshot is taken right
    # after each such token; tokens the tokenizer does not have are ignored.
    anchors: tuple[tuple[str, str], ...] = ()


# The ChatML markers of the Qwen families (and of the built-in model).
CHATML_ANCHORS = (
    ("<|im_end|>", "end_of_turn"),
    ("</think>", "end_of_thinking"),
    ("<tool_call>", "tool_call_start"),
    ("</tool_call>", "tool_call_end"),
    ("<tool_response>", "tool_output_start"),
    ("</tool_response>", "tool_output_end"),
)
