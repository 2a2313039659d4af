"""Routed experts quantized after loading: a float checkpoint's experts turned into mxfp4 /
nvfp4 / fp8_block banks in RAM, at load (``LLM(quantize_experts=)``, ``--quantize-experts``) or
once at FTW conversion (``ftctl checkpoint --quantize-experts``); and the format a folder stores
its experts in (an FTW folder may hold quantized experts under a float config.json)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from ..checkpoint.ftw_index import read_index
from ..experts.banks import ExpertBanks
from ..experts.formats import FORMATS, quantize_banks
from .config import ModelConfig
from .config_hf import read_config
from .loader import model_config

log = logging.getLogger(__name__)


def stored_expert_format(model_dir: str | Path) -> str:
    """The routed experts' format as the folder stores them (an FTW folder may hold experts
    quantized at conversion under a float config.json)."""
    model_dir = Path(model_dir)
    if model_dir.is_file():  # GGUF: kept in their block format where a kernel computes it
        return model_config(model_dir).expert_format
    if (model_dir / "ftw.json").exists():
        return read_index(model_dir).expert_format
    return read_config(model_dir).expert_format


def quantize_experts_at_load(
    banks: ExpertBanks,
    cfg: ModelConfig,
    fmt: str,
    progress: Callable[[int, int], None] | None = None,
) -> ExpertBanks:
    """Float experts quantized to ``fmt`` in RAM (llama.cpp's quantize, at load or at FTW
    conversion): 4.25 bits a weight for mxfp4 instead of 16. Dense weights stay as they are."""

    if fmt == "bf16" or fmt not in FORMATS:
        singles = sorted(n for n in FORMATS if n != "bf16" and "/" not in n)
        raise ValueError(
            f"quantize_experts: {fmt!r} is not one of {', '.join(singles)}, or a pair of GGUF "
            "block types GATE_UP/DOWN such as q4_k/q6_k"
        )
    if banks.format != "bf16":
        raise ValueError(f"quantize_experts={fmt!r}: the experts are already {banks.format}")
    FORMATS[fmt].check_dims(cfg.hidden_size, cfg.moe_intermediate_size)
    t0 = time.perf_counter()
    out = quantize_banks(banks, fmt, progress)
    n = banks.gate_up.shape[0]
    log.info(
        "quantized %d experts to %s in %.1f s: %d -> %d MiB",
        n,
        fmt,
        time.perf_counter() - t0,
        banks.nbytes_per_expert() * n >> 20,
        out.nbytes_per_expert() * n >> 20,
    )
    return out
