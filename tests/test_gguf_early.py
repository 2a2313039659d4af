"""The experts of a GGUF file read into their banks before torch is imported
(formats/gguf_early.py): the banks the loader adopts are byte for byte those it fills itself, a
fill of another layout is cancelled, and the fill needs no torch. A fill still running when the
load ends is handed to the cpu backend, which computes a layer once that layer's rows are in
and a decode step once all are."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from gguf_files import kmix_qwen3_moe

from freetokend.experts.backend import CpuBackend
from freetokend.experts.banks import ActivationSpec, activation_of
from freetokend.formats import gguf_early
from freetokend.models.loader import load_model, model_config

ftdense = pytest.importorskip("ftdense")
if not hasattr(ftdense, "fill_rows"):
    pytest.skip("ftdense without fill_rows (rebuild the extension)", allow_module_level=True)


@pytest.fixture(scope="module")
def gguf_path(builtin_model_dir, tmp_path_factory):
    return kmix_qwen3_moe(tmp_path_factory.mktemp("gguf-early"), builtin_model_dir, seed=5)


@pytest.fixture(scope="module")
def bf16_path(builtin_model_dir, tmp_path_factory):
    """The same model's file with every matrix BF16 (the converter's output): bf16 banks."""
    d = tmp_path_factory.mktemp("gguf-early-bf16")
    return kmix_qwen3_moe(d, builtin_model_dir, seed=6, kind="bf16")


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
    got.wait_filled()  # a fill still running at the load's end is handed over, not waited for
    assert got.filling is None
    assert got.interleaved and want.interleaved and got.format == want.format
    assert _equal(got, want)
    addresses = {gguf_early._address(m) for m in fill.memory.values()}
    assert {t.data_ptr() for t in got.all_tensors().values()} == addresses
    assert gguf_early.take(gguf_path) is None  # handed out once


def test_bf16_banks_filled_before_torch_are_the_loaders(bf16_path):
    """A BF16 file's experts: the cpu backend's bf16 banks (gate_up [N, 2I, H], each expert's
    gate rows then its up rows; down [N, H, I]) filled before torch hold what the loader's own
    fill writes, which is the file's rows as they are (no interleave)."""
    from freetokend.formats.gguf_header import read_header

    cfg = model_config(bf16_path)
    assert cfg.expert_format == "bf16" and cfg.torch_dtype == "bfloat16"
    _, want = load_model(bf16_path, cfg, interleave_experts=True, host_only=True)
    fill = gguf_early.start(_settings(bf16_path))
    assert fill is not None and fill.floats and not fill.interleave
    _, got = load_model(bf16_path, cfg, interleave_experts=True, host_only=True)
    got.wait_filled()
    assert got.filling is None and not got.interleaved
    assert got.format == want.format == "bf16" and got.gate_up.dtype == torch.bfloat16
    assert _equal(got, want)
    addresses = {gguf_early._address(m) for m in fill.memory.values()}
    assert {t.data_ptr() for t in got.all_tensors().values()} == addresses
    e, i = cfg.num_experts, cfg.moe_intermediate_size
    tensors = read_header(bf16_path).tensors
    raw = bf16_path.read_bytes()
    for moe, b in enumerate(fill.blocks):
        for proj, bank in (
            ("gate", got.gate_up[:, :i]), ("up", got.gate_up[:, i:]), ("down", got.down)
        ):  # fmt: skip
            t = tensors[f"blk.{b}.ffn_{proj}_exps.weight"]
            stored = torch.frombuffer(
                bytearray(raw[t.offset : t.offset + t.nbytes]), dtype=torch.int16
            )
            assert torch.equal(
                bank[moe * e : (moe + 1) * e].view(torch.int16), stored.view(t.shape)
            )


def test_bf16_tokens_are_those_of_a_load_without_the_fill(bf16_path):
    """Greedy tokens of the engine over banks the early fill read (still filling when the load
    ends, or not) are those of an engine that read them itself."""
    from freetokend.engine.llm import LLM

    prompts = [[5, 17, 230, 41, 9, 77], [300, 2, 2, 81]]
    llm = LLM(bf16_path, max_model_len=64, kv_tokens=256)
    try:
        want = llm.generate(prompts, 8, ignore_eos=True)
    finally:
        llm.close()
    fill = gguf_early.start(_settings(bf16_path))
    assert fill is not None
    llm = LLM(bf16_path, max_model_len=64, kv_tokens=256)
    try:
        assert gguf_early.take(bf16_path) is None and fill.memory  # taken, not cancelled
        assert llm.generate(prompts, 8, ignore_eos=True) == want
    finally:
        llm.close()


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


