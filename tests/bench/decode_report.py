"""bench_decode's results: one row per engine, the medians of its rounds, and the printed table
with the (ours, peer) comparisons: speed ratios, greedy tokens and logits on the same input."""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, field


@dataclass
class Row:
    engine: str
    decode_tok_s: float | None = None
    prefill_tok_s: float | None = None
    note: str = ""
    extra: dict[str, object] = field(default_factory=dict)
    bytes_per_token: int = 0  # weight bytes one decoded token reads in this engine's precision


@dataclass
class Report:
    read_rounds: list[float]  # the memory-read bandwidth measured in each round (bytes/s)
    bytes_per_token: int
    threads: int
    rows: list[Row]
    pairs: tuple[tuple[str, str], ...] = ()  # (ours, peer) engines compared line by line

    @property
    def read_bytes_s(self) -> float:
        return statistics.median(self.read_rounds)

    @property
    def roofline_tok_s(self) -> float:
        return self.read_bytes_s / self.bytes_per_token

    def _bytes(self, r: Row) -> int:
        return r.bytes_per_token or self.bytes_per_token

    def roofline_fraction(self, r: Row) -> float:
        """The median over the row's rounds of its decode speed against the read bandwidth
        measured in the same round (the row's median speed against the median bandwidth when
        it does not say its rounds)."""
        by_round = _rounds(r, "decode")
        if not by_round or any(i >= len(self.read_rounds) for i in by_round):
            return (r.decode_tok_s or 0.0) * self._bytes(r) / self.read_bytes_s
        return statistics.median(
            tok_s * self._bytes(r) / self.read_rounds[i] for i, tok_s in by_round.items()
        )

    def table(self) -> str:
        gb = 1e9
        lines = [
            f"memory read bandwidth ({self.threads} threads): {self.read_bytes_s / gb:.1f} GB/s"
            f" (median; rounds: {', '.join(f'{b / gb:.1f}' for b in self.read_rounds)});"
            f" weights read per decoded token (BF16): {self.bytes_per_token / 1e6:.0f} MB;"
            f" decode roofline (BF16): {self.roofline_tok_s:.1f} tok/s",
            f"{'engine':<16} {'MB/token':>8} {'decode tok/s':>12} {'ms/token':>9} {'GB/s':>6}"
            f" {'roofline':>9} {'prefill tok/s':>14}  note",
        ]
        for r in self.rows:
            mb = f"{self._bytes(r) / 1e6:8.0f}"
            if r.decode_tok_s is None:
                lines.append(
                    f"{r.engine:<16} {mb} {'-':>12} {'-':>9} {'-':>6} {'-':>9} {'-':>14}  {r.note}"
                )
                continue
            frac = self.roofline_fraction(r)
            lines.append(
                f"{r.engine:<16} {mb} {r.decode_tok_s:12.1f} {1e3 / r.decode_tok_s:9.1f}"
                f" {r.decode_tok_s * self._bytes(r) / gb:6.1f} {frac:9.0%}"
                f" {r.prefill_tok_s or 0:14.1f}  {r.note}"
            )
        lines.append(
            f"(medians over rounds x repeats, engines interleaved per round; MB/token measured"
            f" from the loaded tensors where the engine reports it; agree = greedy tokens equal"
            f" to the bf16 freetoken row's; same input = each engine's logits of one 48-token"
            f" prompt, position by position; load = 1-min load average while the engine ran, on"
            f" {os.cpu_count()} CPUs: a shared machine slows every engine)"
        )
        by_name = {r.engine: r for r in self.rows}
        for us, them in self.pairs:
            ours, peer = by_name.get(us), by_name.get(them)
            if ours is None or peer is None or not (ours.decode_tok_s and peer.decode_tok_s):
                continue
            pre = (ours.prefill_tok_s or 0) / peer.prefill_tok_s if peer.prefill_tok_s else 0
            a, b = ours.extra.get("greedy"), peer.extra.get("greedy")
            agree = ""
            if isinstance(a, list) and isinstance(b, list) and b:
                same = sum(x == y for x, y in zip(a, b, strict=False))
                agree = f", greedy tokens equal {same}/{len(b)}"
            fa, fb = ours.extra.get("logits_file"), peer.extra.get("logits_file")
            if isinstance(fa, str) and isinstance(fb, str):
                agree += "; " + logits_agreement(fa, fb)
            lines.append(
                f"{us} / {them}: decode {ours.decode_tok_s / peer.decode_tok_s:.2f}x"
                f"{paired_ratios(ours, peer)}, prefill {pre:.2f}x{agree}"
            )
        lines += spell_lines(self.rows, self.pairs)
        return "\n".join(lines)


