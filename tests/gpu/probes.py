"""The GPU probes of tests/gpu/check.sh, one subcommand each: what the CPU tiers (ARCHITECTURE §9) cannot
show. Each ends with one ``VERDICT:`` line; exit status 0 pass, 1 fail.

  sync      decode steps of ``fused`` and ``offload`` (batches 1 and 3, expert fills every few
            steps) with their forward pass under ``torch.cuda.set_sync_debug_mode("error")``: any
            host sync inside raises; the sampled-token read stays outside (the one host read a
            step); on the tiny qwen3_moe (static decode form) and the built-in model (DeltaNet)
  prefill   prefill overlap under stress: ``offload`` with 2 x E slots, so each MoE layer's
            experts stream while the previous layer computes, on 2k-token prompts; all logits
            against ``fused`` (a race shows as another expert's weights), 5 prompts
  tiny-run  a short run of every device path on the tiny model (fused, offload with fills,
            offload streaming a prefill): what check.sh runs under compute-sanitizer memcheck
  memory    peak ``torch.cuda.max_memory_reserved()`` through CUDA graph capture and a long
            batch-8 decode of ``offload`` with the default slot count, against what
            ``SlotBudget`` left beside the slots, on a card made small by a ballast tensor
  zerocopy  the zero-copy fill (``device_fill_ok``) after an unload and a reload at the same
            host address (pinning.py: a stale registration or finalizer breaks it), at the
            registry level and through ``LLM``; the CUDA error state checked clean after
  park      park / unpark (manager/models.py) of ``fused`` with quantized experts (mxfp4,
            q8_0) and CUDA graphs on: same greedy tokens after, graphs recaptured and replayed,
            device memory freed while parked
  hybrid    ``hybrid`` below a split of 1 (B_P / B_H = 1/4: a quarter of the misses filled, the
            rest on the CPU) against ``fused``, teacher-forced decode logits; a timeline of each
            MoE layer's CPU share (host clock) and GPU share (CUDA events on the compute
            stream) must show them overlapping; written as a Chrome trace (OUT/hybrid_trace.json)
  copylist  a prefill's device-side copy list held for the copy stream (``Accelerator.fill_rows``
            -> ``_hold``: ``record_stream``): the copy stream stalled (``torch.cuda._sleep``),
            the list's tensors dropped as soon as ``fill_rows`` returns and same-size tensors
            allocated and written on the compute stream at once; the slots must hold the rows
            the list named. Then the same without the hold (a control: the rows should come out
            wrong, which shows the probe sees the race), and ``fill_rows`` captured in a CUDA
            graph with lists made inside the capture (record_stream during capture), replayed
  pinerrors a host buffer registered (or unregistered) behind the registry's back: pinning.py's
            ``register`` fails with 712 (``unregister`` with 713) and leaves no CUDA error set
            (it reads ``cudaGetLastError`` through ctypes: that lookup must find the runtime);
            a torch op, a Triton kernel and a synchronize after must not raise. A control shows
            that the runtime keeps such an error and torch's next op raises it
  vram      the VRAM watcher (experts/vram_watch.py) against the real allocator: a ~4 GiB block
            allocated and freed, ``torch_unallocated()`` reads it, NVML's free dropped by it
            (skipped with a note without pynvml); ``check_once`` with the band's low edge just
            above NVML's free does not shrink (with ``unallocated`` zero, a control, it does)
  slotstress  the slot-cache kernel (kernels/slot_cache.py, its barrier on the step and visit
            counters) against its torch reference every step of up to ``--steps`` decode steps
            (random batches of 1-64 tokens, random layers) at 2000 slots (aged frequency) and
            6144 slots (LRU, the sort in chunks), Qwen3-30B-A3B geometry; plans and state equal
            each step. Bounded by ``--budget``: no step starts past it; how many ran is said
  smoke     every probe above in turn, in this process (for ``--device standin``)

Several probes may be named (``probes.py copylist prefill``): they run in that order in one
process, each with its own ``VERDICT:`` line, then one line for all of them (the last).

``--device cuda`` (default) is the real thing. ``--device standin`` runs the same code paths on
the CPU stand-in accelerator, smaller models and fewer tokens, with the device-only checks
marked n/a: API mistakes show without a GPU. ``--device fake-cuda`` (sync, memory): the fake CUDA
card of ARCHITECTURE §9.2, its sync counter and its device bytes in place of the real ones.

    python tests/gpu/probes.py PROBE [PROBE ...] [--device cuda|standin|fake-cuda] [--work DIR]
                               [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import logging
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: tiny_models
from tiny_models import make_tiny  # noqa: E402

MIB = 1 << 20

# the tiny model: qwen3_moe, 3 layers (2 MoE), 8 experts of I 32, top-2, H 64, vocab 97
TINY = {"seed": 5, "max_position_embeddings": 4096}
# the "mid" model: MoE layers big enough for copies and compute to take real time on a GPU
# (3 MiB experts, 96 MiB a layer); smaller on the stand-in (CPU)
MID = {
    "cuda": dict(hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512,
                 num_experts=32, num_experts_per_tok=8, num_hidden_layers=4, mlp_only_layers=[],
                 num_attention_heads=8, num_key_value_heads=2, head_dim=128, vocab_size=512,
                 max_position_embeddings=4096, initializer_range=0.04),
    "small": dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                  num_experts=16, num_experts_per_tok=4, num_hidden_layers=3, mlp_only_layers=[],
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=128,
                  max_position_embeddings=4096),
}  # fmt: skip


class Probe:
    """What a probe reports: lines as it goes, then one verdict."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.failures: list[str] = []
        self.notes: list[str] = []

    def say(self, text: str) -> None:
        print(f"  {text}", flush=True)

    def check(self, ok: bool, what: str) -> bool:
        self.say(("ok    " if ok else "FAIL  ") + what)
        if not ok:
            self.failures.append(what)
        return ok

    def note(self, text: str) -> None:
        """Something the verdict line mentions (an n/a, a skipped part)."""
        self.say("note  " + text)
        self.notes.append(text)

    @contextlib.contextmanager
    def part(self, what: str) -> Iterator[None]:
        """A part of the probe: an exception fails it and the probe goes on."""
        t0 = time.perf_counter()
        self.say(f"-- {what}")
        try:
            yield
        except Exception as e:  # noqa: BLE001 - a failing part is reported, the next one runs
            traceback.print_exc()
            self.failures.append(f"{what}: {type(e).__name__}: {str(e)[:200]}")
            self.say(f"FAIL  {what}: {type(e).__name__}: {str(e)[:300]}")
        self.say(f"   ({time.perf_counter() - t0:.1f} s)")

    def verdict(self) -> int:
        tail = f" [{'; '.join(self.notes)}]" if self.notes else ""
        if self.failures:
            print(f"VERDICT: FAIL {self.name}: {'; '.join(self.failures)[:400]}{tail}")
            return 1
        print(f"VERDICT: PASS {self.name}{tail}")
        return 0


# ---- models and engines --------------------------------------------------------------------
def checkpoint(work: Path, name: str, **over: Any) -> Path:
    """A tiny_models checkpoint under ``work``, written once (to a temporary folder renamed into
    place: a killed run leaves none half-written)."""
    d = work / name
    if (d / "config.json").exists():
        return d
    work.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=work))
    make_tiny("qwen3_moe", tmp, **over)
    try:
        tmp.rename(d)
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    return d


def tiny(a: argparse.Namespace) -> Path:
    return checkpoint(a.work, "tiny-qwen3-moe", **TINY)


