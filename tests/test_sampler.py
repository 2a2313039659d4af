"""Sampler: parameter validation, greedy, seeds, filters, and the sampled distribution."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch

from freetokend.engine.sampler import (
    SamplingParams,
    filtered_probs,
    logprobs_of,
    make_generator,
    sample,
)

# A crafted distribution over 8 tokens, deliberately not sorted by id.
PROBS = torch.tensor([0.05, 0.30, 0.02, 0.40, 0.01, 0.12, 0.07, 0.03])
LOGITS = PROBS.log()


def draws(
    params: SamplingParams, n: int, logits: torch.Tensor = LOGITS, seed: int = 0
) -> torch.Tensor:
    """n independent draws: one batch of n identical rows, each with its own seeded generator."""
    batch = logits.unsqueeze(0).expand(n, -1).contiguous()
    gens = [torch.Generator().manual_seed(seed * 100_003 + i) for i in range(n)]
    return sample(batch, [params] * n, gens)


def frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).float() / tokens.numel()


# --- SamplingParams ------------------------------------------------------------------------


def test_defaults_are_valid_and_greedy() -> None:
    p = SamplingParams().validate()
    assert p.greedy and p.max_tokens == 256 and p.top_k == 0 and p.logprobs is None


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", -1),
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", -0.1),
        ("min_p", 1.01),
        ("logprobs", -1),
        ("stop", ("",)),
        ("stop_token_ids", (-5,)),
        ("seed", 2**70),
    ],
)
def test_validate_names_the_bad_field(field: str, value: object) -> None:
    params = SamplingParams(**{field: value})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=field):
        params.validate()


def test_params_are_frozen_and_decode_from_json() -> None:
    p = msgspec.json.decode(b'{"temperature": 0.7, "stop": ["x"], "top_k": 5}', type=SamplingParams)
    assert p == SamplingParams(temperature=0.7, stop=("x",), top_k=5)
    with pytest.raises(AttributeError):
        p.temperature = 1.0  # type: ignore[misc]


# --- greedy and seeds ----------------------------------------------------------------------


def test_greedy_equals_argmax_and_ties_pick_lowest_id() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    logits[2, [7, 30, 41]] = 100.0  # a three-way tie for the maximum
    out = sample(logits, [SamplingParams()] * 6, [None] * 6)
    assert out.dtype == torch.int64
    assert torch.equal(out, logits.argmax(dim=-1))
    assert out[2].item() == 7


def test_greedy_rows_ignore_sampled_neighbours() -> None:
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(), SamplingParams(temperature=5.0)] * 2
    out = sample(logits, params, [None] * 4)
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()


def test_seeded_rows_reproduce_whatever_the_batch() -> None:
    vocab = 64
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(3))
    seeded = SamplingParams(temperature=1.0, seed=1234)

    def run(position: int, batch: int) -> list[int]:
        gen = make_generator(seeded)
        others = [make_generator(SamplingParams(seed=s)) for s in range(batch)]
        tokens = []
        for step in range(40):
            rows = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(step))
            rows[position] = logits
            params = [SamplingParams(temperature=1.0)] * batch
            params[position] = seeded
            gens = list(others)
            gens[position] = gen
            tokens.append(int(sample(rows, params, gens)[position]))
        return tokens

    alone = run(0, 1)
    assert run(2, 5) == alone  # other rows (seeded or not) do not disturb the draws
    assert len(set(alone)) > 5  # it is really sampling
    other_seed = make_generator(SamplingParams(seed=99))
    batch = logits.unsqueeze(0)
    changed = [int(sample(batch, [seeded], [other_seed])[0]) for _ in range(40)]
    assert changed != alone


def test_make_generator_only_for_seeded_requests() -> None:
    assert make_generator(SamplingParams(temperature=1.0)) is None
    g1, g2 = make_generator(SamplingParams(seed=5)), make_generator(SamplingParams(seed=5))
    assert g1 is not None and g2 is not None
    assert torch.equal(torch.rand(4, generator=g1), torch.rand(4, generator=g2))


# --- filters -------------------------------------------------------------------------------


def test_top_k_never_samples_outside_the_k_best() -> None:
    tokens = draws(SamplingParams(temperature=1.0, top_k=3), 4000)
    assert set(tokens.tolist()) == {3, 1, 5}  # the three most likely, all of them reached


def test_top_p_keeps_the_smallest_nucleus() -> None:
    # sorted: 0.40 (3), 0.30 (1), 0.12 (5), ... ; mass before token 5 is 0.70 >= 0.7
    tokens = draws(SamplingParams(temperature=1.0, top_p=0.7), 4000)
    assert set(tokens.tolist()) == {3, 1}
    tokens = draws(SamplingParams(temperature=1.0, top_p=0.71), 4000, seed=1)
    assert set(tokens.tolist()) == {3, 1, 5}


def test_min_p_drops_tokens_below_the_scaled_floor() -> None:
    # floor = 0.25 * 0.40 = 0.10: keeps 0.40, 0.30, 0.12
    tokens = draws(SamplingParams(temperature=1.0, min_p=0.25), 4000)
    assert set(tokens.tolist()) == {3, 1, 5}


def test_filters_compose_and_always_keep_the_best_token() -> None:
    tokens = draws(SamplingParams(temperature=1.0, top_k=2, top_p=0.05), 500)
    assert set(tokens.tolist()) == {3}
    probs = filtered_probs(LOGITS.unsqueeze(0), [SamplingParams(temperature=1.0, min_p=1.0)])
    assert probs[0].nonzero().flatten().tolist() == [3]


def test_per_row_filters_in_one_batch() -> None:
    params = [
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.0, top_p=0.5),
    ]
    probs = filtered_probs(LOGITS.unsqueeze(0).expand(3, -1), params)
    assert probs[0].nonzero().flatten().tolist() == [3]
    assert torch.allclose(probs[1], PROBS / PROBS.sum(), atol=1e-6)  # top_p = 1 drops nothing
    assert set(probs[2].nonzero().flatten().tolist()) == {3, 1}


# --- distribution --------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_sampled_frequencies_match_the_tempered_softmax(temperature: float) -> None:
    n = 20_000
    tokens = draws(SamplingParams(temperature=temperature), n, seed=7)
    expected = torch.softmax(LOGITS / temperature, dim=-1)
    observed = frequencies(tokens, 8)
    # 5 standard errors per token: a real bias of a couple of percent would show
    tolerance = 5 * torch.sqrt(expected * (1 - expected) / n) + 1e-4
    assert torch.all((observed - expected).abs() <= tolerance), (observed, expected)


def test_top_k_renormalises_the_kept_mass() -> None:
    n = 20_000
    tokens = draws(SamplingParams(temperature=1.0, top_k=2), n, seed=8)
    observed = frequencies(tokens, 8)
    assert abs(observed[3].item() - 0.4 / 0.7) < 0.02
    assert abs(observed[1].item() - 0.3 / 0.7) < 0.02


def test_unseeded_rows_sample_too() -> None:
    batch = LOGITS.unsqueeze(0).expand(3000, -1)
    tokens = sample(batch, [SamplingParams(temperature=1.0)] * 3000, [None] * 3000)
    assert abs(frequencies(tokens, 8)[3].item() - 0.4) < 0.04


# --- logprobs ------------------------------------------------------------------------------


def test_logprobs_of_the_raw_distribution() -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(4))
    chosen_ids = torch.tensor([5, 0, 39])
    chosen, top_ids, top_lp = logprobs_of(logits, chosen_ids, 4)
    ref = torch.log_softmax(logits, dim=-1)
    assert torch.allclose(chosen, ref[torch.arange(3), chosen_ids])
    assert top_ids.shape == (3, 4) and top_lp.shape == (3, 4)
    assert torch.equal(top_ids, ref.argsort(dim=-1, descending=True)[:, :4])
    assert torch.all(top_lp[:, :-1] >= top_lp[:, 1:])
    assert torch.allclose(top_lp, ref.gather(1, top_ids))
    _, none_ids, none_lp = logprobs_of(logits, chosen_ids, 0)
    assert none_ids.shape == (3, 0) and none_lp.shape == (3, 0)


def test_batch_size_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError):
        sample(torch.zeros(2, 5), [SamplingParams()], [None, None])
