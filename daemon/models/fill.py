"""Filling a model's pre-allocated parameters and expert banks from checkpoint tensors: the
``Filler`` (every destination, what has been filled, the shape and dtype checks) and
``allocate_banks`` (the exact-size banks it fills), shared by the HF safetensors loader
(``loader``) and the GGUF loader (``gguf_loader``).

A checkpoint tensor reaches the filler as a ``Source`` (``fp8_weights.Source``: ``shape``,
``dtype``, ``read``, ``into``): a safetensors tensor read on demand, an FP8 weight widened on the
way (``fp8_weights.Widened``), a GGUF tensor, or a tensor already in memory (``_Loaded``, the
output of a family converter).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..experts.banks import ExpertBanks
from ..experts.formats import allocate, expert_rows
from ..formats.errors import CheckpointError
from . import release_experts
from .config import ModelConfig
from .families.spec import FamilySpec
from .fp8_weights import Source
from .layers.common import dtype_of
from .model import CausalLM, model_tables
from .release_quant import quant_config, release_quant

__all__ = ["Filler", "allocate_banks"]

_FLOAT = (torch.float32, torch.bfloat16, torch.float16)
_FUSED = re.compile(
    r"^layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj|gate_up_proj_bias|down_proj_bias"
    r"|gate_up_proj_blocks|gate_up_proj_scales|down_proj_blocks|down_proj_scales)$"
)
_MXFP4_PARTS = (
    "gate_up_proj_blocks",
    "gate_up_proj_scales",
    "down_proj_blocks",
    "down_proj_scales",
)
_PER_EXPERT = re.compile(
    r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)"
    r"\.(weight|bias|scale|weight_scale_inv|"
    + "|".join((*release_experts.KINDS, *release_experts.ACTIVATION_SCALES))
    + r")$"
)
# a part of a quantized dense weight of a compressed-tensors / ModelOpt release that the loader's
# pairing (release_dense) did not take
_RELEASE_DENSE = re.compile(
    r"\.(weight_packed|weight_scale|weight_global_scale|weight_scale_2|weight_shape|weight_zero_point"
    r"|input_scale|input_global_scale)$"
)
_PACKED = (torch.int8, torch.uint8)  # two e2m1 codes a byte (DeepSeek-V4's release: int8)
_E8M0 = (torch.float8_e8m0fnu, torch.uint8)
_ALWAYS_IGNORED = (r"rotary_emb\.inv_freq$",)
# a multimodal wrapper's text model as llava-style releases spell it (Kimi-K2.5:
# ``language_model.model.*``, ``language_model.lm_head.*``), for transformers'
# ``model.language_model.*`` / ``lm_head.*``
_LLAVA_SPELLING = (
    ("language_model.model.", "model.language_model."),
    ("language_model.lm_head.", "lm_head."),
)
_LAYER = re.compile(r"^layers\.(\d+)\.")


class _Loaded:
    """A tensor already in memory (the output of a family converter), with the ``Source`` interface."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t, self.shape, self.dtype = t, tuple(t.shape), t.dtype

    def read(self) -> torch.Tensor:
        return self.t

    def into(self, dest: torch.Tensor) -> None:
        dest.copy_(self.t)


