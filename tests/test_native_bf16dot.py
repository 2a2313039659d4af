"""The bf16-dot path (vdpbf16ps, native/src/kernels_bf16dot.h) against plain-torch references that
round the activations to bf16 the same way.

Experts (`ftnative`, isa "avx512bf16"): x is rounded to bf16 once per call, each act row once
after the activation; gate/up/down sums, biases and the activation stay fp32. The reference
`bf16_dot_reference` does exactly that in torch. Dense projections (`ftdense`): y = x.to(bf16) @
W^T in fp32, the same math as the existing bf16 dense path.

Tolerance: products of two bf16 numbers are exact in fp32, so the kernel and the reference differ
only in the order of fp32 sums (~1e-6 here). For experts, that difference can move a gate/up sum
across a bf16 rounding boundary of its act value: one act element then differs by one bf16 ulp
(2^-8 relative), moving an output by ~|w| |a| / 256 ~ 1e-3 at these scales (seen rarely). So
experts are checked at rtol = atol = 2e-3, dense projections (no intermediate rounding) at
rtol = atol = 1e-4. A wrong row, pair, lane, tail or a missing bias shifts results by >= 1e-2;
and the fp32 (unrounded) reference is much further away than the bf16 one (asserted: the path
really rounds).

"avx512bf16" runs only where the CPU has AVX512-BF16 (skipped elsewhere); "emubf16" runs the same
executor/dense layouts on the plain-C++ kernels everywhere. The path is opt-in ("auto" keeps the
fp32-activation kernels): forced here by isa.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from native_support import need_isa, single_threaded_reference  # noqa: F401 (autouse fixture)

from freetokend.experts.banks import (
    Activation,
    ActivationSpec,
    ExpertBanks,
    activate,
    moe_reference,
)
from freetokend.experts.cpu_executor import CpuExecutor, available, supported_isas
from freetokend.native import dense_native

pytestmark = pytest.mark.skipif(
    not available() or not dense_native.available(),
    reason="ftnative / ftdense extensions not built (pip install -e .)",
)

ISAS = ["avx512bf16", "emubf16"]
EXPERT_TOL = 2e-3
DENSE_TOL = 1e-4
ACTS = {
    "silu": ActivationSpec(Activation.SILU),
    "gptoss": ActivationSpec(Activation.GPTOSS, alpha=1.702, limit=1.0),
    "swiglu_clamp": ActivationSpec(Activation.SWIGLU_CLAMP, limit=0.5),  # DeepSeek-V4
}
# tile_min_tokens: 1 = every expert tiled (prefill), huge = every expert gemv (decode), 6 = mix
PATHS = {"tiled": 1, "gemv": 1 << 30, "mixed": 6}


def bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


def bf16_dot_reference(
    x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, banks: ExpertBanks, act: ActivationSpec
) -> torch.Tensor:
    """moe_reference with x and every act row rounded to bf16 (round to nearest even)."""
    xb = bf16(x)
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32)
    for t in range(ids.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if e < 0:
                continue
            h = xb[t] @ banks.gate_up[e].float().t()
            if banks.gate_up_bias is not None:
                h = h + banks.gate_up_bias[e].float()
            y = bf16(activate(h, act)) @ banks.down[e].float().t()
            if banks.down_bias is not None:
                y = y + banks.down_bias[e].float()
            out[t] += float(w[t, k]) * y
    return out


def make_banks(n: int, h: int, i: int, bias: bool, seed: int = 0) -> ExpertBanks:
    g = torch.Generator().manual_seed(seed)
    return ExpertBanks(
        gate_up=(torch.randn(n, 2 * i, h, generator=g) / h**0.5).to(torch.bfloat16),
        down=(torch.randn(n, h, i, generator=g) / i**0.5).to(torch.bfloat16),
        gate_up_bias=(0.3 * torch.randn(n, 2 * i, generator=g)).to(torch.bfloat16)
        if bias
        else None,
        down_bias=(0.3 * torch.randn(n, h, generator=g)).to(torch.bfloat16) if bias else None,
    )


def make_routes(t: int, k: int, n: int, h: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = 2 * torch.randn(t, h, generator=g)
    ids = torch.randint(0, n, (t, k), generator=g, dtype=torch.int32)
    ids[torch.rand(t, k, generator=g) < 0.2] = -1
    return x, ids, torch.rand(t, k, generator=g)


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("path", PATHS)
# (H, I): multiples of 32; odd sizes (masked gemv tail, padded last pair of the panels)
@pytest.mark.parametrize("h, i", [(96, 64), (77, 37)])
@pytest.mark.parametrize("t", [1, 3, 40])
def test_experts_match_bf16_reference(
    isa: str, act: str, path: str, h: int, i: int, t: int
) -> None:
    if isa != "emubf16":
        need_isa(isa)
    n = 5
    banks = make_banks(n, h, i, bias=act == "gptoss")
    ex = CpuExecutor(banks, ACTS[act], threads=2, isa=isa, tile_min_tokens=PATHS[path])
    assert ex.isa == isa and ex.bf16_dot
    x, ids, w = make_routes(t, 4, n, h)
    out = ex.forward(x, ids, w)
    ref = bf16_dot_reference(x, ids, w, banks, ACTS[act])
    torch.testing.assert_close(out, ref, rtol=EXPERT_TOL, atol=EXPERT_TOL)
    # the path really rounds: the unrounded fp32 reference is much further away
    exact = moe_reference(x, ids, w, banks, ACTS[act])
    assert max_err(out, exact) > 4 * max(max_err(out, ref), 1e-4)


def test_bf16_dot_is_opt_in() -> None:
    banks = make_banks(3, 64, 32, bias=False)
    ex = CpuExecutor(banks, ACTS["silu"], threads=1)
    assert ex.isa == supported_isas()[0] != "avx512bf16" and not ex.bf16_dot
    if "avx512bf16" in supported_isas():  # listed right after avx512
        assert supported_isas()[supported_isas().index("avx512bf16") - 1] == "avx512"
        assert CpuExecutor(banks, ACTS["silu"], threads=1, isa="avx512bf16").bf16_dot
    # forcing the old path keeps the fp32-FMA kernels; fp32 banks never take bf16-dot
    if "avx512" in supported_isas():
        assert not CpuExecutor(banks, ACTS["silu"], threads=1, isa="avx512").bf16_dot
    f32 = ExpertBanks(gate_up=banks.gate_up.float(), down=banks.down.float())
    assert not CpuExecutor(f32, ACTS["silu"], threads=1, isa="emubf16").bf16_dot


def test_experts_qwen3_geometry_decode_and_prefill() -> None:
    """H = 2048, I = 768 (Qwen3-30B-A3B experts), 4 experts, decode and a 48-token prefill."""
    isa = "avx512bf16"
    need_isa(isa)
    banks = make_banks(4, 2048, 768, bias=False, seed=3)
    for t, tmin in ((1, 12), (48, 12)):
        ex = CpuExecutor(banks, ACTS["silu"], threads=2, isa=isa, tile_min_tokens=tmin)
        x, ids, w = make_routes(t, 2, 4, 2048, seed=t)
        torch.testing.assert_close(
            ex.forward(x, ids, w),
            bf16_dot_reference(x, ids, w, banks, ACTS["silu"]),
            rtol=EXPERT_TOL,
            atol=EXPERT_TOL,
        )


@pytest.fixture
def _restore_pool() -> Iterator[None]:
    yield
    dense_native.configure(2)


@pytest.mark.usefixtures("_restore_pool")
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("t", [1, 2, 5, 8, 17, 40])
@pytest.mark.parametrize("n, k", [(300, 128), (37, 77), (64, 2048)])
def test_dense_matches_bf16_reference(isa: str, t: int, n: int, k: int) -> None:
    import ftdense  # type: ignore[import-not-found]

    if isa != "emubf16":
        need_isa(isa)
    dense_native.configure(2, isa=isa)
    assert ftdense.isa() == isa
    g = torch.Generator().manual_seed(t * 1000 + k)
    x = torch.randn(t, k, generator=g)
    ws = [(torch.randn(nn, k, generator=g) / k**0.5).to(torch.bfloat16) for nn in (n, 17)]
    ys = dense_native.linear_many(x, ws)
    for y, w in zip(ys, ws, strict=True):
        ref = bf16(x) @ w.float().t()
        torch.testing.assert_close(y, ref, rtol=DENSE_TOL, atol=DENSE_TOL)


@pytest.mark.usefixtures("_restore_pool")
def test_dense_forced_isas_report_their_kernels() -> None:
    import ftdense  # type: ignore[import-not-found]

    dense_native.configure(1, isa="auto")
    assert ftdense.isa() == supported_isas()[0]
    if "avx512" in supported_isas():
        dense_native.configure(1, isa="avx512")
        assert ftdense.isa() == "avx512"
    if "avx512bf16" not in supported_isas():
        with pytest.raises(ValueError):
            dense_native.configure(1, isa="avx512bf16")


def _forced_isa(monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, str], list[CpuExecutor]]:
    """Every CpuExecutor made from now on runs isa ``mode["isa"]``; they are listed in ``made``."""
    from freetokend.experts import cpu_executor

    mode = {"isa": "auto"}
    made: list[CpuExecutor] = []
    orig = cpu_executor.CpuExecutor.__init__

    def forced(self, banks, act, threads=None, isa="auto", **kw):  # type: ignore[no-untyped-def]
        orig(self, banks, act, threads, mode["isa"], **kw)
        made.append(self)

    monkeypatch.setattr(cpu_executor.CpuExecutor, "__init__", forced)
    return mode, made


def _logits(llm, ids: list[int]) -> torch.Tensor:
    """Logits at every position: a prefill of 10 (tiled experts), then one token at a time."""
    from freetokend.engine.runner import Work

    runner = llm.runner
    st = runner.new_state()
    rows, pos = [], 0
    try:
        for size in [10] + [1] * (len(ids) - 10):
            runner.reserve(st, pos + size)
            rows.append(runner.forward([Work(st, ids[pos : pos + size])]))
            pos += size
        return torch.cat(rows).float()
    finally:
        runner.release(st)


# A bf16 checkpoint end to end: the bf16-dot path (x and act rows rounded to bf16 in the experts)
# against the fp32-activation path (isa "avx512") of the same engine, logits of prefill + decode.
# The fp32-tolerance tests keep the old path: their checkpoints are fp32 (fp32 banks never take
# bf16-dot), they force an ISA, or they pass cpu_bf16_dot=False. Measured here: max |logit diff|
# 0.0084 with max |logit| 1.77 (3 layers of 2^-9 input rounding); the bound is 4x that.
E2E_LOGIT_BOUND = 0.035


def test_bf16_model_end_to_end(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill + decode logits of a tiny bf16 Qwen3-MoE within E2E_LOGIT_BOUND of the old path,
    and the same 16 greedy tokens."""
    if "avx512bf16" not in supported_isas():
        pytest.skip(f"this CPU lacks avx512bf16 (supports {supported_isas()})")
    from tiny_models import make_tiny

    from freetokend import LLM

    path, _ = make_tiny("qwen3_moe", tmp_path / "m", seed=3, dtype=torch.bfloat16)
    mode, made = _forced_isa(monkeypatch)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 97, (24,), generator=g).tolist()
    out = {}
    for isa in ("avx512", "avx512bf16"):
        mode["isa"] = isa
        made.clear()
        dot = isa == "avx512bf16"  # the dense pool follows (cpu_bf16_dot, on by default)
        llm = LLM(path, moe_backend="cpu", max_model_len=256, kv_tokens=1024, cpu_bf16_dot=dot)
        logits = _logits(llm, ids)
        assert made and all(ex.isa == isa and ex.bf16_dot == (isa == "avx512bf16") for ex in made)
        greedy = llm.generate(ids, max_tokens=16, ignore_eos=True)
        out[isa] = (logits, greedy)
        del llm
    (old, old_greedy), (new, new_greedy) = out["avx512"], out["avx512bf16"]
    err = float((old - new).abs().max())
    assert 0 < err < E2E_LOGIT_BOUND, err  # > 0: the experts really took the rounded path
    assert new_greedy == old_greedy


