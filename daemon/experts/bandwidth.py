"""Bandwidth measurement for the q* split: B_P (host -> accelerator expert copies) and B_H (the
CPU executor's expert bandwidth), both through the real code paths. `ftctl bench bw` stores the
result in the state store; the hybrid backend reads it.
"""

from __future__ import annotations

import time

import torch

from ..runtime import heartbeat
from ..runtime.bandwidth import BandwidthProfile
from .accelerator import Accelerator
from .banks import ExpertBanks


def _distinct_experts(banks: ExpertBanks, n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(banks.num_flat, generator=g)[: min(n, banks.num_flat)].tolist()


def measure_copy_bandwidth(
    banks: ExpertBanks,
    acc: Accelerator,
    experts: int = 64,
    repeats: int = 3,
    device_list: bool | None = None,
) -> float:
    """Whole-expert copies host -> accelerator, through the path decode fills take: the
    device-side copy list (``fill_rows``; on CUDA the zero-copy kernel) when it works from these
    banks, else host-listed ``copy_rows`` (``device_list`` forces one)."""
    ids = _distinct_experts(banks, experts)
    host = banks.tensors()
    dev = {k: acc.empty((len(ids), *t.shape[1:]), t.dtype) for k, t in host.items()}
    rows = list(range(len(ids)))
    if device_list is None:
        device_list = acc.device_fill_ok(banks.gate_up)
    if device_list:
        dst = torch.tensor(rows, dtype=torch.int32, device=acc.device)
        src = torch.tensor(ids, dtype=torch.int32, device=acc.device)
        count = torch.tensor([len(ids)], dtype=torch.int32, device=acc.device)
        fill = [(dev[k], host[k]) for k in host]
        kernel = acc.device.type == "cuda"

        def run() -> None:
            acc.fill_rows(fill, dst, src, count, kernel=kernel).wait()
    else:
        pairs = [(dev[k], host[k], rows, ids) for k in host]

        def run() -> None:
            acc.copy_rows(pairs).wait()

    run()  # warm-up
    acc.synchronize()
    best = float("inf")
    for _ in range(repeats):
        heartbeat.beat()  # the bench runs on the engine side: each iteration is progress
        t0 = time.perf_counter()
        run()
        acc.synchronize()
        best = min(best, time.perf_counter() - t0)
    return len(ids) * banks.nbytes_per_expert() / best


def measure_cpu_bandwidth(
    banks: ExpertBanks, cpu_backend: object, top_k: int = 8, steps: int = 16
) -> float:
    """Batch-1 decode over distinct experts (cold in cache as far as possible)."""
    ids = _distinct_experts(banks, top_k * steps, seed=1)
    x = torch.randn(1, banks.hidden_size)
    w = torch.full((1, top_k), 1.0 / top_k)
    fwd = cpu_backend.forward_flat  # type: ignore[attr-defined]
    fwd(x, torch.tensor([ids[:top_k]], dtype=torch.int32), w)  # warm-up
    chunks = [ids[i : i + top_k] for i in range(0, len(ids) - top_k + 1, top_k)]
    t0 = time.perf_counter()
    for c in chunks:
        fwd(x, torch.tensor([c], dtype=torch.int32), w[:, : len(c)])
    dt = time.perf_counter() - t0
    heartbeat.beat()
    return sum(len(c) for c in chunks) * banks.nbytes_per_expert() / dt


def profile_format(expert_format: str, float_dtype: str) -> str:
    """What a bandwidth profile is stored under: the float dtype ("bfloat16") for float experts,
    the format ("mxfp4") for quantized ones (the bytes per expert and the kernels differ)."""
    return float_dtype if expert_format == "bf16" else expert_format


def measure(
    banks: ExpertBanks, acc: Accelerator, cpu_backend: object, top_k: int = 8
) -> BandwidthProfile:
    fmt = profile_format(banks.format, str(banks.gate_up.dtype).removeprefix("torch."))
    return BandwidthProfile(
        b_p=measure_copy_bandwidth(banks, acc),
        b_h=measure_cpu_bandwidth(banks, cpu_backend, top_k),
        expert_format=fmt,
        accelerator=acc.name,
        expert_bytes=banks.nbytes_per_expert(),
    )
