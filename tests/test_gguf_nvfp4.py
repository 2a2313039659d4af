"""GGUF files whose routed experts are NVFP4, as llama.cpp's converter writes an NVFP4 checkpoint
(GLM-5.2's release: ``ggml`` type NVFP4, super-blocks of 64 inputs with 4 UE4M3 scale bytes and
32 bytes of E2M1 codes, plus a per-expert global scale ``blk.N.ffn_<proj>_exps.scale``), load
into our ``nvfp4`` banks with nothing dequantized, and compute on the native packed kernels.

The file is our reproduction of the converter's layout (tests/gguf_files.py ``nvfp4_stack``);
the oracle that reads it back is the ``gguf`` package's own NVFP4 dequantizer (llama.cpp's
Python reader), times the file's global scales, loaded into transformers
(``dequantized_reference``). llama.cpp's real converter on an NVFP4 checkpoint is the opt-in
test_gguf_llamacpp_convert_slow.py."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf_files import dequantized_reference, write_gguf
from greedy_check import FP32_MARGIN, HfScorer, assert_greedy_agrees, hf_greedy
from tiny_models import make_tiny

from freetokend import LLM
from freetokend.experts.formats import expert_tensors
from freetokend.experts.microscale import nv_dequant
from freetokend.formats.errors import CheckpointError
from freetokend.formats.gguf_file import GgufFile

KW = dict(dtype="float32", max_model_len=128, kv_tokens=512, prefix_cache=False)
ATOL = 2e-4  # fp32 on both sides (the packed kernels take fp32 activations); measured 3.4e-6


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    d = tmp_path_factory.mktemp("nvgguf")
    _, hf = make_tiny(  # widths in whole NVFP4 super-blocks (64)
        "qwen3_moe",
        d / "hf",
        seed=5,
        hidden_size=128,
        moe_intermediate_size=64,
        head_dim=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        mlp_only_layers=[],
    )
    with torch.no_grad():  # gate and up of an expert at scales 4x apart: separate globals
        for layer in hf.model.layers:
            layer.mlp.experts.gate_up_proj[:, :64].mul_(4.0)
    path = write_gguf("qwen3_moe", hf, d / "m.gguf", "nvfp4")
    return path, hf


def test_nvfp4_experts_load_packed_and_match_transformers(tiny) -> None:  # type: ignore[no-untyped-def]
    path, hf = tiny
    llm = LLM(path, "cpu", **KW)
    b = llm.banks
    assert llm.config.expert_format == b.format == "nvfp4"
    assert type(llm.moe.executor).__name__ == "CpuExecutor"  # the native packed kernels
    assert not [n for n, _ in llm.model.named_parameters() if ".experts." in n]
    e, i = hf.config.num_experts, hf.config.moe_intermediate_size
    with GgufFile(path) as f:
        for layer in range(hf.config.num_hidden_layers):
            for proj in ("gate", "up", "down"):
                name = f"blk.{layer}.ffn_{proj}_exps"
                t = f.tensors[name + ".weight"]
                raw = f.read_raw(t).reshape(-1, t.shape[2] // 64 * 36).numpy()
                glob = f.read_float(f.tensors[name + ".scale"]).reshape(-1)
                # gguf's dequantizer of the file's rows x its global scales ...
                want = torch.from_numpy(
                    gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.NVFP4).copy()
                )
                want = want.reshape(e, *t.shape[1:]) * glob.view(-1, 1, 1)
                for x in range(e):  # ... equal, bit for bit, to our banks read back
                    row = expert_tensors(b, layer * e + x)
                    if proj == "down":
                        got = nv_dequant(row["down"], row["down_scale"], row["down_global"][0])
                    else:
                        h = slice(0, i) if proj == "gate" else slice(i, 2 * i)
                        g = row["gate_up_global"][int(proj == "up")]
                        got = nv_dequant(row["gate_up"][h], row["gate_up_scale"][h], g)
                    assert torch.equal(got, want[x]), (name, x)
        gu = b.extra["gate_up_global"][:e]
        assert bool((gu[:, 0] > 2 * gu[:, 1]).all())  # gate's globals are its own
    with GgufFile(path) as f:  # a dense NVFP4 weight: dequantized at load, times its scale
        t, s = (f.tensors[f"blk.1.attn_output.{k}"] for k in ("weight", "scale"))
        assert t.type_name == "NVFP4" and f.read_float(s).item() != 1.0
        want_o = f.read_float(t) * f.read_float(s)
    assert torch.equal(
        dict(llm.model.named_parameters())["layers.1.self_attn.o_proj.weight"], want_o
    )
    dequantized_reference("qwen3_moe", hf, path)  # transformers on the file's weights
    ids = torch.randint(2, 97, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    got, want = llm.logits(ids), HfScorer(hf).logits(ids)
    assert (got - want).abs().max().item() < ATOL
    prompts = [ids[:9], ids[5:20]]
    ours = llm.generate(prompts, max_tokens=12, ignore_eos=True)
    theirs = [hf_greedy(hf, p, 12) for p in prompts]
    assert_greedy_agrees(ours, theirs, prompts, HfScorer(hf), FP32_MARGIN, "nvfp4 gguf")
    llm.close()


def test_nvfp4_ue4m3_0x7f_reads_as_zero(tiny, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """llama.cpp reads a scale byte 0x7F (E4M3's NaN) as 0: so do we, not as a NaN."""
    path, _ = tiny
    data = bytearray(path.read_bytes())
    with GgufFile(path) as f:
        t = f.tensors["blk.0.ffn_down_exps.weight"]
        at = t.offset  # expert 0, row 0, super-block 0: its first scale byte
    data[at] = 0x7F
    bad = tmp_path / "m.gguf"
    bad.write_bytes(bytes(data))
    llm = LLM(bad, "cpu", **KW)
    s = llm.banks.extra["down_scale"][0, 0, :4].view(torch.uint8)
    assert s[0].item() == 0 and torch.isfinite(llm.logits([3, 4, 5])).all()
    llm.close()


def _rewrite(src: Path, dst: Path, edit) -> Path:  # type: ignore[no-untyped-def]
    """``src`` rewritten with ``edit(name, type, array)`` -> [(name, type, array)] per tensor."""
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, "qwen3moe")
    for field in r.fields.values():
        if field.name.startswith(("GGUF.", "general.architecture")):
            continue
        vtype = field.types[0]
        val = field.contents()
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_array(field.name, val)
        else:
            w.add_key_value(field.name, val, vtype)
    for t in r.tensors:
        for name, qt, arr in edit(t.name, t.tensor_type, np.array(t.data)):
            w.add_tensor(name, arr, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_nvfp4_scale_must_be_positive_and_fit_the_experts(tiny, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path, _ = tiny

    def negative(name, qt, arr):  # type: ignore[no-untyped-def]
        if name == "blk.1.ffn_up_exps.scale":
            arr = -arr
        return [(name, qt, arr)]

    with pytest.raises(CheckpointError, match="ffn_up_exps.scale' must hold 8 finite positive"):
        LLM(_rewrite(path, tmp_path / "neg.gguf", negative), "cpu", **KW)


def test_a_scale_beside_experts_that_are_not_nvfp4_is_refused(tiny, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path, hf = tiny
    q8 = write_gguf("qwen3_moe", hf, tmp_path / "q8.gguf", "q8_0")

    def add_scale(name, qt, arr):  # type: ignore[no-untyped-def]
        out = [(name, qt, arr)]
        if name == "blk.0.ffn_gate_exps.weight":
            out.append(
                ("blk.0.ffn_gate_exps.scale", gguf.GGMLQuantizationType.F32, np.ones(8, np.float32))
            )
        return out

    with pytest.raises(CheckpointError, match="unexpected tensor 'blk.0.ffn_gate_exps.scale'"):
        LLM(_rewrite(q8, tmp_path / "q8s.gguf", add_scale), "cpu", **KW)


def test_nvfp4_experts_and_the_disk_tier(tiny) -> None:  # type: ignore[no-untyped-def]
    """The disk tier reads GGUF block formats only: NVFP4 experts are refused with the reason."""
    path, _ = tiny
    with pytest.raises(CheckpointError, match="disk tier"):
        LLM(path, "cpu", expert_cache_mb=1, **KW)
