"""EngineCore scheduling (engine/scheduler.py Scheduler): preemption under a small KV pool, aborts, validation, NO_TOKEN finish."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny

from freetokend import LLM
from freetokend.engine.core import NO_TOKEN
from freetokend.engine.sampler import SamplingParams
from freetokend.engine.scheduler import Request, Scheduler


@pytest.fixture(scope="module", params=["qwen3_5_moe", "gpt_oss"])
def model_dir(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    make_tiny(request.param, d, seed=21)
    return d


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [
        torch.randint(2, 97, (int(k),), generator=g).tolist()
        for k in torch.randint(5, 40, (n,), generator=g)
    ]


def test_preemption_keeps_outputs_identical(model_dir):
    prompts = _prompts(6)
    roomy = LLM(model_dir, max_model_len=128, kv_tokens=4096, prefix_cache=False)
    alone = [roomy.generate(p, max_tokens=20, ignore_eos=True) for p in prompts]
    # 8 pages of 16 tokens: six sequences of up to 60 tokens cannot all stay resident.
    tight = LLM(model_dir, max_model_len=128, kv_tokens=128, prefix_cache=False)
    together = tight.generate(prompts, max_tokens=20, ignore_eos=True)
    assert together == alone
    assert tight.engine.stats().preemptions_total > 0
    assert tight.runner.kv.num_used == 0


def test_abort_frees_and_others_continue(model_dir):
    llm = LLM(model_dir, max_model_len=128, kv_tokens=1024, prefix_cache=False)
    prompts = _prompts(3)
    expect = llm.generate(prompts[0], max_tokens=8, ignore_eos=True)
    eng = llm.engine
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, params)
    got: dict[str, list[int]] = {}
    steps = 0
    while eng.has_unfinished():
        for out in eng.step():
            got.setdefault(out.request_id, []).append(out.token_id)
        steps += 1
        if steps == 2:
            eng.abort("r1")
            eng.abort("r2")
    assert got["r0"] == expect
    assert len(got.get("r1", [])) < 8 and len(got.get("r2", [])) < 8
    assert llm.runner.kv.num_used == 0


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ([], SamplingParams(max_tokens=4), "empty"),
        ([5, 500], SamplingParams(max_tokens=4), r"\[0, 97\)"),
        (
            [5] * 100,
            SamplingParams(max_tokens=100),
            r"prompt \(100 tokens\) \+ max_tokens \(100\) exceeds the context \(128\)",
        ),
        ([5], SamplingParams(max_tokens=-1), "max_tokens"),
        ([5], SamplingParams(max_tokens=4, temperature=-1.0), "temperature"),
    ],
)
def test_add_request_validates(model_dir, prompt, params, match):
    llm = LLM(model_dir, max_model_len=128, kv_tokens=256)
    with pytest.raises(ValueError, match=match):
        llm.engine.add_request("x", prompt, params)


def test_request_larger_than_the_pool_finishes_without_a_token(model_dir):
    llm = LLM(model_dir, max_model_len=128, kv_tokens=32, prefix_cache=False)
    llm.engine.add_request("big", list(range(2, 60)), SamplingParams(max_tokens=4))
    outs = []
    while llm.engine.has_unfinished():
        outs.extend(llm.engine.step())
    assert (
        outs[-1].finished and outs[-1].finish_reason == "length" and outs[-1].token_id == NO_TOKEN
    )
    assert llm.runner.kv.num_used == 0


def test_short_prompt_is_not_held_behind_a_long_prefill(model_dir):
    """A long prompt prefills in 64-token chunks; a short one arriving after its first chunk
    gets its first token several steps before the long one, with the same tokens as alone."""
    llm = LLM(model_dir, max_model_len=512, kv_tokens=4096, prefix_cache=False,
              max_step_tokens=64)  # fmt: skip
    g = torch.Generator().manual_seed(9)
    long, short = (torch.randint(2, 97, (n,), generator=g).tolist() for n in (400, 9))
    alone = {
        "long": llm.generate(long, max_tokens=3, ignore_eos=True),
        "short": llm.generate(short, max_tokens=3, ignore_eos=True),
    }
    eng = llm.engine
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    eng.add_request("long", long, params)
    eng.step()
    eng.add_request("short", short, params)
    got: dict[str, list[int]] = {}
    first: dict[str, int] = {}
    step = 1
    while eng.has_unfinished():
        step += 1
        for out in eng.step():
            first.setdefault(out.request_id, step)
            got.setdefault(out.request_id, []).append(out.token_id)
    assert first["short"] == 2 and first["long"] >= 7  # 400 tokens: 7 chunks of 64
    assert got == alone


def test_step_plan_decode_rows_then_shortest_chunks_within_the_budget(model_dir):
    """The Scheduler alone: admission stops at max_batch; a plan gives decode rows one token,
    then prompt chunks shortest first within max_step_tokens, each with its pages reserved."""
    llm = LLM(model_dir, max_model_len=128, kv_tokens=1024, prefix_cache=False)
    sched = Scheduler(llm.runner, max_batch=3, max_step_tokens=10)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for rid, n in [("long", 30), ("short", 5), ("mid", 12), ("late", 3)]:
        sched.add(Request(rid, list(range(2, 2 + n)), params, None, None))
    sched.admit()
    assert [r.rid for r in sched.running] == ["long", "short", "mid"]
    assert [r.rid for r in sched.waiting] == ["late"]
    plan = sched.schedule()
    assert [(s.req.rid, len(s.tokens), s.sample) for s in plan] == [
        ("short", 5, True),
        ("mid", 5, False),
    ]
    for s in plan:
        assert s.state is s.req.state
        assert llm.runner.pages_missing(s.state, s.state.num_tokens + len(s.tokens)) == 0
    assert sched.computed_total == 10
    for s in plan:  # as the forward leaves them; "short" sampled a token: one row to decode
        s.state.num_tokens += len(s.tokens)
    plan[0].req.output.append(7)
    plan = sched.schedule()
    assert [(s.req.rid, len(s.tokens), s.sample) for s in plan] == [
        ("short", 1, True),
        ("mid", 7, True),
        ("long", 2, False),
    ]
    for req in list(sched.running):
        sched.finish(req)
    sched.abort("late")
    assert not sched.has_work() and llm.runner.kv.num_used == 0
