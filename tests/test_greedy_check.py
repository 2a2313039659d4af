"""The near-tie comparison of greedy tokens (greedy_check.py) accepts only near-ties."""

from __future__ import annotations

import pytest
import torch
from greedy_check import assert_greedy_agrees, first_split


class _Scorer:
    """Logits over a vocabulary of 8 that depend only on the context's length: at length n,
    token ``best[n]`` scores 5.0, token ``second[n]`` 5.0 - gap[n], the rest 0."""

    def __init__(self, best: dict[int, int], second: dict[int, int], gap: dict[int, float]):
        self.best, self.second, self.gap = best, second, gap

    def logits(self, token_ids: list[int]) -> torch.Tensor:
        n = len(token_ids)
        out = torch.zeros(n, 8)
        out[-1, self.best[n]] = 5.0
        out[-1, self.second[n]] = 5.0 - self.gap[n]
        return out


PROMPT = [1, 2, 3]


def test_first_split() -> None:
    assert first_split([1, 2, 3], [1, 2, 3]) is None
    assert first_split([1, 2, 3], [1, 4, 3]) == 1
    assert first_split([1, 2], [1, 2, 3]) == 2


def test_equal_tokens_pass_without_scoring() -> None:
    assert assert_greedy_agrees([[4, 5]], [[4, 5]], [PROMPT], _Scorer({}, {}, {})) == 0


def test_a_near_tie_at_the_parting_passes() -> None:
    # part at the second generated token: context = prompt + 1 token = length 4
    scorer = _Scorer({4: 6}, {4: 7}, {4: 1e-4})
    assert assert_greedy_agrees([[5, 7, 0]], [[5, 6, 1]], [PROMPT], scorer) == 1


@pytest.mark.parametrize(
    ("second", "gap", "why"),
    [(7, 0.5, "gap of 0.5"), (2, 1e-4, "top two are")],  # a clear winner; another runner-up
)
def test_a_parting_that_is_no_near_tie_fails(second: int, gap: float, why: str) -> None:
    scorer = _Scorer({4: 6}, {4: second}, {4: gap})
    with pytest.raises(AssertionError, match=why):
        assert_greedy_agrees([[5, 7]], [[5, 6]], [PROMPT], scorer)


def test_a_sequence_that_stops_early_fails() -> None:
    with pytest.raises(AssertionError, match="ends early"):
        assert_greedy_agrees([[5]], [[5, 6]], [PROMPT], _Scorer({}, {}, {}))