class Filler:
    """Knows every destination and what has been filled."""

    def __init__(
        self, cfg: ModelConfig, spec: FamilySpec, model: CausalLM, banks: ExpertBanks
    ) -> None:
        self.cfg, self.spec, self.banks = cfg, spec, banks
        self.params = dict(model.named_parameters())
        self.tables = model_tables(model)
        self.filled: set[str] = set()
        self.expert_filled: set[tuple[int, str, int]] = set()  # (layer, part, expert)
        # routed experts quantized by the publisher (compressed-tensors / ModelOpt), kept packed
        rq = release_quant(quant_config(cfg.raw), "config.json") if cfg.raw else None
        self.release = (
            release_experts.ReleaseExperts(rq, banks, cfg.hidden_size, cfg.moe_intermediate_size)
            if rq is not None
            else None
        )

    def unwrapped(self, name: str) -> str:
        """``name`` in transformers' spelling of a multimodal wrapper's text model."""
        if self.cfg.weight_prefix == "model.language_model":
            for old, new in _LLAVA_SPELLING:
                if name.startswith(old):
                    return new + name[len(old) :]
        return name

    def canonical(self, name: str) -> str | None:
        name = self.unwrapped(name)
        prefix = self.cfg.weight_prefix + "."
        if not self.cfg.weight_prefix:  # names as they are: the family's renames place them
            pass
        elif name.startswith(prefix):
            name = name[len(prefix) :]
        elif not name.startswith("lm_head."):
            return None
        for pat, repl in self.spec.renames:
            name = re.sub(pat, repl, name)
        return name

    def mtp(self, name: str) -> bool:
        """A tensor of a multi-token-prediction layer stored after the last decoder layer
        (``<prefix>.layers.<num_layers + i>.``, GLM-4.5 / DeepSeek-V3) or named apart
        (``FamilySpec.mtp``): not loaded for now."""
        if self.spec.mtp and re.search(self.spec.mtp, name):
            return True
        if not self.cfg.num_mtp_layers:
            return False
        m = _LAYER.match(self.unwrapped(name).removeprefix(self.cfg.weight_prefix + "."))
        n = self.cfg.num_layers
        return m is not None and n <= int(m.group(1)) < n + self.cfg.num_mtp_layers

    def routed_expert(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` is a per-expert routed expert tensor."""
        canon = self.canonical(name)
        return canon is not None and _PER_EXPERT.match(canon) is not None

    def ignored(self, name: str) -> bool:
        pats = self.spec.ignore + _ALWAYS_IGNORED
        if any(re.search(p, name) for p in pats):
            return True
        if self.release is not None and name.endswith(release_experts.KV_SCALES):
            return True  # a quantized KV cache's scales: our KV pool is not quantized
        # a tied checkpoint may still carry lm_head.weight
        return self.cfg.tie_word_embeddings and self.unwrapped(name) == "lm_head.weight"

    def put(self, name: str, canon: str, src: Source, path: Path) -> None:
        for pat, convert in self.spec.converters:
            if re.search(pat, canon):
                for out_name, t in convert(self.cfg, canon, src.read()):
                    if out_name not in self.params:
                        raise CheckpointError(
                            f"{path}: tensor '{name}' converts to unknown '{out_name}'"
                        )
                    self._dense(out_name, _Loaded(t), name, path)
                return
        if m := _FUSED.match(canon):
            self._fused(int(m.group(1)), m.group(2), src, name, path)
        elif m := _PER_EXPERT.match(canon):
            self._per_expert(
                int(m.group(1)), int(m.group(2)), m.group(3), m.group(4), src, name, path
            )
        elif canon in self.params:
            self._dense(canon, src, name, path)
        elif canon in self.tables:
            self._table(canon, src, name, path)
        elif 0 in src.shape:
            return  # an empty module (GLM with n_shared_experts = 0 stores [0, H] shared experts)
        elif self.release is not None and _RELEASE_DENSE.search(canon):
            rq = self.release.rq
            raise CheckpointError(
                f"{path}: unexpected tensor '{name}' (a part of a quantized dense weight that "
                f"the config's {rq.method} {rq.expert_format} scheme does not describe)"
            )
        else:
            raise CheckpointError(
                f"{path}: unexpected tensor '{name}' (no parameter '{canon}' in the model)"
            )

    def _check(self, t: Source, shape: tuple[int, ...], name: str, path: Path) -> None:
        if t.dtype not in _FLOAT:
            raise CheckpointError(
                f"{path}: tensor '{name}' has dtype {t.dtype}; expected a float dtype"
            )
        if tuple(t.shape) != shape:
            raise CheckpointError(
                f"{path}: tensor '{name}' has shape {tuple(t.shape)}; expected {shape}"
            )

    def _dense(self, canon: str, src: Source, name: str, path: Path) -> None:
        p = self.params[canon]
        self._check(src, tuple(p.shape), name, path)
        src.into(p.data)
        self.filled.add(canon)

    def _table(self, canon: str, src: Source, name: str, path: Path) -> None:
        b = self.tables[canon]
        if src.dtype.is_floating_point or src.dtype == torch.bool:
            raise CheckpointError(
                f"{path}: tensor '{name}' has dtype {src.dtype}; expected an integer table"
            )
        if tuple(src.shape) != tuple(b.shape):
            raise CheckpointError(
                f"{path}: tensor '{name}' has shape {tuple(src.shape)}; expected {tuple(b.shape)}"
            )
        b.copy_(src.read())
        self.filled.add(canon)

    def table(self, canon: str, src: Source | Any, name: str, path: Path) -> None:
        """Fills the integer table ``canon`` from ``src`` (shape and integer dtype checked)."""
        self._table(canon, src, name, path)

    def dense(self, canon: str, src: Source | Any, name: str, path: Path) -> None:
        """Fills the dense parameter ``canon`` from ``src`` (shape and float dtype checked)."""
        self._dense(canon, src, name, path)

    def expert_stack(
        self, layer: int, proj: str, kind: str, src: Any, name: str, path: Path
    ) -> None:
        """One projection of all experts of a layer, stacked: ``proj`` gate | up | down, ``kind``
        weight [E, rows, cols] | bias [E, rows] (GGUF's ``ffn_<proj>_exps``)."""
        base, e, i, h = (
            self.moe_base(layer, name, path),
            self.cfg.num_experts,
            self.cfg.moe_intermediate_size,
            self.cfg.hidden_size,
        )
        rows = proj_rows(self.cfg, proj)
        if kind == "weight":
            self._check(src, (e, h, i) if proj == "down" else (e, i, h), name, path)
            # the layer's rows: of its type's bank where the format keeps types per layer
            dest = expert_rows(self.banks, "down" if proj == "down" else "gate_up", base, e)
        else:
            self._check(src, (e, h) if proj == "down" else (e, i), name, path)
            bias = self.banks.down_bias if proj == "down" else self.banks.gate_up_bias
            dest = self._bias(bias, name, path)[base : base + e]
        src.into(dest[:, rows])
        part = f"{proj}_proj" if kind == "weight" else f"{proj}_bias"
        part = "down_proj_bias" if part == "down_bias" else part
        self.expert_filled.update((layer, part, x) for x in range(e))
        done = {(layer, "gate_bias", x) for x in range(e)} | {
            (layer, "up_bias", x) for x in range(e)
        }
        if done <= self.expert_filled:  # both halves of the fused gate/up bias are in
            self.expert_filled.update((layer, "gate_up_proj_bias", x) for x in range(e))

    def moe_base(self, layer: int, name: str, path: Path) -> int:
        """The flat id of ``layer``'s first expert (refused where the layer has none)."""
        if layer >= self.cfg.num_layers or self.cfg.moe_layer_index[layer] < 0:
            raise CheckpointError(
                f"{path}: unexpected tensor '{name}' (layer {layer} has no experts)"
            )
        return self.cfg.moe_layer_index[layer] * self.cfg.num_experts

    def _fused(self, layer: int, part: str, src: Source, name: str, path: Path) -> None:
        quantized = self.banks.format == "mxfp4"
        if (part in _MXFP4_PARTS) != quantized and not part.endswith("_bias"):
            want = "mxfp4 blocks and scales" if quantized else "float weights"
            raise CheckpointError(
                f"{path}: unexpected tensor '{name}' (config.json says the experts are {want})"
            )
        if quantized and not part.endswith("_bias"):
            self._fused_mxfp4(layer, part, src, name, path)
            return
        base, e, i, h = (
            self.moe_base(layer, name, path),
            self.cfg.num_experts,
            self.cfg.moe_intermediate_size,
            self.cfg.hidden_size,
        )
        gptoss = self.spec.experts_transposed_interleaved
        if part == "gate_up_proj":
            self._check(src, (e, h, 2 * i) if gptoss else (e, 2 * i, h), name, path)
            dest = self.banks.gate_up
        elif part == "down_proj":
            self._check(src, (e, i, h) if gptoss else (e, h, i), name, path)
            dest = self.banks.down
        elif part == "gate_up_proj_bias":
            self._check(src, (e, 2 * i), name, path)
            dest = self._bias(self.banks.gate_up_bias, name, path)
        else:
            self._check(src, (e, h), name, path)
            dest = self._bias(self.banks.down_bias, name, path)
        if gptoss and part != "down_proj_bias":
            t = src.read()
            if part in ("gate_up_proj", "gate_up_proj_bias"):  # interleaved -> gate rows, up rows
                t = torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)
            if part in ("gate_up_proj", "down_proj"):  # x @ W layout -> W x layout
                t = t.transpose(1, 2)
            dest[base : base + e].copy_(t)
        else:
            src.into(dest[base : base + e])
        self.expert_filled.update((layer, part, x) for x in range(e))

    def _fused_mxfp4(self, layer: int, part: str, src: Source, name: str, path: Path) -> None:
        """GPT-OSS's quantized experts: blocks [E, rows, cols / 32, 16] uint8 (two e2m1 codes a
        byte, the low nibble first) and scales [E, rows, cols / 32] uint8 (e8m0), rows = outputs
        (gate/up interleaved), cols = inputs: our mxfp4 banks' layout once the 16-byte blocks of
        a row are joined and the gate/up rows are de-interleaved."""
        base, e, i, h = (
            self.moe_base(layer, name, path),
            self.cfg.num_experts,
            self.cfg.moe_intermediate_size,
            self.cfg.hidden_size,
        )
        gate_up = part.startswith("gate_up")
        rows, cols = (2 * i, h) if gate_up else (h, i)
        blocks = part.endswith("_blocks")
        shape = (e, rows, cols // 32, 16) if blocks else (e, rows, cols // 32)
        if src.dtype != torch.uint8 or tuple(src.shape) != shape:
            raise CheckpointError(
                f"{path}: tensor '{name}' is {src.dtype}{list(src.shape)}; expected "
                f"torch.uint8{list(shape)}"
            )
        t = src.read()
        if gate_up:  # interleaved -> gate rows, up rows (whole rows: the packing is along inputs)
            t = torch.cat([t[:, 0::2], t[:, 1::2]], dim=1)
        if blocks:
            dest = self.banks.gate_up if gate_up else self.banks.down
            t = t.reshape(e, rows, cols // 2)
        else:
            dest = self.banks.extra["gate_up_scale" if gate_up else "down_scale"]
        dest[base : base + e].copy_(t)
        self.expert_filled.update((layer, part, x) for x in range(e))

    def _bias(self, bank: torch.Tensor | None, name: str, path: Path) -> torch.Tensor:
        if bank is None:
            raise CheckpointError(
                f"{path}: unexpected tensor '{name}' (this model has no expert biases)"
            )
        return bank

    def _per_expert(
        self, layer: int, x: int, proj: str, kind: str, t: Source, name: str, path: Path
    ) -> None:
        base, i, h = (
            self.moe_base(layer, name, path),
            self.cfg.moe_intermediate_size,
            self.cfg.hidden_size,
        )
        if x < self.cfg.num_experts and self.release is not None and kind != "bias":
            part = self.release.put(base + x, proj, kind, t, name, path)
            if part is not None:
                self.expert_filled.add((layer, f"{proj}.{part}", x))
            return
        if x < self.cfg.num_experts and self.banks.format == "mxfp4" and kind != "bias":
            self._per_expert_mxfp4(base + x, layer, x, proj, kind != "weight", t, name, path)
            return
        if x >= self.cfg.num_experts or kind != "weight":
            raise CheckpointError(f"{path}: unexpected tensor '{name}'")
        fid = base + x
        if proj == "down_proj":
            self._check(t, (h, i), name, path)
            t.into(self.banks.down[fid])
            self.expert_filled.add((layer, "down_proj", x))
            return
        self._check(t, (i, h), name, path)
        rows = slice(0, i) if proj == "gate_proj" else slice(i, 2 * i)
        t.into(self.banks.gate_up[fid, rows])
        self.expert_filled.add((layer, proj, x))

    def _per_expert_mxfp4(
        self, fid: int, layer: int, x: int, proj: str, scale: bool, t: Any, name: str, path: Path
    ) -> None:
        """One FP4 expert projection as DeepSeek-V4's release stores it: ``weight`` [rows,
        cols / 2] int8, two e2m1 codes a byte along the inputs, the low nibble first, and
        ``scale`` [rows, cols / 32] ue8m0 (float8_e8m0fnu), one per 32 inputs: our mxfp4 banks'
        bytes as they are, read straight into the bank rows (gate rows, then up rows)."""
        i, h = self.cfg.moe_intermediate_size, self.cfg.hidden_size
        rows, cols = (h, i) if proj == "down_proj" else (i, h)
        shape, dtypes = ((rows, cols // 32), _E8M0) if scale else ((rows, cols // 2), _PACKED)
        if t.dtype not in dtypes or tuple(t.shape) != shape:
            want = " or ".join(str(d) for d in dtypes)
            raise CheckpointError(
                f"{path}: tensor '{name}' is {t.dtype}{list(t.shape)}; expected {want}"
                f"{list(shape)} (config.json says the experts are FP4)"
            )
        if proj == "down_proj":
            dest = self.banks.extra["down_scale"] if scale else self.banks.down
            dest = dest[fid]
        else:
            dest = self.banks.extra["gate_up_scale"] if scale else self.banks.gate_up
            dest = dest[fid, slice(0, i) if proj == "gate_proj" else slice(i, 2 * i)]
        t.into(dest.view(t.dtype))  # the same bytes: int8 / e8m0 over the uint8 bank
        self.expert_filled.add((layer, proj + ("_scale" if scale else ""), x))

    def verify(self) -> None:
        missing = [n for n in (*self.params, *self.tables) if n not in self.filled]
        if missing:
            raise CheckpointError(f"missing tensor '{missing[0]}' ({len(missing)} missing in all)")
        for layer, moe in enumerate(self.cfg.moe_layer_index):
            if moe < 0:
                continue
            for x in range(self.cfg.num_experts):
                gu = (layer, "gate_up_proj", x) in self.expert_filled or {
                    (layer, "gate_proj", x),
                    (layer, "up_proj", x),
                } <= self.expert_filled
                parts = [
                    ("gate_up_proj", gu),
                    ("down_proj", (layer, "down_proj", x) in self.expert_filled),
                ]
                if self.release is not None:
                    parts = [
                        (f"{p}.{s}", (layer, f"{p}.{s}", x) in self.expert_filled)
                        for p in ("gate_proj", "up_proj", "down_proj")
                        for s in release_experts.PARTS[self.banks.format]
                    ]
                if self.banks.format == "mxfp4":
                    parts = [(p, (layer, p, x) in self.expert_filled) for p in _MXFP4_PARTS]
                    per_expert = [
                        (p + s, (layer, p + s, x) in self.expert_filled)
                        for p in ("gate_proj", "up_proj", "down_proj")
                        for s in ("", "_scale")
                    ]
                    if any(ok for _, ok in per_expert):  # DeepSeek-V4's per-expert FP4
                        parts = per_expert
                if self.cfg.expert_bias:
                    parts += [
                        (p, (layer, p, x) in self.expert_filled)
                        for p in ("gate_up_proj_bias", "down_proj_bias")
                    ]
                for part, ok in parts:
                    if not ok:
                        raise CheckpointError(
                            f"missing tensor for layer {layer} expert {x} ({part})"
                        )


def proj_rows(cfg: ModelConfig, proj: str) -> slice:
    """A projection's rows of its bank: gate the first half of gate_up, up the second, down
    all of down."""
    i = cfg.moe_intermediate_size
    return slice(None) if proj == "down" else slice(0, i) if proj == "gate" else slice(i, 2 * i)


def allocate_banks(
    cfg: ModelConfig,
    resident: bool = True,
    empty: Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor] | None = None,
) -> ExpertBanks:
    """Exact-size, uninitialised banks for all routed experts (filled by the loader).
    ``resident`` False (the disk tier): the weight banks are meta tensors (shapes, no memory);
    biases stay real. ``empty``: the weight banks' memory (``experts.formats.allocate``'s, by
    bank name; for float banks "gate_up" and "down")."""
    n, i, h = cfg.num_moe_layers * cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    dt = dtype_of(cfg.torch_dtype)
    if not resident:
        with torch.device("meta"):
            banks = allocate(cfg.expert_format, n, h, i, dt)
        if cfg.expert_bias:
            banks.gate_up_bias = torch.empty(n, 2 * i, dtype=dt)
            banks.down_bias = torch.empty(n, h, dtype=dt)
        return banks
    if cfg.expert_format != "bf16":
        banks = allocate(cfg.expert_format, n, h, i, dt, bias=cfg.expert_bias, empty=empty)
    else:
        new = empty or (lambda _, shape, dtype: torch.empty(shape, dtype=dtype))
        banks = ExpertBanks(
            gate_up=new("gate_up", (n, 2 * i, h), dt),
            down=new("down", (n, h, i), dt),
            gate_up_bias=torch.empty(n, 2 * i, dtype=dt) if cfg.expert_bias else None,
            down_bias=torch.empty(n, h, dtype=dt) if cfg.expert_bias else None,
        )
    return banks
