"""The native rotary embedding (native/dense/rope.h) against Rope.apply's torch form, bit for
bit: half-split and interleaved pairs, partial rotary dims, non-contiguous input."""

from __future__ import annotations

import pytest
import torch

from freetokend.models.config import RopeConfig
from freetokend.models.layers.rope import Rope
from freetokend.native import dense_native

pytestmark = pytest.mark.skipif(
    not dense_native.available(), reason="ftdense extension not built (pip install -e .)"
)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize(("head_dim", "rot"), [(64, 64), (128, 64), (96, 32)])
@pytest.mark.parametrize("n", [1, 7])
def test_native_rope_is_torch_bit_for_bit(
    interleaved: bool, head_dim: int, rot: int, n: int
) -> None:
    rope = Rope(RopeConfig(theta=10000.0, rotary_dim=rot, interleaved=interleaved))
    g = torch.Generator().manual_seed(n + head_dim)
    wide = torch.randn(n, 3, 2 * head_dim, generator=g) * 3
    x = wide[..., :head_dim]  # a view: not contiguous
    cos, sin = rope.cos_sin(torch.randint(0, 5000, (n,), generator=g))
    assert dense_native.rope_usable(x, cos, sin)
    got = rope.apply(x, cos, sin)
    want = rope.apply_reference(x, cos, sin)
    assert torch.equal(got, want)
    assert not torch.equal(got[..., :rot], x[..., :rot])  # it did rotate
    assert torch.equal(got[..., rot:], x[..., rot:])


def test_not_taken_for_autograd_or_other_dtypes() -> None:
    x = torch.randn(2, 1, 8)
    cos = sin = torch.randn(2, 4)
    assert not dense_native.rope_usable(x.double(), cos.double(), sin.double())
    assert not dense_native.rope_usable(x.requires_grad_(), cos, sin)
