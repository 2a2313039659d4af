"""Routed experts quantized by the checkpoint's publisher, read from ``quantization_config``: the
two conventions of 4-bit releases (compressed-tensors, NVIDIA ModelOpt) mapped onto our expert
formats (experts/formats.py), kept packed. Which family a checkpoint is plays no part.

compressed-tensors (``quant_method: compressed-tensors``, llm-compressor's output; the weights
scheme in ``config_groups``, the format per group or at the top level):

- ``nvfp4-pack-quantized`` (float, 4 bits, groups of 16): NVFP4, our ``nvfp4``. Tensors per
  linear: ``weight_packed`` uint8 [rows, cols / 2] (two e2m1 codes a byte, element 2j in the low
  nibble: our packing), ``weight_scale`` float8_e4m3fn [rows, cols / 16], ``weight_global_scale``
  float32 [1], the *divisor* of the scales (w = code * weight_scale / weight_global_scale), so
  our global multiplier is its reciprocal (rounded once to fp32).
- ``pack-quantized`` (int, 4 bits, symmetric, ``strategy: group``, a group size that is a
  multiple of 32; Kimi-K2-Thinking / K2.5: 32): our GGUF-block ``q4_0``. Tensors:
  ``weight_packed`` int32 [rows, cols / 8], eight values a word, value i of a row at bits
  4i..4i+3 of its little-endian words, stored as q + 8 for q in [-8, 7];
  ``weight_scale`` (bf16) [rows, cols / group]; ``weight_shape`` [rows, cols]. w = scale * q,
  which is Q4_0's d * (nibble - 8) with the same nibble: repacking moves nibbles into Q4_0's
  order and writes each scale as the block's fp16 d (every Q4_0 block of a group gets the
  group's scale). A bf16 scale is exact in fp16 when in fp16's range; one that is not is refused
  (a clear error: no silent rounding). Asymmetric schemes (a ``weight_zero_point``) are refused.

ModelOpt (``quant_method: modelopt``, ``quant_algo: NVFP4`` or ``W4A16_NVFP4``; or the same in
``hf_quant_config.json``, see config_hf.read_config_json): ``weight`` uint8 [rows, cols / 2] (our
packing), ``weight_scale`` float8_e4m3fn [rows, cols / 16], ``weight_scale_2`` float32, the
*multiplier* (w = code * weight_scale * weight_scale_2, the reciprocal of compressed-tensors'
global scale): our global as it is.

Activations stay unquantized on our side: the activation scales these checkpoints carry
(``input_global_scale``, ``input_scale``: NVFP4 W4A4's per-tensor input scales) are read past
and ignored on purpose, and so are a quantized KV cache's ``k_scale`` / ``v_scale`` (our KV pool
is not quantized). What the config excludes (``ignore``: module names or ``re:`` patterns;
``exclude_modules``: globs) is stored as float and loads as any float tensor; a routed expert
stored float inside a quantized checkpoint is an error (mixed banks are not supported). Packed
dense weights (a shared expert, a dense MLP the config does not exclude) are widened to float
at load (release_dense); the routed experts are read packed (release_experts).
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Any

from .config import ConfigError

METHODS = ("compressed-tensors", "modelopt")
_MODELOPT_ALGOS = ("NVFP4", "W4A16_NVFP4")


@dataclass(frozen=True)
class ReleaseQuant:
    """What the loader needs of a release's quantization: the convention, our format, the
    group size (inputs per stored scale) and the exclusions as written."""

    method: str  # "compressed-tensors" | "modelopt"
    expert_format: str  # "nvfp4" | "q4_0"
    group_size: int
    ignore: tuple[str, ...] = ()

    def excluded(self, module: str) -> bool:
        """Whether the config leaves module ``module`` (a checkpoint name without the
        ``.weight`` suffix) unquantized."""
        for p in self.ignore:
            if self.method == "compressed-tensors":
                if p.startswith("re:") and re.match(p[3:], module) or p == module:
                    return True
            elif fnmatch.fnmatchcase(module, p):
                return True
        return False


def quant_config(raw: dict[str, Any], text: dict[str, Any] | None = None) -> Any:
    """``quantization_config`` of the text config or of the top level (None: absent)."""
    text = text if text is not None else raw.get("text_config") or raw
    return text.get("quantization_config") or raw.get("quantization_config")


def release_quant(q: Any, source: str) -> ReleaseQuant | None:
    """The ReleaseQuant of ``quantization_config`` ``q``; None when its ``quant_method`` is
    neither convention; ConfigError for a scheme of them that is not read."""
    if not isinstance(q, dict) or q.get("quant_method") not in METHODS:
        return None
    if q["quant_method"] == "modelopt":
        return _modelopt(q, source)
    return _compressed_tensors(q, source)


def _modelopt(q: dict[str, Any], source: str) -> ReleaseQuant:
    algo = q.get("quant_algo")
    if algo not in _MODELOPT_ALGOS:
        raise ConfigError(
            f"{source}: field 'quantization_config.quant_algo' = {algo!r} is not supported "
            f"for ModelOpt checkpoints (supported: {', '.join(_MODELOPT_ALGOS)})"
        )
    group = q.get("group_size", 16)
    if group != 16:
        raise ConfigError(
            f"{source}: field 'quantization_config.group_size' = {group!r}: NVFP4 has 16"
        )
    return ReleaseQuant("modelopt", "nvfp4", 16, _strings(q.get("exclude_modules"), source))


def _compressed_tensors(q: dict[str, Any], source: str) -> ReleaseQuant:
    status = q.get("quantization_status", "compressed")
    if status != "compressed":
        raise ConfigError(
            f"{source}: field 'quantization_config.quantization_status' = {status!r}: only "
            "compressed checkpoints (packed weights) are read"
        )
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ConfigError(f"{source}: field 'quantization_config.config_groups' is missing")
    schemes = set()
    for name, g in groups.items():
        w = g.get("weights") if isinstance(g, dict) else None
        if not isinstance(w, dict):
            raise ConfigError(
                f"{source}: 'quantization_config.config_groups.{name}' has no 'weights' scheme"
            )
        fmt = g.get("format") or q.get("format")
        schemes.add(
            (
                fmt,
                w.get("type"),
                w.get("num_bits"),
                w.get("group_size"),
                w.get("strategy"),
                w.get("symmetric", True),
            )
        )
    if len(schemes) != 1:
        raise ConfigError(
            f"{source}: 'quantization_config.config_groups' mixes weight schemes "
            f"{sorted(map(str, schemes))}; one scheme throughout is supported"
        )
    fmt, kind, bits, group, strategy, symmetric = schemes.pop()
    ignore = _strings(q.get("ignore"), source)
    if fmt == "nvfp4-pack-quantized" and (kind, bits, group) == ("float", 4, 16):
        return ReleaseQuant("compressed-tensors", "nvfp4", 16, ignore)
    int4 = fmt == "pack-quantized" and (kind, bits, strategy) == ("int", 4, "group")
    if int4 and symmetric and isinstance(group, int) and group > 0 and group % 32 == 0:
        return ReleaseQuant("compressed-tensors", "q4_0", group, ignore)
    raise ConfigError(
        f"{source}: compressed-tensors scheme format={fmt!r} type={kind!r} num_bits={bits!r} "
        f"group_size={group!r} strategy={strategy!r} symmetric={symmetric!r} is not supported "
        "(supported: nvfp4-pack-quantized; pack-quantized int 4-bit symmetric groups of a "
        "multiple of 32)"
    )


def _strings(v: Any, source: str) -> tuple[str, ...]:
    if v is None:
        return ()
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise ConfigError(f"{source}: the quantization config's exclusions must list strings")
    return tuple(v)
