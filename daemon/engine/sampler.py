"""Sampling: per-request parameters and the batched next-token choice.

``sample`` turns a batch of logits into one token per row. Greedy rows (temperature 0) take the
argmax. The other rows are scaled by their temperature, filtered (top-k, then top-p on the
renormalised distribution, then min-p) and drawn with the exponential race
``argmax(p / E)``, E ~ Exp(1) i.i.d., which picks token i with probability p_i. The noise of a row
comes from that row's generator only, over the full vocabulary, so a seeded request draws the
same tokens whatever else shares its batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec
import torch

from ..native import dense_native
from ..runtime.staging import to_device

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts
# Ints a tensor of int64 can hold: anything larger overflows when the sampler builds its
# per-row tensors (a top_k of 2**63 once failed a whole batch).
INT64_MAX = 2**63 - 1
MAX_STOP_TOKEN_IDS = 64  # stop ids per request: a set, checked once per sampled token


class SamplingParams(msgspec.Struct, frozen=True):
    """How one request picks its tokens."""

    max_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # drop tokens below min_p * max prob, in [0, 1]
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return; None = off

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> SamplingParams:
        """Raise ValueError naming the first out-of-range field; return self when valid."""
        checks: list[tuple[str, bool, str]] = [
            ("max_tokens", 0 <= self.max_tokens <= INT64_MAX, "must be >= 0 and fit in 64 bits"),
            ("temperature", _finite(self.temperature) and self.temperature >= 0, "must be >= 0"),
            ("top_p", _finite(self.top_p) and 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", 0 <= self.top_k <= INT64_MAX, "must be >= 0 (0 = off)"),
            ("min_p", _finite(self.min_p) and 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("seed", self.seed is None or SEED_MIN <= self.seed <= SEED_MAX, "out of range"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings"),
            (
                "stop_token_ids",
                len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS
                and all(0 <= i <= INT64_MAX for i in self.stop_token_ids),
                f"must be at most {MAX_STOP_TOKEN_IDS} ids >= 0",
            ),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= INT64_MAX, "must be >= 0"),
        ]
        for field, ok, why in checks:
            if not ok:
                raise ValueError(f"{field} {why}, got {getattr(self, field)!r}")
        return self


def _finite(x: float) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


def make_generator(
    params: SamplingParams, device: torch.device | str = "cpu"
) -> torch.Generator | None:
    """A generator seeded from ``params.seed`` on ``device``, or None for unseeded requests."""
    if params.seed is None:
        return None
    return torch.Generator(device=device).manual_seed(params.seed)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    host: bool = False,
) -> torch.Tensor:
    """logits [B, V] float32 -> next token ids [B] int64 (one SamplingParams/generator per row).
    ``host``: the model runs on the CPU, so the greedy argmax may take the native pass (not on
    an accelerator's CPU stand-in, which runs the device code path).

    The sampled rows' parameters reach the logits' device in one asynchronous copy (``staging``):
    no host sync before the token ids are read."""
    batch = logits.shape[0]
    if len(params) != batch or len(generators) != batch:
        raise ValueError(f"{batch} rows but {len(params)} params and {len(generators)} generators")
    # greedy rows keep this; ties -> lowest id (on the CPU one native pass: torch's argmax over a
    # 50k vocabulary cost 0.3 ms of a decode step)
    out = dense_native.argmax(logits) if host else None
    if out is None:
        out = torch.argmax(logits, dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return out
    gens = [generators[i] for i in rows]
    unseeded = [j for j, g in enumerate(gens) if g is None]
    table = RowParams.build(
        [params[i] for i in rows], logits.shape[-1], logits.device, (rows, unseeded)
    )
    index, unseeded_idx = table.extra
    probs = filtered_probs(logits.index_select(0, index).float(), table)
    noise = _exponential_noise(probs, gens, unseeded_idx)  # [R, V]
    out[index] = torch.argmax(probs / noise, dim=-1)
    return out


class RowParams:
    """The filters of R sampled rows as device tensors: ``temps``, ``top_p``, ``min_p`` [R, 1]
    fp32, ``ks`` [R] int64 (top-k, the vocabulary when off), and ``extra`` int64 index lists
    sent along; the flags say which filters any row uses (known on the host)."""

    def __init__(
        self,
        params: Sequence[SamplingParams],
        temps: torch.Tensor,
        top_p: torch.Tensor,
        min_p: torch.Tensor,
        ks: torch.Tensor,
        extra: list[torch.Tensor],
    ) -> None:
        self.temps, self.top_p, self.min_p, self.ks, self.extra = temps, top_p, min_p, ks, extra
        self.any_top = any(p.top_k > 0 or p.top_p < 1.0 for p in params)
        self.any_min_p = any(p.min_p > 0 for p in params)

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        vocab: int,
        device: torch.device,
        extra: Sequence[Sequence[int]] = (),
    ) -> RowParams:
        """One fp64 host tensor (it holds the fp32 values and the ints below 2**53 exactly),
        one copy to ``device``."""
        r = len(params)
        # a top_k above the vocabulary keeps the whole vocabulary
        ks = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]
        host = torch.tensor(
            [p.temperature for p in params]
            + [p.top_p for p in params]
            + [p.min_p for p in params]
            + ks
            + [i for e in extra for i in e],
            dtype=torch.float64,
        )
        dev = to_device(host, device)
        cols = dev[: 3 * r].float().view(3, r, 1)
        off, extras = 4 * r, []
        for e in extra:
            extras.append(dev[off : off + len(e)].long())
            off += len(e)
        return cls(params, cols[0], cols[1], cols[2], dev[3 * r : 4 * r].long(), extras)


def filtered_probs(
    logits: torch.Tensor, params: Sequence[SamplingParams] | RowParams
) -> torch.Tensor:
    """[R, V] logits -> [R, V] probabilities after temperature, top-k, top-p and min-p.

    Every row keeps at least its most likely token."""
    if not isinstance(params, RowParams):
        params = RowParams.build(params, logits.shape[-1], logits.device)
    scaled = logits / params.temps
    if params.any_top:
        scaled = _top_k_top_p(scaled, params)
    probs = torch.softmax(scaled, dim=-1)
    if params.any_min_p:
        floor = params.min_p * probs.max(dim=-1, keepdim=True).values  # [R, 1]
        probs = torch.where(probs >= floor, probs, torch.zeros_like(probs))
    return probs


def _top_k_top_p(scaled: torch.Tensor, params: RowParams) -> torch.Tensor:
    """Mask (to -inf) what top-k and then top-p drop, working on one descending sort."""
    dev, vocab = scaled.device, scaled.shape[-1]
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)  # [R, V]
    rank = torch.arange(vocab, device=dev).unsqueeze(0)  # [1, V]
    drop = rank >= params.ks.unsqueeze(1)  # top-k
    masked = sorted_logits.masked_fill(drop, float("-inf"))
    top_p = params.top_p
    sorted_probs = torch.softmax(masked, dim=-1)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of better tokens
    # a token is kept while the mass above it is below top_p; rows with top_p = 1 skip this
    # (rounding can push the cumulative sum to 1 before the tail ends)
    drop |= (mass_before >= top_p) & (top_p < 1.0)
    drop[:, 0] = False
    mask = torch.zeros_like(drop).scatter(1, order, drop)  # back to vocabulary order
    return scaled.masked_fill(mask, float("-inf"))


def _exponential_noise(
    probs: torch.Tensor,
    generators: Sequence[torch.Generator | None],
    unseeded_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """[R, V] Exp(1) noise: each seeded row from its own generator, the rest in one draw
    (``unseeded_idx``: those rows' indices on the device, sent with the step's parameters)."""
    noise = torch.empty_like(probs)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        idx = unseeded_idx
        if idx is None:
            idx = to_device(torch.tensor(unseeded, dtype=torch.long), probs.device)
        noise[idx] = torch.empty(
            (len(unseeded), probs.shape[1]), device=probs.device
        ).exponential_()
    for i, gen in enumerate(generators):
        if gen is not None:
            noise[i].exponential_(generator=gen)
    # Exp(1) can return exactly 0 (probability ~2^-24 per draw in fp32); p / 0 would be inf.
    return noise.clamp_min_(torch.finfo(noise.dtype).tiny)


def logprobs_of(
    logits: torch.Tensor, token_ids: torch.Tensor, top_n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities of the raw model distribution (before temperature and filters).

    logits [B, V], token_ids [B] -> (chosen_logprob [B], top_ids [B, n], top_logprobs [B, n]),
    top entries in descending order."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, token_ids.long().view(-1, 1)).squeeze(1)
    top_n = max(0, min(int(top_n), logp.shape[-1]))
    top_logprobs, top_ids = torch.topk(logp, top_n, dim=-1)
    return chosen, top_ids, top_logprobs
