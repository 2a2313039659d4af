"""One sequence's failure in sampling or in its grammar ends that sequence alone: the others
in the batch go on and produce exactly what they produce alone (issue 15, item 1)."""

from __future__ import annotations

import time

import pytest
import torch
from greedy_check import assert_greedy_agrees

from freetokend import LLM
from freetokend.engine import core, row_guard
from freetokend.engine.core import NO_TOKEN
from freetokend.engine.sampler import SamplingParams, filtered_probs, sample

PROMPT = [5, 6, 7, 8]
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
# A request beside others runs other tile sizes than alone (test_cpu_batch_invariance.py): its
# tokens are those alone up to a near-tie, at the bound measured there.
NEAR_TIE = 1e-2


def _as_alone(llm: LLM, outs: list, alone: list[int]) -> None:
    assert_greedy_agrees([[o.token_id for o in outs]], [alone], [PROMPT], llm, margin=NEAR_TIE)


class _Grammar:
    """A constraint that allows every token, and fails (or stalls) where told."""

    def __init__(self, fail_fill: bool = False, fail_accept: bool = False, sleep_s: float = 0):
        self.fail_fill, self.fail_accept, self.sleep_s = fail_fill, fail_accept, sleep_s

    def fill_mask(self, logits: torch.Tensor) -> None:
        time.sleep(self.sleep_s)
        if self.fail_fill:
            raise RuntimeError("hostile grammar")

    def accept(self, token_id: int) -> None:
        if self.fail_accept:
            raise RuntimeError("matcher state broken")

    def is_terminated(self) -> bool:
        return False


@pytest.fixture(scope="module")
def llm(builtin_model_dir):
    return LLM(builtin_model_dir, max_model_len=128, kv_tokens=1024, prefix_cache=False)


def _run(llm: LLM, requests: dict[str, tuple[SamplingParams, object]]) -> dict[str, list]:
    eng = llm.engine
    for rid, (params, constraint) in requests.items():
        eng.add_request(rid, PROMPT, params, constraint)  # type: ignore[arg-type]
    got: dict[str, list] = {rid: [] for rid in requests}
    while eng.has_unfinished():
        for out in eng.step():  # never raises for one request's failure
            got[out.request_id].append(out)
    assert llm.runner.kv.num_used == 0  # the failed sequences' pages came back
    return got


@pytest.mark.parametrize(
    "grammar",
    [_Grammar(fail_fill=True), _Grammar(fail_accept=True)],
    ids=["mask-raises", "accept-raises"],
)
def test_a_failing_grammar_fails_its_sequence_alone(llm, grammar):
    alone = llm.generate(PROMPT, max_tokens=6, ignore_eos=True)
    got = _run(llm, {"good": (GREEDY, None), "bad": (GREEDY, grammar), "good2": (GREEDY, None)})
    _as_alone(llm, got["good"], alone)
    _as_alone(llm, got["good2"], alone)
    [bad] = got["bad"]
    assert bad.finished and bad.finish_reason == "error" and bad.token_id == NO_TOKEN
    assert "grammar" in (bad.error or "")


def test_a_slow_grammar_fails_its_sequence_within_the_bound(llm, monkeypatch):
    monkeypatch.setattr(row_guard, "MASK_FILL_LIMIT_S", 0.02)
    alone = llm.generate(PROMPT, max_tokens=6, ignore_eos=True)
    got = _run(llm, {"good": (GREEDY, None), "slow": (GREEDY, _Grammar(sleep_s=0.1))})
    _as_alone(llm, got["good"], alone)
    [slow] = got["slow"]  # failed after its first (slow) fill: it cost the batch one fill
    assert slow.finish_reason == "error" and "too slow" in (slow.error or "")


def test_sampling_failure_of_one_row_spares_the_others():
    # A value no validated request carries (a top_p that is not a number) makes the batched
    # sampler raise; the row-by-row retry names that row and keeps the others' tokens.
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    broken = SamplingParams(temperature=1.0, top_p="0.5")  # type: ignore[arg-type]
    seeded = SamplingParams(temperature=0.8, seed=3)
    params = [SamplingParams(), broken, seeded]
    with pytest.raises(TypeError):
        sample(logits, params, [None, None, torch.Generator().manual_seed(3)])
    ids, errors = row_guard.sample_rows(
        logits, params, [None, None, torch.Generator().manual_seed(3)]
    )
    assert set(errors) == {1} and "sampling" in errors[1] and ids[1] is None
    assert ids[0] == int(logits[0].argmax())
    # the seeded row draws what it draws alone (its generator was rewound for the retry)
    expect = sample(logits[2:3], [seeded], [torch.Generator().manual_seed(3)])
    assert ids[2] == int(expect[0])


def test_top_k_above_the_vocabulary_is_the_whole_vocabulary():
    logits = torch.randn(1, 40, generator=torch.Generator().manual_seed(1))
    huge = SamplingParams(temperature=1.0, top_k=9223372036854775807)
    off = SamplingParams(temperature=1.0, top_k=0)
    assert torch.allclose(filtered_probs(logits, [huge]), filtered_probs(logits, [off]))
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=2**63).validate()
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=frozenset(range(1000))).validate()


@pytest.fixture
def sample_rows_calls(monkeypatch):
    """A list that gets one entry each time the engine calls the guarded sampler."""
    calls: list[int] = []
    real = core.sample_rows
    monkeypatch.setattr(core, "sample_rows", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def test_an_all_greedy_host_batch_skips_the_guarded_sampler_and_picks_the_same(
    llm, monkeypatch, sample_rows_calls
):
    """Greedy rows with no grammar and no logprobs take one argmax of the host logits
    (core._greedy_ids), not sample_rows; the tokens are the ones sample_rows picks."""
    calls = sample_rows_calls
    reqs = {"a": (GREEDY, None), "b": (GREEDY, None), "c": (GREEDY, None)}
    fast = _run(llm, reqs)
    assert calls == []
    monkeypatch.setattr(core, "_greedy_ids", lambda reqs, logits: None)
    slow = _run(llm, reqs)
    assert calls  # the guarded sampler ran every step
    assert {r: [o.token_id for o in v] for r, v in fast.items()} == {
        r: [o.token_id for o in v] for r, v in slow.items()
    }
    assert all(len(v) == 6 and NO_TOKEN not in [o.token_id for o in v] for v in fast.values())


def test_a_row_asking_for_logprobs_keeps_the_batch_on_the_guarded_sampler(llm, sample_rows_calls):
    calls = sample_rows_calls
    with_lp = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2)
    got = _run(llm, {"a": (GREEDY, None), "lp": (with_lp, None)})
    assert len(calls) >= 6
    assert all(o.top_logprobs is not None and len(o.top_logprobs) == 2 for o in got["lp"])
    assert [o.token_id for o in got["a"]] == [o.token_id for o in got["lp"]]
