"""llama.cpp's own converter and quantizer against us (opt-in: ``pytest --runslow``; needs
``llama-cpp-python`` and the llama.cpp sources of the same version, ``FT_LLAMA_CPP_SRC``: the
folder holding ``convert_hf_to_gguf.py``, ``gguf-py`` and ``models/ggml-vocab-gpt-2.gguf``).

Where test_gguf_llamacpp_slow.py reads files of our reproduction of the converter
(tests/gguf_convert.py), this one runs the real ``convert_hf_to_gguf.py`` on the tiny HF
checkpoint (tests/tiny_models.py) of the DSA families, DeepSeek-V3.2 (``deepseek32``) and GLM-5
(``glm-dsa``), and on DeepSeek-V4's rewritten into the release layout (``deepseek4``: the only
layout its converter reads; FP4 experts, which it repacks to MXFP4), to F32, and
``llama_model_quantize`` to Q8_0 (V4's MXFP4 experts kept: llama.cpp refuses to requantize them).
llama.cpp's limits shape the tiny configs: index heads of 64 (its Hadamard rotation of the
indexer's keys is 64 wide at least), and for V4 4 hyper-connection streams, HCA at rate 128,
head dim 64. The checkpoint carries GPT-2's
tokenizer (rebuilt from llama.cpp's test vocabulary, tests/bench/decode_tokenizer.py: the only
kind of tokenizer whose pre-tokenizer the converter recognises offline), with GLM's special
tokens added for GLM-5 (the converter looks them up). V3.2's converter asserts the tokenizer's
``add_bos_token``, which transformers 5.25 never reports for a folder with a tokenizer.json
(it drops the key from tokenizer_config.json): the converter runs with AutoTokenizer's result
flagged so (``_CONVERT``), the tokenization itself unchanged. DeepSeek-V3.2's config.json gets ``scoring_func: sigmoid``, as the
release has it: transformers' config drops the key, the converter then writes no
``expert_gating_func``, and llama.cpp's deepseek32 refuses a file without it.

Checks: the F32 file within 1e-4 of transformers (our load of llama.cpp's file, not of ours)
and of llama.cpp on it; on the Q8_0 file top-1 agreement >= 0.95 between llama.cpp and us over
64 teacher-forced positions (llama.cpp with an F32 KV cache).

Measured (llama-cpp-python 0.3.36 built from source, CPU, 2 threads, a shared machine;
vocabulary 50257 / 50260, index heads of 64, the widths above). Columns: max |dlogit| against
transformers; top-1, max and median |dlogit| against llama.cpp on the same file.
    deepseek_v32 F32    2.1e-6    1.000   2.4e-6 / 1.6e-6
    glm_moe_dsa  F32    2.7e-6    1.000   3.5e-6 / 2.0e-6
    deepseek_v4  F32    3.6e-6    1.000   4.4e-6 / 2.2e-6   (its MXFP4 experts in their blocks
                                                           on both sides; against transformers
                                                           dequantized, on their FP4 values)
    deepseek_v32 Q8_0   -         1.000   0.040  / 2.4e-7
    glm_moe_dsa  Q8_0   -         1.000   4.8e-7 / 2.4e-7
    deepseek_v4  Q8_0   -         1.000   0.79   / 2.4e-7   (one position apart)
Before (Dec 6, tiny widths, our float kv_b_proj, V4's hyper-connection mixes and grouped
attn_output_a widened to fp32): top-1 0.859 / 0.938 / 0.906, medians 0.055 / 0.044 / 0.076.
Each difference was found by computing ours the other way: attn_k_b / attn_v_b are now kept in
their blocks and MLA runs absorbed as llama.cpp does (layers/mla.py: 0.719 -> 1.000 for V3.2,
0.875 -> 1.000 for GLM-5 with the widths above); V4's hc_*_fn and attn_output_a stay in their
blocks (int8 inputs; 0.906 -> 0.938 with either alone, 1.000 with both); the F16 fallbacks and
GLM's norm eps are the fixture's (see OVER, GLM_EPS). The margins are not the cause: median top-1
margin ~0.1, and with the same arithmetic the two engines agree to ~1e-7 at almost every position.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from llama_cpp_logits import compare, llama_logits
from tiny_models import make_tiny

from freetokend import LLM
from freetokend.native import qlinear_native as ql

pytestmark = pytest.mark.slow
llama_cpp = pytest.importorskip("llama_cpp")

SRC = Path(os.environ.get("FT_LLAMA_CPP_SRC", "/nonexistent"))
if not (SRC / "convert_hf_to_gguf.py").exists():
    pytest.skip(
        "FT_LLAMA_CPP_SRC: no llama.cpp sources with convert_hf_to_gguf.py", allow_module_level=True
    )

sys.path.insert(0, str(Path(__file__).parent / "bench"))  # the benchmarks' GPT-2 tokenizer
from decode_tokenizer import write_tokenizer  # noqa: E402

F32_TOL = 1e-4
# llama.cpp rotates the indexer's keys and queries by a Hadamard matrix of 64 at least (its
# KV cache's k_rot): the tiny configs' 16-wide index heads are widened to 64. Every matrix's
# rows are a multiple of 32 wide (q_lora, kv_lora, nope, heads * v, the dense FFN), as in the
# released models: narrower rows fall back to F16 in llama.cpp's Q8_0 file, whose matmuls round
# their inputs to fp16 (the tiny config's 12-, 16-, 24-, 40- and 48-wide rows did: top-1 0.859
# and 0.938 from that alone with attn_k_b / attn_v_b, measured).
OVER = {
    "index_head_dim": 64,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 32,
    "v_head_dim": 16,
    "intermediate_size": 64,
}
# llama.cpp normalises MLA's compressed query and latent (attn_q_a_norm, attn_kv_a_norm) with
# the model's rms_norm_eps, transformers (and we) with 1e-6: GLM-5's 1e-5 alone moved the
# logits by a median 0.04 (top-1 0.969 with the rest equal), so its case takes 1e-6, DeepSeek's
GLM_EPS = {"rms_norm_eps": 1e-6}
DSA = ("deepseek_v32", "glm_moe_dsa")
GLM_SPECIAL = ("[gMASK]", "<|user|>", "<|observation|>")  # _set_vocab_glm looks these up
IDS = torch.randint(2, 50000, (64,), generator=torch.Generator().manual_seed(1)).tolist()


def _tokenizer(folder: Path, family: str) -> int:
    """GPT-2's tokenizer into ``folder`` as the family's converter wants it; -> its size."""
    from tokenizers import AddedToken, Tokenizer

    if write_tokenizer(folder, SRC / "models" / "ggml-vocab-gpt-2.gguf") != "gpt2":
        pytest.skip("llama.cpp's GPT-2 test vocabulary is missing")
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    if family == "glm_moe_dsa":
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in GLM_SPECIAL])
        tok.save(str(folder / "tokenizer.json"))
        cfg_path = folder / "tokenizer_config.json"  # transformers reads added tokens from here
        cfg = json.loads(cfg_path.read_text())
        for t in GLM_SPECIAL:
            entry = {"content": t, "special": True, "normalized": False}
            entry.update(lstrip=False, rstrip=False, single_word=False)
            cfg["added_tokens_decoder"][str(tok.token_to_id(t))] = entry
        cfg_path.write_text(json.dumps(cfg))
    return tok.get_vocab_size()


def _checkpoint(family: str, folder: Path, **extra):
    """The tiny HF checkpoint with a tokenizer the converter takes; -> the transformers model."""
    folder.mkdir(parents=True)
    vocab = _tokenizer(folder, family)
    over = {**OVER, **(GLM_EPS if family == "glm_moe_dsa" else {}), **extra}
    hf = make_tiny(family, folder, seed=3, vocab_size=vocab, **over)[1]
    if family == "deepseek_v32":
        cfg = json.loads((folder / "config.json").read_text())
        cfg["scoring_func"] = "sigmoid"
        (folder / "config.json").write_text(json.dumps(cfg))
    _tokenizer(folder, family)  # save_pretrained may have written its own files over ours
    return hf


# convert_hf_to_gguf.py run as it is, with AutoTokenizer's tokenizers flagged add_bos_token
# (set on the private field: the property's setter would rebuild the post-processor)
_CONVERT = """
import os, runpy, sys, transformers
load = transformers.AutoTokenizer.from_pretrained
def flagged(*a, **k):
    tok = load(*a, **k)
    object.__setattr__(tok, "_add_bos_token", True)
    return tok
