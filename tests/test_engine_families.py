"""Every family against transformers: logits, greedy tokens, prefill/decode split, batching."""

from __future__ import annotations

import pytest
import torch
from tiny_models import FAMILIES, VARIANTS, make_tiny

from freetokend import LLM
from freetokend.engine.runner import Work

# fp32 checkpoints; our attention/DeltaNet/MoE sum in a different order than transformers.
ATOL = 2e-4


@pytest.fixture(scope="module", params=FAMILIES + tuple(VARIANTS))
def tiny(request, tmp_path_factory):
    family = request.param
    d = tmp_path_factory.mktemp(family.replace(":", "-"))
    _, hf = make_tiny(family, d, seed=3)
    llm = LLM(d, moe_backend="cpu", max_model_len=256, kv_tokens=2048)
    return family, hf, llm


def _prompt(n: int, seed: int, vocab: int = 97) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n,), generator=g).tolist()


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    # One thread: the tiny oracle's ops are too small to split, and on a loaded machine two
    # spinning threads made each forward ~20x slower (0.6 s instead of 0.03 s).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            return hf(torch.tensor([ids])).logits[0].float()
    finally:
        torch.set_num_threads(threads)


def _hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    """Greedy decoding by full forwards without a cache: an oracle independent of any KV logic."""
    seq = list(ids)
    for _ in range(n):
        seq.append(int(_hf_logits(hf, seq)[-1].argmax()))
    return seq[len(ids) :]


def _our_logits(llm: LLM, ids: list[int], split: list[int]) -> torch.Tensor:
    """Logits at every position, feeding ``ids`` in chunks of the given sizes then token by token."""
    runner = llm.runner
    st = runner.new_state()
    rows, pos = [], 0
    try:
        for size in split:
            chunk = ids[pos : pos + size]
            runner.reserve(st, pos + size)
            rows.append(runner.forward([Work(st, chunk)]))
            pos += size
        return torch.cat(rows)
    finally:
        runner.release(st)


def test_logits_match_transformers(tiny):
    family, hf, llm = tiny
    ids = _prompt(24, seed=1)
    ref = _hf_logits(hf, ids)
    # prefill of 10, then one token at a time: logits of positions 9..23
    ours = _our_logits(llm, ids, [10] + [1] * 14)
    err = (ours - ref[9:]).abs().max().item()
    assert err < ATOL, f"{family}: max |logit diff| {err}"


def test_chunked_prefill_equals_full_forward(tiny):
    family, hf, llm = tiny
    ids = _prompt(40, seed=2)
    full = _our_logits(llm, ids, [40])
    chunked = _our_logits(llm, ids, [7, 13, 20])
    assert (full[-1] - chunked[-1]).abs().max().item() < ATOL


def test_greedy_tokens_identical(tiny):
    family, hf, llm = tiny
    ids = _prompt(12, seed=4)
    ours = llm.generate(ids, max_tokens=32, ignore_eos=True)
    assert len(ours) == 32
    assert ours == _hf_greedy(hf, ids, 32), family


def test_batch_equals_one_by_one(tiny):
    family, hf, llm = tiny
    prompts = [_prompt(n, seed=10 + n) for n in (3, 17, 9, 30)]
    alone = [llm.generate(p, max_tokens=10, ignore_eos=True) for p in prompts]
    together = llm.generate(prompts, max_tokens=10, ignore_eos=True)
    assert together == alone
    assert llm.engine.stats().kv_pages_used == 0  # no request holds pages
    if llm.engine.prefix is not None:  # (the engine may be built without one)
        llm.engine.prefix.radix.clear()
    assert llm.runner.kv.num_used == 0  # and nothing leaked: the prefix cache held the rest
