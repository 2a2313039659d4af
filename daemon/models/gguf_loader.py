"""GGUF checkpoints (single files and ``-0000i-of-0000N`` split sets) into dense parameters and
expert banks: the GGUF reader (``formats.gguf_file``) composed with the model's tables.

llama.cpp's tensor names are mapped onto ours by one table (the names only some architectures
carry, and the converter's transforms undone, are in ``gguf_arch``); stacked expert tensors
(``blk.N.ffn_{gate,up,down}_exps``, [E, rows, cols]) go into the flat_id-major banks (gate rows,
then up rows).
F32/F16/BF16 are read as they are. Quantized tensors of a type the CPU's integer-dot kernels
compute (``gguf_blocks.BLOCK_BYTES``) stay in their blocks, read raw: routed experts
(``gguf_experts``) and dense projections (attention, dense MLP, shared expert, lm_head) whose
converter transform at most reorders rows (a row's blocks move together); so does the token
embedding when the dense part stays on the host (``layers.common.Embedding``: the rows a step
looks up are dequantized then, as llama.cpp's get_rows does); every other quantized tensor is
dequantized at load (one log line says which, and what it costs in memory).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import torch

from ..experts.banks import ExpertBanks
from ..experts.disk_tier import DiskTier
from ..experts.formats import interleaves
from ..formats import gguf_early, gguf_interleave
from ..formats.errors import CheckpointError
from ..formats.gguf_blocks import BLOCK_BYTES, supports
from ..formats.gguf_dequant import DEQUANTIZERS
from ..formats.gguf_file import (
    NATIVE,
    GgufFile,
    GgufFormatError,
    GgufHeader,
    GgufTensor,
    can_dequantize,
    split_files,
)
from ..native.qlinear_native import QuantWeight
from . import gguf_experts, gguf_nvfp4
from .config import ModelConfig
from .families.spec import GgufJoin
from .fill import Filler, allocate_banks
from .gguf_arch import Fix, block_key, block_targets, joins, split_gate_up, top_fix, top_name
from .gguf_config import config_from_gguf, gguf_arch
from .layers.common import dtype_of
from .model import CausalLM, build_model
from .registry import GGUF_ARCHITECTURES, family_spec

log = logging.getLogger(__name__)

_TOP = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}
# blk.N.<key> -> layers.N.<value>
_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_sinks": "self_attn.sinks",
    "attn_sinks.weight": "self_attn.sinks",
    "ffn_gate_inp.weight": "mlp.router.weight",
    "ffn_gate_inp.bias": "mlp.router.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")
_EXPS = re.compile(r"^ffn_(gate|up|down)_exps\.(weight|bias)$")
_FUSED_EXPS = "ffn_gate_up_exps.weight"  # llama.cpp's converter with --fuse-gate-up-exps
_IGNORED = ("rope_freqs.weight",)  # llama.cpp's precomputed rope factors: we compute our own


class _Source:
    """One GGUF tensor with the loader's source interface; ``fix`` undoes a converter transform
    (``gguf_arch``), and ``shape`` is the shape after it."""

    def __init__(self, f: GgufFile, t: GgufTensor, fix: Fix | None = None) -> None:
        self.f, self.t, self.fix = f, t, fix
        # set for a stacked expert weight read into the banks: each expert's read runs on the
        # pool's threads (``into`` returns before they end; the loader waits on the pool)
        self.pool: gguf_experts.FillPool | None = None
        self.shape = (
            t.shape if fix is None else tuple(fix(torch.empty(t.shape, device="meta")).shape)
        )
        self.dtype = torch.float32 if t.quantized else _native(t)

    def read(self) -> torch.Tensor:
        try:
            out = self.f.read_float(self.t)
        except (GgufFormatError, OSError) as e:
            raise CheckpointError(
                f"{self.t.path}: tensor '{self.t.name}' cannot be read ({e})"
            ) from None
        return out if self.fix is None else self.fix(out)

    def into(self, dest: torch.Tensor) -> None:
        direct = self.fix is None and not self.t.quantized and dest.dtype == self.dtype
        # (asked only where it decides: a check a row would take ~0.3 s over a 50k-row vocabulary)
        per_expert = (
            direct
            and (self.pool is not None or not dest.is_contiguous())
            and dest.dim() > 1
            and all(d.is_contiguous() for d in dest)
        )
        if direct and dest.is_contiguous() and not (per_expert and self.pool is not None):
            self.f.read_into(self.t, dest)
        elif self.fix is None and self.t.quantized and dest.is_contiguous():
            try:  # dequantized a slice of rows at a time, straight into dest
                self.f.read_float_into(self.t, dest)
            except (GgufFormatError, OSError) as e:
                raise CheckpointError(
                    f"{self.t.path}: tensor '{self.t.name}' cannot be read ({e})"
                ) from None
        elif per_expert:
            # a stacked expert tensor into its rows of the banks (gate rows, then up rows):
            # each expert's slice is contiguous, so read expert by expert with no temporary
            step = self.t.nbytes // dest.shape[0]
            for x in range(dest.shape[0]):
                if self.pool is None:
                    self.f.read_into(self.t, dest[x], offset=x * step)
                else:
                    self.pool.submit(gguf_experts.read_expert, self.f, self.t, dest[x], x * step)
        else:
            dest.copy_(self.read())


class _Joined:
    """Two GGUF tensors read together into one parameter (DeepSeek's split kv_b)."""

    def __init__(self, parts: list[_Source], join: Callable[..., torch.Tensor]) -> None:
        self.parts, self.join, self.t = parts, join, parts[0].t
        metas = [torch.empty(p.shape, device="meta") for p in parts]
        self.shape = tuple(join(*metas).shape)
        self.dtype = torch.float32

    def read(self) -> torch.Tensor:
        return self.join(*(p.read().float() for p in self.parts))

    def into(self, dest: torch.Tensor) -> None:
        dest.copy_(self.read())


def _native(t: GgufTensor) -> torch.dtype:

    return NATIVE[t.type_name]


class GgufCheckpoint:
    """An open GGUF file or split set: metadata (from the first file) and every tensor.
    ``headers``: the files' headers parsed before (``gguf_file.read_headers``), so that one
    load parses each header once; any that is not a file's current one is parsed again."""

    def __init__(self, path: str | Path, headers: list[GgufHeader] | None = None) -> None:
        self.path = Path(path)
        self._stack = ExitStack()
        self.files: list[GgufFile] = []
        self.tensors: dict[str, tuple[GgufFile, GgufTensor]] = {}
        given = {h.path: h for h in headers or ()}
        try:
            for p in split_files(self.path):
                f = self._stack.enter_context(GgufFile(p, given.get(p)))
                self.files.append(f)
                for name, t in f.tensors.items():
                    if name in self.tensors:
                        raise CheckpointError(f"{p}: tensor '{name}' appears in two split files")
                    self.tensors[name] = (f, t)
        except GgufFormatError as e:
            self._stack.close()
            raise CheckpointError(str(e)) from None
        except BaseException:
            self._stack.close()
            raise
        self.metadata = self.files[0].metadata
        self.arch = gguf_arch(self.metadata, str(self.path))

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> GgufCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def default_dtype(self) -> str:
        """float32 when every float tensor is F32; bfloat16 otherwise (quantized types
        dequantize to it). Integer tables (I32) do not count."""
        types = {t.type_name for _, t in self.tensors.values()} - {"I32"}
        return "float32" if types == {"F32"} else "bfloat16"

    def config(self, dtype: str | None = None) -> ModelConfig:
        infos = {n: t for n, (_, t) in self.tensors.items()}

        def read(name: str) -> torch.Tensor:
            f, t = self.tensors[name]
            return f.read_float(t)

        cfg = config_from_gguf(
            self.metadata, infos, dtype or self.default_dtype(), str(self.path), read
        )
        block = gguf_experts.block_expert_format(infos, cfg.hidden_size, cfg.moe_intermediate_size)
        if cfg.expert_format == "bf16" and block is not None:
            cfg = dataclasses.replace(cfg, expert_format=block)
        elif cfg.expert_format == "bf16" and gguf_experts.nvfp4_experts(infos):
            cfg = dataclasses.replace(cfg, expert_format="nvfp4")
        return cfg

    def sources(self, cfg: ModelConfig) -> Iterator[tuple[str, str, _Source | _Joined]]:
        """(gguf name, our canonical name or an expert key, source) for every tensor."""
        mtp = int(self.metadata.get(f"{self.arch}.nextn_predict_layers", 0) or 0)
        for name, (f, t) in self.tensors.items():
            if name in _IGNORED:
                continue
            top = _TOP.get(name) or top_name(self.arch, name)
            if top is not None:
                yield name, top, _Source(f, t, top_fix(self.arch, name))
                continue
            m = _BLK.match(name)
            key = m.group(2) if m else ""
            if m is not None and mtp and int(m.group(1)) >= cfg.num_layers:
                continue  # a multi-token-prediction layer after the decoder layers: not loaded
            nv_scale = m is not None and gguf_nvfp4.scale_of(self.tensors, name) is not None
            if m is not None and (
                _EXPS.match(key) or (nv_scale and gguf_nvfp4.EXPS_SCALE.match(key))
            ):
                yield name, f"experts:{m.group(1)}:{key}", _Source(f, t)
                continue
            if m is not None and key == _FUSED_EXPS:  # [E, 2I, H]: gate rows, then up rows
                for proj, rows in split_gate_up(cfg).items():
                    yield name, f"experts:{m.group(1)}:ffn_{proj}_exps.weight", _Source(f, t, rows)
                continue
            if nv_scale:
                continue  # a dense NVFP4 weight's scale: applied where the weight is read
            try:
                targets = block_targets(self.arch, cfg, key, _BLOCK) if m else None
            except KeyError:
                targets = None
            if targets is None:
                raise CheckpointError(f"{t.path}: unexpected tensor '{name}' for {self.arch}")
            layer = int(m.group(1)) if m else 0
            scale = gguf_nvfp4.dense_global(self.tensors, name, t)
            for canon, fix in targets:
                if scale is not None:
                    fix = gguf_nvfp4.scaled(fix, scale)
                yield name, f"layers.{layer}.{canon}", _Source(f, t, fix)
            # tensors read together (DeepSeek's split kv_b), joined once per layer (from
            # whichever part the file has), unless the file holds the parameter whole
            for join in joins(self.arch):
                lead = join.parts[0]
                first = key == lead or f"blk.{layer}.{lead}" not in self.tensors
                if key in join.parts and first and f"blk.{layer}.{join.unless}" not in self.tensors:
                    yield name, f"layers.{layer}.{join.target}", self._joined(cfg, layer, join)

    def _joined(self, cfg: ModelConfig, layer: int, join: GgufJoin) -> _Joined:
        names = [f"blk.{layer}.{k}" for k in join.parts]
        for n in names:
            if n not in self.tensors:
                raise CheckpointError(f"{self.path}: missing tensor '{n}'")
        parts = [_Source(*self.tensors[n]) for n in names]
        return _Joined(parts, lambda *ts: join.join(cfg, *ts))

    def log_dequantized(
        self, dtype: str, packed: str = "", kept: frozenset[str] = frozenset()
    ) -> None:
        """``kept``: names of dense tensors loaded in their blocks (not dequantized); kept
        experts are told by ``gguf_experts``."""
        gguf_experts.log_kept(self.path.name, {n: t for n, (_, t) in self.tensors.items()}, packed)
        quant = [
            t
            for name, (_, t) in self.tensors.items()
            if t.quantized and name not in kept and not gguf_experts.kept(name, t, packed)
        ]
        if not quant:
            return
        elem = torch.empty((), dtype=_dt(dtype)).element_size()
        mem = sum(math.prod(t.shape) for t in quant) * elem
        file_bytes = sum(t.nbytes for t in quant)
        kinds = ", ".join(
            f"{k} x{n}" for k, n in sorted(Counter(t.type_name for t in quant).items())
        )
        log.info(
            "%s: dequantizing %d quantized tensors (%s) to %s at load: %.2f GiB in memory for "
            "%.2f GiB in the file (no native kernels for these types yet)",
            self.path.name,
            len(quant),
            kinds,
            dtype,
            mem / 2**30,
            file_bytes / 2**30,
        )


@dataclasses.dataclass(frozen=True)
class _Kept:
    """A projection loaded in its GGUF blocks: the module, and the rows (``order``) or the
    input order (``in_perm``) the converter's transform amounts to (None: as in the file)."""

    mod: torch.nn.Module
    order: torch.Tensor | None = None
    in_perm: torch.Tensor | None = None
    attr: str = "weight"  # the parameter the blocks replace (the module's ``block_param``)


def _block_linear(model: CausalLM, canon: str, src: object) -> _Kept | None:
    """The projection ``canon`` belongs to when its GGUF tensor can stay in its blocks: any
    `Linear` or module like it (``block_param``: the grouped o_a_proj, a hyper-connection's fn;
    attention, linear attention, MLPs, shared experts, routers, lm_head: llama.cpp
    computes each from the file's blocks) of a type those kernels compute, with the shape the
    model expects, read from one tensor whose converter transform (if any) only reorders or
    selects rows, or only reorders input columns (then the input moves: ``_input_order``)."""

    if not isinstance(src, _Source):
        return None
    t = src.t
    fmt = t.type_name.lower()
    layer, _, attr = canon.rpartition(".")
    if fmt not in BLOCK_BYTES or len(t.shape) != 2 or not layer:
        return None
    try:
        mod = model.get_submodule(layer)
    except AttributeError:
        return None
    if getattr(mod, "block_param", None) != attr:  # Linear, and the modules like it
        return None
    order = perm = None
    if src.fix is not None:
        order = _row_order(src.fix, t.shape[0])
        perm = None if order is not None else _input_order(src.fix, t.shape[1])
        if order is None and perm is None:
            return None
    rows = t.shape[0] if order is None else len(order)
    if tuple(getattr(mod, attr).shape) != (rows, t.shape[1]):
        return None
    return _Kept(mod, order, perm, attr)


def _row_order(fix: Fix, rows: int) -> torch.Tensor | None:
    """The row indices ``fix`` amounts to when it only reorders or selects whole rows (llama's
    Q/K permutation, Qwen3.5's value-head order, Qwen3-Next's b and a rows of ``ssm_ba``), found
    by applying it to the row numbers; None for any other transform (values changed, columns
    moved, rows repeated)."""
    probe = torch.arange(rows, dtype=torch.float64).unsqueeze(1)
    try:
        out = fix(probe)
    except (RuntimeError, ValueError, IndexError):
        return None
    if out.dim() != 2 or out.shape[1] != 1 or not 0 < out.shape[0] <= rows:
        return None
    idx = out[:, 0]
    if not torch.equal(idx, idx.round()) or idx.unique().numel() != idx.numel():
        return None
    if bool((idx < 0).any()) or bool((idx >= rows).any()):
        return None
    return idx.long()


def _input_order(fix: Fix, cols: int) -> torch.Tensor | None:
    """QuantWeight.in_perm for a ``fix`` that only reorders whole columns (Qwen3.5's tiled value
    heads at the input of ``ssm_out``): input j of the file's rows is the model's input
    in_perm[j]; None for any other transform."""
    probe = torch.arange(cols, dtype=torch.float64).unsqueeze(0)
    try:
        out = fix(probe)
    except (RuntimeError, ValueError, IndexError):
        return None
    if out.shape != probe.shape or not torch.equal(out.sort(1).values, probe):
        return None
    return out[0].long().argsort()  # out[0, i]: the file column of model column i


def _keep_blocks(kept: _Kept, src: _Source) -> None:
    """Loads the GGUF rows raw into ``kept.mod`` (a row-reordering or row-selecting transform
    moves whole rows: a row's blocks move together; a column reorder becomes the weight's
    in_perm); the float weight it replaces was never touched, so never resident."""
    raw = src.f.read_raw(src.t)
    if kept.order is not None:
        raw = raw[kept.order]
    qw = QuantWeight.from_raw(raw, src.t.type_name.lower(), src.t.shape[1])
    mod = kept.mod
    qw = dataclasses.replace(qw, in_perm=kept.in_perm) if kept.in_perm is not None else qw
    mod.qweight = qw  # type: ignore[assignment]  # Linear and the modules like it hold one
    dt = getattr(mod, kept.attr).dtype
    setattr(mod, kept.attr, torch.nn.Parameter(torch.empty(0, dtype=dt), requires_grad=False))


def _embedding_blocks(ck: GgufCheckpoint, cfg: ModelConfig, model: CausalLM) -> _Source | None:
    """The token embedding's tensor where the model can keep it in its blocks (``Embedding``:
    the rows a step looks up dequantized then, the table never whole): the base ``CausalLM``
    (a family's own model reads its embedding's weight itself), not tied to lm_head, a 2-D
    tensor of a type ``gguf_dequant`` dequantizes, as the file has it (no converter transform),
    of the model's shape. None: it loads dequantized."""
    entry = ck.tensors.get("token_embd.weight")
    if entry is None or type(model) is not CausalLM or cfg.tie_word_embeddings:
        return None
    src = _Source(*entry, top_fix(ck.arch, "token_embd.weight"))
    t = src.t
    if src.fix is not None or t.type_name not in DEQUANTIZERS or len(t.shape) != 2:
        return None
    if t.shape != (cfg.vocab_size, cfg.hidden_size):
        return None
    return src


def _joined_blocks(model: CausalLM, canon: str, src: object) -> torch.nn.Module | None:
    """The module that takes the parts of a joined parameter in their GGUF blocks
    (``keep_joined_blocks``: MLA's attn_k_b / attn_v_b, computed from the blocks as llama.cpp
    computes them), when every part is of a type the integer-dot kernels compute."""
    if not isinstance(src, _Joined):
        return None
    owner_name, _, rest = canon.rpartition(".")
    owner_name, _, name = owner_name.rpartition(".")
    try:
        owner = model.get_submodule(owner_name)
    except AttributeError:
        return None
    if rest != "weight" or name not in getattr(owner, "joined_blocks", ()):
        return None
    for p in src.parts:
        fmt = p.t.type_name.lower()
        if p.fix is not None or fmt not in BLOCK_BYTES or not supports(fmt, p.t.shape[-1]):
            return None
    return owner


def _keep_joined(owner: torch.nn.Module, canon: str, src: _Joined) -> None:
    """Reads the parts raw (rows of the file's blocks) into ``owner``."""
    parts = []
    for p in src.parts:
        fmt = p.t.type_name.lower()
        raw = p.f.read_raw(p.t)
        parts.append(QuantWeight.from_raw(raw.reshape(-1, raw.shape[-1]), fmt, p.t.shape[-1]))
    name = canon.rpartition(".")[0].rpartition(".")[2]
    owner.keep_joined_blocks(name, parts)  # type: ignore[operator]


def _check_types(ck: GgufCheckpoint, cfg: ModelConfig) -> None:
    """Refuses, before loading, a tensor of a type we can neither keep nor dequantize."""

    seen: dict[str, bool] = {}
    for name, (_, t) in ck.tensors.items():
        if t.type_name not in seen:
            seen[t.type_name] = can_dequantize(t.type_name)
        if not seen[t.type_name]:
            raise CheckpointError(
                f"{t.path}: tensor '{name}' has type {t.type_name}, which is not supported "
                "(no kernel and no dequantizer)"
            )


def _check_experts(ck: GgufCheckpoint, cfg: ModelConfig) -> None:
    """Every MoE layer has its stacked expert tensors (before minutes of loading)."""
    kinds = ("weight", "bias") if cfg.expert_bias else ("weight",)
    for layer, moe in enumerate(cfg.moe_layers):
        for proj in ("gate", "up", "down") if moe else ():
            for kind in kinds:
                name = f"blk.{layer}.ffn_{proj}_exps.{kind}"
                if proj != "down" and f"blk.{layer}.{_FUSED_EXPS}" in ck.tensors:
                    continue
                if name not in ck.tensors:
                    raise CheckpointError(f"{ck.path}: missing tensor '{name}'")


def gguf_name(canon: str, arch: str = "") -> str:
    """The GGUF name of one of our parameters (for messages)."""
    spec = GGUF_ARCHITECTURES.get(arch)
    extra = spec.gguf.top if spec is not None and spec.gguf is not None else {}
    for g, c in (*_TOP.items(), *extra.items()):
        if c == canon:
            return g
    m = re.match(r"^layers\.(\d+)\.(.+)$", canon)
    key = m and (
        block_key(arch, m.group(2)) or next((g for g, c in _BLOCK.items() if c == m.group(2)), None)
    )
    return f"blk.{m.group(1)}.{key}" if m and key else canon


def _dt(name: str) -> torch.dtype:

    return dtype_of(name)


def _interleaved(t: GgufTensor, proj: str, interleave: bool) -> str | None:
    """The block type whose interleaved layout the stacked expert tensor ``t`` of ``proj``
    (gate | up | down: [E, rows, cols]) is written in: where ``formats.interleave_banks`` would
    interleave its rows, with ``interleave``; else None (the file's rows)."""
    qtype, rows = t.type_name.lower(), t.shape[1]  # gate or up: one half of gate_up's rows
    bank = ("down", rows) if proj == "down" else ("gate_up", 2 * rows)
    return qtype if interleave and interleaves(bank[0], qtype, bank[1]) else None


def _disk_tier(ck: GgufCheckpoint, cfg: ModelConfig, cache_bytes: int) -> DiskTier:
    """The disk tier over ``ck``'s expert tensors, through descriptors of its own (``ck``'s
    close with the load)."""
    files = [GgufFile(f.path, f.header) for f in ck.files]
    again = {f.path: g for f, g in zip(ck.files, files, strict=True)}
    tensors = {n: (again[f.path], t) for n, (f, t) in ck.tensors.items()}
    blocks = sorted((m, b) for b, m in enumerate(cfg.moe_layer_index[: cfg.num_layers]) if m >= 0)
    try:
        source = gguf_experts.GgufExpertSource(
            files, tensors, [b for _, b in blocks], cfg.num_experts
        )
    except ValueError as e:
        for f in files:
            f.close()
        raise CheckpointError(f"{ck.path}: {e}") from None
    return DiskTier(source, cache_bytes, cfg.top_k)


def _fill(
    ck: GgufCheckpoint,
    cfg: ModelConfig,
    filler: Filler,
    banks: ExpertBanks,
    in_blocks: dict[str, tuple[str, _Kept]],
    joined: dict[str, torch.nn.Module],
    block: bool,
    tiered: bool,
    interleave: bool,
    pool: gguf_experts.FillPool | None,
    nv: bool = False,
    done: frozenset[str] = frozenset(),
    early: bool = False,
) -> None:
    """Every tensor of ``ck`` into the model and the banks (``pool``: the block experts' reads
    run on its threads and may still be in flight when this returns; ``nv``: NVFP4 experts into
    ``nvfp4`` banks; ``done``: GGUF names loaded before, skipped; ``early``: the block or BF16
    experts are being read already, by the fill started before torch: checked and counted
    only)."""
    for name, canon, src in ck.sources(cfg):
        if name in done:
            continue
        if canon in in_blocks and isinstance(src, _Source):
            _keep_blocks(in_blocks[canon][1], src)
            filler.filled.add(canon)
            continue
        if canon in joined and isinstance(src, _Joined):
            _keep_joined(joined[canon], canon, src)
            filler.filled.add(canon)
            continue
        if canon.startswith("experts:") and gguf_nvfp4.EXPS_SCALE.match(canon.split(":")[2]):
            assert isinstance(src, _Source)
            _, layer, key = canon.split(":")
            gguf_nvfp4.experts_global(
                cfg, banks, filler, int(layer), key, src.read(), name, src.t.path, nv
            )
            continue
        if canon.startswith("experts:"):
            _, layer, key = canon.split(":")
            m = _EXPS.match(key)
            assert m is not None and isinstance(src, _Source)
            if nv and m.group(2) == "weight":  # NVFP4 codes and scales into the nvfp4 banks
                gguf_nvfp4.experts_stack(
                    cfg, banks, filler, int(layer), m.group(1), src.f, src.t, name, pool
                )
                continue
            if block and m.group(2) == "weight":  # the raw blocks, as the file has them
                if src.fix is not None:
                    raise CheckpointError(
                        f"{src.t.path}: tensor '{name}': fused gate/up experts in blocks "
                        "are not supported"
                    )
                if tiered or early:
                    raw: gguf_experts.RawStack = gguf_experts.InFile(src.f, src.t)
                    layout = _interleaved(src.t, m.group(1), interleave)
                    banks.interleaved |= early and layout is not None
                else:
                    raw = gguf_experts.RawStack(
                        src.f, src.t, _interleaved(src.t, m.group(1), interleave), pool
                    )
                    banks.interleaved |= raw.interleave is not None
                filler.expert_stack(int(layer), m.group(1), "weight", raw, name, src.t.path)
                continue
            if early and m.group(2) == "weight":  # BF16 experts read by the early fill
                kept = gguf_experts.InFile(src.f, src.t)
                kept.dtype = src.dtype
                filler.expert_stack(int(layer), m.group(1), "weight", kept, name, src.t.path)
                continue
            if m.group(2) == "weight":  # float experts: each expert's read on the pool too
                src.pool = pool
            filler.expert_stack(int(layer), m.group(1), m.group(2), src, name, src.t.path)
        elif cfg.tie_word_embeddings and canon == "lm_head.weight":
            continue
        elif canon in filler.tables:  # an integer table (DeepSeek-V4's tid2eid)
            filler.table(canon, src, name, src.t.path)
        elif canon not in filler.params and 0 in src.shape:
            continue  # an empty module (GLM with no shared expert: [0, H] tensors)
        elif canon not in filler.params:
            raise CheckpointError(
                f"{src.t.path}: unexpected tensor '{name}' (no parameter '{canon}' in the model)"
            )
        else:
            filler.dense(canon, src, name, src.t.path)


def _early_error(fill: gguf_early.EarlyFill) -> None:
    """Raises what stopped the early fill as the load's error."""
    try:
        fill.wait()
    except GgufFormatError as e:
        raise CheckpointError(str(e)) from None


def load_gguf(
    path: str | Path,
    cfg: ModelConfig | None = None,
    headers: list[GgufHeader] | None = None,
    expert_cache_bytes: int | None = None,
    interleave_experts: bool = False,
    host_only: bool = False,
) -> tuple[CausalLM, ExpertBanks]:
    """Loads a GGUF file (or split set) into a model and its expert banks (``headers``: the
    files' headers, parsed before). ``expert_cache_bytes``: the disk tier (load_model).
    ``interleave_experts``: block banks that only the cpu backend will read are filled in the
    interleaved layout ``formats.interleave_banks`` would give them (``banks.interleaved``).
    ``host_only``: the dense part stays on the host: a token embedding in a block type our
    dequantizers take stays in its blocks (``_embedding_blocks``)."""
    with GgufCheckpoint(path, headers) as ck:
        cfg = cfg or ck.config()
        infos = {n: t for n, (_, t) in ck.tensors.items()}
        kept = gguf_experts.block_expert_format(infos, cfg.hidden_size, cfg.moe_intermediate_size)
        block = kept is not None and cfg.expert_format == kept
        nv = cfg.expert_format == "nvfp4" and gguf_experts.nvfp4_experts(infos)
        if cfg.expert_format != "bf16" and not block and not nv:
            raise CheckpointError(
                f"{path}: GGUF experts load as float banks or in the block format "
                f"of the file's expert tensors; not {cfg.expert_format}"
            )
        tiered = expert_cache_bytes is not None
        if tiered and not block:  # (NVFP4 experts too: not yet)
            raise CheckpointError(
                f"{path}: the disk tier reads experts in a GGUF block format the integer-dot "
                "kernels compute (Q4_K, Q8_0, ...); these experts load dequantized"
            )
        family_spec(cfg.family)
        interleave = interleave_experts and block and not tiered
        interleave = interleave and gguf_interleave.native_moves_available()
        # the experts read into banks of this layout since before torch (formats.gguf_early)
        early = gguf_experts.early_banks(path, cfg, interleave, not tiered and not nv)
        model = build_model(cfg)
        banks = allocate_banks(cfg, not tiered, None if early is None else early[1])
        if nv:  # the converter leaves out a global scale of 1
            banks.extra["gate_up_global"].fill_(1.0)
            banks.extra["down_global"].fill_(1.0)
        filler = Filler(cfg, family_spec(cfg.family), model, banks)
        _check_experts(ck, cfg)
        _check_types(ck, cfg)
        in_blocks = {  # by our name: one GGUF tensor can fill several (ssm_ba)
            canon: (name, keep)
            for name, canon, src in ck.sources(cfg)
            if (keep := _block_linear(model, canon, src)) is not None
        }
        joined = {
            canon: owner
            for _, canon, src in ck.sources(cfg)
            if (owner := _joined_blocks(model, canon, src)) is not None
        }
        embedding = _embedding_blocks(ck, cfg, model) if host_only else None
        kept_names = frozenset(name for name, _ in in_blocks.values())
        kept_names |= {embedding.t.name} if embedding is not None else set()
        kept_names |= {
            f"blk.{canon.split('.')[1]}.{part}"
            for canon in joined
            for join in joins(ck.arch)
            if canon.endswith(join.target)
            for part in join.parts
        }
        ck.log_dequantized(cfg.torch_dtype, cfg.expert_format, kept_names)
        # resident experts are read on worker threads while this one loads the rest
        threaded = not tiered
        pool = gguf_experts.FillPool(os.cpu_count() or 1) if threaded else None
        try:
            done: frozenset[str] = frozenset()
            if embedding is not None:  # the file's rows as they are
                t = embedding.t
                model.embed_tokens.keep_blocks(embedding.f.read_raw(t), t.type_name)
                filler.filled.add("embed_tokens.weight")
                done = frozenset({t.name})
            _fill(
                ck, cfg, filler, banks, in_blocks, joined, block, tiered, interleave, pool, nv,
                done, early is not None,
            )  # fmt: skip
            if pool is not None:
                pool.wait()
            if early is not None and early[0].done():
                _early_error(early[0])
            elif early is not None:  # the cpu backend waits for each layer's rows (gguf_early)
                banks.filling = early[0]
                log.info("%s: serving while the experts are read", Path(path).name)
        except BaseException:
            if early is not None:
                early[0].stop()  # nothing writes into banks the failed load frees
            raise
        finally:
            if pool is not None:
                pool.close()
        missing = [n for n in (*filler.params, *filler.tables) if n not in filler.filled]
        if cfg.tie_word_embeddings:
            missing = [n for n in missing if n != "lm_head.weight"]
        if missing:
            raise CheckpointError(
                f"{path}: missing tensor '{gguf_name(missing[0], ck.arch)}' ({len(missing)} missing in all)"
            )
        try:
            filler.verify()
        except CheckpointError as e:
            raise CheckpointError(f"{path}: {e}") from None
        if expert_cache_bytes is not None:
            banks.disk = _disk_tier(ck, cfg, expert_cache_bytes)
        mtp = [n for n in ck.tensors if (m := _BLK.match(n)) and int(m.group(1)) >= cfg.num_layers]
        if mtp:
            log.info(
                "%s: skipped %d tensors of %d multi-token-prediction layer(s) (not used yet)",
                ck.path.name,
                len(mtp),
                int(ck.metadata.get(f"{ck.arch}.nextn_predict_layers", 0) or 0),
            )
    model.eval()
    return model, banks
