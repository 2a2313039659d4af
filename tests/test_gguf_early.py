"""The experts of a GGUF file read into their banks before torch is imported
(formats/gguf_early.py): the banks the loader adopts are byte for byte those it fills itself, a
fill of another layout is cancelled, and the fill needs no torch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from gguf_files import kmix_qwen3_moe

from freetokend.formats import gguf_early
from freetokend.models.loader import load_model, model_config

ftdense = pytest.importorskip("ftdense")
if not hasattr(ftdense, "fill_rows"):
    pytest.skip("ftdense without fill_rows (rebuild the extension)", allow_module_level=True)


@pytest.fixture(scope="module")
def gguf_path(builtin_model_dir, tmp_path_factory):
    return kmix_qwen3_moe(tmp_path_factory.mktemp("gguf-early"), builtin_model_dir, seed=5)


def _settings(path: Path, **over: object) -> SimpleNamespace:
    base = dict(model=str(path), disk_tier="auto", quantize=None, quantize_experts=None,
                accelerator="auto", moe_backend="cpu")  # fmt: skip
    return SimpleNamespace(**{**base, **over})


def _equal(a, b) -> bool:
    ta, tb = a.all_tensors(), b.all_tensors()
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def test_banks_filled_before_torch_are_the_loaders(gguf_path):
    """The cpu backend's banks (per-layer Q4_K/Q6_K, interleaved): the fill's memory, wrapped
    with no copy, holds what the loader's own fill writes."""
    cfg = model_config(gguf_path)
    _, want = load_model(gguf_path, cfg, interleave_experts=True, host_only=True)
    fill = gguf_early.start(_settings(gguf_path))
    assert fill is not None and fill.interleave
    _, got = load_model(gguf_path, cfg, interleave_experts=True, host_only=True)
    assert got.interleaved and want.interleaved and got.format == want.format
    assert _equal(got, want)
    addresses = {gguf_early._address(m) for m in fill.memory.values()}
    assert {t.data_ptr() for t in got.all_tensors().values()} == addresses
    assert gguf_early.take(gguf_path) is None  # handed out once


def test_a_fill_the_load_does_not_take_is_cancelled(gguf_path):
    """Banks the load lays out otherwise (not interleaved: not the cpu backend) are filled by
    the loader as before; the early fill stops and frees its memory."""
    cfg = model_config(gguf_path)
    _, want = load_model(gguf_path, cfg)
    fill = gguf_early.start(_settings(gguf_path))
    assert fill is not None
    _, got = load_model(gguf_path, cfg)
    assert not got.interleaved and _equal(got, want)
    assert not fill.memory
    fill = gguf_early.start(_settings(gguf_path))  # the disk tier: the experts stay in the file
    assert fill is not None
    _, tiered = load_model(gguf_path, cfg, expert_cache_bytes=1 << 20, interleave_experts=True)
    assert tiered.disk is not None and not fill.memory


@pytest.mark.parametrize(
    "over",
    [
        dict(disk_tier="on"),
        dict(quantize_experts="q8_0"),
        dict(moe_backend="offload"),
        dict(accelerator="fake-cuda"),
        dict(model=""),
    ],
)
def test_no_fill_where_the_load_would_not_take_it(gguf_path, over):
    assert gguf_early.start(_settings(gguf_path, **over)) is None


def test_the_fill_runs_without_torch(gguf_path):
    code = (
        "import sys, types\n"
        "from freetokend.formats import gguf_early\n"
        f"cfg = types.SimpleNamespace(model={str(gguf_path)!r}, disk_tier='off', quantize=None,"
        " quantize_experts=None, accelerator='auto', moe_backend='cpu')\n"
        "fill = gguf_early.start(cfg)\n"
        "fill.wait()\n"
        "assert 'torch' not in sys.modules and 'numpy' not in sys.modules, 'imported'\n"
        "print(sum(sum(m[:4096]) for m in fill.memory.values()) > 0)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"


def test_a_read_past_the_end_is_an_error(tmp_path):
    path = tmp_path / "short"
    path.write_bytes(b"x" * 100)
    dest = bytearray(64)
    import ctypes

    addr = ctypes.addressof(ctypes.c_char.from_buffer(dest))
    fd = os.open(path, os.O_RDONLY)
    try:
        ftdense.fill_rows(fd, [(0, 32, addr, -1, 0, 0)], 2)
        assert bytes(dest[:32]) == b"x" * 32
        with pytest.raises(RuntimeError, match="ends early"):
            ftdense.fill_rows(fd, [(80, 64, addr, -1, 0, 0)], 2)
        flag = ctypes.c_uint8(1)  # cancelled before it starts: nothing read
        dest[:] = bytes(64)
        ftdense.fill_rows(fd, [(0, 32, addr, -1, 0, 0)], 1, ctypes.addressof(flag))
        assert bytes(dest) == bytes(64)
    finally:
        os.close(fd)
