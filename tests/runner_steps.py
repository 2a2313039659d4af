"""Driving a loaded model's runner directly, step by step (no scheduler, no sampling)."""

from __future__ import annotations

import torch

from freetokend.engine.llm import LLM
from freetokend.engine.runner import Work


def logits_in_steps(llm: LLM, ids: list[int], split: list[int]) -> torch.Tensor:
    """The logits of the last position of each step, feeding ``ids`` to one fresh sequence in
    steps of the sizes in ``split`` (their sum: len(ids)): [len(split), vocab]."""
    runner, st, rows, pos = llm.runner, llm.runner.new_state(), [], 0
    try:
        for size in split:
            runner.reserve(st, pos + size)
            rows.append(runner.forward([Work(st, ids[pos : pos + size])]))
            pos += size
        return torch.cat(rows)
    finally:
        runner.release(st)