transformers.AutoTokenizer.from_pretrained = flagged
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(sys.argv[0]))
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _convert(folder: Path, out: Path) -> Path:
    cmd = [sys.executable, "-c", _CONVERT, str(SRC / "convert_hf_to_gguf.py"), str(folder)]
    cmd += ["--outtype", "f32", "--outfile", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-20:])
        raise AssertionError(f"convert_hf_to_gguf.py failed (rc {proc.returncode}):\n{tail}")
    return out


def _quantize(src: Path, out: Path, keep_mxfp4_experts: bool = False) -> Path:
    """Q8_0 by llama.cpp's quantizer; ``keep_mxfp4_experts``: the experts stay as they are
    (DeepSeek-V4's MXFP4: llama.cpp refuses to requantize them)."""
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
    params.nthread = 2
    if keep_mxfp4_experts:
        overrides = (llama_cpp.llama_model_tensor_override * 2)()
        overrides[0].pattern, overrides[0].type = b"_exps", llama_cpp.GGML_TYPE_MXFP4
        overrides[1].pattern = None  # the list ends at a null pattern
        ptr = ctypes.POINTER(llama_cpp.llama_model_tensor_override)
        params.tt_overrides = ctypes.cast(overrides, ptr)
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params))
    assert rc == 0, f"llama_model_quantize failed (rc {rc})"
    return out


