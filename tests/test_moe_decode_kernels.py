"""The sync-free decode kernels (kernels/moe_decode.py) against their torch references: in the
Triton interpreter on CPU tensors (ftkernels.interp, nothing set process-wide), or compiled on
CUDA with FT_TEST_ACCELERATOR=cuda (tests/gpu/check.sh; the copy source is then pinned host
memory, read in place by the kernel)."""

from __future__ import annotations

import os

import pytest
import torch

from freetokend.experts.banks import Activation, ActivationSpec, ExpertBanks, moe_reference
from ftkernels.moe_decode import copy_rows, copy_rows_reference, moe_decode

CUDA = os.environ.get("FT_TEST_ACCELERATOR") == "cuda"
DEV = "cuda" if CUDA else "cpu"


def _banks(slots: int, h: int, i: int, dtype: torch.dtype, bias: bool, seed: int) -> ExpertBanks:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.2).to(dtype)

    return ExpertBanks(
        rnd(slots, 2 * i, h),
        rnd(slots, h, i),
        rnd(slots, 2 * i) if bias else None,
        rnd(slots, h) if bias else None,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "act",
    [
        ActivationSpec(),
        ActivationSpec(Activation.GPTOSS, 1.702, 0.6),
        ActivationSpec(Activation.GELU_TANH),
        ActivationSpec(Activation.SWIGLU_CLAMP, limit=0.6),
    ],
    ids=["silu", "gptoss", "gelu_tanh", "swiglu_clamp"],
)
@pytest.mark.parametrize("tokens", [1, 3])
def test_moe_decode_matches_reference(dtype: torch.dtype, act: ActivationSpec, tokens: int) -> None:
    # H and I not multiples of the blocks: the masks are exercised; I spans several row blocks
    h, i, k, slots = 160, 72, 4, 9
    gptoss = act.kind == Activation.GPTOSS
    banks = _banks(slots, h, i, dtype, bias=gptoss, seed=tokens)
    g = torch.Generator().manual_seed(100 + tokens)
    x = torch.randn(tokens, h, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(slots, generator=g)[:k] for _ in range(tokens)]).int()
    ids[0, 1] = -1  # a route computed elsewhere (the CPU) or skipped
    w = torch.rand(tokens, k, generator=g)
    dev = [None if t is None else t.to(DEV) for t in banks.tensors().values()]
    if not gptoss:
        dev += [None, None]
    got = moe_decode(
        x.to(DEV), ids.to(DEV), w.to(DEV), *dev, int(act.kind), act.alpha, act.limit
    ).cpu()
    ref = moe_reference(x, ids, w, banks, act)
    assert got.dtype == torch.float32 and got.shape == (tokens, h)
    # fp32 products either way; only the order of the sums differs
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=2e-5)
    # the clamps of GPT-OSS's and DeepSeek-V4's activations must bind for the test to cover them
    if act.kind in (Activation.GPTOSS, Activation.SWIGLU_CLAMP):
        pre = x.float() @ banks.gate_up[ids[0, 0]].float().t()
        assert (pre.abs() > act.limit).any()


def test_moe_decode_all_routes_skipped_is_zero() -> None:
    banks = _banks(3, 40, 24, torch.float32, bias=True, seed=0)
    ids = torch.full((2, 2), -1, dtype=torch.int32)
    out = moe_decode(torch.randn(2, 40), ids, torch.ones(2, 2), banks.gate_up, banks.down,
                     banks.gate_up_bias, banks.down_bias, 1, 1.702, 7.0)  # fmt: skip
    assert torch.equal(out, torch.zeros(2, 40))


