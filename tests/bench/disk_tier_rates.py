"""The disk's read rates of the disk tier benchmark (bench_disk_tier.py, issue 45): the
sequential rate through the page cache, the rate in the tier's own read pattern (the read size
``tier_pieces`` gives for a GGUF file), the rate a run's ceiling uses (``ceiling_rate``), and
their printout. bench_disk_tier measures them around each engine run, in a child process of
the run's cgroup (``child_rate``)."""

from __future__ import annotations

import os
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

SEQ_BYTES = 1 << 30  # the sequential rate's sample


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def disk_rate(
    path: Path, nbytes: int = SEQ_BYTES, chunk: int = 8 << 20, seed: int | None = None
) -> float:
    """Bytes/s reading ``nbytes`` of ``path`` in ``chunk``-byte reads, 4 in flight, through the
    page cache (caches dropped first): from the file's middle, or (``seed``) from a start drawn
    by it, so that repeats read other places (this VM's host caches what was read)."""
    drop_caches()
    size = path.stat().st_size
    start = max(0, (size - nbytes) // 2)
    if seed is not None:
        start = random.Random(seed).randrange(max(1, size - nbytes))
    start = start // chunk * chunk
    fd = os.open(path, os.O_RDONLY)
    try:
        offsets = range(start, min(size, start + nbytes), chunk)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(4) as pool:
            got = sum(pool.map(lambda o: len(os.pread(fd, chunk, o)), offsets))
        return got / (time.perf_counter() - t0)
    finally:
        os.close(fd)


def tier_pieces(path: str, most: int = 0) -> list[int]:
    """The bytes of each read the disk tier makes for an expert of the GGUF file ``path``, over
    its layers (as models/gguf_experts.GgufExpertSource splits them: one per projection's rows,
    larger slices in whole groups of 8 rows of at most its ``piece_bytes``, or ``most``)."""
    from freetokend.formats.gguf_header import expert_stacks, read_header
    from freetokend.models.gguf_experts import GgufExpertSource, piece_rows

    most = most or GgufExpertSource.piece_bytes
    out = []
    for stack in expert_stacks(read_header(path).tensors).values():
        for t in stack.values():
            n, rows = t.nbytes // t.shape[0], t.shape[-2]
            rb = n // rows
            step = piece_rows(rows, rb, most, path)
            out += [min(step, rows - r0) * rb for r0 in range(0, rows, step)]
    return out


def child_rate(a: dict[str, Any]) -> dict[str, Any]:
    """The disk's read rate two ways, in this (the run's) cgroup: in the disk tier's pattern
    (formats/disk_rate.measure_disk_rate: reads of the tier's mean piece, its reader threads'
    count in flight, O_DIRECT as the tier reads; offsets drawn by ``seed``) and sequential (8
    MiB reads, 4 in flight, through the page cache, caches dropped; ``disk_rate``)."""
    from freetokend.experts.disk_reads import READ_THREADS
    from freetokend.formats.direct_read import ALIGN
    from freetokend.formats.disk_rate import measure_disk_rate

    pieces = tier_pieces(a["path"], a["piece_kb"] << 10)  # --piece-kb: the runs' pieces
    piece = -(-sum(pieces) // len(pieces) // ALIGN) * ALIGN  # the mean, in whole blocks
    t0 = time.perf_counter()
    r = measure_disk_rate(a["path"], a["tier_bytes"], piece, READ_THREADS, a["seed"])
    tier_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    seq = disk_rate(Path(a["path"]), a["seq_bytes"], seed=a["seed"])
    return {"tier": r.bytes_per_s, "direct": r.direct, "piece": piece, "depth": READ_THREADS,
            "tier_s": tier_s, "seq": seq, "seq_s": time.perf_counter() - t0}  # fmt: skip


def ceiling_rate(before: dict[str, Any], after: dict[str, Any]) -> tuple[float | None, str]:
    """The disk rate a run's ceiling uses, and why: the higher of the tier pattern's rates
    measured right before and right after it (a miss is read as the tier reads it, ~1 MB
    pieces at random offsets: an expert's projections lie apart in the file, so no run can
    read its misses as 8 MiB sequential reads; the higher of the two because the rate drifts
    during a run and a ceiling must bound it: the lower would let a run beat it). Where one
    side failed, the other alone."""
    sides = {k: r["tier"] for k, r in (("before", before), ("after", after)) if r.get("tier")}
    if not sides:
        return None, "no rate measured"
    which = max(sides, key=lambda k: sides[k])
    note = "the higher" if len(sides) == 2 else "the other side failed"
    return sides[which], f"the tier pattern's, {which} the run ({note})"


def print_rates(results: dict[tuple[float, str], list[dict[str, Any]]]) -> None:
    """Each run's disk rates (MB/s, before -> after), its ceiling's rate and why, then each
    limit's spread: the rates' min, median and max, and the median of a run's before/after
    difference (over their mean)."""
    print("disk rates around each run, MB/s (before -> after): the tier's pattern, sequential")
    by_share: dict[float, list[dict[str, Any]]] = {}
    for (share, engine), rows in results.items():
        for i, r in enumerate(rows):
            got = r.get("rates")
            if not got:
                continue
            by_share.setdefault(share, []).append(got)
            b, f = got["before"], got["after"]
            if "tier" not in b or "tier" not in f:
                print(f"  {share:.0%} {engine} #{i}: {b.get('error') or f.get('error')}")
                continue
            rate, of = r.get("ceiling_rate"), r.get("of_ceiling")
            low = min(b["tier"], f["tier"])  # the run's share at the lower rate: the band's top
            print(
                f"  {share:.0%} {engine} #{i}: tier {b['tier'] / 1e6:.0f} -> {f['tier'] / 1e6:.0f} "
                f"({b['piece'] / 1e6:.2f} MB x {b['depth']}, "
                f"{'O_DIRECT' if b['direct'] else 'page cache'}), "
                f"seq {b['seq'] / 1e6:.0f} -> {f['seq'] / 1e6:.0f}; ceiling at "
                + (f"{rate / 1e6:.0f}: {r.get('ceiling_why')}" if rate else "-")
                + (f"; {of:.0%} of it ({of * rate / low:.0%} at the lower rate)" if of else "")
            )
    for share, pairs in sorted(by_share.items()):
        for key, name in (("tier", "tier pattern"), ("seq", "sequential")):
            vals = [p[side][key] for p in pairs for side in ("before", "after")
                    if p[side].get(key)]  # fmt: skip
            drift = [abs(p["before"][key] - p["after"][key]) * 2
                     / (p["before"][key] + p["after"][key])
                     for p in pairs if p["before"].get(key) and p["after"].get(key)]  # fmt: skip
            if vals:
                med = statistics.median(vals)
                print(
                    f"{share:.0%} {name}: {min(vals) / 1e6:.0f} / {med / 1e6:.0f} / "
                    f"{max(vals) / 1e6:.0f} MB/s (min / median / max of {len(vals)}), spread "
                    f"{(max(vals) - min(vals)) / med:.0%} of the median; a run's before vs after "
                    + (f"{statistics.median(drift):.0%} (median)" if drift else "-")
                )
