"""Every family's dense part on the fake CUDA card (ARCHITECTURE §9.2, engine/placement.py): the real
device code path of each architecture (GQA with sinks, MLA, Gated DeltaNet, Gemma-4's per-layer
geometry, sigmoid group routing...) runs with no host/device mix (a mix raises on the fake card as
on a GPU), nothing dense on the host, and a decode step reads the host exactly once (its sampled
token ids), plus, per MoE layer for hybrid's CPU share, one asynchronous packed copy into
page-locked memory and the branch's wait for it, and makes no blocking host -> device copy (the
tracker's ``h2d``, a sync on CUDA too).

test_fake_cuda_engine.py checks one model in depth (prefill size, resize, threads); this file
checks the breadth. Values are not checked here (the fake card holds none): the CPU stand-in
does that in test_dense_placement.py.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from tiny_models import FAMILIES, VARIANTS, make_tiny

from freetokend import LLM
from freetokend.engine.sampler import SamplingParams

BACKENDS = ("fused", "offload", "hybrid")
HYBRID_COPIES_PER_MOE_LAYER = 1  # x, gate weights and the CPU share's ids, packed (each way)


@pytest.fixture(scope="module", params=FAMILIES + tuple(VARIANTS))
def family_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp(request.param.replace(":", "-"))
    make_tiny(request.param, d, seed=3)
    return d


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_step_reads_the_host_once(family_dir: Path, backend: str) -> None:
    llm = LLM(family_dir, backend, accelerator="fake-cuda", vram_mib=1024, kv_tokens=512)
    try:
        on_host = [n for n, p in llm.model.named_parameters() if p.device.type != "cuda"]
        assert not on_host, on_host
        assert llm.runner.kv.device.type == "cuda"
        tr = llm.fake_device.tracker
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        llm.engine.add_request("r", list(range(3, 43)), params)
        llm.engine.step()  # the prompt
        with llm.fake_device.in_thread():
            rec = llm.runner.new_state().recurrent  # the engine's sequences get theirs here
        if rec is not None:
            assert rec.ssm.device.type == rec.conv.device.type == "cuda"
        per_step, sent, fetched = [], [], []
        for _ in range(2):
            before, async_before = Counter(tr.syncs.by_kind), (tr.async_h2d, tr.async_d2h)
            llm.engine.step()
            per_step.append(Counter(tr.syncs.by_kind) - before)
            sent.append(tr.async_h2d - async_before[0])
            fetched.append(tr.async_d2h - async_before[1])
        hybrid = HYBRID_COPIES_PER_MOE_LAYER * llm.config.num_moe_layers
        hybrid = hybrid if backend == "hybrid" else 0
        # reads: the token ids (+ hybrid's copies); no blocking host -> device copy (``h2d``: on
        # CUDA it waits for the stream as a read does): the step's metadata crosses pinned and
        # non-blocking, once, not per attention layer
        assert [n["h2d"] for n in per_step] == [0, 0], per_step
        # the token ids' read; hybrid's CPU branch waits for its inputs' copy (no blocking read)
        want = Counter(d2h=1, event=hybrid) + Counter()
        assert per_step == [want] * 2, (dict(tr.syncs.by_kind), per_step)
        # the asynchronous copies: the step's metadata (+ hybrid's CPU share joining per layer),
        # and hybrid's inputs to the host
        assert sent == [1 + hybrid] * 2, sent
        assert fetched == [hybrid] * 2, fetched
        assert tr.peak <= tr.capacity
    finally:
        llm.close()
