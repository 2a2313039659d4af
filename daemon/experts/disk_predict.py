"""A read-ahead predictor for the disk tier (experts/disk_tier.py) learned from the routing
itself: which experts a token takes in MoE layer L + 1 given the ones it took in layer L.

The router-on-the-previous-input predictor (models/layers/moe.py ``router_predictor``) needs the
routes to come from the model's routers; this one needs only the routes, so it also works where
they do not (a recorded routing replayed on random weights: tests/bench/bench_disk_tier.py
``--routes``) and costs no router product. Per pair of consecutive MoE layers it counts, over
the decode tokens seen, how often expert a in layer L was followed by expert b in L + 1
(``counts[L + 1][a, b]``, halved every ``HALF_LIFE`` observations of the layer, so the counts
follow the text); a prediction for layer L + 1 is the ``width`` experts with the largest sum of
the counts of this token's layer-L experts. On the Qwen3-30B-A3B trace of
shared/data/routing-traces (11 of its 48 layers, global LRU at 15 % of the experts) the top 8
named 27 % of the misses for 2.3 wasted reads each; at 30 % 8 % (most misses there are experts
the token had not used for long: nothing in the history names them).
"""

from __future__ import annotations

import torch

HALF_LIFE = 256  # observations of a layer between halvings of its counts


class CooccurrencePredictor:
    """Counts of consecutive layers' experts (see the module). ``observe`` takes one token's
    experts of a layer, in layer order; ``predict`` the next layer's likely ones."""

    def __init__(self, num_layers: int, num_experts: int, width: int) -> None:
        if width < 1:
            raise ValueError(f"width must be >= 1, got {width}")
        self.num_experts, self.width = num_experts, width
        self.counts = torch.zeros(num_layers, num_experts, num_experts, dtype=torch.float32)
        self._seen = [0] * num_layers
        self._last: tuple[int, list[int]] = (-1, [])  # the layer observed last, its experts

    def observe(self, layer: int, experts: list[int]) -> None:
        """One token's experts (per-layer ids, distinct) of ``layer``; counted against the
        layer before where that was the last observed (the same token's pass)."""
        prev, had = self._last
        self._last = (layer, experts)
        if prev != layer - 1 or not had or not experts:
            return
        c = self.counts[layer]
        self._seen[layer] += 1
        if self._seen[layer] % HALF_LIFE == 0:
            c.mul_(0.5)
        rows = torch.tensor(had)
        cols = torch.tensor(experts)
        c.index_put_((rows.repeat_interleave(len(experts)), cols.repeat(len(had))),
                     torch.ones(len(had) * len(experts)), accumulate=True)  # fmt: skip

    def predict(self, layer: int, experts: list[int]) -> list[int]:
        """The experts of ``layer`` most often seen after ``experts`` (of layer - 1), at most
        ``width``, none never seen."""
        if not 0 < layer < self.counts.shape[0] or not experts:
            return []
        score = self.counts[layer][torch.tensor(experts)].sum(0)
        top = torch.topk(score, min(self.width, self.num_experts))
        return [int(e) for v, e in zip(top.values.tolist(), top.indices.tolist(), strict=True)
                if v > 0]  # fmt: skip
