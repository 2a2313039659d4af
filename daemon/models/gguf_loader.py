"""GGUF checkpoints (single files and ``-0000i-of-0000N`` split sets) into dense parameters and
expert banks: the GGUF reader (``formats.gguf_file``) composed with the model's tables.

llama.cpp's tensor names are mapped onto ours by one table; stacked expert tensors
(``blk.N.ffn_{gate,up,down}_exps``, [E, rows, cols]) go into the flat_id-major banks (gate rows,
then up rows). The llama architecture's converter permutes the rows of Q and K for its
interleaved rope; that permutation is undone here so the model keeps HF's half-split rope.
F32/F16/BF16 are read as they are; experts of the block types the CPU's integer-dot kernels
compute stay in their blocks (``gguf_experts``); other quantized types are dequantized at load (one
log line says which, and what it costs in memory).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import torch

from ..experts.banks import ExpertBanks
from ..formats.gguf_file import GgufFile, GgufFormatError, GgufTensor, split_files
from . import gguf_experts
from .config import ModelConfig
from .gguf_config import config_from_gguf, gguf_arch
from .loader import CheckpointError, Filler, allocate_banks
from .model import CausalLM, build_model
from .registry import family_spec

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
_IGNORED = ("rope_freqs.weight",)  # llama.cpp's precomputed rope factors: we compute our own


class _Source:
    """One GGUF tensor with the loader's source interface; ``rows`` permutes the output rows."""

    def __init__(self, f: GgufFile, t: GgufTensor, rows: torch.Tensor | None = None) -> None:
        self.f, self.t, self.rows = f, t, rows
        self.shape = t.shape
        self.dtype = torch.float32 if t.quantized else _native(t)

    def read(self) -> torch.Tensor:
        try:
            out = self.f.read_float(self.t)
        except (GgufFormatError, OSError) as e:
            raise CheckpointError(
                f"{self.t.path}: tensor '{self.t.name}' cannot be read ({e})"
            ) from None
        return out if self.rows is None else out[self.rows]

    def into(self, dest: torch.Tensor) -> None:
        direct = self.rows is None and not self.t.quantized and dest.dtype == self.dtype
        if direct and dest.is_contiguous():
            self.f.read_into(self.t, dest)
        elif direct and dest.dim() > 1 and all(d.is_contiguous() for d in dest):
            # a stacked expert tensor into its rows of the banks (gate rows, then up rows):
            # each expert's slice is contiguous, so read expert by expert with no temporary
            step = self.t.nbytes // dest.shape[0]
            for x in range(dest.shape[0]):
                self.f.read_into(self.t, dest[x], offset=x * step)
        else:
            dest.copy_(self.read())


def _native(t: GgufTensor) -> torch.dtype:
    from ..formats.gguf_file import NATIVE

    return NATIVE[t.type_name]


