"""Bad GGUF files and paths that are not models: each a clear error naming the file (and the
tensor), never a crash or a hang."""

from __future__ import annotations

import struct

import gguf
import pytest
from gguf_files import write_gguf
from tiny_models import make_tiny

from freetokend import LLM
from freetokend.models.config import ConfigError
from freetokend.models.loader import CheckpointError, load_model


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf-bad")
    return make_tiny("qwen3_moe", d / "hf", seed=3, mlp_only_layers=[])[1]


@pytest.fixture
def good(hf, tmp_path):
    return write_gguf("qwen3_moe", hf, tmp_path / "m.gguf", "f32")


def _load(path):
    return LLM(path, max_model_len=64, kv_tokens=256)


def test_truncated_file_names_the_tensor(good):
    data = good.read_bytes()
    good.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(CheckpointError, match=r"m\.gguf: tensor '.+' .*truncated"):
        _load(good)


def test_truncated_header(good):
    good.write_bytes(good.read_bytes()[:200])
    with pytest.raises(CheckpointError, match=r"m\.gguf: corrupt or unsupported GGUF header"):
        _load(good)


def test_wrong_magic(good):
    good.write_bytes(b"GGUX" + good.read_bytes()[4:])
    with pytest.raises(CheckpointError, match=r"m\.gguf: a file that is not a GGUF checkpoint"):
        _load(good)


def test_wrong_version(good):
    data = bytearray(good.read_bytes())
    data[4:8] = struct.pack("<I", 99)
    good.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"m\.gguf: .*version 99"):
        _load(good)


def test_tensor_size_not_matching_type_and_shape(good):
    """token_embd's type patched from F32 to F64: twice the bytes, running into the next tensor."""
    data = bytearray(good.read_bytes())
    name = b"token_embd.weight"
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    (n_dims,) = struct.unpack_from("<I", data, at)
    type_at = at + 4 + 8 * n_dims
    assert struct.unpack_from("<I", data, type_at)[0] == gguf.GGMLQuantizationType.F32
    struct.pack_into("<I", data, type_at, gguf.GGMLQuantizationType.F64)
    good.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"m\.gguf: tensor 'token_embd\.weight' .*size"):
        _load(good)


def test_missing_dense_tensor(hf, tmp_path):
    p = write_gguf("qwen3_moe", hf, tmp_path / "m.gguf", drop=("blk.1.attn_k.weight",))
    with pytest.raises(CheckpointError, match=r"m\.gguf: missing tensor 'blk\.1\.attn_k\.weight'"):
        _load(p)


def test_missing_expert_tensor(hf, tmp_path):
    p = write_gguf("qwen3_moe", hf, tmp_path / "m.gguf", drop=("blk.2.ffn_up_exps.weight",))
    with pytest.raises(CheckpointError, match=r"missing tensor 'blk\.2\.ffn_up_exps\.weight'"):
        _load(p)


def test_wrong_tensor_shape(hf, tmp_path):
    p = write_gguf("qwen3_moe", hf, tmp_path / "m.gguf")
    w = gguf.GGUFWriter(tmp_path / "bad.gguf", "qwen3moe")
    r = gguf.GGUFReader(p)
    for k, f in r.fields.items():
        if k.startswith("qwen3moe.") or k.startswith("tokenizer."):
            if isinstance(f.contents(), int):
                w.add_uint32(k, f.contents())
            elif isinstance(f.contents(), float):
                w.add_float32(k, f.contents())
    import numpy as np

    for t in r.tensors:
        a = np.array(t.data)
        if t.name == "blk.0.attn_q.weight":
            a = a[:-16]  # 16 rows short
        w.add_tensor(t.name, a, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(
        CheckpointError, match=r"bad\.gguf: tensor 'blk\.0\.attn_q\.weight' has shape"
    ):
        _load(tmp_path / "bad.gguf")


def test_unsupported_architecture(tmp_path):
    import numpy as np

    w = gguf.GGUFWriter(tmp_path / "dense.gguf", "qwen2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(
        ConfigError, match=r"dense\.gguf: GGUF architecture 'qwen2' is not supported"
    ):
        _load(tmp_path / "dense.gguf")


def test_paths_that_are_not_models(tmp_path):
    with pytest.raises(
        CheckpointError, match=r"nope\.gguf: no such file or folder; expected a model"
    ):
        _load(tmp_path / "nope.gguf")
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(CheckpointError, match=r"notes\.txt: a file that is not a GGUF checkpoint"):
        load_model(text)
    with pytest.raises(CheckpointError, match=r"nope: no such file or folder"):
        load_model(tmp_path / "nope")


def test_split_set_with_a_missing_part(good, tmp_path):
    part = tmp_path / "m-00001-of-00002.gguf"
    good.rename(part)
    with pytest.raises(CheckpointError, match=r"split file m-00002-of-00002\.gguf of 2 is missing"):
        _load(part)


def test_a_type_we_cannot_compute_or_dequantize_is_refused(hf, tmp_path):
    """Q8_1 (llama.cpp's activation type) in a weight: refused naming the type and tensor."""
    import numpy as np

    p = write_gguf("qwen3_moe", hf, tmp_path / "m.gguf")
    r = gguf.GGUFReader(p)
    w = gguf.GGUFWriter(tmp_path / "q81.gguf", "qwen3moe")
    for k, f in r.fields.items():
        if k.startswith("qwen3moe."):
            v = f.contents()
            w.add_uint32(k, v) if isinstance(v, int) else w.add_float32(k, v)
    for t in r.tensors:
        a, qt = np.array(t.data), t.tensor_type
        if t.name == "blk.1.attn_v.weight":  # [32, 64] -> Q8_1 blocks of 32 values, 40 bytes
            a, qt = np.zeros((32, 2 * 40), np.uint8), gguf.GGMLQuantizationType.Q8_1
        w.add_tensor(t.name, a, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(
        CheckpointError, match=r"q81\.gguf: tensor 'blk\.1\.attn_v\.weight' has type Q8_1"
    ):
        _load(tmp_path / "q81.gguf")
