"""Expert weight formats: one schema per format, in one table (``FORMATS``).

A format lists the bank tensors each expert has (name, per-expert shape as a function of the hidden
size H and the moe intermediate size I, dtype) and gives plain-torch ``quantize`` / ``dequantize``
of one expert. Allocation, FTW files, conversion and the reference MoE derive from the schema, so
a new kernel keys on ``ExpertBanks.format`` and adding a format touches ``FORMATS`` alone.

Weights are stored as the model computes ``W x``: rows are output features, the packed / blocked
dim is the input dim. ``gate_up`` is [2I, H] (gate rows then up rows), ``down`` is [H, I]. Biases
(GPT-OSS) stay in the model's float dtype in every format and are not part of a schema.

Bit layouts (the codecs are in experts/microscale.py; tested on hand-made values in
tests/test_expert_formats.py):
  e2m1 (FP4) code, 4 bits: bit 3 sign, bits 2..1 exponent (bias 1), bit 0 mantissa; codes 0..7
      are 0, 0.5, 1, 1.5, 2, 3, 4, 6 and codes 8..15 the same negated (8 is -0).
  packing: two codes per uint8 along the input dim, element 2j in the LOW nibble and element
      2j+1 in the high nibble (the GPT-OSS / ModelOpt order).
  e8m0 (MX scale): uint8 e means 2^(e - 127); 255 is NaN and never written here.
  fp8: torch.float8_e4m3fn (bias 7, 3 mantissa bits, max 448, no infinities).

GGUF block formats (one per pair of formats/gguf_blocks.py types, generated from its tables):
``gate_up`` and ``down`` are uint8 rows of GGUF blocks, byte for byte as llama.cpp stores them
(``gate_up`` [2I, row_bytes(t, H)], ``down`` [H, row_bytes(t', I)]), with no scale banks: the
scales live inside the blocks. The name is the type when both projections share it ("q8_0",
"q4_k") and "<gate_up type>/<down type>" otherwise ("q4_k/q6_k": llama.cpp's Q4_K_M keeps some
ffn_down wider); ``block_format`` builds it. H must be a multiple of the gate_up type's block and
I of the down type's (256 for the K-quants). The CPU backend computes them with integer dot
products (experts/block_executor.py); everything else dequantizes them per expert.

Per-layer GGUF block formats (``layered_format``): a GGUF file whose expert types differ between
layers (llama.cpp's Q4_K_M keeps the ffn_down of about half the layers in Q6_K) keeps each
layer's blocks as they are. The name lists the (MoE) layers' pair formats in order, runs
counted: "layers:q4_k/q6_k*2,q4_k*3,q4_k/q6_k". There is one bank per projection and type, each
holding the layers of that type in layer order, E experts per layer: ``gate_up`` and ``down``
for the types of the first layer, ``gate_up.<type>`` / ``down.<type>`` (in ``extra``) for the
others. Flat id f = layer * E + e stays the address: ``expert_rows`` / ``expert_tensors`` find
the bank and row (rank of the layer among those of its type * E + e). Nothing is padded, so the
banks take the file's bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensor

from ..formats import gguf_blocks, gguf_interleave
from ..formats.block_layout import interleaves, layer_banks
from .banks import ExpertBanks
from .microscale import (
    cdiv,
    fp8_dequant,
    fp8_quant,
    mx_dequant,
    mx_quant,
    nv_dequant,
    nv_global,
    nv_quant,
)

Tensor = torch.Tensor

# ---- the formats ------------------------------------------------------------------------------


def _halves(gate_up: Tensor) -> tuple[Tensor, Tensor]:
    inter = gate_up.shape[0] // 2
    return gate_up[:inter], gate_up[inter:]


def _bf16_quant(gate_up: Tensor, down: Tensor, float_dtype: torch.dtype) -> dict[str, Tensor]:
    return {"gate_up": gate_up.to(float_dtype), "down": down.to(float_dtype)}


def _bf16_dequant(t: Mapping[str, Tensor]) -> tuple[Tensor, Tensor]:
    return t["gate_up"].float(), t["down"].float()


def _fp8_block_quant(gate_up: Tensor, down: Tensor, float_dtype: torch.dtype) -> dict[str, Tensor]:
    # gate and up are blocked separately (as the checkpoints store them), so I need not be a
    # multiple of 128: scale rows [0, ceil(I/128)) cover gate, the rest cover up.
    (gq, gs), (uq, us) = (fp8_quant(h) for h in _halves(gate_up))
    dq, ds = fp8_quant(down)
    return {
        "gate_up": torch.cat([gq, uq]),
        "down": dq,
        "gate_up_scale": torch.cat([gs, us]),
        "down_scale": ds,
    }


def _fp8_block_dequant(t: Mapping[str, Tensor]) -> tuple[Tensor, Tensor]:
    g, u = _halves(t["gate_up"])
    gs, us = _halves(t["gate_up_scale"])
    gate_up = torch.cat([fp8_dequant(g, gs), fp8_dequant(u, us)])
    return gate_up, fp8_dequant(t["down"], t["down_scale"])


def _mxfp4_quant(gate_up: Tensor, down: Tensor, float_dtype: torch.dtype) -> dict[str, Tensor]:
    gq, gs = mx_quant(gate_up)
    dq, ds = mx_quant(down)
    return {"gate_up": gq, "down": dq, "gate_up_scale": gs, "down_scale": ds}


def _mxfp4_dequant(t: Mapping[str, Tensor]) -> tuple[Tensor, Tensor]:
    return mx_dequant(t["gate_up"], t["gate_up_scale"]), mx_dequant(t["down"], t["down_scale"])


def _nvfp4_quant(gate_up: Tensor, down: Tensor, float_dtype: torch.dtype) -> dict[str, Tensor]:
    # gate and up keep separate global scales, as NVFP4 checkpoints store them per projection.
    halves = _halves(gate_up)
    globs = [nv_global(h) for h in halves]
    (gq, gs), (uq, us) = (nv_quant(h, g) for h, g in zip(halves, globs, strict=True))
    dglob = nv_global(down)
    dq, ds = nv_quant(down, dglob)
    return {
        "gate_up": torch.cat([gq, uq]),
        "down": dq,
        "gate_up_scale": torch.cat([gs, us]),
        "down_scale": ds,
        "gate_up_global": torch.tensor(globs, dtype=torch.float32),
        "down_global": torch.tensor([dglob], dtype=torch.float32),
    }


def _nvfp4_dequant(t: Mapping[str, Tensor]) -> tuple[Tensor, Tensor]:
    (g, u), (gs, us) = _halves(t["gate_up"]), _halves(t["gate_up_scale"])
    glob = t["gate_up_global"]
    gate_up = torch.cat([nv_dequant(g, gs, glob[0]), nv_dequant(u, us, glob[1])])
    return gate_up, nv_dequant(t["down"], t["down_scale"], t["down_global"][0])


Shape = Callable[[int, int], tuple[int, ...]]


@dataclass(frozen=True)
class BankSpec:
    """One bank tensor of a format. ``dtype`` None means the model's float dtype (bf16/fp16/fp32)."""

    name: str
    shape: Shape  # (H, I) -> per-expert shape
    dtype: torch.dtype | None
    # per-layer block formats: the MoE layers this bank holds, in order (None: every flat id)
    layers: tuple[int, ...] | None = None


