"""Greedy tokens of engines whose arithmetic differs, compared up to a near-tie.

Two engines that sum in different orders (the stand-in's or a GPU's torch ops against the host
kernels, a batch of three against a padded graph of four, one request alone against the same in
a batch) give logits a rounding apart, and greedy decoding turns a rounding into another token
wherever the top two logits are that close. So such a comparison accepts a parting only at a
near-tie: at the first token where the two continuations part, the reference engine's logits
(teacher-forced over the prompt and the common part) must rank the two tokens first and second,
within ``margin`` of each other. Everything before the parting is compared exactly; nothing after
it is (the contexts differ from there on). Where the arithmetic is the same by construction,
tests compare tokens with ``==`` instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

# fp32 checkpoints: the device path and the host kernels part by ~1e-6 in the logits (measured
# max 6.2e-6, test_dense_placement.py); a near-tie is a gap under 1e-3.
FP32_MARGIN = 1e-3


class Scorer(Protocol):
    def logits(self, token_ids: list[int]) -> torch.Tensor: ...


def first_split(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where ``a`` and ``b`` differ (the shorter's length if one is a prefix of
    the other and they differ in length), or None when equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def assert_greedy_agrees(
    got: Sequence[Sequence[int]],
    want: Sequence[Sequence[int]],
    prompts: Sequence[Sequence[int]],
    scorer: Scorer,
    margin: float = FP32_MARGIN,
    what: object = "",
) -> int:
    """``got[i]`` and ``want[i]`` (greedy continuations of ``prompts[i]``; ``want`` from the
    reference engine, which ``scorer`` is) agree up to a near-tie (module docstring). Returns
    how many of them parted."""
    assert len(got) == len(want) == len(prompts), (what, len(got), len(want), len(prompts))
    parted = 0
    for n, (g, w, p) in enumerate(zip(got, want, prompts, strict=True)):
        i = first_split(g, w)
        if i is None:
            continue
        assert i < min(len(g), len(w)), f"{what}: sequence {n} ends early: {g} vs {w}"
        row = scorer.logits(list(p) + list(w[:i]))[-1]
        top2 = [int(t) for t in row.topk(2).indices]
        gap = float(row[w[i]] - row[g[i]])
        assert sorted(top2) == sorted((g[i], w[i])) and gap <= margin, (
            f"{what}: sequence {n} parts at token {i} ({g[i]} against the reference's {w[i]}) "
            f"where the reference's top two are {top2} with a gap of {gap:.3g} "
            f"(a near-tie is at most {margin:g}): got {list(g)}, want {list(w)}"
        )
        parted += 1
    return parted


class HfScorer:
    """A transformers model as the reference ``Scorer``: full forwards without a cache, on one
    thread (the tiny oracles' ops are too small to split; on a shared machine more threads
    make them tens of times slower)."""

    def __init__(self, hf: torch.nn.Module) -> None:
        self.hf = hf

    def logits(self, token_ids: list[int]) -> torch.Tensor:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with torch.no_grad():
                return self.hf(torch.tensor([token_ids])).logits[0].float()  # type: ignore[no-any-return]
        finally:
            torch.set_num_threads(threads)


def hf_greedy(hf: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    """Greedy decoding by full forwards of ``hf`` without a cache: the ``n`` new tokens."""
    seq = list(ids)
    for _ in range(n):
        seq.append(int(HfScorer(hf).logits(seq)[-1].argmax()))
    return seq[len(ids) :]