def logits_agreement(ours: str, peer: str) -> str:
    """Both engines' logits of one prompt (.npy files [T, vocab], decode_workers' ``logits``)
    compared position by position: top-1 equal, the relative difference ||ours - peer|| /
    ||peer||, and how many of the other positions are near ties, where the peer's margin of its
    top-1 over ours is below that position's largest |difference| (noise of that size swaps
    them, as two int8 roundings of the same activations do)."""
    import numpy as np

    o, p = np.load(ours), np.load(peer)
    if o.shape != p.shape:
        return f"logits shapes differ ({o.shape} vs {p.shape})"
    ot, pt = o.argmax(-1), p.argmax(-1)
    rows = np.arange(len(p))
    margin = p[rows, pt] - p[rows, ot]
    noise = np.abs(o - p).max(-1)
    other = ot != pt
    ties = int((other & (margin < noise)).sum())
    rel = float(np.linalg.norm(o - p) / np.linalg.norm(p))
    ties_note = f" (of the {int(other.sum())} other, {ties} near a tie)" if other.any() else ""
    return (
        f"same input, top-1 equal {int((~other).sum())}/{len(p)}{ties_note},"
        f" logits differ by {rel:.2%}"
    )


def _rounds(r: Row, what: str) -> dict[int, float]:
    """The row's ``what`` ("decode" or "prefill") tok/s by round, as median_row kept them."""
    got = r.extra.get(f"{what}_rounds")
    return {int(k): float(v) for k, v in got.items()} if isinstance(got, dict) else {}


def paired_ratios(ours: Row, peer: Row) -> str:
    """ ", paired rounds median X (a, b, ...)": ours over the peer's decode in each round both
    ran, and their median; "" when fewer than two rounds pair up. The ratio of the two medians
    can pair one engine's slow spell with the other's fast one; a round's two runs are minutes
    apart."""
    a, b = _rounds(ours, "decode"), _rounds(peer, "decode")
    both = sorted(set(a) & set(b))
    if len(both) < 2:
        return ""
    ratios = [a[i] / b[i] for i in both]
    listed = ", ".join(f"{x:.2f}" for x in ratios)
    return f" (paired rounds: median {statistics.median(ratios):.2f}x of {listed})"


def median_row(rows: list[Row]) -> Row:
    """Median decode and median prefill over an engine's rounds (its notes from the first);
    extra's ``decode_rounds`` and ``prefill_rounds`` keep each round's figure by the round
    number its row carried in extra["round"] (its place in ``rows`` when none)."""

    def round_of(r: Row, i: int) -> int:
        got = r.extra.get("round", i)
        return got if isinstance(got, int) else i

    ok = [(round_of(r, i), r) for i, r in enumerate(rows) if r.decode_tok_s is not None]
    if not ok:
        return rows[0]
    dec = statistics.median(r.decode_tok_s for _, r in ok if r.decode_tok_s is not None)
    pre = statistics.median(r.prefill_tok_s or 0.0 for _, r in ok)
    first = ok[0][1]
    note = first.note + (f", rounds {len(ok)}" if len(ok) > 1 else "")
    failed = [r for r in rows if r.decode_tok_s is None]
    if failed:  # a round that failed is dropped from the medians, and said so
        note += f" of {len(rows)} ({len(failed)} failed: {failed[0].note[:120]})"
    extra = {
        **first.extra,
        "decode_rounds": {i: r.decode_tok_s for i, r in ok},
        "prefill_rounds": {i: r.prefill_tok_s or 0.0 for i, r in ok},
        "decode_samples": [s for _, r in ok for s in _samples(r)],
    }
    return Row(first.engine, dec, pre, note, extra)


