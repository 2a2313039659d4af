"""Parking and unparking a model on the ``fused`` backend (manager/models.py park, unpark), on the
CPU stand-in accelerator.

The host pool of quantized experts (``LLM.banks``) stays packed: mxfp4 or GGUF blocks with their
scales. Unpark must build the device experts as load built them (dequantized to bf16), not copy
the packed banks' data tensors (no scales: garbage tokens, or a dtype error). A parked model
holds no decode graphs (their memory pool and scratch KV page are the card's); unpark captures
them again. The stand-in runs no torch.cuda graphs, so the capture is injected (an eager
stand-in, as in test_decode_graphs.py) and what is checked is that parking empties the graphs
and frees their scratch page, and that unparking captures them again and replays them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import make_tiny

from freetokend import LLM
from freetokend.engine import graphs as g
from freetokend.manager.lane import Lane
from freetokend.manager.models import ResidentModel, host_bytes, park, unpark

PROMPTS = [[3 + (7 * i + j) % 80 for j in range(5 + 9 * i)] for i in range(3)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("park-fused")
    make_tiny("qwen3_moe", d, seed=13, max_position_embeddings=512)
    return d


class _Capture:
    """A capture stand-in: the step run once at capture, rerun on replay; counts captures."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, fn):  # type: ignore[no-untyped-def]
        import torch

        self.count += 1
        out = fn()

        def replay() -> None:
            with torch.inference_mode():
                out.copy_(fn())

        return g.Captured(replay, out)


def _resident(llm: LLM, d: Path, name: str) -> ResidentModel:
    return ResidentModel(name, d, llm, Lane(name, llm.engine), host_bytes(llm), "fused")


@pytest.mark.parametrize("fmt", ["mxfp4", "q8_0"])
def test_quantized_fused_experts_give_the_same_tokens_after_park(tiny_dir: Path, fmt: str) -> None:
    llm = LLM(tiny_dir, "fused", accelerator="standin", quantize_experts=fmt, kv_tokens=512)
    assert llm.banks.format == fmt  # the host pool stays packed
    want = llm.generate(PROMPTS, max_tokens=8, ignore_eos=True)
    model = _resident(llm, tiny_dir, fmt)
    for cycle in range(2):
        park(model)
        assert not hasattr(llm.moe, "dev")  # the device experts went
        unpark(model)
        got = llm.generate(PROMPTS, max_tokens=8, ignore_eos=True)
        assert got == want, (cycle, got, want)


def test_park_releases_the_decode_graphs(tiny_dir: Path) -> None:
    llm = LLM(tiny_dir, "fused", accelerator="standin", kv_tokens=512)
    cap = _Capture()
    graphs = g.DecodeGraphs(llm.runner, max_pages=8, batches=(1, 4), capture=cap)
    assert graphs.capture_all()
    llm.runner.graphs = graphs
    captured = cap.count
    want = llm.generate(PROMPTS, max_tokens=8, ignore_eos=True)
    assert graphs.replays > 0
    model = _resident(llm, tiny_dir, "bf16")
    for cycle in range(2):
        park(model)
        assert llm.runner.graphs is None or not llm.runner.graphs.graphs, (
            "a parked model keeps its decode graphs"
        )
        assert llm.runner.kv.num_used == 0  # their scratch page freed too
        unpark(model)
        assert llm.runner.graphs is graphs
        assert len(graphs.graphs) == 2 * len(graphs.widths)  # captured again at unpark
        assert cap.count == captured * (cycle + 2)
        replays = graphs.replays
        got = llm.generate(PROMPTS, max_tokens=8, ignore_eos=True)
        assert got == want, (cycle, got, want)
        assert graphs.replays > replays