@dataclass(frozen=True)
class ExpertFormat:
    """The schema of one expert format. ``gate_up``/``down`` banks go to the ExpertBanks fields of
    those names, every other bank to ``ExpertBanks.extra``."""

    name: str
    doc: str
    banks: tuple[BankSpec, ...]
    # (gate_up fp32 [2I, H], down fp32 [H, I], model float dtype) -> {bank name: per-expert tensor}
    quantize: Callable[[Tensor, Tensor, torch.dtype], dict[str, Tensor]]
    # {bank name: per-expert tensor} -> (gate_up fp32 [2I, H], down fp32 [H, I])
    dequantize: Callable[[Mapping[str, Tensor]], tuple[Tensor, Tensor]]
    dim_multiple: int = 1  # H and I must be multiples of this (the packing / scale block)
    # GGUF block formats: (gate_up type, down type) of formats/gguf_blocks.py; None otherwise
    block_types: tuple[str, str] | None = None
    # per-layer GGUF block formats: each MoE layer's (gate_up type, down type); None otherwise
    layer_types: tuple[tuple[str, str], ...] | None = None

    @property
    def in_blocks(self) -> bool:
        """Raw GGUF block rows (one pair of types, or one per layer): the integer-dot kernels'."""
        return self.block_types is not None or self.layer_types is not None

    def multiples(self) -> tuple[int, int]:
        """What H and I must be multiples of."""
        if self.layer_types is not None:
            return (
                max(gguf_blocks.BLOCK_INPUTS[gu] for gu, _ in self.layer_types),
                max(gguf_blocks.BLOCK_INPUTS[dn] for _, dn in self.layer_types),
            )
        if self.block_types is None:
            return self.dim_multiple, self.dim_multiple
        gu, dn = self.block_types
        return gguf_blocks.BLOCK_INPUTS[gu], gguf_blocks.BLOCK_INPUTS[dn]

    def where(self, layer: int, proj: str) -> tuple[str, int]:
        """Per-layer formats: (bank name, rank of ``layer`` in it) of projection ``proj``
        (gate_up | down) of MoE layer ``layer``; its experts are rows [rank*E, (rank+1)*E)."""
        for b in self.banks:
            if b.layers is not None and b.name.partition(".")[0] == proj and layer in b.layers:
                return b.name, b.layers.index(layer)
        raise ValueError(f"expert format {self.name!r} has no layer {layer}")

    def shapes(
        self, num_flat: int, hidden: int, inter: int, float_dtype: torch.dtype
    ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """{bank name: (whole bank's shape, dtype)} for ``num_flat`` experts."""
        out = {}
        per_layer = num_flat // len(self.layer_types) if self.layer_types else 0
        if self.layer_types and per_layer * len(self.layer_types) != num_flat:
            raise ValueError(
                f"expert format {self.name!r} has {len(self.layer_types)} layers; "
                f"{num_flat} experts are not a whole number per layer"
            )
        for name, (shape, dt) in self.specs(hidden, inter, float_dtype).items():
            b = next(b for b in self.banks if b.name == name)
            rows = num_flat if b.layers is None else per_layer * len(b.layers)
            out[name] = ((rows, *shape), dt)
        return out

    def check_dims(self, hidden: int, inter: int) -> None:
        mh, mi = self.multiples()
        if (hidden % mh or inter % mi) and mh == mi:
            raise ValueError(
                f"expert format {self.name!r} needs hidden and moe intermediate sizes that are "
                f"multiples of {mh}; got H={hidden}, I={inter}"
            )
        if hidden % mh or inter % mi:
            raise ValueError(
                f"expert format {self.name!r} needs a hidden size that is a multiple of {mh} and "
                f"a moe intermediate size that is a multiple of {mi}; got H={hidden}, I={inter}"
            )

    def specs(
        self, hidden: int, inter: int, float_dtype: torch.dtype
    ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """{bank name: (per-expert shape, dtype)}."""
        self.check_dims(hidden, inter)
        return {b.name: (b.shape(hidden, inter), b.dtype or float_dtype) for b in self.banks}

    def nbytes_per_expert(self, hidden: int, inter: int, float_dtype: torch.dtype) -> int:
        """Bytes of one expert; per-layer formats: the mean over layers, rounded up."""
        total, layers = 0, len(self.layer_types or (None,))
        for b in self.banks:
            shape, dt = b.shape(hidden, inter), b.dtype or float_dtype
            n = layers if b.layers is None else len(b.layers)
            total += n * torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size()
        return -(-total // layers)


_U8, _F32, _FP8 = torch.uint8, torch.float32, torch.float8_e4m3fn


def block_format(gate_up: str, down: str) -> str:
    """The name of the GGUF block format with gate_up rows of type ``gate_up`` and down rows of
    type ``down`` (gguf_blocks names, e.g. "q4_k"). A type whose name a non-block format has
    (our own "mxfp4" bank layout) is always written as a pair: GGUF MXFP4 blocks throughout are
    "mxfp4/mxfp4"."""
    taken = gate_up in FORMATS and FORMATS[gate_up].block_types is None
    return gate_up if gate_up == down and not taken else f"{gate_up}/{down}"


def _block(gu: str, dn: str) -> ExpertFormat:
    def quantize(gate_up: Tensor, down: Tensor, float_dtype: torch.dtype) -> dict[str, Tensor]:
        return {
            "gate_up": gguf_blocks.quantize(gate_up, gu),
            "down": gguf_blocks.quantize(down, dn),
        }

    def dequantize(t: Mapping[str, Tensor]) -> tuple[Tensor, Tensor]:
        return gguf_blocks.dequantize(t["gate_up"], gu), gguf_blocks.dequantize(t["down"], dn)

    return ExpertFormat(
        block_format(gu, dn),
        f"GGUF {gu} blocks for gate_up, {dn} blocks for down (raw rows, scales inside)",
        (
            BankSpec("gate_up", lambda h, i: (2 * i, gguf_blocks.row_bytes(gu, h)), _U8),
            BankSpec("down", lambda h, i: (h, gguf_blocks.row_bytes(dn, i)), _U8),
        ),
        quantize,
        dequantize,
        block_types=(gu, dn),
    )


FORMATS: dict[str, ExpertFormat] = {
    f.name: f
    for f in (
        ExpertFormat(
            "bf16",
            "unquantised weights in the model's float dtype (bf16, fp16 or fp32)",
            (
                BankSpec("gate_up", lambda h, i: (2 * i, h), None),
                BankSpec("down", lambda h, i: (h, i), None),
            ),
            _bf16_quant,
            _bf16_dequant,
        ),
        ExpertFormat(
            "fp8_block",
            "fp8 e4m3 weights, one fp32 scale per 128x128 block (gate and up blocked separately)",
            (
                BankSpec("gate_up", lambda h, i: (2 * i, h), _FP8),
                BankSpec("down", lambda h, i: (h, i), _FP8),
                BankSpec("gate_up_scale", lambda h, i: (2 * cdiv(i, 128), cdiv(h, 128)), _F32),
                BankSpec("down_scale", lambda h, i: (cdiv(h, 128), cdiv(i, 128)), _F32),
            ),
            _fp8_block_quant,
            _fp8_block_dequant,
        ),
        ExpertFormat(
            "mxfp4",
            "OCP MXFP4 (GPT-OSS): packed e2m1, one e8m0 scale per 32 inputs",
            (
                BankSpec("gate_up", lambda h, i: (2 * i, h // 2), _U8),
                BankSpec("down", lambda h, i: (h, i // 2), _U8),
                BankSpec("gate_up_scale", lambda h, i: (2 * i, h // 32), _U8),
                BankSpec("down_scale", lambda h, i: (h, i // 32), _U8),
            ),
            _mxfp4_quant,
            _mxfp4_dequant,
            dim_multiple=32,
        ),
        ExpertFormat(
            "nvfp4",
            "NVFP4: packed e2m1, one fp8 e4m3 scale per 16 inputs, fp32 global scale per projection",
            (
                BankSpec("gate_up", lambda h, i: (2 * i, h // 2), _U8),
                BankSpec("down", lambda h, i: (h, i // 2), _U8),
                BankSpec("gate_up_scale", lambda h, i: (2 * i, h // 16), _FP8),
                BankSpec("down_scale", lambda h, i: (h, i // 16), _FP8),
                BankSpec("gate_up_global", lambda h, i: (2,), _F32),  # [gate, up]
                BankSpec("down_global", lambda h, i: (1,), _F32),
            ),
            _nvfp4_quant,
            _nvfp4_dequant,
            dim_multiple=16,
        ),
    )
}
# Every pair of block types (GGUF's MXFP4 blocks as "mxfp4/mxfp4": "mxfp4" is our own layout).
for _gu in gguf_blocks.BLOCK_BYTES:
    for _dn in gguf_blocks.BLOCK_BYTES:
        FORMATS.setdefault(block_format(_gu, _dn), _block(_gu, _dn))


# ---- per-layer GGUF block formats ---------------------------------------------------------------

LAYERED = "layers:"
_LAYERED: dict[str, ExpertFormat] = {}


def layered_format(pairs: list[tuple[str, str]] | tuple[tuple[str, str], ...]) -> str:
    """The format name of experts whose MoE layer l has block types ``pairs[l]`` (gate_up,
    down): the plain pair's name when every layer has the same, a per-layer name otherwise."""
    if not pairs:
        raise ValueError("no layers")
    names = [block_format(gu, dn) for gu, dn in pairs]
    for n, pair in zip(names, pairs, strict=True):
        if n not in FORMATS or FORMATS[n].block_types != pair:
            raise ValueError(f"{pair} is not a pair of GGUF block types")
    if len(set(names)) == 1:
        return names[0]
    runs: list[list] = []
    for n in names:
        if runs and runs[-1][0] == n:
            runs[-1][1] += 1
        else:
            runs.append([n, 1])
    return LAYERED + ",".join(n if k == 1 else f"{n}*{k}" for n, k in runs)


def _layered(name: str) -> ExpertFormat:
    pairs: list[tuple[str, str]] = []
    for run in name[len(LAYERED) :].split(","):
        entry, _, count = run.partition("*")
        fmt = FORMATS.get(entry)
        if fmt is None or fmt.block_types is None or (count and not count.isdigit()):
            raise ValueError(f"expert format {name!r}: {run!r} is not a GGUF block format run")
        pairs.extend([fmt.block_types] * (int(count) if count else 1))
    if layered_format(pairs) != name:
        raise ValueError(f"expert format {name!r} is not in its canonical form")
    banks = [
        BankSpec(name, _rows(proj, t), _U8, layers) for name, proj, t, layers in layer_banks(pairs)
    ]

    def quantize(gate_up: Tensor, down: Tensor, float_dtype: torch.dtype) -> dict[str, Tensor]:
        raise ValueError(f"{name!r} is per layer: quantize_banks takes it, a layer at a time")

    def dequantize(t: Mapping[str, Tensor]) -> tuple[Tensor, Tensor]:
        raise ValueError(f"{name!r} is per layer: dequantize_expert takes it (by flat id)")

    return ExpertFormat(
        name,
        "GGUF block rows with their types per layer: " + name[len(LAYERED) :],
        tuple(banks),
        quantize,
        dequantize,
        layer_types=tuple(pairs),
    )


def _rows(proj: str, t: str) -> Shape:
    """The per-expert shape of a block bank of type ``t`` for ``proj``."""
    if proj == "gate_up":
        return lambda h, i: (2 * i, gguf_blocks.row_bytes(t, h))
    return lambda h, i: (h, gguf_blocks.row_bytes(t, i))


def get_format(name: str) -> ExpertFormat:
    """The schema of ``name``; the error lists the known formats."""
    if name.startswith(LAYERED):
        if name not in _LAYERED:
            _LAYERED[name] = _layered(name)
        return _LAYERED[name]
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown expert format {name!r}; known: {', '.join(FORMATS)}") from None


def is_known(name: str) -> bool:
    """Whether ``name`` is an expert format (of ``FORMATS``, or a valid per-layer one)."""
    try:
        get_format(name)
    except ValueError:
        return False
    return True


def layer_experts(banks: ExpertBanks) -> int:
    """Experts per MoE layer (E) of per-layer-format banks."""
    fmt = get_format(banks.format)
    assert fmt.layer_types is not None
    first = next(b for b in fmt.banks if b.name == "gate_up")
    assert first.layers is not None
    return int(banks.gate_up.shape[0]) // len(first.layers)


def expert_rows(banks: ExpertBanks, proj: str, first: int, count: int) -> Tensor:
    """The [count, ...] rows of projection ``proj`` (gate_up | down) for flat ids
    [first, first + count), a view: for a per-layer format they must lie in one layer."""
    fmt = get_format(banks.format)
    if fmt.layer_types is None:
        return getattr(banks, proj)[first : first + count]  # type: ignore[no-any-return]
    e = layer_experts(banks)
    layer, off = divmod(first, e)
    if count < 0 or off + count > e:
        raise ValueError(f"flat ids [{first}, {first + count}) span more than one layer")
    name, rank = fmt.where(layer, proj)
    return banks.all_tensors()[name][rank * e + off : rank * e + off + count]


def layer_pair(banks: ExpertBanks, fid: int) -> tuple[str, str]:
    """(gate_up type, down type) of flat id ``fid`` of block-format banks."""
    fmt = get_format(banks.format)
    if fmt.layer_types is not None:
        return fmt.layer_types[fid // layer_experts(banks)]
    assert fmt.block_types is not None
    return fmt.block_types


# ---- bank-level helpers -----------------------------------------------------------------------


def allocate(
    name: str,
    num_flat: int,
    hidden: int,
    inter: int,
    float_dtype: torch.dtype,
    bias: bool = False,
    empty: Callable[[str, tuple[int, ...], torch.dtype], Tensor] | None = None,
) -> ExpertBanks:
    """Exact-size, uninitialised banks of format ``name`` for ``num_flat`` experts (``empty``:
    gives each weight bank's memory, by name, shape and dtype, instead of ``torch.empty``)."""
    fmt = get_format(name)
    t = {
        n: torch.empty(*s, dtype=dt) if empty is None else empty(n, s, dt)
        for n, (s, dt) in fmt.shapes(num_flat, hidden, inter, float_dtype).items()
    }
    return ExpertBanks(
        gate_up=t.pop("gate_up"),
        down=t.pop("down"),
        gate_up_bias=torch.empty(num_flat, 2 * inter, dtype=float_dtype) if bias else None,
        down_bias=torch.empty(num_flat, hidden, dtype=float_dtype) if bias else None,
        format=name,
        extra=t,
    )


def expert_tensors(banks: ExpertBanks, fid: int) -> dict[str, Tensor]:
    """The weight tensors (no biases) of expert ``fid``, named as in the format's schema (a
    per-layer format: "gate_up" and "down", in the types ``layer_pair`` says); GGUF rows even
    when the banks are interleaved (a copy then)."""
    if get_format(banks.format).layer_types is not None:
        out = {p: expert_rows(banks, p, fid, 1)[0] for p in ("gate_up", "down")}
    else:
        out = {
            "gate_up": banks.gate_up[fid],
            "down": banks.down[fid],
            **{n: t[fid] for n, t in banks.extra.items()},
        }
    if banks.interleaved:
        for proj, qtype in zip(("gate_up", "down"), layer_pair(banks, fid), strict=True):
            if interleaves(proj, qtype, out[proj].shape[0]):
                out[proj] = gguf_interleave.deinterleave(out[proj], qtype)
    return out


def interleaved_layout(banks: ExpertBanks) -> bool:
    """Whether ``interleave_banks`` would interleave any projection of ``banks`` (it sets
    ``banks.interleaved`` then): for banks filled later, expert by expert, in that layout (the
    disk tier's slots), with nothing to regroup now."""
    fmt = get_format(banks.format)
    if not fmt.in_blocks:
        return False
    inter, h = banks.gate_up.shape[1] // 2, banks.down.shape[1]
    pairs = fmt.layer_types if fmt.layer_types is not None else [fmt.block_types or ("", "")]
    return any(
        interleaves("gate_up", gu, 2 * inter) or interleaves("down", dn, h) for gu, dn in pairs
    )


def interleave_banks(banks: ExpertBanks) -> None:
    """In place, one expert at a time: the rows of every GGUF block projection whose type has
    an interleaved layout (``gguf_interleave.interleave``: q4_k, q5_k, q6_k, mxfp4, q8_0)
    regrouped by 8 as the native kernels read them fastest; sets ``banks.interleaved`` when any
    was (``expert_tensors`` still gives GGUF rows). Only for banks that nothing else reads raw:
    the cpu backend's."""
    fmt = get_format(banks.format)
    if banks.interleaved or not fmt.in_blocks:
        return
    per_layer = layer_experts(banks) if fmt.layer_types is not None else banks.num_flat
    pairs = fmt.layer_types if fmt.layer_types is not None else [fmt.block_types or ("", "")]
    scratch = torch.empty(0, dtype=torch.uint8)  # one expert's rows, reused
    for li, types in enumerate(pairs):
        for proj, qtype in zip(("gate_up", "down"), types, strict=True):
            rows = expert_rows(banks, proj, li * per_layer, per_layer)
            if interleaves(proj, qtype, rows.shape[1]):
                if scratch.numel() < rows[0].numel():
                    scratch = torch.empty(rows[0].numel(), dtype=torch.uint8)
                for expert in rows:
                    if not gguf_interleave.interleave_in_place(expert, qtype, scratch):
                        expert.copy_(gguf_interleave.interleave(expert, qtype))
                banks.interleaved = True


def dequantize_expert(banks: ExpertBanks, fid: int) -> tuple[Tensor, Tensor]:
    """Expert ``fid`` as fp32 (gate_up [2I, H], down [H, I])."""
    fmt = get_format(banks.format)
    if fmt.layer_types is not None:
        fmt = FORMATS[block_format(*layer_pair(banks, fid))]
    return fmt.dequantize(expert_tensors(banks, fid))


def quantize_banks(
    banks: ExpertBanks, name: str, progress: Callable[[int, int], None] | None = None
) -> ExpertBanks:
    """Float banks (format bf16) -> banks of format ``name``; biases are kept as they are.
    ``progress(done, total)`` is called after each expert."""
    if banks.format != "bf16":
        raise ValueError(f"quantize_banks needs float (bf16-format) banks, got {banks.format!r}")
    n, two_i, h = banks.gate_up.shape
    fmt = get_format(name)
    out = allocate(name, n, h, two_i // 2, banks.gate_up.dtype)
    dest = out.all_tensors()
    for fid in range(n):
        gu, dn = banks.gate_up[fid].float(), banks.down[fid].float()
        if fmt.layer_types is not None:  # the layer's pair, into the banks of its types
            q = FORMATS[block_format(*layer_pair(out, fid))].quantize(gu, dn, banks.gate_up.dtype)
            for k, v in q.items():
                expert_rows(out, k, fid, 1)[0].copy_(v)
        else:
            for k, v in fmt.quantize(gu, dn, banks.gate_up.dtype).items():
                dest[k][fid].copy_(v)
        if progress is not None:
            progress(fid + 1, n)
    out.gate_up_bias, out.down_bias = banks.gate_up_bias, banks.down_bias
    return out


def dequantize_banks(banks: ExpertBanks) -> ExpertBanks:
    """Any format -> fp32 bf16-format banks (what ``moe_reference`` reads)."""
    n = banks.num_flat
    pairs = [dequantize_expert(banks, fid) for fid in range(n)]
    return ExpertBanks(
        gate_up=torch.stack([p[0] for p in pairs]),
        down=torch.stack([p[1] for p in pairs]),
        gate_up_bias=banks.gate_up_bias,
        down_bias=banks.down_bias,
    )


def dequantize_banks_to(banks: ExpertBanks, dtype: torch.dtype) -> ExpertBanks:
    """Any format -> float banks of ``dtype``, one expert at a time: the peak is the output plus
    one expert in fp32 (a whole fp32 copy of a pool is 100+ GB for gpt-oss-120b)."""
    n, two_i = banks.num_flat, banks.gate_up.shape[1]
    h, inter = banks.down.shape[1], two_i // 2
    # new_empty: a fake pool (a plan without weights) gets a fake output
    gate_up = banks.gate_up.new_empty((n, two_i, h), dtype=dtype)
    down = banks.gate_up.new_empty((n, h, inter), dtype=dtype)

    # a fake pool (a plan) has no values: one expert shows the shapes and the transient peak
    todo = range(1) if isinstance(banks.gate_up, FakeTensor) else range(n)
    for fid in todo:
        gu, dn = dequantize_expert(banks, fid)
        gate_up[fid].copy_(gu)
        down[fid].copy_(dn)
    cast = [None if b is None else b.to(dtype) for b in (banks.gate_up_bias, banks.down_bias)]
    return ExpertBanks(gate_up, down, cast[0], cast[1])
