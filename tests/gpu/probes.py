"""The GPU probes of tests/gpu/check.sh, one subcommand each: what the CPU tiers (DESIGN §7) cannot
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
  smoke     every probe above in turn, in this process (for ``--device standin``)

``--device cuda`` (default) is the real thing. ``--device standin`` runs the same code paths on
the CPU stand-in accelerator, smaller models and fewer tokens, with the device-only checks
marked n/a: API mistakes show without a GPU. ``--device fake-cuda`` (sync, memory): the fake CUDA
card of DESIGN §7, its sync counter and its device bytes in place of the real ones.

    python tests/gpu/probes.py PROBE [--device cuda|standin|fake-cuda] [--work DIR] [--out DIR]
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
    from freetokend.models.config import ModelConfig

    # offload: as many slots as a layer has experts (of all layers'), so decode fills from the
    # host every few steps, and never more routes than slots (a route to the CPU: a sync)
    slots = None if backend == "fused" else ModelConfig.from_hf(d).num_experts
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
        from freetokend.models.config import ModelConfig

        e = ModelConfig.from_hf(d).num_experts
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

    def sized(banks: Any, acc: Any, num_experts: int, budget: Any) -> int:
        if acc.name == "fake-cuda":
            mem.tracker = acc.tracker
        info = acc.mem_get_info()
        seen.update(info=info, budget=budget, slot=banks.nbytes_per_expert(),
                    flat=banks.num_flat, before=mem.now())  # fmt: skip
        seen["n"] = n = inner(banks, acc, num_experts, budget)
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


# ---- zero-copy after unload / reload -------------------------------------------------------
class FakeCudart:
    """The two cudart calls of pinning.py on the CPU (smoke mode): registrations by address,
    a second register of a live one refused (cudaErrorHostMemoryAlreadyRegistered, 712), an
    unregister of none refused (cudaErrorHostMemoryNotRegistered, 713)."""

    def __init__(self) -> None:
        self.live: set[int] = set()

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802
        if ptr in self.live:
            return 712
        self.live.add(ptr)
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        if ptr not in self.live:
            return 713
        self.live.discard(ptr)
        return 0


def _cudart_lib() -> Any:
    """The process's loaded libcudart (the one torch uses), for its last-error state."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split()[-1] if len(line.split()) >= 6 else ""
        if "libcudart.so" in path:
            return ctypes.CDLL(path)
    return None


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
    from freetokend.experts import pinning
    from freetokend.experts.accelerator import create_accelerator

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
        from freetokend.models.config import ModelConfig

        e = ModelConfig.from_hf(d).num_experts
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


PROBES: dict[str, Callable[[argparse.Namespace, Probe], None]] = {
    "sync": probe_sync,
    "prefill": probe_prefill,
    "tiny-run": probe_tiny_run,
    "memory": probe_memory,
    "zerocopy": probe_zerocopy,
    "park": probe_park,
    "hybrid": probe_hybrid,
}
FAKE_CUDA = ("sync", "memory", "tiny-run")  # the probes the fake card can stand in for


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("probe", choices=[*PROBES, "smoke"])
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
    a = ap.parse_args()
    cuda = a.device == "cuda"
    a.prompt = a.prompt or (2048 if cuda else 256)
    a.decode = a.decode or (16 if cuda else 6)
    a.long_decode = a.long_decode or (448 if cuda else 8)
    if cuda and not torch.cuda.is_available():
        sys.exit("probes: no CUDA device (use --device standin for the CPU smoke run)")
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    names = list(PROBES) if a.probe == "smoke" else [a.probe]
    if a.device == "fake-cuda":
        names = [n for n in names if n in FAKE_CUDA]
    worst = 0
    for name in names:
        print(f"== {name} ({a.device})", flush=True)
        t0 = time.perf_counter()
        p = Probe(f"{name} ({a.device})")
        with p.part(name):
            PROBES[name](a, p)
        worst = max(worst, p.verdict())
        print(f"   {name}: {time.perf_counter() - t0:.1f} s", flush=True)
    sys.exit(worst)


if __name__ == "__main__":
    main()
