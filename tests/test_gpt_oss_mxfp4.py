"""GPT-OSS checkpoints with MXFP4 experts (the format gpt-oss-20b/120b ship in): loaded packed,
computed packed by the native CPU executor, against transformers' own MXFP4 loader (which
dequantizes on a CPU) as the oracle."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny

from freetokend import LLM
from freetokend.experts.microscale import mx_quant as _mx_quant
from freetokend.models.config import ConfigError
from freetokend.models.config_hf import read_config
from freetokend.models.loader import CheckpointError

ATOL = 2e-4  # fp32 everywhere else; only summation order differs (as in test_engine_families)


def _quantize(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's fused x @ W expert tensor [E, in, out] -> (blocks [E, out, in/32, 16], scales)."""
    w = t.transpose(1, 2).float()  # [E, out (gate/up interleaved for gate_up), in]
    packed, scales = zip(*(_mx_quant(w[x]) for x in range(w.shape[0])), strict=True)
    e, out, inp = w.shape
    return torch.stack(packed).reshape(e, out, inp // 32, 16), torch.stack(scales)


def write_mxfp4(src: Path, dst: Path) -> Path:
    """A copy of the float GPT-OSS checkpoint ``src`` with its experts stored as HF MXFP4."""
    shutil.copytree(src, dst)
    (f,) = dst.glob("*.safetensors")
    tensors = load_file(f)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = _quantize(tensors.pop(name))
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    save_file(tensors, f, metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head",
        ],
    }  # fmt: skip
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src, _ = make_tiny("gpt_oss", tmp_path_factory.mktemp("float"), seed=11)
    return write_mxfp4(src, tmp_path_factory.mktemp("q") / "mxfp4")


@pytest.fixture(scope="module")
def oracle(ckpt: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM, Mxfp4Config

    # the experts dequantized by transformers' own MXFP4 code; asked for, since with triton and
    # the `kernels` package installed it would otherwise fetch GPT-OSS kernels from the Hub
    qc = Mxfp4Config(dequantize=True)
    hf = AutoModelForCausalLM.from_pretrained(ckpt, quantization_config=qc)
    return hf.float().eval()


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 97, (n,), generator=g).tolist()


def test_config_and_packed_banks(ckpt: Path) -> None:
    assert read_config(ckpt).expert_format == "mxfp4"
    llm = LLM(ckpt, "cpu", dtype="float32", max_model_len=128, kv_tokens=512)
    b = llm.banks
    assert b.format == "mxfp4" and b.gate_up.dtype == torch.uint8
    assert set(b.extra) == {"gate_up_scale", "down_scale"}


def test_logits_and_greedy_match_transformers(ckpt: Path, oracle) -> None:  # type: ignore[no-untyped-def]
    llm = LLM(ckpt, "cpu", dtype="float32", max_model_len=128, kv_tokens=512, prefix_cache=False)
    assert llm.moe.executor is not None, "the native executor computes the packed experts"
    ids = _prompt(12, 1)
    with torch.no_grad():
        ref = oracle(torch.tensor([ids])).logits[0, -1].float()
        seq = list(ids)
        for _ in range(12):  # cache-free greedy oracle
            seq.append(int(oracle(torch.tensor([seq])).logits[0, -1].argmax()))
    ours = llm.generate(ids, 12, ignore_eos=True)
    assert ours == seq[len(ids) :]
    from freetokend.engine.runner import Work

    st = llm.runner.new_state()
    llm.runner.reserve(st, len(ids))
    logits = llm.runner.forward([Work(st, ids)])[0]
    llm.runner.release(st)
    assert (logits - ref).abs().max() < ATOL


def test_accelerator_backends_dequantize_once(ckpt: Path) -> None:
    cpu = LLM(ckpt, "cpu", dtype="float32", prefix_cache=False, max_model_len=128, kv_tokens=512)
    fused = LLM(ckpt, "fused", accelerator="standin", dtype="float32", prefix_cache=False,
                max_model_len=128, kv_tokens=512)  # fmt: skip
    ids = _prompt(9, 2)
    assert fused.generate(ids, 10, ignore_eos=True) == cpu.generate(ids, 10, ignore_eos=True)


def test_bad_quantized_checkpoints_are_named(ckpt: Path, tmp_path: Path) -> None:
    bad = tmp_path / "other-method"
    shutil.copytree(ckpt, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq"}
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="quant_method.*gptq"):
        read_config(bad)

    short = tmp_path / "short-scales"
    shutil.copytree(ckpt, short)
    (f,) = short.glob("*.safetensors")
    t = load_file(f)
    key = next(n for n in t if n.endswith("down_proj_scales"))
    t[key] = t[key][:, :-1].contiguous()
    save_file(t, f, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="down_proj_scales"):
        LLM(short, "cpu", max_model_len=64, kv_tokens=256)


def test_ftw_keeps_the_packed_experts(ckpt: Path, tmp_path: Path) -> None:
    from freetokend.models.ftw_convert import convert

    convert(ckpt, tmp_path / "ftw")
    a = LLM(ckpt, "cpu", prefix_cache=False, max_model_len=128, kv_tokens=512)
    b = LLM(tmp_path / "ftw", "cpu", prefix_cache=False, max_model_len=128, kv_tokens=512)
    assert b.banks.format == "mxfp4"
    for name, t in a.banks.all_tensors().items():
        assert torch.equal(t, b.banks.all_tensors()[name]), name
    ids = _prompt(7, 3)
    assert b.generate(ids, 6, ignore_eos=True) == a.generate(ids, 6, ignore_eos=True)
