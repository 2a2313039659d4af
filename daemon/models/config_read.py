"""Reading config.json values: the helpers that ``config_hf`` and the family modules share.

Typed access to one key (the message names the field), the first of several spellings of one
key, and the rope parameters. Plain dicts in, :class:`RopeConfig` out; no family is named here.
"""

from __future__ import annotations

import math
from typing import Any

from .config import ConfigError, RopeConfig


def get(
    d: dict[str, Any], key: str, typ: type | tuple[type, ...], source: str, default: Any = ...
) -> Any:
    """``d[key]`` as ``typ`` (an int is accepted for a float); an absent or null key gives
    ``default``, or a ConfigError without one."""
    if key not in d or d[key] is None:
        if default is ...:
            raise ConfigError(f"{source}: missing field '{key}'")
        return default
    val = d[key]
    if typ is float and isinstance(val, int) and not isinstance(val, bool):
        val = float(val)
    if not isinstance(val, typ) or (typ is int and isinstance(val, bool)):
        raise ConfigError(f"{source}: field '{key}' must be {typ}, got {type(val).__name__}")
    return val


def first(d: dict[str, Any], keys: tuple[str, ...], source: str, default: Any = ...) -> Any:
    """The int under the first of ``keys`` that is set (the spellings of one field)."""
    for k in keys:
        if d.get(k) is not None:
            return get(d, k, int, source)
    if default is ...:
        raise ConfigError(f"{source}: missing field '{keys[0]}' (or {', '.join(keys[1:])})")
    return default


def rope(
    text: dict[str, Any], head_dim: int, source: str, partial_default: float = 1.0
) -> RopeConfig:
    """The rope of ``text`` (``rope_parameters``, the older ``rope_scaling`` / ``rope_theta``):
    "default" or "yarn", partial rotary as a factor or as a dim count (``rotary_dim``)."""
    if text.get("qk_rope_head_dim"):  # MLA: only the rope part of each head rotates
        head_dim = int(text["qk_rope_head_dim"])
    params = text.get("rope_parameters") or {}
    scaling = text.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        raise ConfigError(f"{source}: field 'rope_parameters' must be an object")
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", text.get("rope_theta", 10000.0))
    partial = merged.get("partial_rotary_factor", text.get("partial_rotary_factor"))
    if partial is None and text.get("rotary_dim"):  # partial rotary spelt as a dim count
        partial = int(text["rotary_dim"]) / head_dim
    if partial is None:
        partial = partial_default
    kind = merged.get("rope_type", merged.get("type", "default")) or "default"
    if kind not in ("default", "yarn"):
        raise ConfigError(
            f"{source}: field 'rope_parameters.rope_type' = {kind!r} is not supported"
        )
    rotary_dim = int(head_dim * float(partial))
    if rotary_dim % 2:
        raise ConfigError(f"{source}: field 'partial_rotary_factor' gives an odd rotary dim")
    factor = float(merged.get("factor", 1.0) or 1.0)
    attn_factor = merged.get("attention_factor")
    if attn_factor is None and kind == "yarn":
        attn_factor = yarn_mscale(factor, merged.get("mscale"), merged.get("mscale_all_dim"))
    return RopeConfig(
        theta=float(theta),
        rotary_dim=rotary_dim,
        kind=kind,
        factor=factor,
        attention_factor=float(attn_factor or 1.0),
        interleaved=bool(text.get("rope_interleave", False)),
        mscale_all_dim=float(merged.get("mscale_all_dim", 0) or 0),
        original_max_position=int(merged.get("original_max_position_embeddings", 0) or 0),
        beta_fast=float(merged.get("beta_fast", 32.0)),
        beta_slow=float(merged.get("beta_slow", 1.0)),
        truncate=bool(merged.get("truncate", True)),
    )


def yarn_mscale(factor: float, mscale: Any, mscale_all_dim: Any) -> float:
    def m(scale: float, k: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * k * math.log(scale) + 1.0

    if mscale and mscale_all_dim:
        return m(factor, float(mscale)) / m(factor, float(mscale_all_dim))
    return m(factor)