def _samples(r: Row) -> list[tuple[float, float, float]]:
    """(tok/s, read bytes/s before, after) of each decode repeat the row's worker bracketed
    with bandwidth reads (decode_workers' ``decode_bw``); already gathered ones as they are."""
    got = r.extra.get("decode_samples")
    if isinstance(got, list):
        return [(float(a), float(b), float(c)) for a, b, c in got]
    speeds, bws = r.extra.get("decode_all"), r.extra.get("decode_bw")
    if not isinstance(speeds, list) or not isinstance(bws, list):
        return []
    return [(float(t), float(b[0]), float(b[1])) for t, b in zip(speeds, bws, strict=False)]


STEADY = 0.10  # a repeat whose two bandwidth reads differ by more straddled a change: left out
SPELLS = 1.3  # bandwidths this far apart (max / min) split into a slow and a fast spell


def spell_lines(rows: list[Row], pairs: tuple[tuple[str, str], ...]) -> list[str]:
    """Each (ours, peer) pair compared within spells of the machine's memory bandwidth.

    A shared VM's read bandwidth sits at one of two levels that change minutes apart (here ~37
    and ~68 GB/s), and an engine's speed follows it, so two engines measured minutes apart can
    differ by the machine alone. Every decode repeat carries the bandwidth read just before and
    just after it; the steady ones (the two within STEADY) are split at the geometric mean of the
    lowest and highest bandwidth when those are SPELLS apart, and each pair is compared within a
    spell: the ratio of median speeds, and each engine's median speed against the bandwidth
    beside it (the share of the read ceiling it reached then)."""
    steady: dict[str, list[tuple[float, float]]] = {}
    left_out = 0
    for r in rows:
        for tok_s, before, after in _samples(r):
            if abs(before - after) > STEADY * max(before, after):
                left_out += 1
                continue
            steady.setdefault(r.engine, []).append((tok_s, (before + after) / 2))
    bws = [bw for got in steady.values() for _, bw in got]
    if not bws:
        return []
    lo, hi = min(bws), max(bws)
    split = (lo * hi) ** 0.5 if hi >= SPELLS * lo else None
    gb = 1e9
    spells = (
        [("slow", lambda bw: bw < split), ("fast", lambda bw: bw >= split)]
        if split is not None
        else [("all", lambda bw: True)]
    )
    head = (
        f"decode within spells of the read bandwidth (each repeat's, read just before and after"
        f" it; {left_out} repeat(s) that straddled a change left out): "
        + (
            f"slow below {split / gb:.1f} GB/s, fast above"
            if split is not None
            else f"one spell, {lo / gb:.1f}-{hi / gb:.1f} GB/s"
        )
    )
    lines = [head]
    by_name = {r.engine: r for r in rows}
    for us, them in pairs:
        if us not in steady or them not in steady:
            continue
        parts = []
        for name, inside in spells:
            a = [(t, bw) for t, bw in steady[us] if inside(bw)]
            b = [(t, bw) for t, bw in steady[them] if inside(bw)]
            if not a or not b:
                parts.append(f"{name}: -" + (" (ours only)" if a else " (peer only)" if b else ""))
                continue
            ta = statistics.median(t for t, _ in a)
            tb = statistics.median(t for t, _ in b)
            fa = statistics.median(t * by_name[us].bytes_per_token / bw for t, bw in a)
            fb = statistics.median(t * by_name[them].bytes_per_token / bw for t, bw in b)
            read = statistics.median(bw for _, bw in a + b) / gb
            both = by_name[us].bytes_per_token and by_name[them].bytes_per_token
            share = f"; {fa:.0%} vs {fb:.0%} of the read" if both else ""
            parts.append(
                f"{name} (~{read:.0f} GB/s): {ta / tb:.2f}x ({ta:.1f} vs {tb:.1f} tok/s{share};"
                f" repeats {len(a)}, {len(b)})"
            )
        lines.append(f"{us} / {them}: " + ", ".join(parts))
    return lines
