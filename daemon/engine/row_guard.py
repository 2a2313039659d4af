"""Per-sequence failure isolation for the sampling half of an engine step.

A batch shares one forward pass, but what happens after it (grammar mask, sampling, logprobs,
grammar accept) depends on one request's own parameters and grammar. An error there must end
that request alone: :func:`sample_rows` samples the whole batch at once and, only when that
raises, again row by row, so the failing rows are named and every other row gets the token it
would have got alone (greedy rows are an argmax; seeded rows get their generator state back
before the retry). :func:`fill_masks` applies each grammar under a time limit.

Bound on mask filling: each constraint's ``fill_mask`` runs once per step on the engine thread
and cannot be interrupted; a sequence whose fill takes longer than ``limit_s`` fails after that
step. So a hostile grammar delays the batch by at most one slow fill (plus the time under the
limit, ``limit_s`` per sequence per step); compile-time schema limits keep fills small.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .sampler import SamplingParams, sample

log = logging.getLogger(__name__)

MASK_FILL_LIMIT_S = 0.25  # one grammar mask fill slower than this fails its sequence


def _why(where: str, exc: BaseException) -> str:
    return f"{where} failed for this request: {type(exc).__name__}: {exc}"


def fill_masks(
    constraints: Sequence[Any | None], logits: torch.Tensor, limit_s: float | None = None
) -> dict[int, str]:
    """Mask row i of ``logits`` [B, V] with constraint i (None = unconstrained), in place.
    Returns {row: reason} for rows whose grammar raised or took longer than ``limit_s``
    (default MASK_FILL_LIMIT_S)."""
    limit_s = MASK_FILL_LIMIT_S if limit_s is None else limit_s
    errors: dict[int, str] = {}
    for i, c in enumerate(constraints):
        if c is None:
            continue
        t0 = time.monotonic()
        try:
            c.fill_mask(logits[i])
        except Exception as e:
            log.warning("grammar mask failed for one sequence", exc_info=True)
            errors[i] = _why("the grammar", e)
            continue
        took = time.monotonic() - t0
        if took > limit_s:
            errors[i] = (
                f"the grammar is too slow to apply ({took * 1000:.0f} ms for one token, the "
                f"limit is {limit_s * 1000:.0f} ms); simplify the schema or tools"
            )
    return errors


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def sample_rows(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    fetch: Callable[[torch.Tensor], torch.Tensor] = _same,
    host: bool = False,
) -> tuple[list[int | None], dict[int, str]]:
    """Next token per row of ``logits`` [B, V] (None where that row failed) and {row: reason}.
    ``fetch`` brings the sampled ids to the host (logits on a device: the step's one read);
    ``host``: the model runs on the CPU (``sample``'s native argmax may serve)."""
    saved = [g.get_state() if g is not None else None for g in generators]
    try:
        return list(fetch(sample(logits, params, generators, host)).tolist()), {}
    except Exception:
        log.warning("batched sampling failed; sampling row by row", exc_info=True)
    ids: list[int | None] = []
    errors: dict[int, str] = {}
    for i, (p, g, state) in enumerate(zip(params, generators, saved, strict=True)):
        if g is not None and state is not None:
            g.set_state(state)
        try:
            ids.append(int(fetch(sample(logits[i : i + 1], [p], [g], host))[0]))
        except Exception as e:
            ids.append(None)
            errors[i] = _why("sampling", e)
    return ids, errors
