"""llama.cpp's own converter and quantizer against us (opt-in: ``pytest --runslow``; needs
``llama-cpp-python`` and the llama.cpp sources of the same version, ``FT_LLAMA_CPP_SRC``: the
folder holding ``convert_hf_to_gguf.py``, ``gguf-py`` and ``models/ggml-vocab-gpt-2.gguf``).

Where test_gguf_llamacpp_slow.py reads files of our reproduction of the converter
(tests/gguf_convert.py), this one runs the real ``convert_hf_to_gguf.py`` on the tiny HF
checkpoint (tests/tiny_models.py) of the DSA families, DeepSeek-V3.2 (``deepseek32``) and GLM-5
(``glm-dsa``), to F32, and ``llama_model_quantize`` to Q8_0. The checkpoint carries GPT-2's
tokenizer (rebuilt from llama.cpp's test vocabulary, tests/bench/decode_tokenizer.py: the only
kind of tokenizer whose pre-tokenizer the converter recognises offline), with GLM's special
tokens added for GLM-5 (the converter looks them up). V3.2's converter asserts the tokenizer's
``add_bos_token``, which transformers 5.25 never reports for a folder with a tokenizer.json
(it drops the key from tokenizer_config.json): the converter runs with AutoTokenizer's result
flagged so (``_CONVERT``), the tokenization itself unchanged. DeepSeek-V3.2's config.json gets ``scoring_func: sigmoid``, as the
release has it: transformers' config drops the key, the converter then writes no
``expert_gating_func``, and llama.cpp's deepseek32 refuses a file without it.

Checks: the F32 file within 1e-4 of transformers (our load of llama.cpp's file, not of ours);
on the Q8_0 file top-1 agreement >= 0.95 between llama.cpp and us over 64 teacher-forced
positions (llama.cpp with an F32 KV cache). The F32 file against llama.cpp is printed too.
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


def _checkpoint(family: str, folder: Path):
    """The tiny HF checkpoint with a tokenizer the converter takes; -> the transformers model."""
    folder.mkdir(parents=True)
    vocab = _tokenizer(folder, family)
    hf = make_tiny(family, folder, seed=3, vocab_size=vocab)[1]
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


def _quantize(src: Path, out: Path) -> Path:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params))
    assert rc == 0, f"llama_model_quantize failed (rc {rc})"
    return out


def _llama_logits(path: Path) -> torch.Tensor:
    m = llama_cpp.Llama(
        str(path),
        n_ctx=128,
        n_batch=128,
        n_threads=2,
        logits_all=True,
        verbose=False,
        type_k=0,  # GGML_TYPE_F32: the default F16 cache alone moves logits by ~1e-3
        type_v=0,
    )
    m.eval(IDS)
    return torch.tensor(m.scores[: len(IDS)], dtype=torch.float32)


def _ours(path: Path) -> torch.Tensor:
    ql.set_fp16_act_scales(True)  # llama.cpp's Q8_0 activation scales
    try:
        return LLM(path, max_model_len=128, kv_tokens=512, dtype="float32").logits(IDS)
    finally:
        ql.set_fp16_act_scales(False)


def _compare(ours: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, float]:
    per_pos = (ours - ref).abs().amax(-1)
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    return agree, per_pos.max().item(), per_pos.median().item()


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_llama_cpp_converted_files(family, tmp_path):
    hf = _checkpoint(family, tmp_path / "hf")
    f32 = _convert(tmp_path / "hf", tmp_path / "m-F32.gguf")
    with torch.no_grad():
        want = hf(torch.tensor([IDS])).logits[0].float()
    ours = _ours(f32)
    err = (ours - want).abs().max().item()
    agree, d, med = _compare(ours, _llama_logits(f32))
    print(
        f"{family} F32: vs transformers {err:.2e}; vs llama.cpp top-1 {agree:.3f} max {d:.2e} median {med:.2e}"
    )
    assert err < F32_TOL, err
    q8 = _quantize(f32, tmp_path / "m-Q8_0.gguf")
    agree, d, med = _compare(_ours(q8), _llama_logits(q8))
    print(f"{family} Q8_0 vs llama.cpp: top-1 {agree:.3f}, max |dlogit| {d:.2e}, median {med:.2e}")
    assert agree >= 0.95, (agree, d, med)
