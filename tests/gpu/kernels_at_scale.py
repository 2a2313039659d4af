"""The compiled Triton kernels against their torch references at production shapes, on CUDA
(step ``kernels`` of tests/gpu/check.sh; the pytest files cover small shapes). Every check runs
until the time budget; one line each, then a ``VERDICT:`` line; exit status 1 when any failed.

The references run on the GPU too (plain torch, the same math as on the CPU; integer state is
exact, fp32 sums differ in order only), so a 16,384-route dedupe is milliseconds, not the
CPU reference's 10 s. By default the trimmed set (about a minute, compiles included: one
compile per kernel configuration); ``--full`` every configuration below.

- slot cache: Qwen3-30B-A3B (48 layers x 128 experts); trimmed: 2000 slots with the aged-
  frequency policy (one 2048-wide sort) and 6144 slots with LRU (every expert: above 2048 the
  sort runs in chunks); full: 600, 2000, 4000 and 6144 slots, both policies. Decode batches of
  1 and 64 tokens and 2048-token prefill chunks (16,384 routes): outputs and state bit-equal;
- copy_rows: zero-copy fills from a pinned host pool of Qwen3-30B-A3B gate_up rows, and one
  Mixtral-8x22B gate_up row (100,663,296 words: beyond the old grid's y limit);
- moe_decode: Qwen3-30B-A3B and gpt-oss-20b geometry, bf16 banks; trimmed: 64 and 1 tokens
  (one each), full: both;
- paged decode attention: Qwen3-30B-A3B (32 q / 4 KV heads, d 128) and gpt-oss-20b (64 / 8,
  d 64, sinks; window 128 and full) over bf16 16-token pages in scattered order, 1 sequence of
  32k keys and 64 of ragged lengths up to 32k (trimmed: one batch per geometry);
- Gated DeltaNet decode step: Qwen3-Next-80B-A3B (16 key / 32 value heads, dk = dv = 128) and
  Qwen3.5-397B-A17B (16 / 64) geometry, 1 and 64 sequences (trimmed: one each), each with its
  own state tensor, bf16 beta, four steps on alternating layers: outputs and states;
- Gated DeltaNet chunked prefill: the same geometry, prompts of 100 and 8192 tokens (trimmed:
  one each), against the model's torch chunked form (models/layers/deltanet.py); both timed.

    python tests/gpu/kernels_at_scale.py [--full] [--budget SECONDS]
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections.abc import Callable

import torch

from freetokend.experts.banks import Activation, ActivationSpec, ExpertBanks, moe_reference
from freetokend.experts.slot_cache import EvictionPolicy, SlotCache, decode_step_reference
from freetokend.models.layers.deltanet import delta_rule_chunked
from ftkernels.deltanet import deltanet_decode_reference, state_pointers
from ftkernels.moe_decode import copy_rows, copy_rows_reference, moe_decode
from ftkernels.ops import deltanet_decode, deltanet_prefill, paged_decode_attention
from ftkernels.paged_attention import paged_decode_attention_reference

DEV = "cuda"


def slot_cache(slots: int, policy: EvictionPolicy) -> None:
    layers, experts, k = 48, 128, 8
    g = torch.Generator().manual_seed(slots)
    # the reference: plain torch on the GPU (its [N, N] dedupe of a prefill chunk's 16,384
    # routes is 10 s on the CPU), called directly (SlotCache dispatches CUDA ids to the kernel)
    ref = SlotCache(layers, experts, slots, policy, device=DEV)
    ker = SlotCache(layers, experts, slots, policy, device=DEV, force_kernel=True)
    for c in (ref, ker):
        c.set_fill_policy(11.8, 47.5)
    for step in range(40):
        tokens = 2048 if step % 13 == 5 else (1 if step % 2 else 64)
        layer = step % layers
        ids = (
            torch.randint(0, experts, (tokens, k), generator=g, dtype=torch.int32) + layer * experts
        ).to(DEV)
        a = decode_step_reference(ref.state, ids, layer, experts, policy)
        b = ker.decode_step(ids, layer)
        for name in vars(a):
            assert torch.equal(getattr(a, name), getattr(b, name)), (step, name)
        for name, t in vars(ref.state).items():
            assert torch.equal(t, getattr(ker.state, name)), (step, name)


def copy_qwen3() -> None:
    g = torch.Generator(device=DEV).manual_seed(0)
    dev_src = torch.randn(64, 1536, 2048, generator=g, device=DEV).to(torch.bfloat16)
    src = torch.empty(dev_src.shape, dtype=torch.bfloat16).pin_memory()
    src.copy_(dev_src)  # random rows made on the GPU, one copy into the pinned pool
    dst = torch.zeros(32, 1536, 2048, dtype=torch.bfloat16, device=DEV)
    ref = dst.clone()
    d = torch.randperm(32, generator=g, device=DEV)[:24].int()
    s = torch.randperm(64, generator=g, device=DEV)[:24].int()
    count = torch.tensor([20], dtype=torch.int32, device=DEV)
    copy_rows(dst, src, d, s, count)
    copy_rows_reference(ref, dev_src, d, s, count)
    torch.cuda.synchronize()
    assert torch.equal(dst, ref)


def copy_mixtral_row() -> None:
    src = torch.empty(1, 2 * 16384, 6144, dtype=torch.bfloat16).pin_memory()
    words = torch.arange(src.numel(), dtype=torch.int32, device=DEV).to(torch.int16)
    src.view(torch.int16).copy_(words.view(src.shape))
    dst = torch.zeros(2, 2 * 16384, 6144, dtype=torch.bfloat16, device=DEV)
    one = torch.tensor([1], dtype=torch.int32, device=DEV)
    copy_rows(dst, src, one, one - 1, one)
    torch.cuda.synchronize()
    assert torch.equal(dst[1].view(torch.int16), words.view(src.shape)[0]) and not dst[0].any()


def decode(h: int, i: int, k: int, tokens: int, gptoss: bool) -> None:
    g = torch.Generator(device=DEV).manual_seed(tokens)
    slots = 64

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=DEV) * 0.05).to(torch.bfloat16)

    banks = ExpertBanks(rnd(slots, 2 * i, h), rnd(slots, h, i),
                        rnd(slots, 2 * i) if gptoss else None, rnd(slots, h) if gptoss else None)  # fmt: skip
    act = ActivationSpec(Activation.GPTOSS, 1.702, 7.0) if gptoss else ActivationSpec()
    x = torch.randn(tokens, h, generator=g, device=DEV).to(torch.bfloat16)
    ids = torch.stack(
        [torch.randperm(slots, generator=g, device=DEV)[:k] for _ in range(tokens)]
    ).int()
    ids[0, 0] = -1
    w = torch.rand(tokens, k, generator=g, device=DEV)
    dev = list(banks.tensors().values())
    if not gptoss:
        dev += [None, None]
    got = moe_decode(x, ids, w, *dev, gptoss, act.alpha, act.limit)
    want = moe_reference(x, ids, w, banks, act)  # fp32 on the GPU
    # both take fp32 products of bf16 weights; only the order of the fp32 sums differs
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


def attention(
    heads: int, kvh: int, d: int, sinks: bool, window: int | None, batch: int, longest: int = 32768
) -> None:
    g = torch.Generator(device=DEV).manual_seed(batch * 7 + d)
    page = 16
    if batch == 1:
        lens = torch.tensor([longest], dtype=torch.int32)
    else:  # ragged, the longest included, a one-key sequence too
        cpu = torch.Generator().manual_seed(batch)
        lens = torch.randint(1, longest, (batch,), generator=cpu, dtype=torch.int32)
        lens[0], lens[1] = longest, 1
    width = -(-longest // page)
    pages = batch * width + 5
    kp = torch.randn(pages, page, kvh, d, generator=g, device=DEV, dtype=torch.bfloat16)
    vp = torch.randn(pages, page, kvh, d, generator=g, device=DEV, dtype=torch.bfloat16)
    tables = torch.randperm(pages, generator=g, device=DEV)[: batch * width].view(batch, width)
    tables = tables.int()
    q = torch.randn(batch + 3, heads, d, generator=g, device=DEV, dtype=torch.bfloat16)
    rows = torch.randperm(batch + 3, generator=g, device=DEV)[:batch].int()
    sk = torch.randn(heads, generator=g, device=DEV).to(torch.bfloat16) if sinks else None
    lens = lens.to(DEV)
    args = (q, kp, vp, tables, lens, rows, longest, d**-0.5, window, sk)
    got = paged_decode_attention(*args)
    want = paged_decode_attention_reference(*args)
    # both fp32 from the same bf16 K/V, each rounded once to bf16
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-4)


def deltanet(kh: int, heads: int, batch: int, d: int = 128, layers: int = 4) -> None:
    g = torch.Generator(device=DEV).manual_seed(batch + heads)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=DEV)

    states = [rnd(layers, heads, d, d) * 0.1 for _ in range(batch)]
    ref = [s.clone() for s in states]
    ptrs = state_pointers(states).to(DEV)
    for step in range(4):
        layer = (2 * step + 1) % layers
        q = torch.nn.functional.normalize(rnd(batch, kh, d), dim=-1) * d**-0.5
        k = torch.nn.functional.normalize(rnd(batch, kh, d), dim=-1)
        v, gate = rnd(batch, heads, d), -rnd(batch, heads).abs()
        beta = torch.sigmoid(rnd(batch, heads)).to(torch.bfloat16)
        got = deltanet_decode(q, k, v, gate, beta, states, ptrs, layer)
        want = deltanet_decode_reference(q, k, v, gate, beta, ref, layer)
        # both fp32 from the same inputs: summation order only
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for s, r in zip(states, ref, strict=True):
        torch.testing.assert_close(s, r, rtol=1e-4, atol=1e-4)


def deltanet_prompt(kh: int, heads: int, n: int, d: int = 128) -> None:
    g = torch.Generator(device=DEV).manual_seed(n + heads)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=DEV)

    q = torch.nn.functional.normalize(rnd(n, kh, d), dim=-1) * d**-0.5
    k = torch.nn.functional.normalize(rnd(n, kh, d), dim=-1)
    v, gate = rnd(n, heads, d), -rnd(n, heads).abs() * 0.1
    beta = torch.sigmoid(rnd(n, heads)).to(torch.bfloat16)
    state = rnd(heads, d, d) * 0.1
    ref = state.clone()
    rep = heads // kh
    times = []
    for _ in range(2):  # the first includes the kernel's compile
        s, r = state.clone(), ref.clone()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        got = deltanet_prefill(q, k, v, gate, beta, s)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        want, r = delta_rule_chunked(
            q.repeat_interleave(rep, 1), k.repeat_interleave(rep, 1), v, gate, beta, r
        )
        torch.cuda.synchronize()
        times.append(((t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3))
    print(f"    {heads} heads, {n} tokens: kernel {times[1][0]:.2f} ms, torch chunked "
          f"{times[1][1]:.2f} ms (second run)")  # fmt: skip
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(s, r, rtol=1e-3, atol=1e-3)


Check = tuple[str, Callable[[], None]]


def checks(full: bool) -> list[Check]:
    """In the order they run (the budget cuts the tail): slot cache, copies, GEMVs, attention,
    DeltaNet."""
    out: list[Check] = []
    slot_cases = (
        [(s, p) for s in (600, 2000, 4000, 6144) for p in EvictionPolicy]
        if full
        else [(2000, EvictionPolicy.AGED_FREQ), (6144, EvictionPolicy.LRU)]
    )
    for slots, policy in slot_cases:
        out.append((f"slot cache, {slots} slots, {policy.name}",
                    lambda s=slots, p=policy: slot_cache(s, p)))  # fmt: skip
    out += [("copy_rows, Qwen3 gate_up rows, pinned host", copy_qwen3),
            ("copy_rows, one Mixtral-8x22B gate_up row", copy_mixtral_row)]  # fmt: skip
    for name, (h, i, k), gptoss, trimmed in (("Qwen3-30B-A3B", (2048, 768, 8), False, 64),
                                             ("gpt-oss-20b", (2880, 2880, 4), True, 1)):  # fmt: skip
        for tokens in (1, 64) if full else (trimmed,):
            out.append((f"moe_decode, {name}, {tokens} tokens",
                        lambda h=h, i=i, k=k, t=tokens, o=gptoss: decode(h, i, k, t, o)))  # fmt: skip
    for name, (heads, kvh, d, sinks, window), trimmed in (
        ("Qwen3-30B-A3B", (32, 4, 128, False, None), 64),
        ("gpt-oss-20b sliding", (64, 8, 64, True, 128), 1),
        ("gpt-oss-20b full", (64, 8, 64, True, None), 64),
    ):
        for batch in (1, 64) if full else (trimmed,):
            out.append((f"paged attention, {name}, {batch} seqs to 32k",
                        lambda a=(heads, kvh, d, sinks, window, batch): attention(*a)))  # fmt: skip
    for name, (kh, heads), batch_t, n_t in (("Qwen3-Next-80B-A3B", (16, 32), 64, 8192),
                                            ("Qwen3.5-397B-A17B", (16, 64), 1, 100)):  # fmt: skip
        for batch in (1, 64) if full else (batch_t,):
            out.append((f"deltanet decode, {name}, {batch} seqs",
                        lambda a=(kh, heads, batch): deltanet(*a)))  # fmt: skip
        for n in (100, 8192) if full else (n_t,):
            out.append((f"deltanet prefill, {name}, {n} tokens",
                        lambda a=(kh, heads, n): deltanet_prompt(*a)))  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--full", action="store_true", help="every configuration (several minutes)")
    ap.add_argument("--budget", type=float, default=None,
                    help="start no check after this many seconds (the rest: listed, not run)")  # fmt: skip
    ap.add_argument("--list", action="store_true", help="print the checks and exit")
    args = ap.parse_args()
    todo = checks(args.full)
    if args.list:
        print("\n".join(name for name, _ in todo))
        return
    failed, passed, not_run = 0, 0, []
    start = time.perf_counter()
    for name, fn in todo:
        if args.budget is not None and time.perf_counter() - start > args.budget:
            not_run.append(name)
            print(f"{name:52s}    -    NOT RUN (past the {args.budget:.0f} s budget)", flush=True)
            continue
        t0 = time.perf_counter()
        try:
            fn()
            status = "PASS"
            passed += 1
        except Exception:  # noqa: BLE001 - report and go on with the next check
            failed += 1
            status = "FAIL\n" + traceback.format_exc(limit=3)
        print(f"{name:52s} {time.perf_counter() - t0:6.1f} s  {status}", flush=True)
    tail = f", {len(not_run)} not run (budget {args.budget:.0f} s)" if not_run else ""
    print(f"VERDICT: {passed} passed, {failed} failed{tail} "
          f"in {time.perf_counter() - start:.0f} s")  # fmt: skip
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
