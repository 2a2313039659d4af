"""The cpu backend's batch invariance: a request's greedy tokens do not depend on the requests
beside it, on when they arrive, on the kernels' tile and tail sizes (which follow the number of
rows in a step), or on where its prefill is cut into chunks, up to a near-tie; its logprobs agree
within LOGPROB_ATOL.

Not bit for bit (measured on an AMD EPYC Zen 3, AVX2, these bf16 checkpoints): a row's logits
part in the last bits between its step alone and beside others, and between chunk sizes, because
the kernels sum a row in an order that depends on the step: the expert executor's tiled kernel
(an expert with 12 or more routes in the step) against its streaming one, the dense projections'
tiled kernel (8 rows or more) against theirs, and the native decode step's router against the
generic layers' torch softmax (a decode step beside a prefill runs the generic layers). The KV
pool stores bf16, so a last-bit difference that crosses a rounding boundary of a key becomes a
bf16 step: logprobs then part by up to ~3e-3 (with the experts' tiled kernel switched off, the
same cases agree within 1e-4). So tokens compare up to a near-tie (greedy_check.py), and where a
test needs equality it compares a request alone with a run alone. The agent-scale CPU work
(prefill at GEMM rates, parallel agents) is held to ``assert_batch_invariant``; kernels that sum a
row in one order whatever its neighbours would let it tighten to equality.
Checkpoints in bf16, so the dense projections and attention take the native host kernels.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from greedy_check import assert_greedy_agrees
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import make_tiny

from freetokend import LLM
from freetokend.engine.core import NO_TOKEN
from freetokend.engine.sampler import SamplingParams

NEW_TOKENS = 5
LOGPROB_ATOL = 1e-2  # measured up to ~3e-3 (module docstring)
NEAR_TIE = 1e-2  # the same bound on the gap of a parting's two tokens
VOCAB = 97  # tiny models' prompts stay below every tiny vocabulary


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3_5_moe"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp(f"{request.param}-bf16")
    make_tiny(request.param, d, seed=17, dtype=torch.bfloat16)
    return d


def _llm(d: Path, max_step_tokens: int) -> LLM:
    return LLM(d, "cpu", max_model_len=256, kv_tokens=2048, prefix_cache=False,
               max_step_tokens=max_step_tokens)  # fmt: skip


Step = tuple[int, float | None, list[tuple[int, float]] | None]


def _serve(llm: LLM, prompts: list[list[int]], starts: list[int]) -> dict[int, list[Step]]:
    """Greedy continuations of ``prompts``, each token with its logprob and the top 5 (so the
    logits are compared, bit for bit, not only their argmax); prompt i joins before engine step
    ``starts[i]``."""
    out: dict[int, list[Step]] = {i: [] for i in range(len(prompts))}
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)
    step, waiting = 0, sorted(range(len(prompts)), key=lambda i: starts[i])
    while waiting or llm.engine.has_unfinished():
        while waiting and starts[waiting[0]] <= step:
            i = waiting.pop(0)
            llm.engine.add_request(f"r{i}", prompts[i], params)
        for o in llm.engine.step():
            if o.token_id != NO_TOKEN:
                out[int(o.request_id[1:])].append((o.token_id, o.logprob, o.top_logprobs))
        step += 1
    return out


def serve_alone(llm: LLM, prompts: list[list[int]]) -> dict[int, list[Step]]:
    """Each of ``prompts`` served by itself."""
    return {i: _serve(llm, [p], [0])[0] for i, p in enumerate(prompts)}


def assert_batch_invariant(
    llm: LLM,
    alone: dict[int, list[Step]],
    prompts: list[list[int]],
    starts: list[int],
    scorer: LLM | None = None,
) -> None:
    """Every request of ``prompts`` (joining at ``starts``), served together by ``llm``, gives
    the tokens it gives alone (``alone[i]``, from an engine of the same settings; ``scorer``,
    default ``llm``, scores a parting) up to a near-tie, with logprobs within LOGPROB_ATOL
    wherever the tokens agree."""
    together = _serve(llm, prompts, starts)
    assert_same_steps(together, alone, prompts, scorer or llm, starts)


def assert_same_steps(
    got: dict[int, list[Step]],
    want: dict[int, list[Step]],
    prompts: list[list[int]],
    scorer: LLM,
    what: object = "",
) -> None:
    ids = range(len(prompts))
    assert_greedy_agrees(
        [[t for t, _, _ in got[i]] for i in ids], [[t for t, _, _ in want[i]] for i in ids],
        prompts, scorer, margin=NEAR_TIE, what=what,
    )  # fmt: skip
    for i in ids:
        for (t, lp, top), (wt, wlp, wtop) in zip(got[i], want[i], strict=False):
            if t != wt:
                break  # parted at a near-tie: the contexts differ from here on
            assert lp == pytest.approx(wlp, abs=LOGPROB_ATOL), (what, i, got[i], want[i])
            assert top is not None and wtop is not None
            assert [v for _, v in top] == pytest.approx([v for _, v in wtop], abs=LOGPROB_ATOL)


_batches = st.lists(
    st.tuples(
        st.lists(st.integers(2, VOCAB - 1), min_size=1, max_size=40),  # a prompt
        st.integers(0, 6),  # the engine step it joins at
    ),
    min_size=2,
    max_size=5,
)


@settings(max_examples=6)
@given(batch=_batches, max_step_tokens=st.sampled_from([7, 16, 512]))
def test_a_request_gives_its_tokens_alone_in_any_batch(model_dir, batch, max_step_tokens) -> None:
    prompts, starts = [p for p, _ in batch], [s for _, s in batch]
    llm = _llm(model_dir, max_step_tokens)
    alone = serve_alone(llm, prompts)
    # alone with its prefill in one piece: the chunk boundaries must not matter either
    whole = _llm(model_dir, 512)
    assert_same_steps(serve_alone(whole, prompts), alone, prompts, llm, max_step_tokens)
    assert_batch_invariant(llm, alone, prompts, starts)


def test_whole_and_chunked_teacher_forced_logits_agree(model_dir) -> None:
    """Three prompts at once give their tokens alone; the teacher-forced logits of each whole
    sequence are the same, within LOGPROB_ATOL, in one prefill step as in chunks of 5 tokens."""
    llm = _llm(model_dir, 512)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (23, 9, 31)]
    alone = serve_alone(llm, prompts)
    assert_batch_invariant(llm, alone, prompts, [0, 0, 0])
    for i, p in enumerate(prompts):
        seq = p + [t for t, _, _ in alone[i]]
        a = llm.logits(seq)
        b = _llm(model_dir, 5).logits(seq)  # the same tokens, prefill in chunks of 5
        assert torch.allclose(a, b, rtol=0, atol=LOGPROB_ATOL), (i, (a - b).abs().max().item())