def _llama_logits(path) -> torch.Tensor:
    return llama_logits(path, IDS)


def _ours(path: Path) -> torch.Tensor:
    ql.set_fp16_act_scales(True)  # llama.cpp's Q8_0 activation scales
    try:
        return LLM(path, max_model_len=128, kv_tokens=512, dtype="float32").logits(IDS)
    finally:
        ql.set_fp16_act_scales(False)


@pytest.mark.parametrize("family", DSA)
def test_llama_cpp_converted_f32_files(family, tmp_path):
    hf = _checkpoint(family, tmp_path / "hf")
    f32 = _convert(tmp_path / "hf", tmp_path / "m-F32.gguf")
    with torch.no_grad():
        want = hf(torch.tensor([IDS])).logits[0].float()
    ours = _ours(f32)
    err = (ours - want).abs().max().item()
    agree, d, med = compare(ours, _llama_logits(f32))
    line = f"vs transformers {err:.2e}; vs llama.cpp top-1 {agree:.3f} max {d:.2e} median {med:.2e}"
    print(f"{family} F32: {line}")
    assert err < F32_TOL and agree == 1.0 and d < 3 * F32_TOL, line


@pytest.mark.parametrize("family", DSA)
def test_llama_cpp_quantized_q8_0_files(family, tmp_path):
    _checkpoint(family, tmp_path / "hf")
    f32 = _convert(tmp_path / "hf", tmp_path / "m-F32.gguf")
    q8 = _quantize(f32, tmp_path / "m-Q8_0.gguf")
    agree, d, med = compare(_ours(q8), _llama_logits(q8))
    line = f"top-1 {agree:.3f}, max |dlogit| {d:.2e}, median {med:.2e}"
    print(f"{family} Q8_0 vs llama.cpp: {line}")
    assert agree >= 0.95, line


# DeepSeek-V4: llama.cpp's converter reads the release layout only (its names, FP4 experts with
# their scales, the legacy config keys), and llama.cpp computes compress ratios 0, 4 and 128
V4_OVER = {
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    "head_dim": 64,
    "index_head_dim": 64,
    "q_lora_rank": 32,
    "hc_mult": 4,  # llama.cpp asserts 4 streams
}


def _v4_release(hf_dir: Path, out: Path) -> None:
    """The tiny transformers checkpoint in the release layout (test_deepseek_v4_release's
    codecs): release names with the attention's KV norm as released (``attn.kv_norm``, which
    the converter reads; transformers saves ``attn.norm``), FP4 routed experts, float dense
    weights, the legacy config keys."""
    from safetensors.torch import load_file, save_file
    from test_deepseek_v4_release import fp4_blocks, release_config, release_names

    out.mkdir()
    tensors = {}
    for name, t in release_names(load_file(hf_dir / "model.safetensors")).items():
        name = name.replace(".attn.norm.", ".attn.kv_norm.")
        if ".ffn.experts." in name:
            q, s = fp4_blocks(t.float())
            tensors[name], tensors[name.removesuffix(".weight") + ".scale"] = q, s
        else:
            tensors[name] = t
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    cfg = release_config(json.loads((hf_dir / "config.json").read_text()))
    cfg["architectures"] = ["DeepseekV4ForCausalLM"]
    (out / "config.json").write_text(json.dumps(cfg))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (out / f).write_bytes((hf_dir / f).read_bytes())


def _v4_file(tmp_path: Path):
    """(the transformers model, llama.cpp's F32 file of its release layout)."""
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    vocab = _tokenizer(hf_dir, "deepseek_v4")
    hf = make_tiny("deepseek_v4", hf_dir, seed=3, vocab_size=vocab, **V4_OVER)[1]
    _tokenizer(hf_dir, "deepseek_v4")
    _v4_release(hf_dir, tmp_path / "release")
    return hf, _convert(tmp_path / "release", tmp_path / "v4-F32.gguf")


def test_llama_cpp_converted_deepseek_v4_f32(tmp_path, monkeypatch):
    from gguf_files import dequantized_reference

    from freetokend.models import gguf_experts

    hf, f32 = _v4_file(tmp_path)
    # transformers on the file's weights: the experts' FP4 values (read by our reproduction's
    # names: a name the converter writes otherwise fails here)
    dequantized_reference("deepseek_v4", hf, f32)
    with torch.no_grad():
        want = hf(torch.tensor([IDS])).logits[0].float()
    with monkeypatch.context() as m:  # the experts dequantized: fp32 throughout
        m.setattr(gguf_experts, "block_expert_format", lambda *a: None)
        err = (_ours(f32) - want).abs().max().item()
    agree, d, med = compare(_ours(f32), _llama_logits(f32))  # MXFP4 experts in their blocks
    line = f"vs transformers {err:.2e}; vs llama.cpp top-1 {agree:.3f} max {d:.2e} median {med:.2e}"
    print(f"deepseek_v4 F32: {line}")
    assert err < F32_TOL and agree == 1.0 and d < F32_TOL, line