def mid(a: argparse.Namespace) -> Path:
    size = "cuda" if a.device == "cuda" else "small"
    return checkpoint(a.work, f"mid-qwen3-moe-{size}", seed=7, dtype=torch.bfloat16, **MID[size])


def make_llm(a: argparse.Namespace, model: Path, backend: str, **kw: Any) -> Any:
    from freetokend import LLM

    if a.device == "fake-cuda":
        kw.setdefault("vram_mib", a.vram_mib or 1024)
    kw.setdefault("prefix_cache", False)
    return LLM(model, backend, accelerator=a.device, **kw)


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (length + 3 * i,), generator=g).tolist() for i in range(n)]


def compare(got: torch.Tensor, ref: torch.Tensor) -> tuple[bool, str]:
    """Logits ``got`` against ``ref`` ([..., vocab], fp32 on the host): within 2% of the logits'
    scale, and the same argmax wherever the reference's top two are further apart than twice
    the difference (a bf16 hidden state rounded the other way moves logits by ~0.4%; another
    expert's weights, a stale slot or a race, by O(1))."""
    got, ref = got.reshape(-1, got.shape[-1]), ref.reshape(-1, ref.shape[-1])
    diff = (got - ref).abs().amax(-1)
    scale = ref.abs().max().item()
    top2 = ref.topk(2, dim=-1).values
    flips = (got.argmax(-1) != ref.argmax(-1)) & (top2[:, 0] - top2[:, 1] > 2 * diff)
    ok = diff.max().item() <= 2e-2 * max(1.0, scale) and not flips.any()
    return ok, (f"max |logit diff| {diff.max().item():.2e} (logits up to {scale:.1f}, "
                f"bit-equal: {torch.equal(got, ref)}), argmax flips beyond rounding: "
                f"{int(flips.sum())} of {len(ref)}")  # fmt: skip


def close(llm: Any) -> None:
    acc = getattr(llm.moe, "acc", None)
    if acc is not None and llm.fake_device is None:
        acc.synchronize()  # nothing of this model left in flight
    llm.close()


def synchronize(a: argparse.Namespace) -> None:
    if a.device == "cuda":
        torch.cuda.synchronize()


# ---- sync ----------------------------------------------------------------------------------
class SyncGuard:
    """Around a decode step's forward pass: on CUDA ``set_sync_debug_mode("error")`` (a host
    sync raises where it happens); on the fake card its sync counter must not move; on the
    stand-in nothing (no device to sync with)."""

    def __init__(self, a: argparse.Namespace, llm: Any) -> None:
        self.device, self.llm, self.steps = a.device, llm, 0

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        self.steps += 1
        if self.device == "cuda":
            torch.cuda.set_sync_debug_mode("error")
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode("default")
        elif self.device == "fake-cuda":
            syncs = self.llm.fake_device.tracker.syncs
            before = syncs.total
            yield
            if syncs.total != before:
                raise RuntimeError(f"{syncs.total - before} host sync(s) in a decode forward pass")
        else:
            yield


def guard_decode_steps(llm: Any, guard: SyncGuard) -> None:
    """The runner's forward of a decode-only step (one token per row, last logits) runs under
    ``guard``; prefill and mixed steps, and the engine's sampling after, run outside it."""
    inner = llm.runner.forward

    def forward(work: list[Any]) -> torch.Tensor:
        if work and all(len(w.tokens) == 1 and not w.all_logits for w in work):
            with guard():
                return inner(work)
        return inner(work)

    llm.runner.forward = forward


def builtin(a: argparse.Namespace) -> Path:
    """The daemon's built-in model (Qwen3.5-MoE: Gated DeltaNet layers, no static decode form)."""
    from freetokend.models.builtin import ensure_builtin_model

    return ensure_builtin_model(a.work / "state")


def probe_sync(a: argparse.Namespace, p: Probe) -> None:
    if a.device == "standin":
        p.note("standin: no device to sync with, the steps run unguarded")
    # the tiny qwen3_moe decodes in static form (engine/graphs.py); the built-in model's
    # DeltaNet layers take the general forward
    for model, d in (("tiny qwen3_moe", tiny(a)), ("built-in", builtin(a))):
        for backend in ("fused", "offload"):
            with p.part(f"{model}, {backend}: decode forward passes with host syncs as errors"):
                _sync_run(a, p, d, f"{model}, {backend}", backend)


def _sync_run(a: argparse.Namespace, p: Probe, d: Path, what: str, backend: str) -> None:
    from freetokend.models.config_hf import read_config

    # offload: as many slots as a layer has experts (of all layers'), so decode fills from the
    # host every few steps, and never more routes than slots (a route to the CPU: a sync)
    slots = None if backend == "fused" else read_config(d).num_experts
    llm = make_llm(a, d, backend, moe_slots=slots, max_model_len=512, kv_tokens=4096)
    try:
        ps = prompts(3, 24, llm.config.vocab_size, seed=1)
        # warm-up, unguarded: kernel compiles, allocator growth, the buckets' first use
        llm.generate(ps[:1], max_tokens=4, ignore_eos=True)
        llm.generate(ps, max_tokens=4, ignore_eos=True)
        guard = SyncGuard(a, llm)
        guard_decode_steps(llm, guard)
        for batch in (1, 3):
            out = llm.generate(ps[:batch], max_tokens=a.decode, ignore_eos=True)
            assert all(len(o) == a.decode for o in out)
        synchronize(a)
        p.check(guard.steps >= 2 * (a.decode - 1),
                f"{what}: {guard.steps} decode steps, no host sync inside")  # fmt: skip
        fills = getattr(llm.moe, "cache", None)
        if fills is not None and a.device != "fake-cuda":  # (no data to read there)
            p.say(f"{what}: slot cache {fills.stats()}")
    finally:
        close(llm)


# ---- prefill overlap -----------------------------------------------------------------------
def probe_prefill(a: argparse.Namespace, p: Probe) -> None:
    d = mid(a)
    n = a.prompt
    with p.part(f"fused: logits of {a.repeats} prompts of {n} tokens (the reference)"):
        fused = make_llm(a, d, "fused", max_model_len=n + 64, kv_tokens=n + 128)
        vocab = fused.config.vocab_size
        ps = [prompts(1, n, vocab, seed=100 + r)[0] for r in range(a.repeats)]
        refs = [fused.logits(x) for x in ps]
        close(fused)
        del fused
        gc.collect()
    if len(refs) != a.repeats:
        return
    with p.part("offload, 2 x E slots: prefill streams each layer's experts with overlap"):
        from freetokend.experts.device_backends import OffloadBackend
        from freetokend.models.config_hf import read_config

        e = read_config(d).num_experts
        llm = make_llm(a, d, "offload", moe_slots=2 * e, max_model_len=n + 64, kv_tokens=n + 128)
        try:
            be = llm.moe
            assert isinstance(be, OffloadBackend) and be.prefill_overlap
            layers = llm.config.num_moe_layers
            for r, x in enumerate(ps):
                ok, text = compare(llm.logits(x), refs[r])
                p.check(ok, f"prompt {r}, {len(x)} positions: {text}")
            c = be.counters
            p.check(c["prefill_layers_streamed"] == a.repeats * layers
                    and c["prefill_on_demand"] == 0,
                    f"{c['prefill_layers_streamed']} layer streams ({a.repeats} x {layers} MoE "
                    f"layers), {c['prefill_on_demand']} on demand")  # fmt: skip
        finally:
            close(llm)


