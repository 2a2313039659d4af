"""bench_decode's results: one row per engine, the medians of its rounds, and the printed table
with the (ours, peer) comparisons: speed ratios, greedy tokens and logits on the same input."""

from __future__ import annotations

import os
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
    read_bytes_s: float
    bytes_per_token: int
    threads: int
    rows: list[Row]
    pairs: tuple[tuple[str, str], ...] = ()  # (ours, peer) engines compared line by line

    @property
    def roofline_tok_s(self) -> float:
        return self.read_bytes_s / self.bytes_per_token

    def _bytes(self, r: Row) -> int:
        return r.bytes_per_token or self.bytes_per_token

    def table(self) -> str:
        gb = 1e9
        lines = [
            f"memory read bandwidth ({self.threads} threads): {self.read_bytes_s / gb:.1f} GB/s;"
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
            frac = r.decode_tok_s * self._bytes(r) / self.read_bytes_s
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
                f"{us} / {them}: decode {ours.decode_tok_s / peer.decode_tok_s:.2f}x,"
                f" prefill {pre:.2f}x{agree}"
            )
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


def median_row(rows: list[Row]) -> Row:
    """Median decode and median prefill over an engine's rounds (its notes from the first)."""
    import statistics

    ok = [r for r in rows if r.decode_tok_s is not None]
    if not ok:
        return rows[0]
    dec = statistics.median(r.decode_tok_s for r in ok if r.decode_tok_s is not None)
    pre = statistics.median(r.prefill_tok_s or 0.0 for r in ok)
    first = ok[0]
    note = first.note + (f", rounds {len(ok)}" if len(ok) > 1 else "")
    return Row(first.engine, dec, pre, note, first.extra)