def test_llama_cpp_quantized_deepseek_v4(tmp_path):
    _, f32 = _v4_file(tmp_path)
    q8 = _quantize(f32, tmp_path / "v4-Q8_0.gguf", keep_mxfp4_experts=True)
    agree, d, med = compare(_ours(q8), _llama_logits(q8))
    line = f"top-1 {agree:.3f}, max |dlogit| {d:.2e}, median {med:.2e}"
    print(f"deepseek_v4 Q8_0 vs llama.cpp: {line}")
    assert agree >= 0.95, line


def test_llama_cpp_converted_nvfp4_glm5(tmp_path):
    """GLM-5.2's release form: the routed experts (and the fixture's shared experts and layer
    0's dense MLP) in NVFP4, compressed-tensors' convention (test_release_quant_experts'
    fixture), through llama.cpp's converter: NVFP4 tensors with per-expert ``.scale`` globals
    (its reciprocal of compressed-tensors' divisor), the rest F32. Ours on that file against
    ours on the release folder (the same codes, scales and globals: the same arithmetic), and
    against transformers on the dequantized weights.

    Against llama.cpp: its NVFP4 dot products take Q8_0 activations (``vec_dot_type``), ours
    fp32 ones, so the two part by that rounding. Measured (the widths of OVER, 64 positions):
    llama.cpp on the NVFP4 file against us top-1 0.906, median |dlogit| 0.040, and against its
    own F32 file of the same dequantized weights also 0.906 / 0.040; us against that F32 file
    1.000, max 3e-6. So the test holds us to llama.cpp's F32 file of the same weights (1e-4) and
    llama.cpp's NVFP4 file to within 1/32 of its own agreement with its F32 file."""
    from test_release_quant_experts import _oracle_dir, write_release

    from freetokend.models.gguf_loader import GgufCheckpoint

    # the converter packs NVFP4 rows in super-blocks of 64 inputs: every quantized row is too
    hf = _checkpoint("glm_moe_dsa", tmp_path / "hf", moe_intermediate_size=64)
    dirs = {"ct": tmp_path / "ct", "modelopt": tmp_path / "modelopt"}
    oracle = write_release(tmp_path / "hf", dirs, "nvfp4")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "ct" / f).write_bytes((tmp_path / "hf" / f).read_bytes())
    gguf_path = _convert(tmp_path / "ct", tmp_path / "m-NVFP4.gguf")
    with GgufCheckpoint(gguf_path) as ck:
        types = {t.type_name for n, (_, t) in ck.tensors.items() if "_exps.weight" in n}
        assert types == {"NVFP4"} and ck.config().expert_format == "nvfp4"
    oracle_dir = _oracle_dir(tmp_path / "hf", oracle, tmp_path / "or")
    with torch.no_grad():
        hf_oracle = type(hf).from_pretrained(oracle_dir).float().eval()
        want = hf_oracle(torch.tensor([IDS])).logits[0].float()
    ours = _ours(gguf_path)
    release = LLM(tmp_path / "ct", max_model_len=128, kv_tokens=512, dtype="float32").logits(IDS)
    err, same = (ours - want).abs().max().item(), (ours - release).abs().max().item()
    theirs_nv = _llama_logits(gguf_path)
    theirs_f32 = _llama_logits(_convert(oracle_dir, tmp_path / "m-deq-F32.gguf"))
    agree, d, med = compare(ours, theirs_nv)
    agree_f32, d_f32, _ = compare(ours, theirs_f32)
    self_agree, _, self_med = compare(theirs_nv, theirs_f32)
    line = (
        f"vs transformers {err:.2e}; vs our load of the release folder {same:.2e}; vs llama.cpp "
        f"NVFP4 top-1 {agree:.3f} max {d:.2e} median {med:.2e}; vs llama.cpp F32 of the same "
        f"weights top-1 {agree_f32:.3f} max {d_f32:.2e}; llama.cpp NVFP4 vs its F32 top-1 "
        f"{self_agree:.3f} median {self_med:.2e}"
    )
    print(f"glm_moe_dsa NVFP4: {line}")
    assert err < F32_TOL and same < F32_TOL, line
    assert agree_f32 == 1.0 and d_f32 < 3 * F32_TOL, line
    assert abs(agree - self_agree) <= 1 / 32, line
