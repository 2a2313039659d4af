"""The fake CUDA tracker's host -> device copies: a blocking one is a host sync (``h2d``), as on
CUDA (the copy returns once the stream has run up to it); only ``non_blocking`` from pinned
memory is asynchronous. ``runtime.staging.to_device`` is that copy (and nothing on the host)."""

from __future__ import annotations

import pytest
import torch

from freetokend.engine.sampler import SamplingParams, sample
from freetokend.experts.fakecuda import FakeCudaAccelerator
from freetokend.runtime.staging import to_device


def test_blocking_and_pageable_copies_are_syncs_pinned_async_ones_not() -> None:
    acc = FakeCudaAccelerator(vram_mib=1024)
    with acc:
        tr = acc.tracker
        dev = torch.device("cuda", 0)
        host = torch.arange(6)
        torch.tensor([1, 2, 3], device="cuda")  # built on the host, then copied: blocking
        host.to(dev)
        host.to(dev, non_blocking=True)  # pageable: the driver may wait for the stream
        torch.empty(6, dtype=torch.long, device=dev).copy_(host)
        assert tr.syncs.by_kind["h2d"] == tr.syncs.total == tr.syncs.h2d == 4
        assert tr.syncs.reads == 0 and tr.async_h2d == 0
        pinned = tr.pin(torch.arange(6))
        pinned[2:].to(dev, non_blocking=True)  # a view of pinned memory
        torch.empty(6, dtype=torch.long, device=dev).copy_(pinned, non_blocking=True)
        pinned.to(dev)  # pinned but blocking: still a sync
        out = to_device(torch.tensor([7, 8]), dev)
        assert out.device == dev
        assert tr.async_h2d == 3 and tr.syncs.h2d == 5
        # sampling rows with filters: their parameters cross once, asynchronously
        logits = torch.randn(4, 50, device="cuda")
        params = [SamplingParams(temperature=0.7, top_k=5, min_p=0.1), SamplingParams()] * 2
        before, sent = tr.syncs.total, tr.async_h2d
        sample(logits, params, [None] * 4)
        assert tr.syncs.total == before and tr.async_h2d == sent + 1


def test_staging_on_the_host_is_no_copy() -> None:
    t = torch.arange(4)
    assert to_device(t, torch.device("cpu")) is t


def test_interleaved_dense_weights_are_undone_on_the_card() -> None:
    """Dense weights of every interleaved format (q4_k, q5_k, q6_k, mxfp4, q8_0) are interleaved
    by 8 for the CPU kernels (gguf_interleave); placement (engine/placement.place_dense, through
    QuantWeight.dequantize) sends the packed rows and undoes the layout on the device, where the native byte moves do not run: the torch
    permutes (checked against the native moves in test_qlinear_native) run there, with one copy
    of the packed bytes and no read back to the host. (The block dequantization after it does
    not run on the fake device: its fp16 views are beyond the shim.)"""
    from freetokend.formats import gguf_interleave
    from freetokend.native import qlinear_native

    if not qlinear_native.available():
        pytest.skip("ftdense is not built: nothing is interleaved")
    for fmt in sorted(gguf_interleave.INTERLEAVED_CODES):
        qw = qlinear_native.QuantWeight.from_float(torch.randn(20, 512) * 0.05, fmt)
        assert qw.interleaved
        acc = FakeCudaAccelerator(vram_mib=1024)
        with acc:
            tr = acc.tracker
            raw = gguf_interleave.deinterleave(qw.raw.to(torch.device("cuda", 0)), fmt)
            assert raw.device.type == "cuda" and raw.shape == qw.raw.shape, fmt
            assert tr.syncs.reads == 0 and tr.syncs.h2d == 1, (fmt, tr.syncs)