@pytest.mark.parametrize(
    "dtype,row", [(torch.bfloat16, (6, 10)), (torch.uint8, (3, 5)), (torch.float32, (7,))]
)
def test_copy_rows_matches_reference(dtype: torch.dtype, row: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(1)
    src = torch.randint(0, 250, (12, *row), generator=g).to(dtype)
    if CUDA:
        src = src.pin_memory()  # the kernel reads the host pool in place
    dst0 = torch.randint(0, 250, (5, *row), generator=g).to(dtype)
    dst_idx = torch.tensor([4, 0, 2, -1, -1], dtype=torch.int32, device=DEV)
    src_idx = torch.tensor([11, 3, 7, -1, -1], dtype=torch.int32, device=DEV)
    count = torch.tensor([3], dtype=torch.int32, device=DEV)
    got, ref = dst0.clone().to(DEV), dst0.clone()
    copy_rows(got, src, dst_idx, src_idx, count)
    copy_rows_reference(ref, src, dst_idx.cpu(), src_idx.cpu(), count.cpu())
    got = got.cpu()
    assert torch.equal(got, ref)
    assert torch.equal(got[4], src[11]) and torch.equal(got[0], src[3])
    assert torch.equal(got[[1, 3]], dst0[[1, 3]])  # untouched rows stay
    count.zero_()
    got = got.to(DEV)
    copy_rows(got, src, dst_idx, src_idx, count)  # an empty copy list copies nothing
    assert torch.equal(got.cpu(), ref)


def test_copy_rows_rows_longer_than_the_grid(monkeypatch: pytest.MonkeyPatch) -> None:
    """Few programs, rows of several blocks (the last one partial), a count below the list
    length: every program loops over (copy, block) items and the result is the reference's."""
    import ftkernels.moe_decode as k

    monkeypatch.setattr(k, "COPY_PROGRAMS", 3)
    g = torch.Generator().manual_seed(2)
    words = 2 * k.COPY_BLOCK + 452
    src = torch.randint(-(2**31), 2**31 - 1, (9, words), generator=g, dtype=torch.int32)
    if CUDA:
        src = src.pin_memory()
    dst0 = torch.randint(-(2**31), 2**31 - 1, (6, words), generator=g, dtype=torch.int32)
    dst_idx = torch.tensor([5, 1, 3, 0, 2], dtype=torch.int32, device=DEV)
    src_idx = torch.tensor([8, 0, 4, 2, 6], dtype=torch.int32, device=DEV)
    count = torch.tensor([4], dtype=torch.int32, device=DEV)
    got, ref = dst0.clone().to(DEV), dst0.clone()
    copy_rows(got, src, dst_idx, src_idx, count)
    copy_rows_reference(ref, src, dst_idx.cpu(), src_idx.cpu(), count.cpu())
    assert torch.equal(got.cpu(), ref)
    assert torch.equal(ref[2], dst0[2]) and torch.equal(ref[0], src[2])


def test_copy_grid_fits_cuda_limits_for_mixtral_8x22b_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Mixtral-8x22B gate_up row is 2 x 16384 x 6144 bf16 = 100,663,296 words; a prefill
    chunk lists 8192 x 2 copies. The grid the launcher asks for must fit CUDA's limits (x <
    2**31, y and z <= 65,535): one axis per row block would need 98,304 on y."""
    import ftkernels.moe_decode as k

    grids: list[tuple[int, ...]] = []

    class Recorder:
        def __getitem__(self, grid: tuple[int, ...]):  # type: ignore[no-untyped-def]
            grids.append(tuple(grid))
            return lambda *a, **kw: None

    monkeypatch.setattr(k, "_copy_rows_kernel", Recorder())
    for rows, copies in (((2 * 16384, 6144), 8192 * 2), ((6144, 16384), 64 * 2)):
        bank = torch.empty((4, *rows), dtype=torch.bfloat16, device="meta")
        idx = torch.empty(copies, dtype=torch.int32, device="meta")
        copy_rows(bank, bank, idx, idx, torch.empty(1, dtype=torch.int32, device="meta"))
    assert len(grids) == 2
    for grid in grids:
        assert len(grid) <= 3 and grid[0] <= 2**31 - 1, grid
        assert all(g <= 65535 for g in grid[1:]), grid


def test_copy_rows_rejects_mismatched_rows() -> None:
    with pytest.raises(ValueError, match="row mismatch"):
        copy_rows(torch.zeros(2, 4), torch.zeros(2, 5), *[torch.zeros(1, dtype=torch.int32)] * 3)


# -- the offload backend on the stand-in with the device kernels (the CUDA decode path) --------


@pytest.mark.parametrize("hybrid", [False, True])
def test_offload_decode_with_device_kernels_matches_fused(builtin_model_dir, hybrid: bool) -> None:
    """Greedy tokens through the sync-free path (fills from the device copy list, GEMVs reading
    slot ids on the device) equal the fused backend's; few slots, so fills happen every step."""
    from freetokend import LLM

    prompt = list(range(5, 11))
    ref = LLM(builtin_model_dir, "fused", accelerator="standin", dtype="float32",
              prefix_cache=False).generate(prompt, 3, ignore_eos=True)  # fmt: skip
    acc = "cuda" if CUDA else "standin"
    llm = LLM(builtin_model_dir, "hybrid" if hybrid else "offload", accelerator=acc,
              moe_slots=24, dtype="float32", prefix_cache=False,
              bandwidth=(1.0, 4.0))  # fmt: skip
    be = llm.moe
    be.device_kernels = True
    calls = {"kernel": 0}
    real = be._decode_kernel

    def counted(*a):  # type: ignore[no-untyped-def]
        calls["kernel"] += 1
        return real(*a)

    be._decode_kernel = counted
    assert llm.generate(prompt, 3, ignore_eos=True) == ref
    assert calls["kernel"] > 0 and llm.moe.cache.stats()["fills"] > 0
    assert be.counters["gpu_routes"] > 0
    assert (be.counters["cpu_routes"] > 0) == hybrid
