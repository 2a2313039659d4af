"""The whole engine on the fake CUDA device (ARCHITECTURE §9.2): ``LLM(..., accelerator="fake-cuda",
vram_mib=N)`` loads a tiny checkpoint, runs a 512-token prefill, decode steps and (slot backends)
a resize down and up, with the real CUDA code path of every MoE backend.

What is checked: no host/device mix (it would raise), every dense weight, the KV pool and the
rope tables on the device, the device peak within the simulated card (a resize included), and
the host syncs of a decode step, counted exactly: the dense part runs on the device, so the step's
one read is its sampled token ids; hybrid adds, per MoE layer, one asynchronous packed copy of
its CPU share's activations, gate weights and expert ids into page-locked memory, and its CPU
branch's wait for that copy (an ``event`` wait: in the branch's own thread on a GPU, inline on
the fake card). A change that adds a sync to the decode step fails here. The tokens are not checked: the fake device holds no data (its outputs reach the host as
zeros), only that they are valid ids."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from tiny_models import make_tiny

from freetokend import LLM
from freetokend.engine.resize import resize_expert_slots
from freetokend.engine.sampler import SamplingParams
from freetokend.experts.fakecuda import FakeCudaAccelerator

MIB = 1 << 20
VRAM_MIB = 1024  # 512 MiB usable after the simulated CUDA context
PROMPT = 512
DECODE_STEPS = 3
# host waits of one decode step per MoE layer (see the module docstring), besides the token ids
SYNCS_PER_MOE_LAYER = {"fused": 0, "offload": 0, "hybrid": 1}


def _decode_syncs(backend: str, moe_layers: int) -> Counter[str]:
    """The syncs of one decode step by kind: the token ids' read, hybrid's branch waits."""
    return Counter(d2h=1, event=SYNCS_PER_MOE_LAYER[backend] * moe_layers) + Counter()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # qwen3_moe: 3 layers, 2 of them MoE (8 experts, top-2); the context fits the prompt
    d = tmp_path_factory.mktemp("fake-cuda-engine")
    make_tiny("qwen3_moe", d, seed=11, max_position_embeddings=1024)
    return d


def _step(llm: LLM) -> list[int]:
    ids = [o.token_id for o in llm.engine.step()]
    vocab = llm.config.vocab_size
    assert ids and all(isinstance(t, int) and 0 <= t < vocab for t in ids), ids
    return ids


@pytest.mark.parametrize("backend", ["fused", "offload", "hybrid"])
def test_engine_runs_on_the_fake_card(tiny_dir: Path, backend: str) -> None:
    llm = LLM(tiny_dir, backend, accelerator="fake-cuda", vram_mib=VRAM_MIB, kv_tokens=2048)
    try:
        acc = llm.fake_device
        assert isinstance(acc, FakeCudaAccelerator) and llm.moe.acc is acc
        tr = acc.tracker
        moe_layers = llm.config.num_moe_layers
        _assert_dense_on_device(llm)
        loaded = tr.sweep()
        assert loaded >= moe_layers * 8 * 3 * 64 * 32 * 2  # the device banks (bf16 experts)
        prompt = [3 + i % 90 for i in range(PROMPT)]
        llm.engine.add_request("r", prompt, SamplingParams(max_tokens=16, ignore_eos=True))
        _step(llm)  # the whole prompt in one step (max_step_tokens 512)
        assert tr.peak <= tr.capacity
        per_step, copied = [], []
        h2d = tr.syncs.h2d  # the load's (weights to the card): blocking, once
        for _ in range(DECODE_STEPS):
            before, async_before = Counter(tr.syncs.by_kind), tr.async_d2h
            _step(llm)
            per_step.append(Counter(tr.syncs.by_kind) - before)
            copied.append(tr.async_d2h - async_before)
        want = _decode_syncs(backend, moe_layers)
        assert per_step == [want] * DECODE_STEPS, (tr.syncs.by_kind, per_step)
        # hybrid's inputs cross asynchronously, once per MoE layer; nothing else does
        assert copied == [SYNCS_PER_MOE_LAYER[backend] * moe_layers] * DECODE_STEPS, copied
        assert tr.syncs.h2d == h2d  # no blocking host -> device copy in a decode step
        # copies back to the host and branch waits, no scalar reads
        assert set(tr.syncs.by_kind) <= {"d2h", "h2d", "event"}, tr.syncs.by_kind
        expected = want.total()
        print(f"\n{backend}: {expected} host syncs per decode step over {moe_layers} MoE layers")
        # a seeded sampled request: its generator lives on the device, still one read per step
        llm.engine.add_request(
            "s", [4, 5, 6], SamplingParams(max_tokens=4, temperature=0.8, top_k=5, top_p=0.9,
                                           min_p=0.05, seed=3, ignore_eos=True),
        )  # fmt: skip
        _step(llm)  # its prompt beside r's decode row
        before = tr.syncs.total
        _step(llm)  # two decode rows, one greedy and one seeded
        assert tr.syncs.total - before == expected
        assert tr.peak <= tr.capacity
        if backend != "fused":
            with acc.in_thread():  # the engine's steps enter it themselves; a direct call not
                _resize_down_and_up(llm)
            _step(llm)  # the engine goes on after the resizes
    finally:
        llm.close()
    assert llm.fake_device is None
    with FakeCudaAccelerator(vram_mib=VRAM_MIB):  # close() left the process-wide session
        pass


class _EvenTokens:
    """A grammar stand-in that masks in place on the logits' device."""

    def fill_mask(self, logits: torch.Tensor) -> None:
        with torch.inference_mode():
            logits[1::2] = float("-inf")

    def accept(self, token_id: int) -> None:
        pass

    def is_terminated(self) -> bool:
        return False