def test_the_cpu_bf16_dot_option(tmp_path, monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    """``cpu_bf16_dot`` (daemon config, LLM; on by default): on an AVX512-BF16 CPU the experts
    and the dense pool take the bf16-dot kernels, with the fp32-activation kernels' greedy
    tokens, and leave them again when it is off; on a CPU without it the log says so and the
    fp32-activation kernels run."""
    import logging

    from tiny_models import make_tiny

    from freetokend import LLM
    from freetokend.config import DaemonConfig
    from freetokend.experts import cpu_executor

    assert DaemonConfig().cpu_bf16_dot is True
    path, _ = make_tiny("qwen3_moe", tmp_path / "m", seed=3, dtype=torch.bfloat16)
    ids = list(range(5, 29))
    kw = dict(moe_backend="cpu", max_model_len=256, kv_tokens=1024)
    try:
        plain = LLM(path, cpu_bf16_dot=False, **kw)
        want = plain.generate(ids, max_tokens=12, ignore_eos=True)
        assert plain.cpu_isa == "auto" and not plain.moe.executor.bf16_dot
        del plain
        if "avx512bf16" in supported_isas():
            fast = LLM(path, **kw)  # the default
            assert fast.cpu_isa == "avx512bf16" and fast.moe.executor.bf16_dot
            assert dense_native.configured_isa() == "avx512bf16"
            assert fast.generate(ids, max_tokens=12, ignore_eos=True) == want
            del fast
            # off again in the same process: the process-wide dense pool leaves bf16-dot too
            again = LLM(path, cpu_bf16_dot=False, **kw)
            assert again.cpu_isa == "auto" and not again.moe.executor.bf16_dot
            assert dense_native.configured_isa() != "avx512bf16"
            del again
            dense_native.configure(isa="avx512bf16")  # as an earlier model would leave it
        lacking = [i for i in supported_isas() if i != "avx512bf16"]
        monkeypatch.setattr(cpu_executor, "supported_isas", lambda: lacking)
        with caplog.at_level(logging.INFO):
            slow = LLM(path, **kw)
        assert slow.cpu_isa == "auto" and not slow.moe.executor.bf16_dot
        assert dense_native.configured_isa() != "avx512bf16"
        assert "cpu_bf16_dot: this CPU lacks AVX512-BF16" in caplog.text
    finally:
        dense_native.configure(isa="auto")  # the pool is process-wide
