"""The GGUF block types our integer-dot kernels compute (their sizes and native codes), the rows
they have an interleaved layout for, and how block-format expert banks group the MoE layers by
type: plain facts and arithmetic, importable before torch (``formats.gguf_early`` lays out and
fills a GGUF file's expert banks while the daemon imports it). ``gguf_blocks``,
``gguf_interleave`` and ``experts.formats`` build on these.
"""

from __future__ import annotations

BLOCK_INPUTS = {
    "q8_0": 32, "q4_k": 256, "q6_k": 256, "q5_k": 256, "mxfp4": 32, "q5_0": 32, "q4_0": 32
}  # fmt: skip
BLOCK_BYTES = {
    "q8_0": 34, "q4_k": 144, "q6_k": 210, "q5_k": 176, "mxfp4": 17, "q5_0": 22, "q4_0": 18
}  # fmt: skip
QTYPE_CODES = {
    "q8_0": 0,
    "q4_k": 1,
    "q6_k": 2,
    "q5_k": 3,
    "mxfp4": 4,
    "q5_0": 5,
    "q4_0": 6,
}  # fmt: skip  (ftdense's qtype codes: native/dense/qdot.h QType)

# The codes of the same formats with their rows interleaved by 8 (``gguf_interleave``).
INTERLEAVED_CODES = {"q4_k": 7, "q6_k": 8, "mxfp4": 9, "q8_0": 10, "q5_k": 11}
INTERLEAVE_ROWS = 8


def row_bytes(fmt: str, cols: int) -> int:
    """Bytes of one quantised row of ``cols`` inputs (a multiple of the block)."""
    return cols // BLOCK_INPUTS[fmt] * BLOCK_BYTES[fmt]


def interleavable(fmt: str, rows: int) -> bool:
    """Whether a [rows, *] matrix of ``fmt`` has an interleaved layout (``interleave``)."""
    return fmt in INTERLEAVED_CODES and rows >= INTERLEAVE_ROWS


def interleaves(proj: str, qtype: str, rows: int) -> bool:
    """Whether ``interleave_banks`` interleaves an expert's ``rows`` rows of ``proj`` in
    ``qtype``: gate_up's groups of 8 must not straddle its gate and up halves."""
    per_half = rows // 2 if proj == "gate_up" else rows  # whole groups only (qmoe.h)
    return interleavable(qtype, per_half) and per_half % INTERLEAVE_ROWS == 0


def layer_banks(
    pairs: list[tuple[str, str]] | tuple[tuple[str, str], ...],
) -> list[tuple[str, str, str, tuple[int, ...]]]:
    """The banks of block-format experts whose MoE layer l has types ``pairs[l]`` (gate_up,
    down): (bank name, projection, block type, the MoE layers it holds in order) per projection
    and type, the first layer's type first and named after the projection ("gate_up",
    "down"), any other "<projection>.<type>". A bank holds E experts per layer it lists."""
    out = []
    for proj, col in (("gate_up", 0), ("down", 1)):
        order = list(dict.fromkeys(p[col] for p in pairs))  # the first layer's type first
        for i, t in enumerate(order):
            layers = tuple(li for li, p in enumerate(pairs) if p[col] == t)
            out.append((proj if i == 0 else f"{proj}.{t}", proj, t, layers))
    return out