# ---- the prefill copy list, held for the copy stream ---------------------------------------
def _copylist_round(
    a: argparse.Namespace, acc: Any, host: torch.Tensor, dst: torch.Tensor, seed: int
) -> int:
    """One ``fill_rows`` whose copy list is dropped at once and its memory contended: the copy
    stream stalled first (CUDA), then same-size int32 tensors allocated right after the drop
    and filled with another row index on the compute stream. Returns the slots that came out
    other than the list named (0: right)."""
    real = a.device == "cuda"
    slots, rows = dst.shape[0], host.shape[0]
    copies = slots * 3 // 4
    other = 3  # what the contending tensors hold: a valid slot, row and count, but not the list
    g = torch.Generator().manual_seed(seed)
    d_list = torch.randperm(slots, generator=g)[:copies].int()
    s_list = torch.randperm(rows, generator=g)[:copies].int()
    want = torch.full(tuple(dst.shape), -1, dtype=torch.int32)
    want[d_list.long()] = host.cpu()[s_list.long()]
    dst.fill_(-1)
    dev = acc.device
    d, s = d_list.to(dev), s_list.to(dev)
    n = torch.tensor([copies], dtype=torch.int32, device=dev)
    if real:  # the copy stream busy: the fill's kernel reads its list ~50 ms from now
        with torch.cuda.stream(acc.copy_stream):
            torch.cuda._sleep(a.sleep_cycles)
    transfer = acc.fill_rows([(dst, host)], d, s, n, kernel=real)
    del d, s, n  # the caller's last references: the blocks go back to the allocator
    # the compute stream's next allocations of the same sizes, written at once (not stalled)
    contend = [torch.full((copies if i % 3 else 1,), other, dtype=torch.int32, device=dev)
               for i in range(48)]  # fmt: skip
    transfer.wait()
    acc.synchronize()
    got = dst.cpu()
    del contend
    return int((got != want).any(dim=1).sum())


def probe_copylist(a: argparse.Namespace, p: Probe) -> None:
    from freetokend.experts.accelerator import StandinAccelerator
    from freetokend.experts.devices import create_accelerator

    real = a.device == "cuda"
    # the stand-in's reclaim mode poisons the list tensors a transfer does not hold, as CUDA's
    # allocator hands them to the next allocation
    acc = create_accelerator("cuda") if real else StandinAccelerator(reclaim=True)
    rows, width, slots = 64, 4096 if real else 64, 32
    host = acc.host_buffer((rows, width), torch.int32)  # pinned on CUDA: read in place
    host.copy_(torch.arange(rows * width, dtype=torch.int32).view(rows, width))
    dst = acc.empty((slots, width), torch.int32)
    if not real:
        p.note(f"{a.device}: the stand-in's reclaim mode in place of the allocator, no graphs")
    with p.part("fill_rows: list dropped at once, its memory contended, copy stream stalled"):
        p.check(acc.device_fill_ok(host), "zero-copy fills from the pinned pool work")
        wrong = [_copylist_round(a, acc, host, dst, seed) for seed in range(4)]
        p.check(not any(wrong), f"4 fills, slots other than the list named: {wrong}")
    with p.part("control: the same without the hold (no record_stream)"):
        acc._hold = lambda transfer, tensors: None  # type: ignore[method-assign]
        try:
            wrong = [_copylist_round(a, acc, host, dst, 10 + seed) for seed in range(4)]
        finally:
            del acc._hold
        if any(wrong):
            p.say(f"without the hold the slots come out wrong ({wrong} of {slots} slots in "
                  "4 fills): the probe sees the race")  # fmt: skip
        else:
            p.note("control: no wrong slot without the hold either: this card's allocator "
                   "did not hand the blocks on, the check above shows nothing")  # fmt: skip
    if not real:
        return
    with p.part("fill_rows in a CUDA graph: lists made inside the capture, record_stream there"):
        copies = slots * 3 // 4
        base_d = torch.zeros(copies, dtype=torch.int32, device="cuda")
        base_s = torch.zeros(copies, dtype=torch.int32, device="cuda")
        base_n = torch.tensor([copies], dtype=torch.int32, device="cuda")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            d, s, n = base_d + 0, base_s + 0, base_n + 0  # from the graph's pool, in-graph
            transfer = acc.fill_rows([(dst, host)], d, s, n, kernel=True)
            del d, s, n
            transfer.wait()
        for seed in (20, 21):
            g = torch.Generator().manual_seed(seed)
            d_list = torch.randperm(slots, generator=g)[:copies].int()
            s_list = torch.randperm(rows, generator=g)[:copies].int()
            base_d.copy_(d_list)
            base_s.copy_(s_list)
            want = torch.full((slots, width), -1, dtype=torch.int32)
            want[d_list.long()] = host[s_list.long()]
            dst.fill_(-1)
            graph.replay()
            torch.cuda.synchronize()
            p.check(torch.equal(dst.cpu(), want), f"replay {seed - 19}: the slots the list named")
        del graph
    acc.close()


# ---- the compute-sanitizer target ----------------------------------------------------------
def probe_tiny_run(a: argparse.Namespace, p: Probe) -> None:
    d = tiny(a)
    # fused; offload with decode fills (8 of 16 experts); offload streaming a prefill (16 = 2 x E)
    for backend, slots in (("fused", None), ("offload", 8), ("offload", 16)):
        with p.part(f"{backend} ({slots or 'all'} slots): 40-token prompt, 4 tokens"):
            llm = make_llm(a, d, backend, moe_slots=slots, max_model_len=128, kv_tokens=512)
            try:
                out = llm.generate(prompts(2, 40, 97, seed=3), max_tokens=4, ignore_eos=True)
                synchronize(a)
                p.check(all(len(o) == 4 for o in out), f"{backend}: {out}")
            finally:
                close(llm)