def test_grammar_and_logprobs_on_the_fake_card(tiny_dir: Path) -> None:
    """A grammar mask is applied on the device (no read); logprobs cost one packed read."""
    llm = LLM(tiny_dir, "offload", accelerator="fake-cuda", vram_mib=VRAM_MIB, kv_tokens=256)
    try:
        tr = llm.fake_device.tracker
        for constraint, logprobs, reads in ((_EvenTokens(), None, 1), (None, 3, 2)):
            params = SamplingParams(max_tokens=3, ignore_eos=True, logprobs=logprobs)
            llm.engine.add_request("g", [5, 6, 7], params, constraint)
            llm.engine.step()
            before = tr.syncs.total
            (out,) = llm.engine.step()
            assert out.error is None and tr.syncs.total - before == reads
            assert (out.top_logprobs is not None) == (logprobs is not None)
            llm.engine.abort("g")
            llm.engine.step()
    finally:
        llm.close()


def _assert_dense_on_device(llm: LLM) -> None:
    """Nothing of the dense part is on the host: weights, rope tables, KV pool."""
    on_host = [n for n, p in llm.model.named_parameters() if p.device.type != "cuda"]
    assert not on_host, on_host
    assert llm.model.rope.inv_freq.device.type == "cuda"
    kv = llm.runner.kv
    assert kv.device.type == "cuda" and kv.k.device.type == kv.v.device.type == "cuda"
    assert llm.runner.placement.on_device and llm.runner.placement.acc is llm.fake_device


def _resize_down_and_up(llm: LLM) -> None:
    be = llm.moe
    tr = be.acc.tracker
    slot = be.slots.nbytes_per_expert()
    default = be.cache.num_slots
    for n, old in ((2, default), (default, 2)):
        tr.reset_peak()
        live = tr.sweep() - old * slot  # what lives besides the slot banks
        resize_expert_slots(be, n)
        assert be.cache.num_slots == n
        # never old + new banks at once: the larger of the two, plus the small copy lists
        assert tr.peak <= live + max(old, n) * slot + MIB, (n, tr.peak, live)
        assert tr.peak <= tr.capacity


def test_engine_steps_from_another_thread(tiny_dir: Path) -> None:
    """The daemon builds the LLM in one thread and steps it in its engine thread: the fake
    device's modes are per thread, each step enters them where it runs."""
    import threading

    llm = LLM(tiny_dir, "offload", accelerator="fake-cuda", vram_mib=VRAM_MIB, kv_tokens=256)
    try:
        loaded = llm.fake_device.tracker.syncs.total  # the load's (weights to the card: h2d)
        llm.engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))
        got: list[object] = []

        def run() -> None:
            try:
                got.extend(_step(llm) + _step(llm))
            except BaseException as e:  # reported by the assertion below
                got.append(e)

        t = threading.Thread(target=run)
        t.start()
        t.join(60)
        assert len(got) == 2 and all(isinstance(x, int) for x in got), got
        assert llm.fake_device.tracker.syncs.total - loaded == 2  # two steps: their token ids
    finally:
        llm.close()


def test_fake_cuda_needs_the_card_size(tiny_dir: Path) -> None:
    with pytest.raises(ValueError, match="vram_mib"):
        LLM(tiny_dir, "offload", accelerator="fake-cuda")
    with pytest.raises(ValueError, match="vram_mib"):
        LLM(tiny_dir, "offload", accelerator="standin", vram_mib=8192)
    with FakeCudaAccelerator(vram_mib=VRAM_MIB):  # a failed load left no session behind
        pass


