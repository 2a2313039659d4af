"""GGUF expert tensors kept in their own block format instead of dequantized at load.

When every layer's ``ffn_{gate,up}_exps.weight`` share one type and its ``ffn_down_exps.weight``
has one (possibly another), all of them types the CPU's integer-dot kernels compute
(formats/gguf_blocks.py: Q8_0, Q4_K, Q6_K, ...), the experts load into banks of the matching block
format (experts/formats.py): "q4_k", "q4_k/q8_0", ... when every layer has the same pair, and a
per-layer format ("layers:q4_k/q6_k*2,q4_k,...", ``formats.layered_format``) when the pairs
differ between layers, as in llama.cpp's Q4_K_M files, which keep the ffn_down of about half the
layers in Q6_K. Each stacked tensor's raw blocks are copied into its rows of the banks byte for
byte, never widened to floats, so the experts take the file's size in RAM rather than two bytes
a weight. The banks are flat_id-major with gate and up rows together per expert, which the file
does not have, hence a copy rather than a memory map.

Files whose gate and up types differ within a layer, or that use a type without a kernel, still
dequantize at load.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from ..experts.formats import (
    FORMATS,
    LAYERED,
    block_format,
    get_format,
    is_known,
    layered_format,
)
from ..formats import direct_read, gguf_blocks, gguf_early, gguf_header, gguf_interleave
from ..formats.gguf_file import GgufFile, GgufTensor
from .config import ModelConfig
from .hugepages import prefault

log = logging.getLogger(__name__)

_WEIGHT = re.compile(r"\.ffn_(gate|up|down)_exps\.weight$")


def _layer_types(tensors: dict[str, GgufTensor]) -> dict[int, dict[str, str]]:
    """{block number: {gate | up | down: ggml type name}} of the expert weights."""
    stacks = gguf_header.expert_stacks(tensors)
    return {b: {p: t.type_name for p, t in s.items()} for b, s in stacks.items()}


def block_expert_format(tensors: dict[str, GgufTensor], hidden: int, inter: int) -> str | None:
    """The block expert format the file's experts can stay in (one pair of types for every
    layer, or a per-layer format), None when they cannot (gate and up of a layer of different
    types, a fused or missing projection, a type without a kernel, sizes the blocks do not
    divide)."""
    layers = _layer_types(tensors)
    pairs: list[tuple[str, str]] = []
    for blk in sorted(layers):  # the MoE layers in order: flat ids count them
        types = layers[blk]
        if set(types) != {"gate", "up", "down"} or types["gate"] != types["up"]:
            return None
        gu, dn = types["gate"].lower(), types["down"].lower()
        if gu not in gguf_blocks.QTYPE_CODES or dn not in gguf_blocks.QTYPE_CODES:
            return None
        fmt = FORMATS.get(block_format(gu, dn))
        if fmt is None or fmt.block_types != (gu, dn):
            return None
        pairs.append((gu, dn))
    if not pairs:
        return None
    fmt = get_format(layered_format(pairs))
    mh, mi = fmt.multiples()
    return fmt.name if hidden % mh == 0 and inter % mi == 0 else None


NVFP4 = "NVFP4"  # llama.cpp's converter writes NVFP4 checkpoints' experts in this ggml type


def nvfp4_experts(tensors: dict[str, GgufTensor]) -> bool:
    """Whether every MoE layer's gate, up and down expert weights are NVFP4 (llama.cpp's
    converter of an NVFP4 checkpoint, GLM-5.2's release): they load into our ``nvfp4`` banks
    (``NvStack``)."""
    layers = _layer_types(tensors)
    return bool(layers) and all(
        set(types) == {"gate", "up", "down"} and set(types.values()) == {NVFP4}
        for types in layers.values()
    )


def kept(name: str, t: GgufTensor, expert_format: str) -> bool:
    """Whether tensor ``name`` loads raw into banks of ``expert_format``."""
    if not is_known(expert_format) or not (_WEIGHT.search(name) and t.quantized):
        return False
    if expert_format == "nvfp4":
        return t.type_name == NVFP4
    return get_format(expert_format).in_blocks


def log_kept(path_name: str, tensors: dict[str, GgufTensor], expert_format: str) -> None:
    """One line: which expert tensors stay quantized, and their size."""
    raw = [t for n, t in tensors.items() if kept(n, t, expert_format)]
    if raw:
        shown = expert_format
        if expert_format.startswith(LAYERED):  # the list of layers is long: the types it has
            lt = get_format(expert_format).layer_types or ()
            shown = "per-layer " + "+".join(sorted({block_format(*p) for p in lt}))
        log.info(
            "%s: keeping %d expert tensors quantized (%s experts, integer-dot kernels): %.1f MiB",
            path_name,
            len(raw),
            shown,
            sum(t.nbytes for t in raw) / 2**20,
        )


Empty = Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor]


def early_banks(
    path: str | Path, cfg: ModelConfig, interleave: bool, resident: bool
) -> tuple[gguf_early.EarlyFill, Empty] | None:
    """The fill started before torch for ``path`` (``formats.gguf_early``) and the memory of
    its banks by name (``formats.allocate``'s ``empty``), where this load's banks are resident
    (``resident``) banks of its layout (``cfg``'s expert format: block banks, rows
    ``interleave``d or not, or the bf16 banks of BF16 experts); None otherwise (a fill of
    another layout is cancelled)."""
    fill = gguf_early.take(path)
    if fill is None:
        return None
    if not resident:
        fill.cancel()
        return None
    fmt = get_format(cfg.expert_format) if is_known(cfg.expert_format) else None
    moe = sorted((m, b) for b, m in enumerate(cfg.moe_layer_index[: cfg.num_layers]) if m >= 0)
    n, h, i = cfg.num_moe_layers * cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    want: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    dtype = torch.uint8
    if fill.floats and cfg.expert_format == "bf16" and cfg.torch_dtype == "bfloat16":
        dtype = torch.bfloat16  # allocate_banks' float banks, as bytes: 2 a weight
        want = {"gate_up": ((n, 2 * i, 2 * h), dtype), "down": ((n, h, 2 * i), dtype)}
    elif not fill.floats and fmt is not None and fmt.in_blocks:
        want = {k: (tuple(s), dt) for k, (s, dt) in fmt.shapes(n, h, i, torch.uint8).items()}
    have = {k: (s, dtype) for k, s in fill.shapes.items()}
    if want != have or not fill.matches(
        Path(path), [b for _, b in moe], cfg.num_experts, interleave
    ):
        log.info("%s: the experts read before start-up do not fit this load: read again", path)
        fill.cancel()
        return None

    def empty(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.frombuffer(fill.memory[name], dtype=dtype).view(shape)

    return fill, empty


class FillPool:
    """Worker threads that fill expert banks while the loader goes on with the other tensors:
    ``preadv`` and the native interleave release the GIL, so the reads of one expert after
    another run on every core at once instead of one after the other on the loader's thread.
    ``wait`` joins them (the first error re-raised); ``close`` (after an error) cancels what has
    not started and waits for what runs, so no thread writes into banks being freed."""

    def __init__(self, threads: int) -> None:
        self.pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="ft-fill")
        self.futures: list[Future[None]] = []
        self._local = threading.local()

    def submit(self, fn: Callable[..., None], *args: object) -> None:
        self.futures.append(self.pool.submit(fn, *args))

    def scratch(self, like: torch.Tensor) -> torch.Tensor:
        """This thread's reused buffer of ``like``'s shape (uint8): stays in its core's cache."""
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.numel() < like.numel():
            buf = self._local.buf = torch.empty(like.numel(), dtype=torch.uint8)
        return buf[: like.numel()].view(like.shape)

    def wait(self) -> None:
        try:
            for f in self.futures:
                f.result()
        finally:
            self.close()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.futures.clear()


def read_expert(f: GgufFile, t: GgufTensor, dest: torch.Tensor, offset: int) -> None:
    """One expert's rows of a native-type (F32/F16/BF16) stacked tensor straight into its
    contiguous part of the banks, its pages faulted in one call first (a ``FillPool`` task)."""
    prefault(dest)
    f.read_into(t, dest, offset)


class RawStack:
    """A stacked expert weight [E, rows, cols] with the loader's source interface, whose raw GGUF
    blocks ``into`` copies into block banks' rows ([E, rows, row bytes] uint8). ``dtype`` is the
    element type the loader's shape check sees (fp32, as for any quantized GGUF tensor).
    ``pool``: each expert's read runs on its threads (``into`` returns before they end; the
    loader waits on the pool)."""

    dtype = torch.float32

    def __init__(
        self,
        f: GgufFile,
        t: GgufTensor,
        interleave: str | None = None,
        pool: FillPool | None = None,
    ) -> None:
        self.f, self.t, self.interleave, self.pool = f, t, interleave, pool
        self.shape = t.shape

    def into(self, dest: torch.Tensor) -> None:
        """Each expert's rows read straight into its part of ``dest`` (a bank's gate or up half
        is contiguous per expert): never the whole stacked tensor in memory besides the bank.
        ``interleave`` (a block type): each expert's rows read into one reused buffer instead and
        interleaved from there into the bank (``gguf_interleave.interleave_to``), the layout
        ``formats.interleave_banks`` gives the cpu backend's banks (whole groups of 8 rows: the
        caller checks ``formats.interleaves``), so the banks are written once, not twice."""
        if dest.dim() != 3 or dest.shape[0] * dest[0].numel() != self.t.nbytes:
            raise ValueError(f"{self.t.name}: {self.t.nbytes} bytes cannot fill {list(dest.shape)}")
        per = dest[0].numel()
        if self.pool is not None:
            for e in range(dest.shape[0]):
                self.pool.submit(self._expert, dest[e], e * per, None)
            return
        scratch = None if self.interleave is None else torch.empty_like(dest[0])  # reused
        for e in range(dest.shape[0]):
            self._expert(dest[e], e * per, scratch)

    def _expert(self, dest: torch.Tensor, offset: int, scratch: torch.Tensor | None) -> None:
        prefault(dest)  # its pages in one call, not a fault every 4 KiB of the writes
        if self.interleave is None:
            self.f.read_raw_into(self.t, dest, offset)  # asserts the part is contiguous
            return
        if scratch is None:
            assert self.pool is not None
            scratch = self.pool.scratch(dest)
        self.f.read_raw_into(self.t, scratch, offset)
        gguf_interleave.interleave_to(scratch, dest, self.interleave)


class NvStack(RawStack):
    """A stacked NVFP4 expert weight as llama.cpp's converter writes it, into our ``nvfp4``
    banks with nothing dequantized. ggml's NVFP4 rows are super-blocks of 64 inputs: 4 scale
    bytes (UE4M3, one per 16 inputs: E4M3's bits without the sign, llama.cpp's 0x7F reading as
    0 where E4M3 has its NaN), then 32 bytes of E2M1 codes, sub-block s's byte j holding its
    input j in the low nibble and input j + 8 in the high one. Our banks hold the codes as the
    checkpoints pack them (input 2k low, 2k + 1 high) and the scales as fp8 e4m3: the same
    codes and scale bits, re-paired. ``scales``: this stack's rows of the scale bank [E, rows,
    cols / 16]. The per-expert global scale is the file's ``.scale`` tensor, loaded apart."""

    def __init__(
        self, f: GgufFile, t: GgufTensor, scales: torch.Tensor, pool: FillPool | None = None
    ) -> None:
        super().__init__(f, t, None, pool)
        self.scales = scales.view(torch.uint8)
        e, rows, cols = t.shape
        if cols % 64 or t.nbytes != e * rows * cols // 64 * 36:
            raise ValueError(f"{t.name}: {t.nbytes} bytes are not NVFP4 rows of {list(t.shape)}")

    def into(self, dest: torch.Tensor) -> None:
        e, rows, cols = self.t.shape
        if list(dest.shape) != [e, rows, cols // 2] or dest.dtype != torch.uint8:
            raise ValueError(f"{self.t.name}: NVFP4 experts cannot fill {list(dest.shape)}")
        per = rows * cols // 64 * 36
        for x in range(e):
            if self.pool is not None:
                self.pool.submit(self._nv_expert, dest[x], self.scales[x], x * per)
            else:
                self._nv_expert(dest[x], self.scales[x], x * per)

    def _nv_expert(self, dest: torch.Tensor, scales: torch.Tensor, offset: int) -> None:
        rows, cols = dest.shape[0], dest.shape[1] * 2
        raw = torch.empty(rows, cols // 64, 36, dtype=torch.uint8)
        self.f.read_raw_into(self.t, raw, offset)
        d = raw[..., :4].reshape(rows, cols // 16)
        scales.copy_(d.masked_fill(d == 0x7F, 0))
        qs = raw[..., 4:].reshape(rows, cols // 16, 8)
        codes = torch.cat((qs & 15, qs >> 4), dim=-1)  # [rows, sub-blocks, 16]: input order
        dest.copy_((codes[..., 0::2] | (codes[..., 1::2] << 4)).reshape(rows, cols // 2))


class InFile(RawStack):
    """A stacked expert weight left in the file (the disk tier), or read into the banks by the
    fill started before torch (``early_banks``): its shape is checked like any other, nothing
    is read here."""

    def into(self, dest: torch.Tensor) -> None:
        pass


class GgufExpertSource:
    """The disk tier's source (experts/disk_tier.py ``ExpertSource``): one expert's GGUF rows
    read from the file's stacked tensors on demand, gate rows then up rows into its ``gate_up``
    row of the slot banks and its down rows into ``down``, byte for byte as ``RawStack`` loads
    them. Holds its own descriptors (``GgufFile``, positional reads: safe from several threads
    at once). ``blocks``: the decoder layer of each MoE layer, in MoE-layer order."""

    piece_bytes = direct_read.PIECE  # the most one read takes (whole groups of 8 rows)

    def __init__(
        self,
        files: list[GgufFile],
        tensors: dict[str, tuple[GgufFile, GgufTensor]],
        blocks: list[int],
        num_experts: int,
        direct: bool = True,
    ) -> None:
        self.files, self.num_experts = files, num_experts
        # O_DIRECT descriptors (formats/direct_read.py), where the file system takes them
        self.direct: dict[str, int | None] = {
            str(f.path): direct_read.open_direct(f.path) if direct else None for f in files
        }
        self.layers = []
        for b in blocks:
            parts = []
            for proj in ("gate", "up", "down"):
                name = f"blk.{b}.ffn_{proj}_exps.weight"
                if name not in tensors:
                    raise ValueError(
                        f"the disk tier needs tensor '{name}' (fused gate/up: not yet)"
                    )
                f, t = tensors[name]
                parts.append((f, t, t.nbytes // num_experts))
            self.layers.append(parts)

    def pieces(
        self,
        fid: int,
        dest: dict[str, torch.Tensor],
        put: Callable[[str, torch.Tensor, torch.Tensor], None],
    ) -> list[Callable[[], int]]:
        """Expert ``fid`` as independent reads (each returns its bytes), one per tensor slice of
        at most ``direct_read.PIECE`` bytes (one expert's gate, up or down rows: ~0.9-1.3 MB for
        Qwen3-30B-A3B's Q4_K_M; larger ones in whole groups of 8 rows), each read into the
        thread's bounce buffer (``direct_read.read_staged``) and handed to ``put(proj, src,
        dest)`` (proj: gate | up | down; src and dest [rows, row bytes]), which moves it into
        ``dest`` (its rows of the expert's slot) as the load would have left it. Where ``put``
        says how (``disk_reads.SlotMove.native``), a piece is one native call that reads and
        moves it with the GIL released (``ftdense.tier_read``), the same bytes."""
        layer, e = divmod(fid, self.num_experts)
        half = dest["gate_up"].shape[0] // 2
        out: list[Callable[[], int]] = []
        for proj, (f, t, n), part in zip(
            ("gate", "up", "down"),
            self.layers[layer],
            (dest["gate_up"][:half], dest["gate_up"][half:], dest["down"]),
            strict=True,
        ):
            assert part.numel() == n and part.dim() == 2
            rows, rb = part.shape
            step = piece_rows(rows, rb, self.piece_bytes, f.path)
            direct = self.direct.get(str(f.path))
            fd, name = (direct if direct is not None else f.fd), str(f.path)
            at = t.offset + e * n
            native = getattr(put, "native", None)
            for r0 in range(0, rows, step):
                piece = part[r0 : r0 + step]
                how = native(proj, piece.shape[0], rb) if native is not None else None
                if how is not None:  # the read and the move in one native call (disk_reads)
                    read, qtype, k = how
                    out.append(functools.partial(
                        read, fd, at + r0 * rb, piece.numel(), direct is not None,
                        piece.data_ptr(), qtype, piece.shape[0], k, name,
                    ))  # fmt: skip
                    continue
                out.append(functools.partial(
                    _staged, fd, direct is not None, at + r0 * rb, proj, piece, put, name
                ))  # fmt: skip
        return out

    def close(self) -> None:
        for f in self.files:
            f.close()
        for fd in self.direct.values():
            if fd is not None:
                os.close(fd)
        self.direct.clear()


def piece_rows(rows: int, row_bytes: int, most: int, path: object = "") -> int:
    """The rows one disk-tier read takes of an expert's slice of ``rows`` rows of ``row_bytes``
    (``GgufExpertSource.pieces``): whole groups of 8 rows of at most ``most`` bytes, or the whole
    slice where it fits in one; raises where eight rows exceed ``most`` (``path`` names the
    file)."""
    step = most // row_bytes // 8 * 8 or (rows if rows * row_bytes <= most else 0)
    if not step:
        raise ValueError(f"{path}: rows of {row_bytes} bytes: eight exceed a read's buffer")
    return step


def _staged(
    fd: int,
    direct: bool,
    offset: int,
    proj: str,
    dest: torch.Tensor,
    put: Callable[[str, torch.Tensor, torch.Tensor], None],
    name: str,
) -> int:
    src = direct_read.read_staged(fd, offset, dest.numel(), direct, name)
    put(proj, src.view(dest.shape), dest)
    return dest.numel()