# ---- memory against the slot budget --------------------------------------------------------
class DeviceBytes:
    """The device's bytes: torch's reserved bytes on CUDA, the fake card's live bytes."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.device = a.device
        self.tracker: Any = None

    def now(self) -> int | None:
        if self.device == "cuda":
            return torch.cuda.memory_reserved()
        return self.tracker.sweep() if self.tracker is not None else None

    def peak(self) -> int | None:
        if self.device == "cuda":
            return torch.cuda.max_memory_reserved()
        return self.tracker.peak if self.tracker is not None else None


@contextlib.contextmanager
def spy_slot_sizing(seen: dict[str, Any], mem: DeviceBytes) -> Iterator[None]:
    """Records what ``_default_slots`` saw and chose (and the device's bytes then)."""
    from freetokend.experts import backend as backend_mod

    inner = backend_mod._default_slots

    def sized(banks: Any, acc: Any, num_flat: int, budget: Any) -> int:
        if acc.name == "fake-cuda":
            mem.tracker = acc.tracker
        info = acc.mem_get_info()
        seen.update(info=info, budget=budget, slot=banks.nbytes_per_expert(),
                    flat=num_flat, before=mem.now())  # fmt: skip
        seen["n"] = n = inner(banks, acc, num_flat, budget)
        return n

    backend_mod._default_slots = sized
    try:
        yield
    finally:
        backend_mod._default_slots = inner


def _memory_report(
    a: argparse.Namespace, p: Probe, llm: Any, seen: dict[str, Any], mem: DeviceBytes
) -> None:
    graphs = a.device == "cuda"
    be = llm.moe
    p.say(f"slots: {seen.get('n')} of {seen.get('flat')} experts, "
          f"{seen.get('slot', 0) / MIB:.2f} MiB each; KV pool "
          f"{llm.runner.kv.nbytes / MIB:.1f} MiB")  # fmt: skip
    if graphs:
        g = llm.runner.graphs
        p.check(g is not None and len(g.graphs) > 0,
                f"graphs captured: {0 if g is None else len(g.graphs)}")  # fmt: skip
    after_load, peak_load = mem.now(), mem.peak()  # the load's peak: the graph capture's
    out = llm.generate(prompts(8, 64, llm.config.vocab_size, seed=5),
                       max_tokens=a.long_decode, ignore_eos=True)  # fmt: skip
    synchronize(a)
    p.check(all(len(o) == a.long_decode for o in out),
            f"batch-8 decode of {a.long_decode} tokens")  # fmt: skip
    if graphs and llm.runner.graphs is not None:
        p.say(f"graph replays: {llm.runner.graphs.replays}")
    info, peak, before = seen.get("info"), mem.peak(), seen.get("before")
    if info is None or peak is None or before is None:
        return
    free = info[0]
    budget = seen["budget"]
    slots_bytes = be.slots.nbytes_per_expert() * be.cache.num_slots
    state = 8 * seen["flat"]
    # what the budget left beside the slots: the KV reserve, the activations and the
    # (1 - memory_ratio) share of the free memory it saw
    left = free - seen["n"] * (seen["slot"] + 21) - state
    reserve = budget.kv_reserve_tokens * budget.kv_bytes_per_token
    beside = peak - before - slots_bytes
    p.say(f"at sizing: {free / MIB:.0f} MiB free; the budget kept {reserve / MIB:.1f} MiB "
          f"KV + {budget.activation_bytes / MIB:.1f} MiB activations + "
          f"{(1 - budget.memory_ratio) * 100:.0f}% margin: {left / MIB:.1f} MiB left "
          "beside the slots")  # fmt: skip
    p.say(f"peak {peak / MIB:.1f} MiB ({'reserved' if a.device == 'cuda' else 'live'}; "
          f"through the load and graph capture {(peak_load or 0) / MIB:.1f} MiB), "
          f"{before / MIB:.1f} MiB before the slots, {(after_load or 0) / MIB:.1f} MiB after "
          "the load")  # fmt: skip
    p.check(beside <= left,
            f"peak beside the slots {beside / MIB:.1f} MiB <= {left / MIB:.1f} MiB the "
            f"budget left ({100 * beside / max(left, 1):.0f}%)")  # fmt: skip
    if a.device == "cuda":
        free_now, total = torch.cuda.mem_get_info()
        other = total - free_now - torch.cuda.memory_reserved()
        p.say(f"now {free_now / MIB:.0f} MiB free; outside torch's allocator (context, "
              f"graphs, modules): {other / MIB:.0f} MiB")  # fmt: skip


def probe_memory(a: argparse.Namespace, p: Probe) -> None:
    d = mid(a)
    mem = DeviceBytes(a)
    seen: dict[str, Any] = {}
    ballast = None
    if a.device == "cuda":
        # a small card: context, cuBLAS and allocator warmed up, then a ballast leaves
        # free_mib free, so the default slot count is bound by the budget (not every expert)
        x = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
        (x @ x).sum().item()
        free = torch.cuda.mem_get_info()[0]
        ballast = torch.empty(max(0, free - a.free_mib * MIB), dtype=torch.uint8, device="cuda")
        torch.cuda.reset_peak_memory_stats()
        p.say(f"ballast {ballast.numel() >> 20} MiB: {torch.cuda.mem_get_info()[0] >> 20} MiB free")
    elif a.device == "standin":
        p.note("standin: no device memory, the budget is not checked (flow only)")
    graphs = a.device == "cuda"
    with p.part(f"offload, default slots, graphs {'on' if graphs else 'off'}, batch-8 decode"):
        # the fake card: 560 MiB, 48 of them usable (what the simulated context leaves)
        fake = {"vram_mib": a.vram_mib or 560} if a.device == "fake-cuda" else {}
        with spy_slot_sizing(seen, mem):
            llm = make_llm(a, d, "offload", max_model_len=1024, max_batch=8, cuda_graphs=graphs,
                           **fake)  # fmt: skip
        try:
            with llm._device_scope():  # (the fake card's tensors are read in its session)
                _memory_report(a, p, llm, seen, mem)
        finally:
            close(llm)
            del ballast


# ---- the VRAM watcher against the real allocator -------------------------------------------
def _nvml_free(a: argparse.Namespace, p: Probe) -> Callable[[], int] | None:
    """NVML's free bytes of the device torch uses (by UUID, as the daemon's watcher reads
    it), or None (noted) without pynvml or a driver."""
    from freetokend.experts.vram_watch import nvml_reader

    uuid = None
    if a.device == "cuda":
        uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
        uuid = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
    read, why = nvml_reader(uuid)
    if read is None:
        p.note(f"NVML {why}: its part is skipped")
        return None
    return lambda: read().free


def probe_vram(a: argparse.Namespace, p: Probe) -> None:
    from freetokend.experts.vram_watch import (
        SlotSizes,
        VramReading,
        VramWatcher,
        torch_unallocated,
    )

    real = a.device == "cuda"
    size = a.alloc_mib * MIB
    sizes = SlotSizes(current=64, target=64, slot_bytes=32 * MIB, min_slots=8)
    with p.part(f"{size // MIB} MiB allocated and freed: torch_unallocated, NVML's free"):
        unallocated = torch_unallocated()
        nvml = _nvml_free(a, p) if real else None
        if not real:
            p.check(unallocated() == 0, f"{a.device}: no CUDA, torch_unallocated reads 0")
            p.note(f"{a.device}: no device memory; the watcher reads a simulated card")
            cached = size  # what a card would show after the free: all of it kept by torch
            free_now = lambda: 2048 * MIB  # noqa: E731
        else:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            # NVML where it answers, else the driver's view through torch (the same count)
            free_now = nvml or (lambda: int(torch.cuda.mem_get_info()[0]))
            base, free0 = unallocated(), free_now()
            block = torch.empty(size, dtype=torch.uint8, device="cuda")
            free1 = free_now()
            del block
            cached, free = unallocated() - base, free_now()
            p.check(abs(cached - size) <= 64 * MIB,
                    f"torch_unallocated()() reads {cached / MIB:.0f} MiB more after the free "
                    f"(of {size // MIB} MiB)")  # fmt: skip
            if nvml is not None:
                drop = free0 - free1
                ok = abs(drop - size) <= 256 * MIB
                p.check(ok, f"NVML's free dropped by {drop / MIB:.0f} MiB at the allocation")
            p.say(f"after the free: {free / MIB:.0f} MiB free ({free0 / MIB:.0f} before the "
                  f"allocation): torch keeps the block, {'NVML' if nvml else 'the driver'} "
                  "counts it used")  # fmt: skip

        def read() -> VramReading:  # as nvml_reader's, on the free bytes read above
            return VramReading(free_now(), 8192 * MIB if not real else torch.cuda.mem_get_info()[1])

        # the low edge just above the free memory the reading shows
        low = read().free + 64 * MIB
        high = low + 2 * size
        p.say(f"band: low {low / MIB:.0f} MiB, high {high / MIB:.0f} MiB; {sizes.current} slots "
              f"of {sizes.slot_bytes // MIB} MiB")  # fmt: skip
        shrunk: list[int] = []
        kw: dict[str, Any] = {} if real else {"unallocated": lambda: cached}
        watcher = VramWatcher(read, lambda: sizes, shrunk.append, low, high, **kw)
        got = watcher.check_once()
        how = "the default, torch_unallocated()" if real else "simulated"
        p.check(got is None and not shrunk,
                f"check_once (unallocated: {how}): no resize ({got}, {shrunk})")  # fmt: skip
        control: list[int] = []
        zero = VramWatcher(read, lambda: sizes, control.append, low, high, unallocated=lambda: 0)
        got = zero.check_once()
        p.check(got is not None and got < sizes.current,
                f"control, unallocated counted 0: check_once shrinks to {got} slots")  # fmt: skip
    if real:
        torch.cuda.empty_cache()  # the next probe (memory) sizes against a clean card
        p.say(f"after empty_cache: {torch.cuda.mem_get_info()[0] / MIB:.0f} MiB free")


# ---- zero-copy after unload / reload -------------------------------------------------------
class FakeCudart:
    """The cudart calls of pinning.py on the CPU (smoke mode): registrations by address, a
    second register of a live one refused (cudaErrorHostMemoryAlreadyRegistered, 712), an
    unregister of none refused (cudaErrorHostMemoryNotRegistered, 713); a refused call leaves
    its error as the last error, as the runtime does, until ``cudaGetLastError`` reads it."""

    def __init__(self) -> None:
        self.live: set[int] = set()
        self.last = 0

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802
        if ptr in self.live:
            self.last = 712
            return 712
        self.live.add(ptr)
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        if ptr not in self.live:
            self.last = 713
            return 713
        self.live.discard(ptr)
        return 0

    def cudaGetLastError(self) -> int:  # noqa: N802
        err, self.last = self.last, 0
        return err


def _cudart_lib() -> Any:
    """The process's loaded libcudart (the one torch uses; pinning.py's pattern, which also
    matches a wheel's hashed copy), for its last-error state; None when none is mapped."""
    from freetokend.runtime import pinning

    path = pinning._mapped_library(pinning.CUDART_NAME)
    if path is None:
        return None
    lib = ctypes.CDLL(path)
    lib.cudaPeekAtLastError.restype = lib.cudaGetLastError.restype = ctypes.c_int
    return lib


def cuda_error_state(p: Probe) -> None:
    """The CUDA error state is clean: nothing pending in the runtime's last-error slot (a
    refused call that nobody cleared fails the next kernel launch check elsewhere), and a
    sync plus a small kernel succeed (a sticky fault from a bad zero-copy read shows here)."""
    lib = _cudart_lib()
    if lib is not None:
        err = int(lib.cudaPeekAtLastError())
        p.check(err == 0, f"cudaPeekAtLastError: {err}")
    else:
        p.note("libcudart not found in the process: the last-error slot is not read")
    torch.cuda.synchronize()
    one = torch.ones(4, device="cuda").add_(1).sum().item()
    p.check(one == 8.0, "a sync and a kernel after: no CUDA error")


def probe_zerocopy(a: argparse.Namespace, p: Probe) -> None:
    from freetokend.experts.devices import create_accelerator
    from freetokend.runtime import pinning

    real = a.device == "cuda"
    cudart = FakeCudart()
    if not real:
        pinning._cudart = lambda: cudart  # type: ignore[assignment]
        p.note(f"{a.device}: a recording cudart, the registry's bookkeeping only")
    with p.part("registry: unload and reload at the same address, the old view still alive"):
        # one host buffer: the second registration is at the first one's address for sure
        buf = torch.empty(64 * MIB, dtype=torch.uint8)
        rows = (16, 1 << 20)  # 16 rows of 2 MiB (bf16)

        def view(fill: float) -> torch.Tensor:
            t = buf[: 32 * MIB].view(torch.bfloat16).view(rows)
            t.copy_(torch.arange(rows[0], dtype=torch.bfloat16)[:, None] + fill)
            return t

        acc = create_accelerator(a.device if real else "standin")
        first = view(1.0)
        if real:
            acc.pin(first)
        else:
            pinning.register(first)
        p.check(pinning.is_registered(first), "first registration")
        p.check(acc.device_fill_ok(first), "zero-copy fill from the first registration")
        if real:
            acc.close()  # model unload: unregistered now, ``first`` not collected yet
        else:
            pinning.unregister(first)
        p.check(not pinning.is_registered(first), "unregistered at unload")
        acc2 = create_accelerator(a.device if real else "standin")
        second = view(2.0)  # the reload: same address
        p.check(second.data_ptr() == first.data_ptr(), "the reload is at the same address")
        if real:
            acc2.pin(second)
        else:
            p.check(pinning.register(second) == 0, "registered again")
        del first
        gc.collect()  # the first registration's finalizer runs now: it must leave the second
        p.check(pinning.is_registered(second), "the stale finalizer left the new registration")
        if not real:
            p.check(second.data_ptr() in cudart.live, "still registered with the driver")
        p.check(acc2.device_fill_ok(second), "zero-copy fill after the reload")
        if real:
            cuda_error_state(p)
            acc2.close()
        else:
            pinning.unregister(second)
        del second
        gc.collect()
    with p.part("LLM: offload, unload (release_device) and load again"):
        from freetokend.manager.models import release_device

        d = tiny(a)
        ps = prompts(2, 20, 97, seed=9)
        addrs, outs, fills = [], [], []
        for _ in range(2):
            llm = make_llm(a, d, "offload", moe_slots=8, max_model_len=128, kv_tokens=512)
            addrs.append(llm.banks.gate_up.data_ptr())
            fills.append(llm.moe.device_fill)
            outs.append(llm.generate(ps, max_tokens=8, ignore_eos=True))
            synchronize(a)
            llm.close()
            release_device(llm)
            del llm
            gc.collect()
        p.say(f"host pool at the same address after the reload: {addrs[0] == addrs[1]}")
        p.check(all(fills), f"zero-copy fills on at both loads: {fills}")
        p.check(outs[0] == outs[1], "the same tokens after the reload")
        if real:
            cuda_error_state(p)


# ---- pinning.py's failed calls leave no CUDA error behind ----------------------------------
class RecordingCudart:
    """pinning.py's runtime (``_cudart()``) with the codes its two calls return recorded; any
    other attribute (``cudaGetLastError`` where the runtime binds one) is the runtime's."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.codes: list[tuple[str, int]] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802
        err = int(self.inner.cudaHostRegister(ptr, size, flags))
        self.codes.append(("register", err))
        return err

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        err = int(self.inner.cudaHostUnregister(ptr))
        self.codes.append(("unregister", err))
        return err

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _device_work(a: argparse.Namespace, p: Probe, what: str) -> None:
    """A torch op (torch checks ``cudaGetLastError`` after its launches), a Triton kernel
    (ftkernels' copy_rows) and a synchronize: none may raise an error left pending."""
    from ftkernels.moe_decode import copy_rows

    dev = "cuda" if a.device == "cuda" else "cpu"
    try:
        x = torch.arange(8 * 16, dtype=torch.float32, device=dev).view(8, 16)
        y = (x * 2).sum()  # the torch op
        dst = torch.zeros(2, 16, device=dev)
        one = torch.ones(1, dtype=torch.int32, device=dev)
        copy_rows(dst, x, one, one * 5, one)  # the Triton kernel: dst[1] <- x[5]
        synchronize(a)
        ok = y.item() == 2 * sum(range(128)) and torch.equal(dst[1].cpu(), x[5].cpu())
        p.check(ok, f"{what}: a torch op, a Triton kernel and a synchronize after: no error")
    except Exception as e:  # noqa: BLE001 - the failure this probe looks for
        p.check(False, f"{what}: device work after raised {type(e).__name__}: {str(e)[:160]}")


def probe_pinerrors(a: argparse.Namespace, p: Probe) -> None:
    from freetokend.runtime import pinning

    real = a.device == "cuda"
    runtime: Any = torch.cuda.cudart() if real else FakeCudart()
    lib = _cudart_lib() if real else None
    if real and lib is None:
        p.note("libcudart not mapped: the runtime's last error is not read")

    def peek() -> int | None:
        if not real:
            return int(runtime.last)
        return None if lib is None else int(lib.cudaPeekAtLastError())

    def error_clear(what: str) -> None:
        err = peek()
        if err is not None:
            p.check(err == 0, f"{what}: the runtime's last error after: {err}")

    get = pinning._loaded_get_last_error()  # what pinning.py clears the last error with
    rec = RecordingCudart(runtime)
    inner = pinning._cudart
    pinning._cudart = lambda: rec  # type: ignore[assignment]
    if not real:
        p.note(f"{a.device}: a recording cudart with a last-error slot, Triton interpreted")
    try:
        with p.part("the runtime's cudaGetLastError, found through ctypes"):
            own = getattr(torch.cuda.cudart(), "cudaGetLastError", None) if real else None
            if real:
                path = pinning._mapped_library(pinning.CUDART_NAME)
                p.check(get is not None, f"ctypes lookup of cudaGetLastError: {path}")
                p.say(f"torch's cudart binds cudaGetLastError itself: {own is not None} "
                      "(pinning.py asks it first)")  # fmt: skip
            else:
                p.say(f"no libcudart on the {a.device}: lookup {get}")
            error_clear("before")
        with p.part("register: the buffer registered behind the registry's back (712)"):
            t = torch.ones(8 * MIB, dtype=torch.uint8)
            ptr, size = t.data_ptr(), t.numel()
            err = int(runtime.cudaHostRegister(ptr, size, pinning.HOST_REGISTER_FLAGS))
            p.check(err == 0, f"cudaHostRegister directly (portable | mapped): {err}")
            try:
                if real and get is not None:
                    _control(p, runtime, get, peek, ptr, size, pinning.HOST_REGISTER_FLAGS)
                got = pinning.register(t)
                p.check(got == 712, f"pinning.register: {got} (712, already registered)")
                p.check(not pinning.is_registered(t), "not taken into the registry")
                error_clear("register")
                _device_work(a, p, "register")
            finally:
                if err == 0:  # the probe's own registration, undone behind the registry too
                    runtime.cudaHostUnregister(ptr)
                if peek() and get is not None:
                    get()  # nothing of the probe's own calls left for the next probe
        with p.part("unregister: the buffer unregistered behind the registry's back (713)"):
            t = torch.ones(8 * MIB, dtype=torch.uint8)
            p.check(pinning.register(t) == 0, "pinning.register: 0")
            err = int(runtime.cudaHostUnregister(t.data_ptr()))
            p.check(err == 0, f"cudaHostUnregister directly: {err}")
            rec.codes.clear()
            pinning.unregister(t)
            p.check(rec.codes == [("unregister", 713)],
                    f"pinning.unregister's call: {rec.codes} (713, not registered)")  # fmt: skip
            p.check(not pinning.is_registered(t), "gone from the registry")
            error_clear("unregister")
            _device_work(a, p, "unregister")
    finally:
        pinning._cudart = inner  # type: ignore[method-assign]


def _control(
    p: Probe,
    runtime: Any,
    get: Callable[[], int],
    peek: Callable[[], int | None],
    ptr: int,
    size: int,
    flags: int,
) -> None:
    """The runtime keeps a refused register's error as the last error and torch's next op
    raises it: what pinning.py clears. Left cleared (by torch's own check or here)."""
    err = int(runtime.cudaHostRegister(ptr, size, flags))
    pending = peek()
    try:
        torch.ones(4, device="cuda").add_(1)
        raised = "nothing"
    except Exception as e:  # noqa: BLE001 - torch's error class for it varies by version
        raised = f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
    if peek():
        get()
    p.say(f"control: a second direct register returns {err}, the last error is then "
          f"{pending}, and torch's next op raises {raised}")  # fmt: skip


# ---- park / unpark -------------------------------------------------------------------------
def probe_park(a: argparse.Namespace, p: Probe) -> None:
    from freetokend.manager.lane import Lane
    from freetokend.manager.models import ResidentModel, host_bytes, park, unpark

    d = tiny(a)
    graphs = a.device == "cuda"
    if not graphs:
        p.note(f"{a.device}: no CUDA graphs (eager decode)")
    for fmt in ("mxfp4", "q8_0"):
        with p.part(f"fused, {fmt} experts, graphs {'on' if graphs else 'off'}: park, unpark"):
            llm = make_llm(a, d, "fused", quantize_experts=fmt, cuda_graphs=graphs,
                           max_model_len=256, kv_tokens=2048)  # fmt: skip
            try:
                if graphs:
                    p.check(llm.runner.graphs is not None, "graphs captured at load")
                ps = prompts(3, 16, llm.config.vocab_size, seed=4)
                want = llm.generate(ps, max_tokens=a.decode, ignore_eos=True)
                model = ResidentModel(fmt, d, llm, Lane(fmt, llm.engine), host_bytes(llm), "fused")
                for cycle in range(2):
                    replays = llm.runner.graphs.replays if graphs else 0
                    used = torch.cuda.memory_allocated() if graphs else 0
                    park(model)
                    if graphs:
                        freed = used - torch.cuda.memory_allocated()
                        p.say(f"cycle {cycle}: parking freed {freed / MIB:.2f} MiB")
                        p.check(freed > 0, f"cycle {cycle}: device memory freed while parked")
                    unpark(model)
                    got = llm.generate(ps, max_tokens=a.decode, ignore_eos=True)
                    p.check(got == want, f"cycle {cycle}: the same tokens after unpark")
                    if graphs:
                        g = llm.runner.graphs
                        p.check(g is not None and g.replays > replays,
                                f"cycle {cycle}: graphs replayed after unpark "
                                f"({replays} -> {g.replays if g else 0})")  # fmt: skip
            finally:
                close(llm)


# ---- hybrid: split below 1, overlap timeline -----------------------------------------------
class Clock:
    """Host-clock times of device work: CUDA events on the compute stream, placed on the host
    clock through one reference event recorded on an idle device; on the stand-in (its "device"
    work runs on the calling thread) ``perf_counter`` itself."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        if cuda:
            torch.cuda.synchronize()
            self.ref = torch.cuda.Event(enable_timing=True)
            self.t0 = time.perf_counter()
            self.ref.record()

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def seconds(self, m: Any) -> float:
        return m if not self.cuda else self.t0 + self.ref.elapsed_time(m) / 1e3


class Timeline:
    """Per MoE layer call of a decode step: the CPU share's span (in the CPU branch's thread,
    inputs landed to result) and the GPU share's (the compute stream from the layer's fills to
    its expert output, before the join), recorded by wrapping the backend's methods on the
    instance. The branch is one worker: its calls come in the order of the layer calls."""

    def __init__(self, be: Any, clock: Clock) -> None:
        self.be, self.clock, self.on = be, clock, False
        self.calls: list[dict[str, Any]] = []  # layer, gpu start and end marks
        self.cpu: list[tuple[float, float, bool]] = []  # (start, end, had routes)
        decode, fill, cpu_part = be._decode, be._fill, be._cpu_part
        to_host = be.acc.to_host

        def _decode(layer: int, *args: Any) -> torch.Tensor:
            if self.on:
                self.calls.append({"layer": layer})
            return decode(layer, *args)

        def _fill(plan: Any) -> Any:
            if self.on and self.calls:
                self.calls[-1].setdefault("start", self.clock.mark())
            return fill(plan)

        def _to_host(t: torch.Tensor, device: torch.device) -> torch.Tensor:
            out = to_host(t, device)  # the layer's device output, right before the join
            if self.on and self.calls:
                self.calls[-1]["end"] = self.clock.mark()
            return out

        def _cpu_part(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            t0 = time.perf_counter()
            out = cpu_part(x, ids, w)
            if self.on:  # ids on the host here: reading them waits for nothing
                self.cpu.append((t0, time.perf_counter(), bool((ids >= 0).any())))
            return out

        be._decode, be._fill, be._cpu_part, be.acc.to_host = _decode, _fill, _cpu_part, _to_host

    def spans(self) -> list[dict[str, Any]]:
        out = []
        for call, (c0, c1, routes) in zip(self.calls, self.cpu, strict=False):
            if "start" not in call or "end" not in call:
                continue
            g0, g1 = self.clock.seconds(call["start"]), self.clock.seconds(call["end"])
            overlap = max(0.0, min(c1, g1) - max(c0, g0))
            out.append(dict(layer=call["layer"], gpu=(g0, g1), cpu=(c0, c1), routes=routes,
                            overlap=overlap))  # fmt: skip
        return out


def write_trace(path: Path, spans: list[dict[str, Any]]) -> None:
    """A Chrome trace (chrome://tracing, Perfetto): one row for each share."""
    t0 = min(min(s["gpu"][0], s["cpu"][0]) for s in spans)
    ev = []
    for s in spans:
        for tid, key in (("GPU share (compute stream)", "gpu"), ("CPU share (branch)", "cpu")):
            a, b = s[key]
            ev.append({"name": f"MoE layer {s['layer']}", "ph": "X", "pid": 1, "tid": tid,
                       "ts": (a - t0) * 1e6, "dur": max(0.0, b - a) * 1e6,
                       "args": {"overlap_us": s["overlap"] * 1e6, "cpu_routes": s["routes"]}})  # fmt: skip
    path.write_text(json.dumps({"traceEvents": ev, "displayTimeUnit": "ms"}))


def teacher_forced(llm: Any, prompt: list[int], tokens: list[int]) -> list[torch.Tensor]:
    """Logits of the prompt's last position, then of each decode step feeding ``tokens``."""
    from freetokend.engine.runner import Work

    r = llm.runner
    st = r.new_state()
    out = []
    try:
        out.append(r.placement.fetch(r.forward([Work(st, list(prompt))])).float()[-1])
        for t in tokens[:-1]:
            out.append(r.placement.fetch(r.forward([Work(st, [t])])).float()[-1])
    finally:
        r.release(st)
    return out


def probe_hybrid(a: argparse.Namespace, p: Probe) -> None:
    d = mid(a)
    prompt = prompts(1, 32, 97, seed=12)[0]
    kw: dict[str, Any] = dict(max_model_len=256, kv_tokens=1024, cpu_bf16_dot=False)
    with p.part("fused: greedy tokens and teacher-forced logits (the reference)"):
        fused = make_llm(a, d, "fused", **kw)
        tokens = fused.generate(prompt, max_tokens=a.decode, ignore_eos=True)
        ref = teacher_forced(fused, prompt, tokens)
        close(fused)
        del fused
        gc.collect()
    if len(ref) != a.decode:
        return
    with p.part("hybrid, E slots, B_P / B_H = 1/4: the same logits, CPU and GPU shares overlap"):
        from freetokend.engine.runner import Work
        from freetokend.models.config_hf import read_config

        e = read_config(d).num_experts
        llm = make_llm(a, d, "hybrid", moe_slots=e, bandwidth=(1.0, 4.0), **kw)
        try:
            be = llm.moe
            st = llm.runner.new_state()  # a warm-up step (kernel compiles, staging buffers)
            llm.runner.forward([Work(st, prompt[:8][::-1])])
            llm.runner.forward([Work(st, [3])])
            llm.runner.release(st)
            synchronize(a)
            tl = Timeline(be, Clock(a.device == "cuda"))
            runner_forward = llm.runner.forward

            def forward(work: list[Any]) -> torch.Tensor:  # only decode steps are timed
                tl.on = all(len(w.tokens) == 1 for w in work)
                try:
                    return runner_forward(work)
                finally:
                    tl.on = False

            llm.runner.forward = forward
            got = teacher_forced(llm, prompt, tokens)
            synchronize(a)
            ok, text = compare(torch.stack(got), torch.stack(ref))
            p.check(ok, f"{len(got)} teacher-forced steps: {text}")
            out = llm.generate(prompt, max_tokens=a.decode, ignore_eos=True)
            p.say(f"hybrid's greedy tokens are fused's: {out == tokens}")
            c, stats = be.counters, be.cache.stats()
            p.check(c["cpu_routes"] > 0 and c["gpu_routes"] > 0 and stats["fills"] > 0,
                    f"routes: {c['gpu_routes']} GPU, {c['cpu_routes']} CPU; cache {stats}")  # fmt: skip
            spans = tl.spans()
            busy = [s for s in spans if s["routes"]]
            over = [s for s in busy if s["overlap"] > 0]
            cpu_t = sum(s["cpu"][1] - s["cpu"][0] for s in busy)
            gpu_t = sum(s["gpu"][1] - s["gpu"][0] for s in busy)
            ov_t = sum(s["overlap"] for s in busy)
            p.say(f"timeline: {len(spans)} MoE layer calls, {len(busy)} with CPU routes; CPU "
                  f"share {cpu_t * 1e3:.2f} ms, GPU share {gpu_t * 1e3:.2f} ms, overlapping "
                  f"{ov_t * 1e3:.2f} ms in {len(over)} of them")  # fmt: skip
            for s in busy[:6]:
                t0 = min(s["gpu"][0], s["cpu"][0])
                p.say(f"  layer {s['layer']}: GPU {1e3 * (s['gpu'][0] - t0):7.3f} .. "
                      f"{1e3 * (s['gpu'][1] - t0):7.3f} ms, CPU {1e3 * (s['cpu'][0] - t0):7.3f}"
                      f" .. {1e3 * (s['cpu'][1] - t0):7.3f} ms")  # fmt: skip
            if spans:
                a.out.mkdir(parents=True, exist_ok=True)
                write_trace(a.out / "hybrid_trace.json", spans)
                p.say(f"Chrome trace: {a.out / 'hybrid_trace.json'}")
            if a.device == "cuda":
                p.check(len(busy) > 0 and 2 * len(over) >= len(busy),
                        f"the CPU share overlaps the GPU share in {len(over)} of {len(busy)} "
                        "layer calls with CPU routes")  # fmt: skip
            else:
                p.note(f"{a.device}: the overlap is reported, not checked")
        finally:
            close(llm)


# ---- the slot-cache kernel under a long decode -----------------------------------------------
def _slot_mismatches(want: Any, got: Any, ref: Any, ker: Any) -> list[str]:
    """The plan's and the state's tensors that differ (one host read for all of them)."""
    pairs = [(f"plan.{k}", v, getattr(got, k)) for k, v in vars(want).items()]
    pairs += [(f"state.{k}", v, getattr(ker, k)) for k, v in vars(ref).items()]
    bad = [name for name, x, y in pairs if x.shape != y.shape]
    same = [(name, x, y) for name, x, y in pairs if x.shape == y.shape]
    flags = torch.stack([(x != y).any() for _, x, y in same]).tolist()
    return bad + [name for (name, _, _), f in zip(same, flags, strict=True) if f]


def probe_slotstress(a: argparse.Namespace, p: Probe) -> None:
    from freetokend.experts.slot_cache import EvictionPolicy, SlotCache, decode_step_reference

    start = time.perf_counter()
    real = a.device == "cuda"
    dev = "cuda" if real else "cpu"
    # Qwen3-30B-A3B: 48 MoE layers of 128 experts, top-8; the two caches kernels_at_scale.py
    # checks (compiled there already: the same constants); the stand-in interprets the kernel
    if real:
        layers, experts, k, batches = 48, 128, 8, (1, 2, 3, 4, 8, 16, 64)
        cases = [(2000, EvictionPolicy.AGED_FREQ), (6144, EvictionPolicy.LRU)]
    else:
        layers, experts, k, batches = 4, 8, 2, (1, 2, 3)
        cases = [(6, EvictionPolicy.AGED_FREQ), (20, EvictionPolicy.LRU)]
        p.note(f"{a.device}: small caches, the kernel in the Triton interpreter")
    for i, (slots, policy) in enumerate(cases):
        # each case may run until its share of the budget has passed (the first: half)
        until = start + a.budget * (i + 1) / len(cases)
        what = f"{slots} slots, {policy.name}"
        if time.perf_counter() >= until:
            p.check(False, f"{what}: not started, the {a.budget:.0f} s budget is spent")
            continue
        with p.part(f"{what}: up to {a.steps} decode steps, kernel against the reference"):
            g = torch.Generator().manual_seed(slots)
            ref = SlotCache(layers, experts, slots, policy, device=dev)
            ker = SlotCache(layers, experts, slots, policy, device=dev, force_kernel=True)
            for c in (ref, ker):
                c.set_fill_policy(11.8, 47.5)  # q* below m: misses left to the CPU too
            ran, bad, t0, first = 0, None, time.perf_counter(), 0.0
            while ran < a.steps and (ran == 0 or time.perf_counter() < until):
                tokens = batches[int(torch.randint(len(batches), (1,), generator=g))]
                layer = int(torch.randint(layers, (1,), generator=g))
                ids = torch.randint(0, experts, (tokens, k), generator=g, dtype=torch.int32)
                ids += layer * experts
                pad = torch.rand(tokens, k, generator=g) < 0.05  # a few routes ignored (-1)
                ids = torch.where(pad, -1, ids).to(dev)
                want = decode_step_reference(ref.state, ids, layer, experts, policy)
                got = ker.decode_step(ids, layer)
                diff = _slot_mismatches(want, got, ref.state, ker.state)
                ran += 1
                if ran == 1:
                    first = time.perf_counter() - t0  # the kernel's compile (or cache load)
                if diff:
                    bad = f"step {ran}: {tokens} tokens, layer {layer}: {', '.join(diff)}"
                    break
            took = time.perf_counter() - t0
            per = (took - first) / max(1, ran - 1) * 1e3
            p.say(f"{what}: {ran} steps in {took:.1f} s (first {first:.1f} s, then "
                  f"{per:.2f} ms a step); stats {ker.stats()}")  # fmt: skip
            p.check(bad is None,
                    f"{what}: {ran} of {a.steps} steps, plan and state equal to the reference"
                    + (f"; differs at {bad}" if bad else ""))  # fmt: skip
            if bad is None and ran < a.steps:
                p.note(f"{what}: {ran} of {a.steps} steps within the budget")


PROBES: dict[str, Callable[[argparse.Namespace, Probe], None]] = {
    "sync": probe_sync,
    "copylist": probe_copylist,
    "prefill": probe_prefill,
    "tiny-run": probe_tiny_run,
    "vram": probe_vram,
    "memory": probe_memory,
    "pinerrors": probe_pinerrors,
    "zerocopy": probe_zerocopy,
    "park": probe_park,
    "hybrid": probe_hybrid,
    "slotstress": probe_slotstress,
}
FAKE_CUDA = ("sync", "memory", "tiny-run")  # the probes the fake card can stand in for


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("probe", nargs="+", choices=[*PROBES, "smoke"],
                    help="one or more, run in this order in one process")  # fmt: skip
    ap.add_argument("--device", default="cuda", choices=["cuda", "standin", "fake-cuda"])
    ap.add_argument("--work", type=Path, default=Path("/tmp/ft-gpu-probes"),
                    help="where the test checkpoints are written (once)")  # fmt: skip
    ap.add_argument("--out", type=Path, default=Path("/tmp/ft-gpu-check"),
                    help="where files of the probes go (hybrid_trace.json)")  # fmt: skip
    ap.add_argument("--prompt", type=int, help="prefill: prompt tokens (2048; standin 256)")
    ap.add_argument("--repeats", type=int, default=5, help="prefill: prompts")
    ap.add_argument("--decode", type=int, help="decode tokens a sequence (16; standin 6)")
    ap.add_argument("--long-decode", type=int, help="memory: batch-8 decode (448; standin 8)")
    ap.add_argument("--free-mib", type=int, default=480, help="memory: the card's free MiB")
    ap.add_argument("--vram-mib", type=int,
                    help="fake-cuda: the simulated card (1024; memory: 560)")  # fmt: skip
    ap.add_argument("--sleep-cycles", type=int, default=100_000_000,
                    help="copylist: the copy stream's stall (GPU cycles, ~50 ms)")  # fmt: skip
    ap.add_argument("--alloc-mib", type=int, default=4096, help="vram: the block allocated")
    ap.add_argument("--steps", type=int, help="slotstress: decode steps a cache (1000; standin 8)")
    ap.add_argument("--budget", type=float, default=60.0,
                    help="slotstress: no step starts this many seconds after it began")  # fmt: skip
    a = ap.parse_args()
    cuda = a.device == "cuda"
    a.prompt = a.prompt or (2048 if cuda else 256)
    a.decode = a.decode or (16 if cuda else 6)
    a.long_decode = a.long_decode or (448 if cuda else 8)
    a.steps = a.steps or (1000 if cuda else 8)
    if cuda and not torch.cuda.is_available():
        sys.exit("probes: no CUDA device (use --device standin for the CPU smoke run)")
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    names = [n for x in a.probe for n in (PROBES if x == "smoke" else [x])]
    if a.device == "fake-cuda":
        names = [n for n in names if n in FAKE_CUDA]
    worst = 0
    done: list[Probe] = []
    for name in names:
        print(f"== {name} ({a.device})", flush=True)
        t0 = time.perf_counter()
        p = Probe(name)
        with p.part(name):
            PROBES[name](a, p)
        p.name = f"{name} ({a.device})"
        worst = max(worst, p.verdict())
        p.name = name
        done.append(p)
        print(f"   {name}: {time.perf_counter() - t0:.1f} s", flush=True)
    if len(done) > 1:  # the step's verdict: every probe's, the failed ones first
        failed = [f"FAIL {p.name}: {'; '.join(p.failures)[:150]}" for p in done if p.failures]
        passed = [p.name for p in done if not p.failures]
        notes = sum(len(p.notes) for p in done)
        text = "; ".join(failed + ([f"PASS {', '.join(passed)}"] if passed else []))
        tail = f" [{notes} note(s) above]" if notes else ""
        print(f"VERDICT: {text} ({a.device}){tail}")
    sys.exit(worst)


if __name__ == "__main__":
    main()
