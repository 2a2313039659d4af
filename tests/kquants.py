"""Simple Q4_K and Q6_K quantizers for test files (the ``gguf`` package only dequantizes
K-quants). Not llama.cpp's search for the best scales: plain min/max scales, packed in ggml's
block layouts, so files carry valid K-quant blocks; tests compare against ``gguf.quants``'
dequantization of the same blocks."""

from __future__ import annotations

import numpy as np

QK = 256


def _blocks(a: np.ndarray) -> tuple[np.ndarray, tuple[int, ...]]:
    assert a.shape[-1] % QK == 0
    return a.reshape(-1, QK).astype(np.float32), a.shape[:-1]


def quantize_q4_k(a: np.ndarray) -> np.ndarray:
    """uint8 [..., row/256 * 144]: d, dmin (f16), 12 bytes of 6-bit scales/mins, 128 nibbles."""
    x, lead = _blocks(a)
    n = x.shape[0]
    sub = x.reshape(n, 8, 32)
    lo = np.minimum(sub.min(-1), 0.0)
    scale = (sub.max(-1) - lo) / 15.0
    mins = -lo
    d = (scale.max(-1) / 63.0).astype(np.float16)
    dmin = (mins.max(-1) / 63.0).astype(np.float16)
    df, dmf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.round(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), 0, 63)
    mn = np.clip(np.round(np.divide(mins, dmf, out=np.zeros_like(mins), where=dmf > 0)), 0, 63)
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    step = (df * sc)[..., None]
    q = np.divide(sub + (dmf * mn)[..., None], step, out=np.zeros_like(sub), where=step > 0)
    q = np.clip(np.round(q), 0, 15).astype(np.uint8)  # [n, 8, 32]
    scales = np.zeros((n, 12), np.uint8)
    scales[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = mn[:, 0:4] | ((mn[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0xF) | ((mn[:, 4:8] & 0xF) << 4)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(n, 128)  # chunk c: sub 2c low, 2c+1 high
    out = np.concatenate(
        [d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2), scales, qs], axis=1
    )
    return out.reshape(*lead, -1)


def quantize_q6_k(a: np.ndarray) -> np.ndarray:
    """uint8 [..., row/256 * 210]: ql (128), qh (64), 16 int8 scales, d (f16)."""
    x, lead = _blocks(a)
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    scale = np.abs(sub).max(-1) / 31.0
    d = (scale.max(-1) / 127.0).astype(np.float16)
    df = d.astype(np.float32)[:, None]
    sc = np.clip(np.round(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), 0, 127)
    step = (df * sc)[..., None]
    q = np.divide(sub, step, out=np.zeros_like(sub), where=step > 0)
    q = (np.clip(np.round(q), -32, 31) + 32).astype(np.uint8).reshape(n, 2, 4, 32)  # half, g, l
    lo = q & 0xF
    ql = np.concatenate(
        [lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)], axis=2
    )
    hi = q >> 4
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)
    out = np.concatenate(
        [
            ql.reshape(n, 128),
            qh.reshape(n, 64),
            sc.astype(np.int8).view(np.uint8),
            d.view(np.uint8).reshape(n, 2),
        ],
        axis=1,
    )
    return out.reshape(*lead, -1)
