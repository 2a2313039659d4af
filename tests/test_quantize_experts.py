"""Quantizing a float checkpoint's experts at load (``LLM(quantize_experts=...)``, the daemon's
``--quantize-experts``). Oracle: transformers running the same checkpoint with each expert's
weights replaced by the dequantized quantized ones, so the only differences left are summation
order (the native executor computes on the packed weights, in-kernel dequant)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from tiny_models import make_tiny

from freetokend import LLM
from freetokend.config import QUANTIZE_FORMATS, ConfigError, DaemonConfig
from freetokend.engine.runner import Work
from freetokend.experts.formats import FORMATS, dequantize_banks
from freetokend.models.expert_quant import quantize_experts_at_load, stored_expert_format

ATOL = 2e-4  # fp32, as in test_engine_families
KW = dict(dtype="float32", prefix_cache=False, max_model_len=128, kv_tokens=512)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    return make_tiny("qwen3_moe", tmp_path_factory.mktemp("float"), seed=5)


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 97, (n,), generator=g).tolist()


def _last_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    st = llm.runner.new_state()
    llm.runner.reserve(st, len(ids))
    logits = llm.runner.forward([Work(st, ids)])[0]
    llm.runner.release(st)
    return logits


# the K-quants need sizes that are multiples of 256: tests/test_gguf_experts.py runs q4_k on such
# a model, and every block type's kernel on every ISA
@pytest.mark.parametrize("fmt", [f for f in QUANTIZE_FORMATS if not f.endswith("_k")])
def test_quantized_experts_match_transformers_on_the_same_weights(ckpt, fmt: str) -> None:  # type: ignore[no-untyped-def]
    src, hf = ckpt
    floats = LLM(src, "cpu", **KW)
    llm = LLM(src, "cpu", quantize_experts=fmt, **KW)
    assert llm.banks.format == fmt and llm.config.expert_format == fmt
    assert llm.moe.executor is not None, "the native executor computes the packed experts"
    assert llm.banks.nbytes_per_expert() < floats.banks.nbytes_per_expert()

    # the oracle: transformers with every expert replaced by its dequantized quantized weights
    deq = dequantize_banks(llm.banks)
    oracle = type(hf)(hf.config).eval()
    oracle.load_state_dict(hf.state_dict())
    experts = [layer.mlp.experts for layer in oracle.model.layers if hasattr(layer.mlp, "experts")]
    e = hf.config.num_experts
    with torch.no_grad():
        for k, ex in enumerate(experts):
            gate_up, down = deq.gate_up[k * e : (k + 1) * e], deq.down[k * e : (k + 1) * e]
            assert (ex.gate_up_proj - gate_up).abs().max() > 1e-4  # quantization did change them
            ex.gate_up_proj.copy_(gate_up)
            ex.down_proj.copy_(down)
        ids = _prompt(11, 1)
        ref = oracle(torch.tensor([ids])).logits[0, -1].float()
        unquantized = hf(torch.tensor([ids])).logits[0, -1].float()
    assert (_last_logits(llm, ids) - unquantized).abs().max() > 10 * ATOL  # the oracle must tell
    with torch.no_grad():
        seq = list(ids)
        for _ in range(12):  # cache-free greedy oracle
            seq.append(int(oracle(torch.tensor([seq])).logits[0, -1].argmax()))
    # block formats also quantize the activations to int8 (per 32, as llama.cpp): ~1e-2 moves
    atol = 2e-2 if FORMATS[fmt].block_types else ATOL
    assert (_last_logits(llm, ids) - ref).abs().max() < atol
    assert llm.generate(ids, 12, ignore_eos=True) == seq[len(ids) :]
    # and the accelerator backends (dequantized once at load) agree with the packed CPU path
    fused = LLM(src, "fused", accelerator="standin", quantize_experts=fmt, **KW)
    assert fused.generate(ids, 12, ignore_eos=True) == seq[len(ids) :]


def test_bad_requests_are_named(ckpt) -> None:  # type: ignore[no-untyped-def]
    src, _ = ckpt
    with pytest.raises(
        ValueError, match="'int3' is not one of fp8_block, mxfp4, nvfp4, q4_0, .*q8_0, or a pair"
    ):
        LLM(src, "cpu", quantize_experts="int3", **KW)
    llm = LLM(src, "cpu", quantize_experts="mxfp4", **KW)
    with pytest.raises(ValueError, match="already mxfp4"):
        quantize_experts_at_load(llm.banks, llm.config, "nvfp4")
    floats = LLM(src, "cpu", **KW)
    odd = dataclasses.replace(floats.config, hidden_size=48)  # mxfp4 packs blocks of 32
    with pytest.raises(ValueError, match="multiples of 32"):
        quantize_experts_at_load(floats.banks, odd, "mxfp4")
    with pytest.raises(ConfigError, match="quantize_experts: 'int3'"):
        DaemonConfig(quantize_experts="int3").check()


def test_daemon_choices_are_the_formats_table() -> None:
    # less the block formats named as a pair (gate_up and down of different types, and GGUF's
    # MXFP4 blocks "mxfp4/mxfp4"): GGUF files and presets make them
    mixed = {n for n, f in FORMATS.items() if f.block_types and "/" in n}
    assert set(QUANTIZE_FORMATS) == set(FORMATS) - {"bf16"} - mixed


def test_spilled_snapshots_of_float_and_quantized_engines_do_not_mix(ckpt, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from freetokend.kv.spill import engine_fingerprint

    src, _ = ckpt
    llm = LLM(src, "cpu", **KW)
    pool = llm.runner.kv
    bf16 = engine_fingerprint(src, "float32", pool, "bf16")
    assert bf16 != engine_fingerprint(src, "float32", pool, "mxfp4")
    assert engine_fingerprint(src, "float32", pool, "mxfp4") != engine_fingerprint(
        src, "float32", pool, "nvfp4"
    )


def test_the_daemon_quantizes_float_checkpoints_and_loads_quantized_ones_as_stored(
    ckpt, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    from test_gpt_oss_mxfp4 import write_mxfp4

    from freetokend.manager.control import ControlPlane

    src, _ = ckpt
    mx = write_mxfp4(make_tiny("gpt_oss", tmp_path / "float-gpt-oss", seed=3)[0], tmp_path / "mx")
    cfg = DaemonConfig(
        quantize_experts="nvfp4", moe_backend="cpu", admin_socket="off", vram_watch=False,
        state_dir=str(tmp_path / "state"), kv_tokens=512,
    )  # fmt: skip
    cp = ControlPlane(cfg)
    cp.manager.load(str(src), name="float")
    cp.manager.load(str(mx), name="mx")
    assert cp.manager.models["float"].llm.banks.format == "nvfp4"
    assert cp.manager.models["mx"].llm.banks.format == "mxfp4"  # as stored, not refused


def test_ftw_conversion_stores_the_experts_quantized(ckpt, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """`ftctl checkpoint --quantize-experts mxfp4`: the FTW folder holds the packed experts (a
    progress phase of its own); LLM and the daemon load them as stored, equal to quantizing at
    load, and never quantize them twice."""
    from test_ftw import _ftctl

    from freetokend.manager.control import ControlPlane

    src, _ = ckpt
    out = tmp_path / "ftw-mxfp4"
    assert _ftctl("--model", str(src), "--out", str(out), "--quantize-experts", "mxfp4") == 0
    assert "experts mxfp4" in capsys.readouterr().out
    assert stored_expert_format(out) == "mxfp4" and stored_expert_format(src) == "bf16"
    at_load = LLM(src, "cpu", quantize_experts="mxfp4", **KW)
    stored = LLM(out, "cpu", **KW)
    assert stored.banks.format == "mxfp4" and stored.config.expert_format == "mxfp4"
    for name, t in at_load.banks.all_tensors().items():
        assert torch.equal(t, stored.banks.all_tensors()[name]), name
    ids = _prompt(9, 4)
    assert stored.generate(ids, 8, ignore_eos=True) == at_load.generate(ids, 8, ignore_eos=True)
    with pytest.raises(ValueError, match="already mxfp4"):
        LLM(out, "cpu", quantize_experts="nvfp4", **KW)
    cfg = DaemonConfig(quantize_experts="nvfp4", state_dir=str(tmp_path / "state"))
    cp = ControlPlane(cfg)
    assert cp._quantize(out) is None and cp._quantize(src) == "nvfp4"

    from freetokend.models.ftw_convert import convert

    seen: list[tuple[str, int, int]] = []
    convert(src, tmp_path / "again", quantize_experts="nvfp4", progress=lambda *a: seen.append(a))
    steps = [(done, total) for phase, done, total in seen if phase == "quantize"]
    assert len(steps) == stored.banks.gate_up.shape[0] and steps[-1][0] == steps[-1][1] > 0