def _unpermute(n_head: int, rows: int) -> torch.Tensor:
    """Row indices that undo llama.cpp's Q/K permutation (``n_head`` heads of rows/n_head): the
    converter stores HF row (head, half, pair) at file row (head, pair, half); ``file[idx]`` is
    the HF order."""
    d = rows // n_head
    return torch.arange(rows).view(n_head, d // 2, 2).transpose(1, 2).reshape(rows)


class GgufCheckpoint:
    """An open GGUF file or split set: metadata (from the first file) and every tensor."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._stack = ExitStack()
        self.files: list[GgufFile] = []
        self.tensors: dict[str, tuple[GgufFile, GgufTensor]] = {}
        try:
            for p in split_files(self.path):
                f = self._stack.enter_context(GgufFile(p))
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
        """float32 when every tensor is F32; bfloat16 otherwise (quantized types dequantize to
        it)."""
        types = {t.type_name for _, t in self.tensors.values()}
        return "float32" if types == {"F32"} else "bfloat16"

    def config(self, dtype: str | None = None) -> ModelConfig:
        infos = {n: t for n, (_, t) in self.tensors.items()}
        cfg = config_from_gguf(self.metadata, infos, dtype or self.default_dtype(), str(self.path))
        block = gguf_experts.block_expert_format(infos, cfg.hidden_size, cfg.moe_intermediate_size)
        if cfg.expert_format == "bf16" and block is not None:
            cfg = dataclasses.replace(cfg, expert_format=block)
        return cfg

    def sources(self, cfg: ModelConfig) -> Iterator[tuple[str, str, _Source]]:
        """(gguf name, our canonical name or an expert key, source) for every tensor."""
        permute = self.arch == "llama"
        for name, (f, t) in self.tensors.items():
            if name in _IGNORED:
                continue
            if name in _TOP:
                yield name, _TOP[name], _Source(f, t)
                continue
            m = _BLK.match(name)
            key = m.group(2) if m else None
            if m is None or (key not in _BLOCK and not _EXPS.match(key or "")):
                raise CheckpointError(f"{t.path}: unexpected tensor '{name}' for {self.arch}")
            layer = int(m.group(1))
            if _EXPS.match(key or ""):
                yield name, f"experts:{layer}:{key}", _Source(f, t)
                continue
            canon = f"layers.{layer}.{_BLOCK[key or '']}"
            rows = None
            if permute and key in ("attn_q.weight", "attn_k.weight"):
                heads = cfg.num_heads if key == "attn_q.weight" else cfg.num_kv_heads
                rows = _unpermute(heads, t.shape[0])
            yield name, canon, _Source(f, t, rows)

    def log_dequantized(self, dtype: str, packed: str = "") -> None:
        gguf_experts.log_kept(self.path.name, {n: t for n, (_, t) in self.tensors.items()}, packed)
        quant = [
            t
            for n, (_, t) in self.tensors.items()
            if t.quantized
            and not (packed == "mxfp4" and t.type_name == "MXFP4")
            and not gguf_experts.kept(n, t, packed)
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


def _mxfp4_repack(src: _Source) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml MXFP4 blocks -> our mxfp4 banks. A ggml block of 32 values is 17 bytes: the e8m0
    scale, then 16 bytes whose low nibbles are values 0..15 and high nibbles values 16..31
    (e2m1 codes; ggml's table holds the values doubled and halves the scale, the same numbers).
    Ours pairs neighbours: value 2j in the low nibble, 2j+1 in the high one.
    -> blocks uint8 [E, rows, cols / 2], scales uint8 [E, rows, cols / 32]."""
    t = src.t
    if t.type_name != "MXFP4":
        raise CheckpointError(f"{t.path}: tensor '{t.name}' is {t.type_name}; expected MXFP4")
    raw = src.f.read_raw(t)  # [E, rows, cols / 32 * 17]
    e, rows = t.shape[0], t.shape[1]
    raw = raw.view(e, rows, -1, 17)
    scales = raw[..., 0].contiguous()
    qs = raw[..., 1:]
    codes = torch.cat([qs & 0xF, qs >> 4], dim=-1)  # [E, rows, nb, 32] in value order
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.reshape(e, rows, -1), scales


def _check_types(ck: GgufCheckpoint, cfg: ModelConfig) -> None:
    """Refuses, before loading, a tensor of a type we can neither keep nor dequantize."""
    from ..formats.gguf_file import can_dequantize

    seen: dict[str, bool] = {}
    for name, (_, t) in ck.tensors.items():
        if cfg.expert_format == "mxfp4" and t.type_name == "MXFP4":
            continue
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
                if name not in ck.tensors:
                    raise CheckpointError(f"{ck.path}: missing tensor '{name}'")


def gguf_name(canon: str) -> str:
    """The GGUF name of one of our parameters (for messages)."""
    for g, c in _TOP.items():
        if c == canon:
            return g
    m = re.match(r"^layers\.(\d+)\.(.+)$", canon)
    for g, c in _BLOCK.items():
        if m and c == m.group(2):
            return f"blk.{m.group(1)}.{g}"
    return canon


def _dt(name: str) -> torch.dtype:
    from .layers.common import dtype_of

    return dtype_of(name)


def load_gguf(path: str | Path, cfg: ModelConfig | None = None) -> tuple[CausalLM, ExpertBanks]:
    """Loads a GGUF file (or split set) into a model and its expert banks."""
    with GgufCheckpoint(path) as ck:
        cfg = cfg or ck.config()
        infos = {n: t for n, (_, t) in ck.tensors.items()}
        kept = gguf_experts.block_expert_format(infos, cfg.hidden_size, cfg.moe_intermediate_size)
        block = kept is not None and cfg.expert_format == kept
        if cfg.expert_format not in ("bf16", "mxfp4") and not block:
            raise CheckpointError(
                f"{path}: GGUF experts load as float or mxfp4 banks, or in the block format "
                f"of the file's expert tensors; not {cfg.expert_format}"
            )
        family_spec(cfg.family)
        model = build_model(cfg)
        banks = allocate_banks(cfg)
        filler = Filler(cfg, family_spec(cfg.family), model, banks)
        _check_experts(ck, cfg)
        _check_types(ck, cfg)
        ck.log_dequantized(cfg.torch_dtype, cfg.expert_format)
        for name, canon, src in ck.sources(cfg):
            if canon.startswith("experts:"):
                _, layer, key = canon.split(":")
                m = _EXPS.match(key)
                assert m is not None
                if banks.format == "mxfp4" and m.group(2) == "weight":
                    blocks, scales = _mxfp4_repack(src)
                    filler.expert_stack_mxfp4(
                        int(layer), m.group(1), blocks, scales, name, src.t.path
                    )
                    continue
                if block and m.group(2) == "weight":  # the raw blocks, as the file has them
                    raw = gguf_experts.RawStack(src.f, src.t)
                    filler.expert_stack(int(layer), m.group(1), "weight", raw, name, src.t.path)
                    continue
                filler.expert_stack(int(layer), m.group(1), m.group(2), src, name, src.t.path)
            elif cfg.tie_word_embeddings and canon == "lm_head.weight":
                continue
            elif canon not in filler.params:
                raise CheckpointError(
                    f"{src.t.path}: unexpected tensor '{name}' (no parameter '{canon}' in the model)"
                )
            else:
                filler.dense(canon, src, name, src.t.path)
        missing = [n for n in filler.params if n not in filler.filled]
        if cfg.tie_word_embeddings:
            missing = [n for n in missing if n != "lm_head.weight"]
        if missing:
            raise CheckpointError(
                f"{path}: missing tensor '{gguf_name(missing[0])}' ({len(missing)} missing in all)"
            )
        try:
            filler.verify()
        except CheckpointError as e:
            raise CheckpointError(f"{path}: {e}") from None
    model.eval()
    return model, banks
