"""llama.cpp side of the decode benchmark: its sources (for the converter) and the GGUF conversion.

The converter and GPT-2's test vocabulary come from the llama-cpp-python source distribution of
the INSTALLED version (so converter and library agree on the GGUF format): found unpacked in the
cache, or fetched with `pip download --no-binary :all: --no-deps llama-cpp-python==VERSION`, of
which only the converter, its `conversion` and `gguf-py` packages and the GPT-2 vocabulary are
extracted. `FT_LLAMA_CPP_SRC` may point at an unpacked `vendor/llama.cpp` folder instead.

On a CPU with AMX, llama-cpp-python built the default way (GGML_NATIVE) runs its quantized
matmuls through ggml's AMX path, which crashed with SIGSEGV in ggml_backend_amx_mul_mat in our
sandbox (seen 2026-12-01 on a Xeon with amx_int8, on Q8_0 and Q4_K_M files; BF16 ran). Build it
without AMX and with the machine's other extensions named explicitly:
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
      -DGGML_BMI2=ON -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON \
      -DGGML_AVX512_BF16=ON -DGGML_AVX512_VBMI=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF \
      -DGGML_AMX_BF16=OFF" pip install llama-cpp-python --no-binary :all:
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

_WANTED = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "models/ggml-vocab-gpt-2.gguf")


def installed_version() -> str | None:
    """The installed llama-cpp-python version, or None."""
    try:
        return importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        return None


def extract_vendored(sdist: Path, dest: Path, wanted: tuple[str, ...] | None = _WANTED) -> None:
    """The sdist's ``vendor/llama.cpp`` files into ``dest``: those under ``wanted`` (None: all)."""
    with tarfile.open(sdist) as tar:
        members = []
        for m in tar.getmembers():
            parts = m.name.split("/vendor/llama.cpp/", 1)
            keep = wanted is None or any(parts[-1].startswith(w) for w in wanted)
            if len(parts) == 2 and keep:
                m.name = parts[1]
                members.append(m)
        tar.extractall(dest, members=members, filter="data")


def download_sdist(cache: Path, version: str) -> Path:
    """llama-cpp-python's source distribution of ``version`` (downloaded once into the cache)."""
    dl = cache / "sdist"
    dl.mkdir(parents=True, exist_ok=True)
    sdist = dl / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.exists():
        pip = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps"]
        subprocess.run([*pip, "-d", str(dl), f"llama-cpp-python=={version}"], check=True)
    return sdist


def llama_source(cache: Path) -> Path | None:
    """Folder holding convert_hf_to_gguf.py for the installed llama-cpp-python, or None."""
    env = os.environ.get("FT_LLAMA_CPP_SRC")
    if env:
        return Path(env)
    version = installed_version()
    if version is None:
        return None
    src = cache / f"llama_cpp_src-{version}"
    if (src / "convert_hf_to_gguf.py").exists():
        return src
    sdist = download_sdist(cache, version)
    tmp = src.with_name(src.name + ".tmp")
    extract_vendored(sdist, tmp)
    tmp.rename(src)
    return src


def gpt2_vocab(src: Path | None) -> Path | None:
    """GPT-2's vocabulary file in the llama.cpp sources (the tokenizer the converter accepts)."""
    if src is None:
        return None
    path = src / "models" / "ggml-vocab-gpt-2.gguf"
    return path if path.exists() else None


def convert_to_gguf(model_dir: Path, src: Path, out: Path) -> Path:
    """model_dir -> GGUF BF16 with the shipped converter (cached; redone when the checkpoint or
    the converter's version changed)."""
    stamp = {
        "checkpoint": (model_dir / "ft_bench_build.json").read_text(),
        "tokenizer": (model_dir / "tokenizer.json").stat().st_mtime,
        "src": str(src),
    }
    stamp_path = out.with_suffix(".stamp.json")
    if out.exists() and stamp_path.exists() and json.loads(stamp_path.read_text()) == stamp:
        return out
    tmp = out.with_suffix(".tmp.gguf")
    cmd = [sys.executable, str(src / "convert_hf_to_gguf.py"), str(model_dir)]
    cmd += ["--outtype", "bf16", "--outfile", str(tmp)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"convert_hf_to_gguf.py failed (rc {proc.returncode}):\n{tail}")
    tmp.rename(out)
    stamp_path.write_text(json.dumps(stamp))
    return out


GGML_TYPE_BF16 = 30  # ggml.h (llama-cpp-python exports no constant for it)


def quantize_gguf(src_gguf: Path, out: Path, ftype: str) -> Path:
    """``src_gguf`` (BF16) -> GGUF quantized by llama.cpp's own quantizer (cached; redone when the
    source changed). ``ftype``: "q8_0", "q4_k_m" and "q5_k_m" are llama.cpp's presets as users
    download them (its own per-tensor mix: Q4_K_M and Q5_K_M put Q6_K on some tensors); "mxfp4"
    is MXFP4_MOE with every non-expert tensor kept BF16, so the pair with our experts-only MXFP4
    reads the same bytes."""
    import ctypes

    import llama_cpp as L

    ftypes = {
        "q8_0": L.LLAMA_FTYPE_MOSTLY_Q8_0,
        "q4_k_m": L.LLAMA_FTYPE_MOSTLY_Q4_K_M,
        "q5_k_m": L.LLAMA_FTYPE_MOSTLY_Q5_K_M,
        "mxfp4": L.LLAMA_FTYPE_MOSTLY_MXFP4_MOE,
    }
    stamp = {
        "src": str(src_gguf),
        "mtime": src_gguf.stat().st_mtime,
        "size": src_gguf.stat().st_size,
        "ftype": ftype,
    }
    stamp_path = out.with_suffix(".stamp.json")
    if out.exists() and stamp_path.exists() and json.loads(stamp_path.read_text()) == stamp:
        return out
    params = L.llama_model_quantize_default_params()
    params.ftype = ftypes[ftype]
    params.nthread = os.cpu_count() or 1
    if ftype == "mxfp4":  # its default Q8_0 for the non-expert tensors overridden to BF16
        overrides = (L.llama_model_tensor_override * 2)()
        overrides[0].pattern, overrides[0].type = b"^(?!.*_exps).*$", GGML_TYPE_BF16
        overrides[1].pattern = None  # the list ends at a null pattern
        params.tt_overrides = ctypes.cast(overrides, ctypes.POINTER(L.llama_model_tensor_override))
    tmp = out.with_suffix(".tmp.gguf")
    rc = L.llama_model_quantize(str(src_gguf).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize failed (rc {rc})")
    tmp.rename(out)
    stamp_path.write_text(json.dumps(stamp))
    return out


def gguf_bytes_per_token(path: Path, top_k: int, experts: int) -> int:
    """Weight bytes one decoded token reads from a GGUF file, measured from its tensors (in
    their stored types): every 2-D weight but the token embedding, and top_k of every layer's
    ``experts`` routed experts."""
    from gguf import GGUFReader

    total = 0
    for t in GGUFReader(str(path)).tensors:
        if t.name.startswith("token_embd") or len(t.shape) < 2:
            continue
        nbytes = int(t.n_bytes)
        total += nbytes * top_k // experts if "_exps" in t.name else nbytes
    return total
