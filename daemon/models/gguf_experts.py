"""GGUF expert tensors kept in their own block format instead of dequantized at load.

When every ``ffn_{gate,up}_exps.weight`` of a file has one type and every ``ffn_down_exps.weight``
one type (possibly another), both of them types the CPU's integer-dot kernels compute
(models/gguf_blocks.py: Q8_0, Q4_K, ...), the experts load into banks of the matching block format
(experts/formats.py: "q4_k", "q4_k/q8_0", ...): each stacked tensor's raw blocks are copied into
its rows of the banks byte for byte, never widened to floats, so the experts take the file's size
in RAM rather than two bytes a weight. The banks are flat_id-major with gate and up rows together
per expert, which the file does not have, hence a copy rather than a memory map.

Files whose expert types differ between layers (llama.cpp's Q4_K_M keeps the ffn_down of some
layers in Q6_K) or use a type without a kernel still dequantize at load, as before.
"""

from __future__ import annotations

import logging
import re

import torch

from ..experts.formats import FORMATS, block_format
from ..formats.gguf_file import GgufFile, GgufTensor
from . import gguf_blocks

log = logging.getLogger(__name__)

_WEIGHT = re.compile(r"\.ffn_(gate|up|down)_exps\.weight$")


def _types(tensors: dict[str, GgufTensor]) -> tuple[set[str], set[str]]:
    """(types of the gate/up expert weights, types of the down expert weights), ggml names."""
    gate_up: set[str] = set()
    down: set[str] = set()
    for name, t in tensors.items():
        m = _WEIGHT.search(name)
        if m:
            (down if m.group(1) == "down" else gate_up).add(t.type_name)
    return gate_up, down


def block_expert_format(tensors: dict[str, GgufTensor], hidden: int, inter: int) -> str | None:
    """The block expert format the file's experts can stay in, None when they cannot (mixed
    types across layers, a type without a kernel, sizes the blocks do not divide)."""
    gate_up, down = _types(tensors)
    if len(gate_up) != 1 or len(down) != 1:
        return None
    gu, dn = next(iter(gate_up)).lower(), next(iter(down)).lower()
    if gu not in gguf_blocks.QTYPE_CODES or dn not in gguf_blocks.QTYPE_CODES:
        return None
    fmt = FORMATS.get(block_format(gu, dn))
    if fmt is None or fmt.block_types != (gu, dn):
        return None
    mh, mi = fmt.multiples()
    return fmt.name if hidden % mh == 0 and inter % mi == 0 else None


def kept(name: str, t: GgufTensor, expert_format: str) -> bool:
    """Whether tensor ``name`` loads raw into banks of ``expert_format``."""
    fmt = FORMATS.get(expert_format)
    return bool(fmt and fmt.block_types and _WEIGHT.search(name) and t.quantized)


def log_kept(path_name: str, tensors: dict[str, GgufTensor], expert_format: str) -> None:
    """One line: which expert tensors stay quantized, and their size."""
    raw = [t for n, t in tensors.items() if kept(n, t, expert_format)]
    if raw:
        log.info(
            "%s: keeping %d expert tensors quantized (%s experts, integer-dot kernels): %.1f MiB",
            path_name,
            len(raw),
            expert_format,
            sum(t.nbytes for t in raw) / 2**20,
        )


class RawStack:
    """A stacked expert weight [E, rows, cols] with the loader's source interface, whose raw GGUF
    blocks ``into`` copies into block banks' rows ([E, rows, row bytes] uint8). ``dtype`` is the
    element type the loader's shape check sees (fp32, as for any quantized GGUF tensor)."""

    dtype = torch.float32

    def __init__(self, f: GgufFile, t: GgufTensor) -> None:
        self.f, self.t = f, t
        self.shape = t.shape

    def into(self, dest: torch.Tensor) -> None:
        dest.copy_(self.f.read_raw(self.t).view(dest.shape))
