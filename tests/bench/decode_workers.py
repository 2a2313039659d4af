"""One measurement per process: memory-read bandwidth, or one engine's prefill and decode speed.

    python decode_workers.py KIND '{"model": ..., "threads": 2, ...}'

KIND is membw, freetoken, hf or llama.cpp. Prints one line `RESULT {json}`. Every engine gets
the same treatment: a warm-up generation (page faults, allocator, thread pools), then `repeats`
rounds of (a) a prefill of `prefill_tokens` prompt tokens producing one token and (b) a decode of
`decode_tokens` tokens after a `prompt_tokens` prompt, each with a fresh random prompt so no
prompt cache helps. Decode speed is (tokens - 1) / (time of last token - time of first token):
pure decode steps, the prefill that produced the first token left out; the median repeat counts.
Each decode is bracketed by two short reads of the machine's memory bandwidth (_read_probe),
reported beside it: on a shared VM the bandwidth moves between two levels minutes apart, and
bench_decode compares the engines within each level (decode_report.spell_lines).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

# Stamps of each produced token, for one generation: prefill ends at the first.
GenFn = Callable[[list[int], int], list[float]]
GREEDY_TOKENS = 16  # greedy tokens compared between engines
# prompt tokens whose logits each engine writes (``logits_out``): compared position by position
# on the same input (teacher-forced), so one near-tie does not part every later token
LOGITS_TOKENS = 48


def _prompts(vocab: int, seed: int) -> Iterator[list[int]]:
    import random

    rng = random.Random(seed)
    while True:
        yield [rng.randrange(vocab - 1) for _ in range(4096)]


def _measure(
    gen: GenFn,
    prefill_fn: Callable[[list[int]], float],
    a: dict[str, Any],
    greedy: Callable[[list[int], int], list[int]] | None = None,
    logits: Callable[[list[int]], Any] | None = None,
) -> dict[str, Any]:
    """Medians over `repeats`; `greedy` (when the engine exposes tokens): the greedy tokens of a
    fixed prompt, for the agreement check between engines; `logits` (likewise): every
    position's logits [T, vocab] of a fixed prompt, saved to ``a["logits_out"]`` (.npy) when
    the caller asks."""
    import statistics

    fixed = next(_prompts(int(a["vocab"]), 11))
    tokens = greedy(fixed[:16], GREEDY_TOKENS) if greedy else None
    extra: dict[str, Any] = {}
    if logits is not None and a.get("logits_out"):
        import numpy as np

        np.save(a["logits_out"], np.asarray(logits(fixed[:LOGITS_TOKENS]), dtype=np.float32))
        extra["logits_file"] = a["logits_out"]
    prompts = _prompts(int(a["vocab"]), 7)
    gen(next(prompts)[: a["prompt_tokens"]], 4)  # warm-up
    prefill_fn(next(prompts)[: a["prefill_tokens"]])
    probe = _read_probe(int(a["threads"]))
    load = os.getloadavg()[0]  # the machine may be shared: reported beside the figures
    decode, prefill, bandwidth = [], [], []
    for _ in range(a["repeats"]):
        secs = prefill_fn(next(prompts)[: a["prefill_tokens"]])
        prefill.append(a["prefill_tokens"] / secs)
        before = probe()
        stamps = gen(next(prompts)[: a["prompt_tokens"]], a["decode_tokens"])
        bandwidth.append([before, probe()])
        assert len(stamps) == a["decode_tokens"], (len(stamps), a["decode_tokens"])
        decode.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
    return {
        "decode_tok_s": statistics.median(decode),
        "prefill_tok_s": statistics.median(prefill),
        "greedy": tokens,
        "decode_all": decode,
        "decode_bw": bandwidth,  # read bytes/s just before and just after each decode
        "prefill_all": prefill,
        "load": max(load, os.getloadavg()[0]),
        **extra,
    }


# ---- memory bandwidth ---------------------------------------------------------------------------
def _read_probe(threads: int) -> Callable[[], float]:
    """A short read-bandwidth measurement to take beside an engine's decode: the best 16 MiB
    slice of one pass over 256 MiB (as membw's, ~10 ms), on `threads` torch threads. Each call
    then sleeps 20 ms so that torch's OpenMP workers, which spin a while after a region, are
    asleep before the engine runs again."""
    import torch

    slices = _slices(256 << 20)  # 16 slices, so each read comes from DRAM

    def probe() -> float:
        prev = torch.get_num_threads()
        torch.set_num_threads(threads)
        got = _best_read(slices, 1)
        torch.set_num_threads(prev)
        time.sleep(0.02)
        return got

    probe()  # the first pass finds the slices written by ones() in cache
    return probe


_SLICE = 16 << 20  # bytes read by one timed sum


def _slices(nbytes: int) -> list[Any]:
    """``nbytes`` of fp32 ones in 2 MiB huge pages where the kernel gives them, as 16 MiB slices."""
    import torch

    from freetokend.models.hugepages import back_with_huge_pages

    x = torch.ones(nbytes // 4, dtype=torch.float32)
    back_with_huge_pages([x])
    n = _SLICE // 4
    return [x[i : i + n] for i in range(0, x.numel(), n)]


def _best_read(slices: list[Any], passes: int) -> float:
    """Bytes/s of the fastest slice sum over ``passes`` passes through ``slices``."""
    best = float("inf")
    for _ in range(passes):
        for s in slices:
            t0 = time.perf_counter()
            s.sum()
            best = min(best, time.perf_counter() - t0)
    return _SLICE / best


def membw(a: dict[str, Any]) -> dict[str, Any]:
    """Read bandwidth of fp32 sums over 16 MiB slices of a 1 GiB tensor with `threads` torch
    threads, best slice of 8 passes: short reads, so some run undisturbed on a shared machine (a
    long sum never does), each from DRAM (a slice comes back after 1 GiB of others). The tensor
    sits in 2 MiB huge pages where the kernel gives them (models/hugepages.py, as freetoken's
    weights; llama.cpp's mmap of its file gets large page-cache folios): on this kind of VM a
    read of 4 KiB pages measured 48.7 GB/s against 59.5 GB/s (2 threads, medians of 7), so a
    4 KiB ceiling could sit below what an engine reads. A plain sum was the fastest torch
    reduction measured (amax, dot, column sums: 4-10 GB/s)."""
    import torch

    torch.set_num_threads(a["threads"])
    return {"read_bytes_s": _best_read(_slices(1 << 30), 8)}


# ---- freetoken ----------------------------------------------------------------------------------
def force_isa(isa: str) -> None:
    """Every freetoken kernel of LLMs made after this call on the ``isa`` path ("avx2",
    "avx512", "scalar"), as on a CPU that has no more (bench_decode's and profile_decode's
    --isa)."""
    from freetokend.engine import build
    from freetokend.native import dense_native

    def forced(bf16_dot: bool, threads: int | None) -> str:
        dense_native.configure(threads, isa=isa)  # projections and integer dots
        return isa  # the float expert executor's path

    build.cpu_isa = forced  # what LLM's build asks for its CPU kernels' path


def freetoken(a: dict[str, Any]) -> dict[str, Any]:
    import torch

    from freetokend import LLM
    from freetokend.engine.sampler import SamplingParams

    torch.set_num_threads(a["threads"])
    if a.get("isa"):  # every kernel on one path (bench_decode's --isa), as on a CPU with no more
        force_isa(str(a["isa"]))
    llm = LLM(
        a["gguf"] if a.get("load_gguf") else a["model"],  # llama.cpp's file itself, or ours
        moe_backend="cpu",
        threads=a["threads"],
        max_model_len=4096,
        quantize_experts=a.get("quantize_experts"),
        quantize=a.get("quantize"),
        cpu_bf16_dot=bool(a.get("cpu_bf16_dot", True)),  # LLM's default
    )
    ids = iter(range(1 << 30))

    def gen(prompt: list[int], n: int) -> list[float]:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        llm.engine.add_request(f"bench-{next(ids)}", prompt, params)
        stamps = []
        while llm.engine.has_unfinished():
            for _ in llm.engine.step():
                stamps.append(time.perf_counter())
        return stamps

    def prefill(prompt: list[int]) -> float:
        t0 = time.perf_counter()
        stamps = gen(prompt, 1)
        return stamps[0] - t0

    out = _measure(
        gen,
        prefill,
        a,
        lambda p, n: llm.generate(p, n, ignore_eos=True),
        lambda p: llm.logits(p).numpy(),
    )
    out["isa"] = getattr(getattr(llm.moe, "executor", None), "isa", "torch")
    out["isa"] = f"{out['isa']}, dense {llm.cpu_isa}"
    if a.get("load_gguf"):  # how one token reads the interleaved GGUF rows (row_tasks.h)
        from freetokend.native import dense_native

        out["isa"] = f"{out['isa']}, x8 {dense_native._native.x8_streams()}"
    if a.get("quantize"):  # the dense layers' integer-dot path
        from freetokend.native import qlinear_native

        out["isa"] = f"{out['isa']}, dense qdot {qlinear_native.configured_isa()}"
    out["bytes_per_token"] = _freetoken_bytes_per_token(llm)
    return out


def _freetoken_bytes_per_token(llm: Any) -> int:
    """Weight bytes one decoded token reads, measured from the loaded tensors: every projection
    (quantized blocks or float weight, lm_head included) and top-k experts of every MoE layer
    (the router is a projection; norms and the one embedding row are left out)."""
    from freetokend.models.layers.common import Linear

    dense = 0
    for mod in llm.model.modules():
        if isinstance(mod, Linear):
            w = mod.qweight.raw if mod.qweight is not None else mod.weight
            dense += w.numel() * w.element_size()
    cfg = llm.config
    moe_layers = llm.banks.gate_up.shape[0] // cfg.num_experts
    experts = llm.banks.nbytes_per_expert() * cfg.top_k * moe_layers
    return int(dense + experts)


# ---- HF transformers ----------------------------------------------------------------------------
def hf(a: dict[str, Any]) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    torch.set_num_threads(a["threads"])
    model = AutoModelForCausalLM.from_pretrained(a["model"], dtype=torch.bfloat16)
    model.eval()

    class Stamps(BaseStreamer):
        def __init__(self) -> None:
            self.t: list[float] = []

        def put(self, value: Any) -> None:
            self.t.append(time.perf_counter())

        def end(self) -> None:
            pass

    @torch.inference_mode()
    def gen(prompt: list[int], n: int) -> list[float]:
        s = Stamps()
        ids = torch.tensor([prompt])
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            streamer=s,
            pad_token_id=0,
        )
        return s.t[1:]  # the first put is the prompt

    @torch.inference_mode()
    def prefill(prompt: list[int]) -> float:
        t0 = time.perf_counter()
        model(torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
        return time.perf_counter() - t0

    return _measure(gen, prefill, a)


# ---- llama.cpp ----------------------------------------------------------------------------------
def llama_cpp(a: dict[str, Any]) -> dict[str, Any]:
    from llama_cpp import Llama

    n_ctx = max(a["prefill_tokens"], a["prompt_tokens"] + a["decode_tokens"]) + 16
    llm = Llama(
        model_path=a["gguf"],
        n_ctx=n_ctx,
        n_batch=a["prefill_tokens"],
        n_ubatch=a["prefill_tokens"],
        n_threads=a["threads"],
        n_threads_batch=a["threads"],
        verbose=False,
    )

    def gen(prompt: list[int], n: int) -> list[float]:
        llm.reset()
        stamps = []
        for _ in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            stamps.append(time.perf_counter())
            if len(stamps) == n:
                break
        return stamps

    def prefill(prompt: list[int]) -> float:
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        return time.perf_counter() - t0

    def greedy(prompt: list[int], n: int) -> list[int]:
        llm.reset()
        out: list[int] = []
        for tok in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            out.append(int(tok))
            if len(out) == n:
                break
        return out

    def logits(prompt: list[int]) -> Any:
        # a context of its own: logits_all on the measured one would compute lm_head for every
        # prefill token. The file is mapped again, not read again.
        import numpy as np

        ctx = Llama(
            model_path=a["gguf"],
            n_ctx=len(prompt) + 16,
            n_threads=a["threads"],
            n_threads_batch=a["threads"],
            logits_all=True,
            verbose=False,
        )
        ctx.eval(prompt)
        out = np.array(ctx.scores[: len(prompt)], dtype=np.float32)
        ctx.close()
        return out

    return _measure(gen, prefill, a, greedy, logits)


WORKERS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "membw": membw,
    "freetoken": freetoken,
    "hf": hf,
    "llama.cpp": llama_cpp,
}


def main() -> None:
    kind, args = sys.argv[1], json.loads(sys.argv[2])
    os.environ.setdefault("OMP_NUM_THREADS", str(args["threads"]))
    result = WORKERS[kind](args)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
