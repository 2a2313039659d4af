"""FREETOKEN_CPU_ISA: the path "auto" takes, forced for every native kernel (runtime/cpu_isa.py).

`make test` runs on whichever x86 machine CI is given; this variable lets the kernel and model
tests run each path on the machine at hand (AVX-512 emulated where the CPU lacks it)."""

from __future__ import annotations

import pytest
import torch

from freetokend.experts.banks import ActivationSpec, ExpertBanks
from freetokend.experts.cpu_executor import CpuExecutor, supported_isas
from freetokend.experts.cpu_executor import available as executor_built
from freetokend.native import dense_native
from freetokend.runtime import cpu_isa

AVX2_ONLY = ["avx2", "scalar"]
AVX512 = ["avx512", "avx2", "scalar"]


@pytest.mark.parametrize(
    ("value", "supported", "want"),
    [
        ("", AVX512, None),
        ("auto", AVX2_ONLY, None),
        ("avx2", AVX512, "avx2"),
        ("AVX2", AVX2_ONLY, "avx2"),
        ("scalar", AVX2_ONLY, "scalar"),
        ("scalar", [], "scalar"),
        ("avx512", AVX512, "avx512"),
        ("avx512", AVX2_ONLY, "emu512"),  # the same kernel bodies on emulated vectors
    ],
)
def test_forced_path(value: str, supported: list[str], want: str | None) -> None:
    assert cpu_isa.forced(supported, {cpu_isa.ENV: value}) == want
    assert cpu_isa.resolve("auto", supported, {cpu_isa.ENV: value}) == (want or "auto")
    assert cpu_isa.resolve("avx2", supported, {cpu_isa.ENV: value}) == "avx2"  # explicit: kept


@pytest.mark.parametrize("value", ["avx1", "emu512", "neon"])
def test_unknown_names_are_refused_with_the_choices(value: str) -> None:
    with pytest.raises(cpu_isa.IsaError, match="choose one of auto, avx512, avx2, scalar"):
        cpu_isa.forced(AVX512, {cpu_isa.ENV: value})


def test_a_path_the_cpu_cannot_run_is_refused() -> None:
    with pytest.raises(cpu_isa.IsaError, match="runs only scalar"):
        cpu_isa.forced(["scalar"], {cpu_isa.ENV: "avx2"})


@pytest.fixture
def restore_pool():
    yield
    dense_native.configure()  # the environment is restored by then: the CPU's own path


@pytest.mark.skipif(not dense_native.available(), reason="ftdense not built")
@pytest.mark.parametrize("value", ["scalar", "avx2", "avx512"])
def test_both_extensions_take_the_forced_path(value, monkeypatch, restore_pool) -> None:
    if value not in supported_isas() and value != "avx512":
        pytest.skip(f"this CPU has no {value}")
    want = cpu_isa.forced(supported_isas(), {cpu_isa.ENV: value})
    monkeypatch.setenv(cpu_isa.ENV, value)
    dense_native.configure(1)
    assert dense_native.configured_isa() == want
    if executor_built():
        n, h, inter = 2, 32, 16
        g = torch.Generator().manual_seed(0)
        banks = ExpertBanks(
            torch.randn(n, 2 * inter, h, generator=g), torch.randn(n, h, inter, generator=g)
        )
        assert CpuExecutor(banks, ActivationSpec(), threads=1).isa == want
