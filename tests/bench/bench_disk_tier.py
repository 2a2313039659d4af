"""Disk tier benchmark (issue 45): a model larger than the memory it may use, freetoken's disk
tier against llama.cpp with plain mmap, in memory cgroups.

    PYTHONPATH=... .venv/bin/python tests/bench/bench_disk_tier.py [--layers 11] [--repeats 3]
        [--limits 0.5,0.25] [--decode 16] [--prompt 8] [--cache-mb 0] [--timeout 300]
        [--engines freetoken,llama.cpp,resident]

The file: Qwen3-30B-A3B's layer geometry (hidden 2048, 128 experts of 768, top-8) in llama.cpp's
Q4_K_M mix, ``--layers`` layers (11: 4.27 GB), random weights, built once and cached by
bench_gguf_startup.build (under /tmp/ftbench-startup). Each run is a fresh child process in a
memory cgroup limited to a share of the file's size (cgroup v1 ``memory.limit_in_bytes`` or v2
``memory.max``: the page cache counts), the page cache dropped before it (``echo 3 >
/proc/sys/vm/drop_caches``; root only: skipped with the reason otherwise). Engines interleave,
figures are medians over ``--repeats`` runs:

- freetoken: ``LLM(file, "cpu", expert_cache_mb=...)``; ``--cache-mb`` 0 (the default): the
  RAM cache sized at load from the memory the cgroup's limit leaves once the dense weights are
  in (runtime/memlimit.memory_left: the limit less what the process holds, one sequence's KV
  and a work reserve), as the daemon sizes it;
- llama.cpp (llama-cpp-python): ``use_mmap=True`` and weight repacking off
  (``llama_model_params.use_extra_bufts = False``: repacking copies the weights into anonymous
  memory, which cannot fit under the limit); checked: its log names no CPU_REPACK buffer;
- base (``--base PYTHONPATH``): freetoken from another tree, as ``freetoken`` runs (a change's
  before and after in one run, interleaved);
- resident: freetoken with the whole pool in RAM (no disk tier; its cgroup's limit 4x the file,
  which never binds), run beside the others: the decode's compute bound on the machine as it is
  loaded during the run. A tiered decode cannot beat it, so where it falls below 70 % of the
  disk-bound ceiling the cores bound the decode, not the disk (printed: freetoken's share of
  min(disk ceiling, resident)). Serial: 1 / (1 / resident + 1 / ceiling), the rate when no
  read overlaps compute (nothing to read ahead: random routers predict the next layer at
  chance), printed beside it.

freetoken's runs (both) start once the weights' huge-page collapse has ended (models/hugepages:
a thread after the load, 6.4-6.7 s over the resident's 4.27 GB on the 2-core EPYC, ~0.05 s over
the tier's cache): before 2026-12-07 ~06:00 it ran during the resident decode and held it to
7-13 tok/s instead of 27-37, so the resident figures ("bound") recorded before then are low.
Each freetoken run also prints where a decode token went: read wait, the expert kernels, the
tier's Python (and the native step's calls back into it), the rest of the step.

Per run: time to first token (the prompt's prefill, from the model loaded), decode tok/s ((n - 1)
over the time from the first token to the last), the bytes a decode token misses (freetoken: the
tier's expert reads; llama.cpp: what its page faults read from the disk, ``/proc/self/io``
read_bytes), whether it was killed (by the OOM killer: SIGKILL and the cgroup's oom_kill count)
and its peak memory (the cgroup's max usage).

The disk-bound ceiling of a run is the disk's read rate over the bytes its decode token misses,
the rate measured right before and right after that run (not the resident's), each time in a
fresh child process in a cgroup limited as the run, caches dropped, two ways
(disk_tier_rates.py): in the disk tier's pattern (formats/disk_rate.measure_disk_rate: ``--rate-mb`` of reads of the tier's mean
read for this file, ``tier_pieces``, ~0.95 MB here or ``--piece-kb``'s, at random 4 KiB-aligned
offsets, its reader threads' count in flight, 8, O_DIRECT as the tier reads) and sequential (1
GiB in 8 MiB reads, 4 in flight, through the page cache); each measurement reads other places
of the file (a seed per measurement: this VM's host caches what was read). The ceiling uses the
higher of the tier pattern's two rates (``ceiling_rate``): a miss is read as the tier reads it
(an expert's projections lie apart in the file: no engine reads its misses as 8 MiB sequential
reads), and the higher one because the rate drifts during a run and a ceiling must bound it.
Printed: each run's rates (before -> after) and its share at the lower rate too (the band its
share lies in), each limit's spread of the rates, and ``of seq``: the share at the higher
sequential rate. Before 2026-12-07 ~14:30 the rate was measured once, at the start, sequential
only: the ceilings recorded before then are from that one figure (hence "101 %" once).

``--daemon``: instead, the daemon serving the file in the first limit's cgroup answers, is
killed (SIGKILL) with a request in flight, restarts there and answers the same.

The engines decode the same prompt greedily; the tokens are not compared (random weights:
near-ties).

Measured 2026-12-06 ~23:00 UTC on 62c82fe (2-core AMD EPYC Zen 3 VM, AVX2, cgroup v1; the
machine shared with 6 other jobs, load average 13-16; 11 layers, 4.27 GB; 8-token prompt, 12
decode tokens; medians of 2 interleaved runs; freetoken's cache sized at load from the memory
left: 1191 MiB / 440 slots at 50 %, 174 MiB / 64 slots at 25 %). Two runs of the bench:

    run  limit        engine   tok/s  TTFT s  MB/token  ceiling  of ceil  killed
    A    25 % 1018M  freetoken    1.21    4.92       204     1.90      64%     0/2
    A    25 % 1018M  llama.cpp    0.08   21.09      2815     0.14      55%     0/2
    A    50 % 2036M  freetoken    2.23   11.15        41     9.42      24%     0/2
    A    50 % 2036M  llama.cpp    0.14   26.76       623     0.62      22%     0/2
    B    25 % 1018M  freetoken    0.95    5.43       204     1.74      55%     0/2
    B    25 % 1018M  llama.cpp    0.09   17.52      2710     0.13      66%     0/2
    B    25 %          resident   4.71    1.28         -        -        -     0/2
    B    50 % 2036M  freetoken    2.53   11.66        41     8.59      29%     0/2
    B    50 % 2036M  llama.cpp    0.22   20.43       620     0.57      39%     0/2
    B    50 %          resident   4.67    1.38         -        -        -     0/2

(disk 389 MB/s cold in run A, 354 in run B; single runs: 25 % 0.98 and 1.45 tok/s in A, 0.95
and 0.95 in B; 50 % 2.59 / 1.88, 2.64 / 2.42.) freetoken / llama.cpp: 15.9x and 11.0x at 25 %,
16.4x and 11.3x at 50 %; never killed. The 70 % of the disk-bound ceiling is not reached:

- 50 %: the cores bound it, not the disk. The resident decode (no reads at all) runs 4.67
  tok/s beside it, 54 % of the ceiling (8.59 tok/s at 354 MB/s and 41 MB a token): no disk tier
  can reach 70 % here. freetoken reaches 54 % of the resident rate: ~0.05 s a token waits for
  reads, ~0.34 s computes against the resident's ~0.21 (the tier's per-layer Python, a call per
  route of a layer with misses, the reader threads' moves, all on the same two cores).
- 25 %: 55-64 % of the ceiling (194-247 MB/s of expert reads against 354-389 MB/s): a token
  waits ~0.45 s for its ~200 MB of reads (0.9 MB-1.3 MB O_DIRECT reads, 8 in flight; the
  disk's random reads measured 430-880 MB/s at 256 KiB-4 MiB, 8-32 in flight, between bursts,
  formats/direct_read.py) and computes ~0.55 s, overlapped only within a layer (a layer's
  resident experts and each landed one run while the rest are read; random routers predict the
  next layer at chance, 8 of 128, so nothing is read ahead across layers).

Earlier (before the overlap and the one-pass reads; load ~11, disk 585 MB/s, medians of 3): 25 %
1.26 tok/s (44 % of ceiling), 50 % 3.63 (26 %); llama.cpp 0.09 and 0.26. ``--daemon`` at 50 %
(cache sized at load): up in 18 s, answered, killed with a request in flight, up again in 31 s,
the same answer, no OOM kill. 2026-12-07 ~17:00 UTC (AMD EPYC Zen 4 VM, shared): up in 2.6 s,
answered, killed with a 960-token request in flight (64 tokens, as the check asked before, were
done before the kill here), up again in 2.4 s, the same answer, no OOM kill.

2026-12-07 ~02:25 UTC (wt1; the same VM shared with 3 other jobs, load average 7.4-9.8; disk
478 MB/s at the start, 349 at the end; 24 decode tokens; caches fixed per limit, 262 MiB / 96
slots at 25 % and 1191 MiB / 432 slots at 50 %, because the memory-left sizing gives 64 or 96
slots at 25 % from run to run, 196 or 34 MB missed a token): the tier before (d57c834) and
after (one kernel call per batch of ready routes, the pool's workers spinning 50 us under the
tier, predictions checked on one call in 8), the resident decode beside them, interleaved,
medians of 3 (runs in brackets):

    limit  engine     tok/s               MB/token  of ceiling  of min(ceiling, resident)
    25 %   before     3.57 (2.95-4.14)          34         26%        78%
    25 %   after      5.25 (4.46-5.52)          34         38%       115%
    25 %   resident   4.58 (3.87-5.02)           -           -          -
    50 %   before     4.10 (3.85-4.32)          22         19%       104%
    50 %   after      5.36 (5.12-5.53)          22         24%       136%
    50 %   resident   3.95 (3.88-4.04)           -           -          -

Under that load the resident decode is no bound: its pool's workers spin 1 ms after each job,
on two cores the other jobs want. Where a tiered token went (25 %, 96 slots, one token at
~200 ms, load ~2.5; tests/bench has no script for it: TieredExecutor's methods timed): reads
waited 43 ms (~1 expert missing in a third of the layers: ~12 ms to read its 3 MB, latency,
not the disk's rate), expert kernels 74 ms (35 calls, ~11 of them the one per layer), the tier's
Python ~29 ms (lookups, reads started, predictions 7 ms), the rest of the layer 54 ms. At 64
slots (196 MB a token) reads waited 300-390 ms of 450-740, the reads' Python and GIL ~30-60
ms, the reader threads' CPU 115-145 ms a token (their interleave moves ~2.2 GB/s). There
(174 MiB, load 8-11, disk 469-1045 MB/s, medians of 2) before 1.36 tok/s (1.16, 1.56), after
1.52 (1.45, 1.58): 52 % and 57 % of the ceiling, the reads' latency a layer at a time (random
routers: nothing read ahead) the bound.

2026-12-07 ~05:30-06:00 UTC (wt4; the VM shared, load average 3-4; 24 decode tokens, medians of
2 interleaved runs; the cache sized at load from the memory left, now after the heap's freed
pages are returned (runtime/memlimit.release_free_heap): 426 MiB / 152 slots at 25 %, 528 slots
at 50 %, the same every load). Before the huge-page wait (disk 476 MB/s; resident 9.8-12.8
tok/s, collapsing): 25 % 9.89 tok/s (6.43, 13.34), 50 % 17.92 (16.90, 18.95). With it (disk
1561 MB/s: the host's cache, this VM's disk measures 476-831 MB/s cold otherwise):

    limit  engine     tok/s               MB/token  of ceiling  of min(ceil, resident)  of serial
    25 %   freetoken  11.77 (11.18, 12.36)       32         24%                     37%        61%
    25 %   resident   32.00 (36.55, 27.45)        -           -                       -          -
    50 %   freetoken  16.41 (18.90, 13.93)       14         15%                     53%        68%
    50 %   resident   30.75 (31.94, 29.56)        -           -                       -          -

Where a tiered token went (ms, medians): 25 %: read wait 32.5, expert kernels 20.2, the tier's
Python 8.4, the rest of the step 24.0 (85 ms against the resident's 31); 50 %: 22.5, 17.9, 5.9,
16.0. llama.cpp (5 decode tokens, 1 run each, disk 558 MB/s): 25 % freetoken 3.57 tok/s against
0.24 (14.7x), 50 % 8.14 against 0.49 (16.6x), none killed (its first decode tokens miss most:
156 and 52 MB a token). With random routers a layer's misses are known only once its router
has run, so its reads wait in series with compute (the serial rate); the 70 % of the ceiling
needs reads ahead of need, which random routing cannot predict (8 of 128: the next layer's
router on this layer's input named 14 of 234 misses for 2812 wasted reads: 40 tokens, 96 slots).
What remains at 25 %: the read wait (~6 experts a token in 2-3 layers, ~5-6 ms a 3 MB expert at
this disk's latency), and the tier's compute path, 44 ms of kernels and rest against the
resident's 31 ms a token: the native step's call back into Python per MoE layer, the extra
kernel call per batch of landed reads, the dense pool's 50 us spin under the tier.

2026-12-07 ~08:00-08:50 UTC (wt4; the VM shared, load 3-5; 24 decode tokens, medians of 2
interleaved runs; the disk measured 528-1547 MB/s "cold" from run to run: the host's cache).
Before: deeeded; after: a layer whose experts are all resident runs inside the native decode
step (no call into Python), the interpreter's switch interval 200 us under the tier:

    routes         limit  build   tok/s  MB/token  hits  ceiling  of ceil  bound  of min
    random         50 %   before  16.05        14   -      53.96      30%  31.80    50%
    random         50 %   after   19.15        14   96%    62.99      30%  30.70    62%
    random         25 %   before  10.67        32   -      23.99      44%  28.59    44%
    random         25 %   after   11.89        32   90%    28.00      42%  33.59    42%
    Qwen3 replay   50 %   after    6.68        30   84%    25.42      26%  26.93    26%
    Qwen3 replay   25 %   after    3.90        96   50%     8.02      49%  34.97    49%

(--routes .../bigmoeonedge/qwen.route.csv: the trace's top-6 of its 48 layers, 11 of them
spread over the depth; single replay runs elsewhere in the session: 50 % 5.4-12.8 tok/s, 25 %
4.0-6.7, 100 % of the ceiling once at 475 MB/s.) A tiered token (ms): random 50 % read wait
11.4, expert kernels 19.3, the tier's Python 4.2 (7.2 before), the rest 17.4; replay 25 %
171.9, 38.6, 27.2, 34.2. Random routers are skewed (96 % hits at 528 slots); a real model's
routing misses twice (50 %) to three times (25 %) the bytes. Read-ahead on real routing
(offline over the same trace, 11 layers, 128 tokens, global LRU): the next layer's experts that
followed this layer's (experts/disk_predict, ``--predictor history``) name 2 % of the misses at
37 % of the experts cached (the 50 % limit's 528 slots) and 35 % at 11 % (152 slots) for 2 wasted
reads each; the experts the previous token used at the layer are resident already, and the most
frequent ones too: at these cache sizes a miss is an expert the text has not used for long.
Only the next layer's router on this layer's input (needs the real weights) can name those.

2026-12-07 ~14:30-15:15 UTC (wt2; AMD EPYC Zen 4 VM, 2 cores, AVX-512, cgroup v1; the VM shared
with the lead and another helper, load average 2-5; 11 layers, 4.27 GB; 8-token prompt, 16
decode tokens; medians of 2 interleaved runs; bench runs A, B (one limit per invocation) and C;
freetoken's cache sized at load: 412 MiB / 152 slots at 25 %, 1429 MiB / 528 slots at 50 %; the
rates measured around each run, the tier's pattern 0.95 MB x 8 in flight, O_DIRECT; rate: the
ceiling's, the median over the runs of the higher tier-pattern rate around each):

    run  limit        engine      tok/s  TTFT s  MB/token  rate MB/s  ceiling  of ceil  killed
    A    25 % 1018M  freetoken    12.87    1.61        47       1074    22.95      63%     0/2
    A    25 % 1018M  llama.cpp     0.25    7.29      2769       1232     0.44      56%     0/2
    A    25 %         resident    29.80    0.20         -          -        -        -     0/2
    B    25 % 1018M  freetoken    17.99    1.51        47       1222    26.11      69%     0/2
    B    25 % 1018M  llama.cpp     0.46    2.72      2786       1529     0.55      84%     0/2
    B    25 %         resident    72.33    0.09         -          -        -        -     0/2
    A    50 % 2036M  freetoken    26.29    3.53        20       1424    71.61      37%     0/2
    A    50 % 2036M  llama.cpp     1.03    8.35       389       1217     3.13      33%     0/2
    A    50 %         resident    29.52    0.19         -          -        -        -     0/2
    B    50 % 2036M  freetoken    39.30    1.13        20       1677    84.30      48%     0/2
    B    50 % 2036M  llama.cpp     4.12    2.24       377       1918     5.09      81%     0/2
    B    50 %         resident    67.97    0.08         -          -        -        -     0/2
    C    25 % 1018M  freetoken    23.92    1.12        47       2029    43.35      55%     0/2
    C    25 %         resident    68.91    0.08         -          -        -        -     0/2
(single runs: 25 % A freetoken 12.41 and 13.34 tok/s, B 17.79 and 18.19; llama.cpp A 0.25 and 0.24,
B 0.48 and 0.45; 50 % A freetoken 29.71 and 22.88, llama.cpp 1.03 and 1.02, B 37.42 and 41.18, 4.12
both; C 25.00 and 22.84.) freetoken / llama.cpp decode: 52.5x (A) and 39.0x (B) at 25 %, 25.6x (A)
and 9.5x (B) at 50 %; nothing killed; peaks at the limits (the page cache counted; the resident's
8.6 GB: its copy and the page cache under a 4x limit). The resident decode (the compute bound) ran
29.8 and 29.5 tok/s in A, 68-72 in B and C: the other jobs' load, not the tier, moved it 2.4x
between the runs.

The rates: the tier's pattern 689-1457 MB/s around the 25 % runs of A (median 1004), 1098-1617 in B,
987-1549 at 50 % in A, 1231-2041 in B, 1253-2193 at 25 % in C (it rose through the hour as the host
cached more of the file); sequential (8 MiB x 4) 1042-2541. A run's before and after differ by a
median of 14-36 % (the tier's pattern), two runs a minute apart by up to 2x: A's first freetoken run
at 25 % had 689 and 691 MB/s around it (84 % of its ceiling), the next 1203 and 1457 (43 %). Back to
back (one process, other offsets each time, caches dropped) the tier's pattern measured 713-1429
MB/s over 256 MiB and 789-1545 over 1 GiB: on this VM the disk's rate is a band that moves within
seconds (the host's cache and other guests), so a share of the ceiling is only good to about +-25 %,
and the medians of the runs' own shares are the figures to read.

Below 70 % of the ceiling:
- 50 %: in A the cores bound it, not the disk: the resident decode beside it (29.5 tok/s) is 41 % of
  the ceiling (71.6), so no disk tier could reach 70 % there; freetoken ran 89 % of the resident
  rate (read wait 7.1 ms a token, expert kernels 15.0, the tier's Python 4.4, the rest 12.2). In B
  (quieter: resident 68.0, 81 % of the ceiling) 48 %, 104 % of the serial rate: read wait 6.8,
  kernels 8.0, Python 2.6, the rest 8.2 (25.6 ms against the resident's 14.7), the reader threads'
  CPU beside it 5.0 ms a token.
- 25 %: 63 % (A), 69 % (B: 68 % and 70 %), 55 % (C). Random routers predict nothing (8 of 128), so a
  layer's reads wait in series with its compute: the serial rate (1 / (1 / bound + 1 / ceiling)) is
  12.96 in A, 19.19 in B and 26.61 in C, freetoken 99 %, 94 % and 90 % of it. A token in B (ms,
  medians): read wait 26.8, expert kernels 12.2, the tier's Python 6.4, the rest 10.2: 56 ms,
  against the resident's 14; in C 20.9, 8.7, 4.3, 8.0 (42 ms against 14.5), the reader threads' CPU
  beside it 10.0 ms a token (their moves, ~4.7 GB/s). The reads run at the disk's rate (with the
  overlap off, TieredExecutor.overlap False, a token waited 26-35 ms for its 32 MB at 24 decode
  tokens, about its bytes at ~1 GB/s; the overlap within a layer hides ~10 ms of them: 13.6-16.1
  tok/s against 12.3-15.3 off, 3 interleaved rounds, load 4-6); a lone expert's miss (its three
  ~0.9-1.3 MB reads in flight at once, O_DIRECT, random offsets) takes 1.6-2.9 ms (medians of 60),
  about a layer's resident experts' compute. The read size does not move it: ``--piece-kb`` 256
  17.87 tok/s, 512 17.04, the tier's ~0.95 MB 16.54 (medians of 3 interleaved rounds, 24 tokens),
  within the runs' spread (14.2-20.6).
What would close the gap at 25 %: the tier's compute, 21-29 ms a token against the resident's ~14
(at the resident's compute the serial rate alone is 61-74 % of the ceiling): the tier's Python and
its extra kernel calls (a call back into Python per layer with a miss, a kernel call per batch of
landed reads), and the reader threads' moves into the slots' interleave (10 ms of CPU a token at 47
MB) on the two cores the step computes on; a tier file laid out as the slots are and aligned for
O_DIRECT, read straight into a slot (issue 45's item 5), takes the moves off the cores. Beyond the
serial rate only reads ahead of need help, which random routers cannot give (a real model's
next-layer router on this layer's input can).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from disk_tier_rates import (
    SEQ_BYTES,
    ceiling_rate,
    child_rate,
    drop_caches,
    print_rates,
)

ENGINES = ("freetoken", "llama.cpp", "resident")
PROMPT_SEED = 7


def _io_read_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def _prompt(n: int, vocab: int) -> list[int]:
    rng = random.Random(PROMPT_SEED)
    return [rng.randrange(1000, vocab - 1000) for _ in range(n)]


# ---- the child: one engine, one run -------------------------------------------------------------


def child_freetoken(a: dict[str, Any]) -> dict[str, Any]:
    import ftdense
    import torch

    from freetokend import LLM
    from freetokend.engine.sampler import SamplingParams
    from freetokend.experts.disk_predict import CooccurrencePredictor
    from freetokend.models.layers import cpu_decode

    torch.set_num_threads(a["threads"])
    t0 = time.perf_counter()
    llm = LLM(
        a["path"], "cpu", threads=a["threads"], expert_cache_mb=a.get("cache_mb"),
        max_model_len=512, kv_tokens=512, prefix_cache=False,
    )  # fmt: skip
    load_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    for t in threading.enumerate():  # the weights' huge pages: their collapse ends first
        if t.name == "ft-hugepages":
            t.join()
    huge_s = time.perf_counter() - t1
    tier = llm.moe.tier
    if a.get("switch_us"):
        sys.setswitchinterval(a["switch_us"] / 1e6)
    if tier is not None and a.get("piece_kb"):
        tier.tier.source.piece_bytes = int(a["piece_kb"]) << 10
    if tier is not None and a.get("routes"):
        tier.set_replay(replay_routes(a["routes"], tier.num_layers))
    if tier is not None and a.get("predictor") == "history":
        tier.history = CooccurrencePredictor(tier.num_layers, tier.num_experts, tier.tier.top_k)
    elif tier is not None and a.get("predictor") == "none":
        tier.read_ahead = False
    spent = _time_tier(tier) if tier is not None else [0.0, 0.0]
    parts_s = torch.zeros(len(ftdense.decode_parts()), dtype=torch.float64)
    cpu_decode.set_timings(parts_s)  # the native step's experts: its fast path's kernels too
    experts_part = ftdense.decode_parts().index("experts")
    loaded_rss = _status_mb()
    prompt = _prompt(a["prompt"], llm.tokenizer.vocab_size if llm.tokenizer else 50000)
    params = SamplingParams(max_tokens=a["decode"], temperature=0.0, ignore_eos=True)
    stamps: list[float] = []
    io: list[int] = []
    st: list[dict[str, int]] = []
    waits: list[float] = []
    faults: list[int] = []
    times: list[tuple[float, float, float]] = []
    readers: list[dict[int, int]] = []
    start = time.perf_counter()
    llm.engine.add_request("bench", prompt, params)
    while llm.engine.has_unfinished():
        for _ in llm.engine.step():
            if not stamps:
                readers.append(_readers_cpu())
            stamps.append(time.perf_counter())
            io.append(_io_read_bytes())
            st.append(tier.stats() if tier is not None else {})
            waits.append(tier.read_seconds if tier is not None else 0.0)
            faults.append(_major_faults())
            times.append((spent[0], spent[1], float(parts_s[experts_part])))
    cpu_decode.set_timings(None)
    readers.append(_readers_cpu())  # after the last token: the decode's reads' CPU time
    first, last = st[0], st[-1]
    n = len(stamps) - 1
    span = stamps[-1] - stamps[0]
    calls, kernels, experts = (times[-1][i] - times[0][i] for i in (0, 1, 2))
    wait = waits[-1] - waits[0]
    # where a decode token's time went (ms): the tier's calls (read waits, expert kernels, its
    # Python and the native step's calls back into it), the native step's layers whose experts
    # were all resident (their kernels: the step's experts part less its calls back), the rest
    fast = max(experts - calls, 0.0)
    parts = {"read_wait": wait, "expert_kernels": kernels + fast,
             "tier_python": calls - kernels - wait, "rest": span - calls - fast}  # fmt: skip
    split = {k: 1e3 * v / n for k, v in parts.items()} if tier is not None else None
    return {
        "load_s": load_s,
        "huge_pages_s": huge_s,
        "ttft_s": stamps[0] - start,
        "decode_tps": (len(stamps) - 1) / (stamps[-1] - stamps[0]),
        "disk_bytes_per_token": (io[-1] - io[0]) / (len(stamps) - 1),
        "tier_bytes_per_token": (last.get("bytes_read", 0) - first.get("bytes_read", 0))
        / (len(stamps) - 1),
        "hit_rate": _rate(first, last),
        "read_ahead_used": _used(first, last),
        "read_ahead_per_token": (last.get("read_ahead", 0) - first.get("read_ahead", 0)) / n,
        "slots": tier.cache.slots if tier is not None else 0,
        "read_wait_s_per_token": wait / n,
        # the reader threads' CPU a decode token (the reads' moves into their slots, on the
        # cores the step computes on; not a part of the step's time: they run beside it)
        "readers_cpu_ms_per_token": sum(v - readers[0].get(k, 0) for k, v in readers[1].items())
        / 1e6
        / n,
        "ms_per_token": split,
        "major_faults_per_token": (faults[-1] - faults[0]) / n,
        "cache_mb": sum(t.nbytes for t in tier.slots.all_tensors().values()) >> 20 if tier else 0,
        "rss_loaded_mb": loaded_rss,
        "rss_end_mb": _status_mb(),
    }


def _time_tier(tier: Any) -> list[float]:
    """[seconds in the tier's calls, seconds of those in its expert kernels], kept up to date
    by wrappers around the tier's and its executor's address calls (a few microseconds a call
    against milliseconds)."""
    spent = [0.0, 0.0]
    inner, tiered = tier.inner.forward_addresses, tier.forward_addresses

    def kernel(*args: Any) -> None:
        t = time.perf_counter()
        inner(*args)
        spent[1] += time.perf_counter() - t

    def call(*args: Any) -> None:
        t = time.perf_counter()
        tiered(*args)
        spent[0] += time.perf_counter() - t

    tier.inner.forward_addresses, tier.forward_addresses = kernel, call
    return spent


def replay_routes(path: str, layers: int) -> Any:
    """A recorded routing trace's decode routes (experts/replay.read_trace) as a disk tier's
    replay (TieredExecutor.set_replay): int32 [decode tokens, layers, the trace's top-k], the
    model's layer i taking the trace's layer round(i * (trace layers - 1) / (layers - 1))
    (spread over its depth)."""
    import torch

    from freetokend.experts.replay import read_trace

    tr = read_trace(path)
    pick = [round(i * (tr.num_layers - 1) / max(layers - 1, 1)) for i in range(layers)]
    steps: list[dict[int, tuple[int, ...]]] = []
    for b in tr.batches:
        if not b.decode:
            continue
        if not steps or b.layer in steps[-1]:
            steps.append({})
        steps[-1][b.layer] = b.ids[0]
    rows = [[list(s[lay]) for lay in pick] for s in steps if all(lay in s for lay in pick)]
    if not rows:
        raise ValueError(f"{path}: no decode token routes every layer")
    return torch.tensor(rows, dtype=torch.int32)


def _readers_cpu() -> dict[int, int]:
    """The disk tier's reader threads (disk_reads.SlotReads: ``ft-disk-tier``): their time on a
    CPU, ns, by thread id (/proc schedstat)."""
    out = {}
    for t in threading.enumerate():
        if t.name.startswith("ft-disk-tier") and t.native_id is not None:
            try:
                stat = Path(f"/proc/self/task/{t.native_id}/schedstat").read_text()
            except OSError:
                continue
            out[t.native_id] = int(stat.split()[0])
    return out


def _major_faults() -> int:
    return int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[9])


def _status_mb() -> dict[str, int]:
    """This process's RssAnon / RssFile / VmHWM, MiB."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile", "VmHWM"):
            out[key] = int(value.split()[0]) >> 10
    return out


def _rate(a: dict[str, int], b: dict[str, int]) -> float | None:
    hits, misses = b.get("hits", 0) - a.get("hits", 0), b.get("misses", 0) - a.get("misses", 0)
    return hits / (hits + misses) if hits + misses else None


def _used(a: dict[str, int], b: dict[str, int]) -> float | None:
    n = b.get("read_ahead", 0) - a.get("read_ahead", 0)
    return (b.get("read_ahead_hits", 0) - a.get("read_ahead_hits", 0)) / n if n else None


def child_llama(a: dict[str, Any]) -> dict[str, Any]:
    import llama_cpp.llama_cpp as C

    default = C.llama_model_default_params

    def no_repack() -> Any:  # Llama() exposes no switch; its params come from this function
        p = default()
        p.use_extra_bufts = False
        return p

    C.llama_model_default_params = no_repack
    from llama_cpp import Llama

    t0 = time.perf_counter()
    llm = Llama(
        model_path=a["path"], n_ctx=512, n_threads=a["threads"], n_threads_batch=a["threads"],
        use_mmap=True, verbose=True,
    )  # fmt: skip
    load_s = time.perf_counter() - t0
    prompt = _prompt(a["prompt"], llm.n_vocab())
    stamps: list[float] = []
    io: list[int] = []
    start = time.perf_counter()
    for _ in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        stamps.append(time.perf_counter())
        io.append(_io_read_bytes())
        if len(stamps) == a["decode"]:
            break
    return {
        "load_s": load_s,
        "ttft_s": stamps[0] - start,
        "decode_tps": (len(stamps) - 1) / (stamps[-1] - stamps[0]),
        "disk_bytes_per_token": (io[-1] - io[0]) / (len(stamps) - 1),
    }


# ---- the parent ---------------------------------------------------------------------------------


class Cgroup:
    """A memory cgroup of this machine (v1 or v2) limited to ``limit`` bytes."""

    def __init__(self, name: str, limit: int) -> None:
        v1 = Path("/sys/fs/cgroup/memory")
        v2 = Path("/sys/fs/cgroup")
        if (v1 / "memory.limit_in_bytes").exists():
            self.v2, self.dir = False, v1 / name
        elif "memory" in (v2 / "cgroup.controllers").read_text(errors="replace").split():
            self.v2, self.dir = True, v2 / name
        else:
            raise OSError("no memory cgroup controller (v1 or v2) is mounted")
        if self.dir.exists():
            self.dir.rmdir()
        self.dir.mkdir()
        (self.dir / ("memory.max" if self.v2 else "memory.limit_in_bytes")).write_text(str(limit))

    def join(self) -> None:  # in the child, before exec
        (self.dir / "cgroup.procs").write_text(str(os.getpid()))

    def oom_kills(self) -> int:
        f = self.dir / ("memory.events" if self.v2 else "memory.oom_control")
        for line in f.read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def peak(self) -> int:
        f = self.dir / ("memory.peak" if self.v2 else "memory.max_usage_in_bytes")
        return int(f.read_text()) if f.exists() else 0

    def remove(self) -> None:
        for _ in range(50):
            try:
                self.dir.rmdir()
                return
            except OSError:
                time.sleep(0.1)


_RATE_SEED = iter(range(1, 1 << 30))  # each measurement reads other places than the last


def rates_near(path: Path, limit: int, a: argparse.Namespace) -> dict[str, Any]:
    """``child_rate`` in a fresh cgroup limited as the engine's run is (caches dropped): the
    disk's rates right before or after a run."""
    args = {"path": str(path), "tier_bytes": a.rate_mb << 20, "seq_bytes": SEQ_BYTES,
            "seed": next(_RATE_SEED), "piece_kb": a.piece_kb}  # fmt: skip
    cg = Cgroup(f"ftbench-rate-{os.getpid()}", limit)
    drop_caches()
    try:
        p = subprocess.run(
            [sys.executable, __file__, "--child", "rate", json.dumps(args)],
            capture_output=True, text=True, preexec_fn=cg.join, timeout=a.timeout,
        )  # fmt: skip
        if p.returncode != 0:
            return {"error": f"rc {p.returncode}: {p.stderr[-300:]}"}
        return dict(json.loads(p.stdout.strip().splitlines()[-1]))
    except subprocess.TimeoutExpired:
        return {"error": f"timeout {a.timeout} s"}
    finally:
        cg.remove()


def run(engine: str, path: Path, limit: int, a: argparse.Namespace) -> dict[str, Any]:
    args = {"path": str(path), "threads": a.threads, "prompt": a.prompt, "decode": a.decode,
            "cache_mb": a.cache_mb, "routes": a.routes, "predictor": a.predictor,
            "piece_kb": a.piece_kb, "switch_us": a.switch_us}  # fmt: skip
    if engine == "resident":  # the whole pool in RAM: no limit that binds, no disk tier
        args["cache_mb"], limit = None, 4 * path.stat().st_size
    # the disk's rates right before and after the run (a resident run reads nothing a token)
    before = rates_near(path, limit, a) if engine != "resident" else {}
    out = _run_engine(engine, path, limit, args, a)
    after = rates_near(path, limit, a) if engine != "resident" else {}
    if engine != "resident":
        out["rates"] = {"before": before, "after": after}
        rate, why = ceiling_rate(before, after)
        seq = [r["seq"] for r in (before, after) if r.get("seq")]
        per, tps = out.get("miss_bytes_per_token"), out.get("decode_tps")
        out["ceiling_rate"], out["ceiling_why"] = rate, why
        out["ceiling"] = rate / per if rate and per else None
        out["of_ceiling"] = tps / out["ceiling"] if tps and out["ceiling"] else None
        # the same with the higher sequential rate (8 MiB reads): what larger reads would allow
        out["seq_ceiling"] = max(seq) / per if seq and per else None
        out["of_seq_ceiling"] = tps / out["seq_ceiling"] if tps and out["seq_ceiling"] else None
    return out


def _run_engine(
    engine: str, path: Path, limit: int, args: dict[str, Any], a: argparse.Namespace
) -> dict[str, Any]:
    """One engine's run: a fresh child process in a cgroup of ``limit`` bytes, caches dropped."""
    cg = Cgroup(f"ftbench-disk-{os.getpid()}", limit)
    drop_caches()
    try:
        t0 = time.perf_counter()
        env = dict(os.environ, PYTHONPATH=a.base) if engine == "base" else None
        p = subprocess.run(
            [sys.executable, __file__, "--child",
             "freetoken" if engine in ("resident", "base") else engine, json.dumps(args)],
            capture_output=True, text=True, preexec_fn=cg.join, timeout=a.timeout, env=env,
        )  # fmt: skip
        wall = time.perf_counter() - t0
        kills = cg.oom_kills()
        out: dict[str, Any] = {"engine": engine, "wall_s": wall, "peak": cg.peak(),
                               "oom_killed": kills > 0 or p.returncode == -9}  # fmt: skip
        if engine == "llama.cpp":
            out["repack"] = (
                "CPU_REPACK" in p.stderr
            )  # a repacked buffer (not the build line "REPACK = 1")
        if p.returncode == 0:
            out.update(json.loads(p.stdout.strip().splitlines()[-1]))
            # the bytes a token misses: the tier's reads; llama.cpp's page faults' disk reads
            out["miss_bytes_per_token"] = (
                None  # no disk tier: nothing to miss (the pool read once at load)
                if engine == "resident"
                else out.get("tier_bytes_per_token") or out.get("disk_bytes_per_token")
            )
        else:
            out["error"] = f"rc {p.returncode}: {p.stderr[-600:]}"
        return out
    except subprocess.TimeoutExpired:
        return {"engine": engine, "error": f"timeout {a.timeout} s", "oom_killed": False}
    finally:
        cg.remove()


def daemon_check(path: Path, limit: int, a: argparse.Namespace) -> None:
    """The daemon serving the file in a cgroup of ``limit`` bytes (the disk tier on, its cache
    ``--cache-mb``, 0: sized at load from the memory left) answers a request, is killed
    (SIGKILL) in the middle of a second one, restarts in the same cgroup and answers the first
    request the same."""
    import re
    import tempfile
    import urllib.request

    listen = re.compile(r"serving (\S+) on (http://\S+)")
    cache_gb = a.cache_mb / 1024
    cg = Cgroup(f"ftbench-daemon-{os.getpid()}", limit)
    state = tempfile.mkdtemp(prefix="ftbench-daemon-")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "FREETOKEN_STATE_DIR": state}

    def start() -> tuple[subprocess.Popen[str], str, str]:
        drop_caches()
        cmd = [sys.executable, "-m", "freetokend.cli", "--host", "127.0.0.1", "--port", "0",
               "--model", str(path), "--moe-backend", "cpu", "--disk-tier", "on",
               "--expert-cache-gb", f"{cache_gb:.3f}", "--admin-socket", "off",
               "--kv-tokens", "1024"]  # fmt: skip
        p = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True, preexec_fn=cg.join)  # fmt: skip
        assert p.stdout is not None
        t0 = time.perf_counter()
        for line in p.stdout:
            m = listen.search(line)
            if m:
                print(f"  daemon up in {time.perf_counter() - t0:.1f} s (pid {p.pid})")
                return p, m.group(1), m.group(2)
        raise RuntimeError(f"the daemon exited ({p.wait()}) before serving")

    def post(url: str, name: str, tokens: int) -> str:
        body = {"model": name, "prompt": "Hello there", "max_tokens": tokens,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"content-type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=600) as r:
            return str(json.loads(r.read())["choices"][0]["text"])

    try:
        p, name, url = start()
        first = post(url, name, 8)
        print(f"  answered {first!r}")

        def doomed() -> None:
            try:
                # long enough to be in flight at the kill on any CPU (within --kv-tokens 1024)
                post(url, name, 960)
            except OSError:  # the connection dies with the daemon
                pass

        t = threading.Thread(target=doomed, daemon=True)
        t.start()
        time.sleep(3)
        alive = t.is_alive()
        p.kill()
        p.wait()
        print(f"  killed (SIGKILL) with a request in flight: {alive}; rc {p.returncode}")
        p, name, url = start()
        again = post(url, name, 8)
        print(f"  restarted, answered the same: {again == first}; OOM kills {cg.oom_kills()}")
        p.terminate()
        p.wait(60)
    finally:
        cg.remove()


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=11)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--limits", default="0.5,0.25", help="shares of the file size")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=8)
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--cache-mb", default="0",
        help="freetoken's expert cache, MiB (0: the memory left), or one per limit (comma-separated)",
    )  # fmt: skip
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument(
        "--rate-mb", type=int, default=512,
        help="MiB each measurement of the disk's rate in the tier's pattern reads",
    )  # fmt: skip
    ap.add_argument(
        "--engines", default=",".join(ENGINES),
        help="resident: freetoken with the whole pool in RAM (no binding limit), the decode's "
        "compute bound beside the tiered runs",
    )  # fmt: skip
    ap.add_argument(
        "--daemon", action="store_true", help="only the daemon check, at the first limit"
    )
    ap.add_argument(
        "--routes", default=None,
        help="a routing trace (shared/data/routing-traces: a bigmoeonedge .csv or a granite "
        ".json) whose decode routes freetoken's disk tier replays in place of the random "
        "routers' (TieredExecutor.set_replay: a real model's hit rates; the trace's top-k, "
        "its layers spread over the model's); the resident engine keeps its own routes",
    )  # fmt: skip
    ap.add_argument(
        "--predictor", choices=("router", "history", "none"), default=None,
        help="freetoken's read-ahead: router (the next layer's router on this layer's input, "
        "the default), history (experts/disk_predict: the next layer's experts that followed "
        "this layer's in the tokens before; for --routes) or none (the default with --routes)",
    )  # fmt: skip
    ap.add_argument(
        "--piece-kb", type=int, default=0,
        help="the most bytes one of the tier's reads takes, KiB (0: the source's own)",
    )  # fmt: skip
    ap.add_argument(
        "--switch-us", type=int, default=0,
        help="the child's sys.setswitchinterval, microseconds (0: Python's 5000)",
    )  # fmt: skip
    ap.add_argument(
        "--base", default=None,
        help="a PYTHONPATH of another freetoken tree (before a change), run as engine 'base' "
        "beside the others (--engines base,freetoken,...), interleaved",
    )  # fmt: skip
    ap.add_argument("--child", nargs=2, metavar=("ENGINE", "ARGS"))
    a = ap.parse_args()
    if a.predictor is None:
        a.predictor = "none" if a.routes else "router"
    if a.routes and a.predictor == "router":
        ap.error("--routes replaces the routers' routes: their predictions name other experts")
    if "base" in a.engines.split(",") and not a.base:
        ap.error("engine base: --base names its tree's PYTHONPATH")
    if a.child:
        engine, args = a.child[0], json.loads(a.child[1])
        child = {"freetoken": child_freetoken, "llama.cpp": child_llama, "rate": child_rate}
        got = child[engine](args)
        print(json.dumps(got))
        return 0
    if os.geteuid() != 0:
        print("skipped: not root (memory cgroups and drop_caches need it)")
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_gguf_startup import build

    path = build(a.layers, a.vocab)
    size = path.stat().st_size
    print(f"file {path}: {size / 1e9:.2f} GB, {a.layers} layers")
    try:
        Cgroup(f"ftbench-probe-{os.getpid()}", 1 << 40).remove()
    except OSError as e:
        print(f"skipped: cannot make a memory cgroup ({e})")
        return 0
    shares = [float(x) for x in a.limits.split(",")]
    caches = [float(x) for x in str(a.cache_mb).split(",")]
    if len(caches) not in (1, len(shares)):
        ap.error(f"--cache-mb takes one size or one per limit ({len(shares)})")
    caches = caches * len(shares) if len(caches) == 1 else caches
    if a.daemon:
        a.cache_mb = caches[0]
        daemon_check(path, int(size * shares[0]), a)
        return 0
    engines = a.engines.split(",")
    if "llama.cpp" in engines:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            print("llama.cpp: llama-cpp-python not installed; freetoken alone")
            engines.remove("llama.cpp")
    print(
        "the disk's rates measured right before and after each run (not the resident's), in a "
        "cgroup limited as the run, caches dropped: the tier's pattern and sequential"
    )
    results: dict[tuple[float, str], list[dict[str, Any]]] = {}
    for share, cache_mb in zip(shares, caches, strict=True):
        limit = int(size * share)
        a.cache_mb = cache_mb
        for i in range(a.repeats):
            for engine in engines if i % 2 == 0 else engines[::-1]:  # interleaved
                r = run(engine, path, limit, a)
                results.setdefault((share, engine), []).append(r)
                print(f"  {share:.0%} {engine} #{i}: " + json.dumps(r), flush=True)
    print(f"\nmedians over {a.repeats} runs; file {size / 1e9:.2f} GB")
    print_rates(results)
    print(
        "ceiling: a run's disk rate (rate: the tier pattern's, the higher of before and after "
        "the run) over the MB a token misses; of ceil: the median of the runs' tok/s over their "
        "own ceilings; of seq: the same with the higher sequential rate; bound: the resident "
        "decode's tok/s "
        "(the compute bound); of min: tok/s over min(ceiling, bound); serial: 1 / (1 / bound + "
        "1 / ceiling), the rate when no read overlaps compute (nothing read ahead: routing that "
        "nothing predicts, as random routers'; a layer's reads still overlap its resident experts)"
    )
    if a.routes:
        print(f"freetoken's routes replayed from {a.routes}")
    print(f"freetoken's read-ahead predictor: {a.predictor}")
    head = f"{'limit':>12} {'engine':>10} {'tok/s':>7} {'TTFT s':>7} {'MB/token':>9} {'slots':>6} "
    print(
        head
        + f"{'rate':>5} {'ceiling':>8} {'of ceil':>8} {'of seq':>7} "
        + f"{'bound':>7} {'of min':>7} {'serial':>7} {'of ser':>7} "
        + f"{'killed':>7} {'peak MB':>8} {'hits':>5}"
    )
    for (share, engine), rows in results.items():
        tps, ttft = _median(rows, "decode_tps"), _median(rows, "ttft_s")
        per = _median(rows, "miss_bytes_per_token")
        ceil, rate = _median(rows, "ceiling"), _median(rows, "ceiling_rate")
        of_ceil, of_seq = _median(rows, "of_ceiling"), _median(rows, "of_seq_ceiling")
        bound = _median(results.get((share, "resident"), []), "decode_tps")
        least = min(ceil, bound) if ceil and bound else None
        serial = 1 / (1 / bound + 1 / ceil) if ceil and bound else None
        slots = _median(rows, "slots")
        killed = sum(bool(r.get("oom_killed")) for r in rows)
        peak = _median(rows, "peak")
        cells = [
            f"{share:.0%} {int(size * share) >> 20}M",
            engine,
            f"{tps:.2f}" if tps else "-",
            f"{ttft:.2f}" if ttft else "-",
            f"{per / 1e6:.0f}" if per else "-",
            f"{slots:.0f}" if slots else "-",
            f"{rate / 1e6:.0f}" if rate else "-",
            f"{ceil:.2f}" if ceil else "-",
            f"{of_ceil:.0%}" if of_ceil else "-",
            f"{of_seq:.0%}" if of_seq else "-",
            f"{bound:.2f}" if bound and engine != "resident" else "-",
            f"{tps / least:.0%}" if tps and least else "-",
            f"{serial:.2f}" if serial and engine != "resident" else "-",
            f"{tps / serial:.0%}" if tps and serial and engine != "resident" else "-",
            f"{killed}/{len(rows)}",
            f"{peak / 2**20:.0f}" if peak else "-",
            f"{hits:.0%}" if (hits := _median(rows, "hit_rate")) is not None else "-",
        ]
        widths = (12, 10, 7, 7, 9, 6, 5, 8, 8, 7, 7, 7, 7, 7, 7, 8, 5)
        print(" ".join(f"{c:>{w}}" for c, w in zip(cells, widths, strict=True)))
    for share in sorted({s for s, _ in results}):
        ft, lc = results.get((share, "freetoken")), results.get((share, "llama.cpp"))
        if ft and lc:
            x, y = _median(ft, "decode_tps"), _median(lc, "decode_tps")
            if x and y:
                print(f"{share:.0%}: freetoken / llama.cpp decode = {x / y:.2f}x")
        for name in ("base", "freetoken"):
            parts = [r["ms_per_token"] for r in results.get((share, name), [])
                     if r.get("ms_per_token")]  # fmt: skip
            if parts:  # medians of each part over the runs
                cpu = _median(results[share, name], "readers_cpu_ms_per_token")
                print(f"{share:.0%} {name}, where a decode token went (ms, medians): " + ", ".join(
                    f"{k} {statistics.median(p[k] for p in parts):.1f}" for k in parts[0])
                    + (f"; readers' CPU beside it {cpu:.1f}" if cpu else ""))  # fmt: skip
        ahead = [r for r in ft or [] if r.get("read_ahead_per_token") is not None]
        if ahead:
            used = _median(ahead, "read_ahead_used")
            print(f"{share:.0%} freetoken read ahead: "
                  f"{_median(ahead, 'read_ahead_per_token'):.2f} experts a token, "
                  + (f"{used:.0%} of them used" if used is not None else "none used"))  # fmt: skip
        res = results.get((share, "resident"))
        if ft and res:  # each run against the resident run of its round (run beside it)
            cells = []
            for r, b in zip(ft, res, strict=False):
                x, y, ceil = r.get("decode_tps"), b.get("decode_tps"), r.get("ceiling")
                if x and y and ceil:
                    cells.append(f"{x:.2f} tok/s: {x / ceil:.0%} of ceiling, "
                                 f"{x / min(y, ceil):.0%} of min(ceiling, {y:.2f})")  # fmt: skip
            print(f"{share:.0%} freetoken by round: " + "; ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
