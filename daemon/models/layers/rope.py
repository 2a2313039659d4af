"""Rotary position embedding: default, YaRN and proportional (Gemma-4), full or partial rotary
dims (half-split form)."""

from __future__ import annotations

import math

import torch

from ...native import dense_native
from ..config import RopeConfig


def inv_frequencies(rope: RopeConfig) -> torch.Tensor:
    """[rotary_dim / 2] inverse frequencies, fp32."""
    dim = rope.rotary_dim
    if rope.kind == "proportional":  # Gemma-4: exponents over the whole head, the tail unrotated
        angles = int(rope.proportion * dim // 2)
        inv = 1.0 / rope.theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.float32) / dim)
        return torch.cat([inv, torch.zeros(dim // 2 - angles)])
    exps = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    base = rope.theta**exps
    if rope.kind != "yarn":
        return 1.0 / base
    extra, inter = 1.0 / base, 1.0 / (rope.factor * base)

    def corr(rot: float) -> float:
        return (
            dim
            * math.log(rope.original_max_position / (rot * 2 * math.pi))
            / (2 * math.log(rope.theta))
        )

    low, high = corr(rope.beta_fast), corr(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep_extra = 1 - ramp  # 1 where the dimension extrapolates (high frequency)
    return inter * (1 - keep_extra) + extra * keep_extra


class Rope:
    def __init__(self, rope: RopeConfig) -> None:
        self.cfg = rope
        self.inv_freq = inv_frequencies(rope) if rope.rotary_dim else torch.empty(0)
        self._cos = self._sin = torch.empty(0, self.inv_freq.shape[0])

    def to(self, device: torch.device) -> Rope:
        """Keeps the frequencies and the tables on ``device`` (where the dense part runs)."""
        self.inv_freq = self.inv_freq.to(device)
        self._cos, self._sin = self._cos.to(device), self._sin.to(device)
        return self

    def cos_sin(
        self, positions: torch.Tensor, max_position: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N] -> cos, sin [N, rotary_dim / 2] (fp32, scaled by the attention factor).

        Rows of a table grown by doubling: a decode step indexes it instead of evaluating
        cos/sin, and a position's values never depend on which other positions share its step.
        ``max_position``: the largest of ``positions`` when the caller knows it (positions on a
        device: reading their max would be a host sync).
        """
        if positions.numel():
            top = int(positions.max()) if max_position is None else max_position
            need = top + 1
            if need > self._cos.shape[0]:
                self._grow(max(need, 2 * self._cos.shape[0], 256))
        # index_select, not advanced indexing: the same rows, a lighter op (a decode step's)
        return self._cos.index_select(0, positions), self._sin.index_select(0, positions)

    def table(self, top: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos and sin tables [n, rotary_dim / 2] (fp32, contiguous), grown to hold row
        ``top``: what `cos_sin` indexes, for a caller that reads the rows in place."""
        if top >= self._cos.shape[0]:
            self._grow(max(top + 1, 2 * self._cos.shape[0], 256))
        return self._cos, self._sin

    def _grow(self, n: int) -> None:
        dev = self.inv_freq.device
        freqs = torch.arange(n, dtype=torch.float32, device=dev).unsqueeze(-1) * self.inv_freq
        s = self.cfg.attention_factor
        self._cos, self._sin = freqs.cos() * s, freqs.sin() * s

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [N, heads, head_dim] fp32; rotates the first rotary_dim dims."""
        r = self.cfg.rotary_dim
        if r == 0:
            return x
        if dense_native.rope_usable(x, cos, sin) and cos.shape[1] == r // 2:
            return dense_native.rope(x, cos, sin, r, self.cfg.interleaved)
        return self.apply_reference(x, cos, sin)

    def apply_reference(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """`apply` in plain torch (the device path, and the native kernel's reference)."""
        r = self.cfg.rotary_dim
        half = r // 2
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        if self.cfg.interleaved:  # pairs (x0, x1), (x2, x3), ...; output in half-split order
            x1, x2 = x[..., 0:r:2], x[..., 1:r:2]
        else:
            x1, x2 = x[..., :half], x[..., half:r]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, x[..., r:]), dim=-1)