@pytest.mark.parametrize("backend", ["fused", "hybrid"])
def test_parking_frees_the_dense_weights_on_the_card(tiny_dir: Path, backend: str) -> None:
    """A parked (idle) model leaves the card: slots and KV shrink, fused banks go, and the dense
    weights move to the host; unparking brings them back and the engine steps as before."""
    from freetokend.engine.placement import dense_device_bytes
    from freetokend.manager.models import ResidentModel, park, unpark

    llm = LLM(tiny_dir, backend, accelerator="fake-cuda", vram_mib=VRAM_MIB, kv_tokens=2048)
    try:
        acc = llm.fake_device
        tr = acc.tracker
        model = ResidentModel("m", tiny_dir, llm, None, 0, backend)  # type: ignore[arg-type]
        dense = dense_device_bytes(llm.model)
        with acc.in_thread():
            loaded = tr.sweep()
            park(model)
            parked = tr.sweep()
            assert all(p.device.type == "cpu" for p in llm.model.parameters())
            assert loaded - parked >= dense
            unpark(model)
            assert tr.sweep() == pytest.approx(loaded, abs=64 * 1024)
        _assert_dense_on_device(llm)
        llm.engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
        _step(llm)
        before = tr.syncs.total
        _step(llm)
        assert tr.syncs.total - before == _decode_syncs(backend, 2).total()
    finally:
        llm.close()


def test_dense_weights_that_do_not_fit_fail_at_load_with_the_numbers(tmp_path: Path) -> None:
    """No silent fallback to the host: a card without room for the dense weights refuses the
    load, naming their size and the card's free memory; the fake session is left."""
    from freetokend.engine.placement import DenseDoesNotFit

    make_tiny("qwen3_moe", tmp_path, seed=11, vocab_size=8192)  # ~4 MiB of embeddings + head
    with pytest.raises(DenseDoesNotFit, match=r"dense weights .* 4 MiB needed, 1 MiB free"):
        LLM(tmp_path, "offload", accelerator="fake-cuda", vram_mib=513, kv_tokens=256)
    with FakeCudaAccelerator(vram_mib=VRAM_MIB):
        pass


def test_daemon_flags_select_the_fake_card() -> None:
    from freetokend.cli import build_parser
    from freetokend.config import ConfigError, resolve

    def cfg(*argv: str):  # type: ignore[no-untyped-def]
        args = vars(build_parser().parse_args(list(argv)))
        args.pop("config")
        return resolve(args, None, env={})

    c = cfg("--accelerator", "fake-cuda", "--vram-mib", "8192")
    assert (c.accelerator, c.vram_mib) == ("fake-cuda", 8192)
    for bad in (("--accelerator", "fake-cuda"), ("--vram-mib", "8192"),
                ("--accelerator", "fake-cuda", "--vram-mib", "0")):  # fmt: skip
        with pytest.raises(ConfigError, match="vram_mib"):
            cfg(*bad)


@pytest.mark.slow
def test_daemon_serves_on_the_fake_card() -> None:
    """The real daemon process with ``--accelerator fake-cuda``: loaded in one thread, stepped
    in its engine thread, a greedy and a seeded sampled request answered (~20 s here; slow: it starts a process)."""
    from server_support.daemon import MODEL_NAME, start_daemon, state_dir

    d = start_daemon(
        "--model", "builtin", "--state-dir", str(state_dir()), "--admin-socket", "off",
        "--accelerator", "fake-cuda", "--vram-mib", "2048", "--moe-backend", "hybrid",
    )  # fmt: skip
    try:
        for extra in ({"temperature": 0}, {"temperature": 0.8, "seed": 3}):
            body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 3, **extra}
            status, out = d.post("/v1/completions", body)
            assert status == 200, out
            assert out["usage"]["completion_tokens"] == 3
    finally:
        assert d.stop() == 0


def test_cuda_generator_stand_in_for_the_sampler() -> None:
    """``torch.Generator("cuda")`` exists on the fake device (seeded requests sampled there),
    generators keep passing ``isinstance`` checks, and a host generator given to a device op
    raises as on a GPU. Sampling on the device reads nothing back."""
    from freetokend.engine.sampler import make_generator, sample

    real = torch.Generator
    acc = FakeCudaAccelerator(vram_mib=VRAM_MIB)
    with acc:
        seeded = SamplingParams(seed=5, temperature=0.7)
        gen = make_generator(seeded, "cuda")
        assert gen is not None and gen.device == torch.device("cuda", 0)
        assert isinstance(gen, torch.Generator) and isinstance(gen, real)
        host = torch.Generator().manual_seed(1)
        assert isinstance(host, torch.Generator) and host.device.type == "cpu"
        assert gen.get_state().equal(real().manual_seed(5).get_state())  # seeding works
        logits = torch.randn(3, 50, device="cuda")
        params = [seeded, SamplingParams(temperature=0.9, top_p=0.9), SamplingParams()]
        ids = sample(logits, params, [gen, None, None])
        assert ids.shape == (3,) and ids.device == torch.device("cuda", 0)
        assert acc.tracker.syncs.total == 0
        with pytest.raises(RuntimeError, match="'cuda' device type for generator"):
            sample(logits, params, [host, None, None])
    assert torch.Generator is real