def _child(gguf_path: Path, before: str, after: str) -> str:
    """Runs ``before``, a fill started for ``gguf_path`` as ``fill``, then ``after``, in a fresh
    interpreter (asserting it exits 0); its output."""
    code = (
        f"{before}"
        "import types\n"
        "from freetokend.formats import gguf_early\n"
        f"cfg = types.SimpleNamespace(model={str(gguf_path)!r}, disk_tier='off', quantize=None,"
        " quantize_experts=None, accelerator='auto', moe_backend='cpu')\n"
        f"{after}"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_the_fill_runs_without_torch(gguf_path):
    out = _child(
        gguf_path,
        "import sys\n",
        "fill = gguf_early.start(cfg)\n"
        "fill.wait()\n"
        "assert 'torch' not in sys.modules and 'numpy' not in sys.modules, 'imported'\n"
        "print(sum(sum(m[:4096]) for m in fill.memory.values()) > 0)\n",
    )
    assert out.strip() == "True"


def test_a_fill_still_running_at_exit_is_stopped_first(gguf_path):
    """An interpreter that exits with a fill running (a daemon stopped within seconds of its
    start) stops the fill before finalization frees its banks: left running, its native
    threads crashed the exit (SIGSEGV in their copy, or SIGABRT). Here the fill is held back
    (a file in the page cache, never taken), so it is still running at exit for certain; the
    check registered before the module's handler runs after it."""
    out = _child(
        gguf_path,
        "import atexit\n"
        "held = {}\n"
        "atexit.register(lambda: print(held['fill'].done(), held['fill']._cancel.value))\n",
        "gguf_early.cached = lambda header: True\n"
        "held['fill'] = gguf_early.start(cfg)\n"
        "assert not held['fill'].done()\n",
    )
    assert out.split() == ["True", "1"]


def test_a_fill_of_a_file_in_the_page_cache_waits_to_be_taken(gguf_path, monkeypatch):
    """Experts all in the page cache (a warm start): the fill is held back until the loader
    takes it (or anything waits for it); a file not all cached is read at once."""
    from freetokend.formats.gguf_header import read_header

    gguf_path.read_bytes()  # in the page cache
    assert gguf_early.cached(read_header(gguf_path))
    fill = gguf_early.start(_settings(gguf_path))
    assert fill is not None
    try:
        threading.Event().wait(0.3)
        assert not fill._in and not fill.done()  # held back
        assert gguf_early.take(gguf_path) is fill
        fill.wait()  # taken: it runs
        assert fill._in == set(range(len(fill.blocks)))
    finally:
        fill.cancel()
    monkeypatch.setattr(gguf_early, "cached", lambda header: False)
    fill = gguf_early.start(_settings(gguf_path))
    assert fill is not None
    try:
        fill._thread.join(30)  # type: ignore[union-attr]  # not taken, not waited for: runs
        assert fill.done() and fill._in == set(range(len(fill.blocks)))
    finally:
        gguf_early.take(gguf_path)
        fill.cancel()


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


class _Gated:
    """ftdense whose ``fill_rows`` (one call a MoE layer) waits for a permit each call."""

    def __init__(self) -> None:
        self.permits = threading.Semaphore(0)
        self.qinterleave = ftdense.qinterleave

    def fill_rows(self, *args):  # type: ignore[no-untyped-def]
        assert self.permits.acquire(timeout=60), "never released"
        return ftdense.fill_rows(*args)


def _returns_within(fn, seconds: float) -> bool:  # type: ignore[no-untyped-def]
    """Runs ``fn`` on a thread; whether it returned within ``seconds`` (it goes on if not)."""
    done = threading.Event()
    threading.Thread(target=lambda: (fn(), done.set()), daemon=True).start()
    return done.wait(seconds)


@pytest.mark.parametrize("file", ["gguf_path", "bf16_path"])
def test_the_cpu_backend_computes_each_layer_once_its_rows_are_in(file, request, monkeypatch):
    """The load returns with the fill still running (``banks.filling``); the backend's prompt
    step computes a MoE layer once that layer's rows are in, not before; a decode step waits
    for every layer; the results are those of banks loaded whole (block banks, and the bf16
    banks of a BF16 file)."""
    gguf_path = request.getfixturevalue(file)
    cfg = model_config(gguf_path)
    _, want = load_model(gguf_path, cfg, interleave_experts=True, host_only=True)
    act = ActivationSpec(activation_of(cfg.activation), cfg.swiglu_alpha, cfg.swiglu_limit)
    ref = CpuBackend(want, cfg.num_experts, act)
    gate = _Gated()
    monkeypatch.setitem(sys.modules, "ftdense", gate)
    fill = gguf_early.start(_settings(gguf_path))
    assert fill is not None
    try:
        _, got = load_model(gguf_path, cfg, interleave_experts=True, host_only=True)
        assert got.filling is fill and not fill.done()  # served before the rows are read
        be = CpuBackend(got, cfg.num_experts, act)
        order = [moe for moe, _ in gguf_early._layer_jobs(fill)]  # the file's layer order
        assert sorted(order) == list(range(cfg.num_moe_layers)) and len(order) >= 2
        g = torch.Generator().manual_seed(3)
        x = torch.randn(6, cfg.hidden_size, generator=g)
        ids = torch.randint(0, cfg.num_experts, (6, cfg.top_k), generator=g)
        w = torch.rand(6, cfg.top_k, generator=g)
        out: dict[int, torch.Tensor] = {}

        def layer(m: int):  # type: ignore[no-untyped-def]
            return lambda: out.__setitem__(m, be.forward(m, x, ids, w))

        be.begin_step(6, prefill=True)  # a prompt step does not wait
        assert not _returns_within(layer(order[0]), 0.3)  # no layer is in
        assert not _returns_within(lambda: fill.wait_layer(order[1]), 0.01)
        gate.permits.release()  # the file's first layer
        assert _returns_within(lambda: fill.wait_layer(order[0]), 30)
        assert not _returns_within(layer(order[1]), 0.3)  # its rows are not in yet
        decode = threading.Event()
        threading.Thread(target=lambda: (be.begin_step(1), decode.set()), daemon=True).start()
        for _ in order[1:-1]:
            gate.permits.release()
        assert not decode.wait(0.3)  # the last layer is not in: a decode step waits
        gate.permits.release()
        assert decode.wait(30) and fill.done() and got.filling is None
        for m in order:
            want_m = ref.forward(m, x, ids, w)
            got_m = out.get(m) if m in order[:2] else be.forward(m, x, ids, w)
            for _ in range(300):  # the two blocked calls end once their layer is in
                if got_m is not None:
                    break
                threading.Event().wait(0.1)
                got_m = out.get(m)
            assert got_m is not None and torch.equal(got_m, want_m), m
    finally:
        for _ in range(64):
            gate.permits.release()
        fill.stop()


def test_a_fill_that_fails_fails_the_layers_not_in(tmp_path, gguf_path, monkeypatch):
    """A read error after the load handed the fill over reaches the layers still waiting."""

    class _Failing(_Gated):
        def fill_rows(self, *args):  # type: ignore[no-untyped-def]
            raise RuntimeError("the file ends early")

    monkeypatch.setitem(sys.modules, "ftdense", _Failing())
    fill = gguf_early.start(_settings(gguf_path))
    assert fill is not None
    fill.release()  # (a file in the page cache: held back until taken)
    fill._thread.join(30)  # type: ignore[union-attr]
    with pytest.raises(gguf_early.GgufFormatError, match="cannot be read"):
        fill.wait_layer(0)


def test_the_loaders_own_tensors_are_read_ahead_first(gguf_path):
    """``dense_ranges``: every tensor but the stacked experts, each inside one range, no range
    touching an expert stack's bytes, in file order (what the CLI's read-ahead reads first)."""
    from freetokend.formats.gguf_header import expert_stacks, read_header

    header = read_header(gguf_path)
    ranges = gguf_early.dense_ranges(header)
    assert ranges == sorted(ranges) and ranges
    stacks = {t.name for p in expert_stacks(header.tensors).values() for t in p.values()}
    assert stacks
    for t in header.tensors.values():
        inside = [a <= t.offset and t.offset + t.nbytes <= a + n for a, n in ranges]
        overlaps = [t.offset < a + n and a < t.offset + t.nbytes for a, n in ranges]
        assert any(inside) if t.name not in stacks else not any(overlaps), t.name
