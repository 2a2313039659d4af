"""GGUF start-up (issue 44 item 4): the header parsed once by our own reader, the byte-level
tokenizer built without transformers, the experts read and interleaved without extra passes.
Each fast path is checked against the path it replaced: the ``gguf`` package's reader for the
header, transformers' GGUF conversion for the tokenizer (the same tokenizer.json), a reference
load for the weights (bit-identical banks and parameters)."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V
from gguf_files import kmix_qwen3_moe

from freetokend import LLM
from freetokend.engine import gguf_tokenizer
from freetokend.engine.gguf_pretokenizers import PRE_TOKENIZER_SPLITS, TRANSFORMERS_SPLITS
from freetokend.engine.tokenizer import Tokenizer
from freetokend.experts.formats import expert_rows, interleave_banks, interleaves
from freetokend.formats import gguf_file, gguf_header, gguf_interleave
from freetokend.formats.gguf_dequant import DEQUANTIZERS
from freetokend.formats.gguf_file import GgufFile, GgufFormatError, read_header
from freetokend.models.gguf_loader import GgufCheckpoint
from freetokend.models.layers.common import Embedding
from freetokend.models.loader import load_model
from freetokend.models.registry import family_spec

# ---- the header ----------------------------------------------------------------------------


def _reference_metadata(path: Path) -> dict:
    """The metadata as the ``gguf`` package's reader gives it (what GgufFile used before)."""
    r = gguf.GGUFReader(path)
    out = {}
    for name, f in r.fields.items():
        if not f.types:
            out[name] = None
        elif f.types[0] == V.ARRAY:
            out[name] = list(f.contents())
        else:
            out[name] = f.contents()
    return out


def _every_type(path: Path, endian: gguf.GGUFEndian) -> Path:
    w = gguf.GGUFWriter(path, "qwen3moe", endianess=endian)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "Grüße 日本語 🚀")
    w.add_array("t.ints", [1, 2, 3])
    w.add_array("t.floats", [0.5, 0.25])
    w.add_array("t.bools", [True, False])
    w.add_array("t.strs", ["a", "", "Ġhello", "<|im_end|>"])
    w.add_array("t.empty", [])
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_tensor("a.weight", np.arange(64, dtype=np.float32).reshape(2, 32))
    w.add_tensor("b.weight", np.ones((3, 32), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("endian", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_header_equals_the_gguf_packages_reader(tmp_path, endian):
    path = _every_type(tmp_path / "t.gguf", endian)
    h = read_header(path)
    ref = _reference_metadata(path)
    assert list(h.metadata) == list(ref)
    for k, v in ref.items():
        assert h.metadata[k] == v and type(h.metadata[k]) is type(v), k
        if isinstance(v, list):
            assert [type(x) for x in h.metadata[k]] == [type(x) for x in v], k
    r = gguf.GGUFReader(path)
    assert {t.name: int(t.data_offset) for t in r.tensors} == {
        n: t.offset for n, t in h.tensors.items()
    }
    if endian == gguf.GGUFEndian.LITTLE:  # tensor data (the reader maps it as stored)
        with GgufFile(path, h) as f:
            a = f.read_float(h.tensors["a.weight"])
        assert a.numpy().tolist() == np.arange(64, dtype=np.float32).reshape(2, 32).tolist()


def test_the_type_table_is_the_gguf_packages():
    """GGML_TYPES (what the header parse reads, without importing the package) agrees with the
    gguf package's names and block sizes; a type only the package knows still parses."""
    for qtype, (name, block, size) in gguf_file.GGML_TYPES.items():
        assert Q(qtype).name == name and gguf.GGML_QUANT_SIZES[Q(qtype)] == (block, size)
    newer = [k for k in Q if int(k) not in gguf_file.GGML_TYPES]
    for k in newer:
        assert gguf_file.ggml_type(int(k)) == (k.name, *gguf.GGML_QUANT_SIZES[k])
    assert gguf_file.ggml_type(255) is None


def test_the_header_parses_without_the_gguf_package(tmp_path, monkeypatch):
    """A start-up's header parse and type check never import the gguf package (~0.2 s)."""
    path = _every_type(tmp_path / "t.gguf", gguf.GGUFEndian.LITTLE)
    monkeypatch.setitem(sys.modules, "gguf", None)  # any import of it fails
    h = gguf_header._parse_file(path)
    assert {n: t.type_name for n, t in h.tensors.items()} == {"a.weight": "F32", "b.weight": "F16"}
    assert all(gguf_file.can_dequantize(t) for t in ("F32", "BF16", "Q4_K", "Q6_K", "Q8_0"))


def test_a_header_given_is_reused_only_while_the_file_is_unchanged(tmp_path):
    path = _every_type(tmp_path / "t.gguf", gguf.GGUFEndian.LITTLE)
    h = read_header(path)
    with GgufFile(path, h) as f:
        assert f.header is h
    data = bytearray(path.read_bytes())
    path.write_bytes(bytes(data) + b"\0" * 64)  # another file now: parsed again
    assert not h.current()
    with GgufFile(path, h) as f:
        assert f.header is not h and f.metadata == h.metadata


def test_a_header_is_parsed_once_while_the_file_is_unchanged(tmp_path, monkeypatch):
    """read_header gives the header it parsed before (one start-up asks in several places) and
    parses again once the file changed."""
    path = _every_type(tmp_path / "t.gguf", gguf.GGUFEndian.LITTLE)
    parses = []
    parse = gguf_header._parse_file
    monkeypatch.setattr(gguf_header, "_parse_file", lambda p: parses.append(p) or parse(p))
    h = read_header(path)
    assert read_header(str(path)) is h and read_header(path) is h and len(parses) == 1
    with GgufFile(path) as f:
        assert f.header is h and len(parses) == 1
    path.write_bytes(path.read_bytes() + b"\0" * 64)
    again = read_header(path)
    assert again is not h and again.current() and len(parses) == 2
    assert again.metadata == h.metadata


@pytest.mark.parametrize("cut", [30, 200, 400])
def test_truncated_header_is_a_format_error(tmp_path, cut):
    path = _every_type(tmp_path / "t.gguf", gguf.GGUFEndian.LITTLE)
    path.write_bytes(path.read_bytes()[:cut])
    with pytest.raises(GgufFormatError, match=r"t\.gguf: corrupt or unsupported GGUF header"):
        read_header(path)


# ---- the tokenizer -------------------------------------------------------------------------


def _alphabet() -> list[str]:
    return list(gguf_tokenizer._byte_spelling().values())


def _cases() -> dict[str, dict]:
    """Byte-level vocabularies exercising what the conversion does beyond vocab and merges:
    tokens outside the byte alphabet (respelled), a duplicate after respelling, control tokens
    (special), a mislabelled control token, user-defined tokens, <|endoftext|> present as a
    control, a user-defined or a normal token, or absent (transformers adds it)."""
    a = _alphabet()
    tokens = [*a, "ab", "abc", "<s>", "</s>", "<think>", "x y", "é", "<｜bos｜>", "<|endoftext|>"]
    tokens.append("Ġhello")
    types = [1] * (len(a) + 2) + [3, 3, 4, 4, 1, 3, 1, 1]
    return {
        "eot-control": dict(tokens=tokens, token_type=types[:-2] + [3, 1]),
        "eot-normal": dict(tokens=tokens, token_type=types),
        "eot-user": dict(tokens=tokens, token_type=types[:-2] + [4, 1]),
        "no-eot": dict(tokens=[*tokens[:-2], "zz", "Ġhello"], token_type=types),
        "no-types": dict(tokens=tokens),
    }


@pytest.mark.parametrize("pre", ["qwen2", "qwen35", "llama-bpe", "deepseek-v3", "gpt-2"])
@pytest.mark.parametrize("case", list(_cases()))
def test_byte_level_tokenizer_equals_transformers_conversion(pre, case):
    convert = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    from freetokend.engine.gguf_pretokenizers import apply_pre_tokenizer

    tok = {"tokenizer_type": "gpt2", "pre_tokenizer_type": pre, "merges": ["a b", "ab c"]}
    tok |= _cases()[case]
    assert gguf_tokenizer._direct(tok)
    ref, _ = convert.convert_gguf_tokenizer("qwen3moe", dict(tok))
    apply_pre_tokenizer(ref, pre, "test")
    ours = gguf_tokenizer._byte_level(tok)
    assert json.loads(ours.to_str()) == json.loads(ref.to_str())


def test_the_copy_of_transformers_splits_matches_the_installed_table():
    convert = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    table = convert.GGUF_PRE_TOKENIZER_SPLITS
    assert {k: table.get(k) for k in TRANSFORMERS_SPLITS} == TRANSFORMERS_SPLITS
    assert not set(TRANSFORMERS_SPLITS) & set(PRE_TOKENIZER_SPLITS)


@pytest.fixture(scope="module")
def gguf_path(builtin_model_dir, tmp_path_factory):
    return kmix_qwen3_moe(tmp_path_factory.mktemp("gguf-startup"), builtin_model_dir, seed=3)


def test_file_tokenizer_built_without_transformers(gguf_path, monkeypatch):
    """The file's byte-level vocabulary is built directly (transformers' conversion never runs)
    and equals what that conversion gives: the same tokenizer.json, ids and fields."""
    convert = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    arch, tok, cfg = convert.get_gguf_tokenizer(str(gguf_path))
    assert gguf_tokenizer.tokenizer_fields(read_header(gguf_path).metadata) == (arch, tok, cfg)
    ref, _ = convert.convert_gguf_tokenizer(arch, tok)

    def refuse(*a: object) -> None:
        raise AssertionError("transformers' conversion ran")

    monkeypatch.setattr(gguf_tokenizer, "_converted", refuse)
    ours = gguf_tokenizer.tokenizer_from_gguf(gguf_path)
    assert json.loads(ours.backend.to_str()) == json.loads(ref.to_str())
    text = "Hello world! Grüße 日本語 <|im_start|>user\nhi<think>ok</think><|im_end|>"
    assert ours.encode(text) == ref.encode(text, add_special_tokens=False).ids


# ---- the weights ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(gguf_path):
    return LLM(gguf_path, max_model_len=64, kv_tokens=256)  # cpu: interleaved, huge pages


def test_expert_banks_are_the_files_blocks(llm, gguf_path):
    """Every expert's rows in the banks, de-interleaved by the torch reference (not the native
    moves that interleaved them at load), are the file's bytes: gate rows, then up rows."""
    banks, cfg = llm.banks, llm.config
    assert banks.format != "bf16" and banks.interleaved
    e = cfg.num_experts
    with GgufCheckpoint(gguf_path) as ck:
        for layer in range(cfg.num_layers):
            base = cfg.moe_layer_index[layer] * e
            f = {p: ck.files[0].read_raw(ck.tensors[f"blk.{layer}.ffn_{p}_exps.weight"][1])
                 for p in ("gate", "up", "down")}  # fmt: skip
            fmts = {p: ck.tensors[f"blk.{layer}.ffn_{p}_exps.weight"][1].type_name.lower()
                    for p in ("gate", "down")}  # fmt: skip
            for proj, want in (
                ("gate_up", torch.cat([f["gate"], f["up"]], 1)),
                ("down", f["down"]),
            ):
                got = expert_rows(banks, proj, base, e)
                fmt = fmts["gate" if proj == "gate_up" else "down"]
                for x in range(e):
                    rows = got[x]
                    if interleaves(proj, fmt, rows.shape[0]):  # groups of 8 rows
                        rows = gguf_interleave.deinterleave(rows, fmt, native=False)
                    assert torch.equal(rows, want[x]), (layer, proj, x)


def test_experts_interleaved_at_read_equal_interleaved_after(llm, gguf_path):
    """The cpu backend's banks, interleaved as each expert is read (``interleave_experts``),
    are byte for byte the banks loaded as the file has them and interleaved after
    (``formats.interleave_banks``, what the backend did before); other backends' banks stay
    the file's rows."""
    plain_model, plain = load_model(gguf_path, llm.config)
    assert not plain.interleaved
    interleave_banks(plain)
    assert plain.interleaved and llm.banks.interleaved
    got, want = llm.banks.all_tensors(), plain.all_tensors()
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    _, again = load_model(gguf_path, llm.config, interleave_experts=True)
    assert again.interleaved and all(torch.equal(again.all_tensors()[k], want[k]) for k in want)
    del plain_model


def test_a_failed_expert_read_fails_the_load_after_the_workers_stop(llm, gguf_path, monkeypatch):
    """The experts are read on worker threads: an error there is the load's error, raised once
    no worker writes into the banks any more."""
    calls = []
    read = GgufFile.read_raw_into

    def failing(self, t, dest, offset=0):
        calls.append(t.name)
        if len(calls) == 5:
            raise OSError(5, "Input/output error")
        read(self, t, dest, offset)

    monkeypatch.setattr(GgufFile, "read_raw_into", failing)
    with pytest.raises(OSError, match="Input/output error"):
        load_model(gguf_path, llm.config, interleave_experts=True)
    done = len(calls)
    assert done >= 5 and all(n.endswith("_exps.weight") for n in calls)
    assert not [t for t in threading.enumerate() if t.name.startswith("ft-fill")]
    assert len(calls) == done  # nothing still reading


def _gguf_dequantized(f: GgufFile, t) -> torch.Tensor:
    """The tensor dequantized whole by the ``gguf`` package's reference (what loads used)."""
    vals = gguf.quants.dequantize(f.read_raw(t).numpy(), Q(t.ggml_type))
    return torch.from_numpy(np.ascontiguousarray(vals, np.float32)).view(t.shape)


def test_dense_weights_equal_a_whole_tensor_read(llm, gguf_path):
    """Float parameters (the token embedding dequantized a slice of rows at a time by our
    dequantizers) equal the whole tensor dequantized at once by the ``gguf`` package, cast as
    before; projections kept in blocks hold the file's rows."""
    params = dict(llm.model.named_parameters())
    checked = kept = 0
    with GgufCheckpoint(gguf_path) as ck:
        for name, canon, src in ck.sources(llm.config):
            if canon.startswith("experts:"):
                continue
            mod = llm.model.get_submodule(canon.rsplit(".", 1)[0])
            qw = getattr(mod, "qweight", None)
            if qw is not None and canon.endswith(".weight"):
                raw = src.f.read_raw(src.t)
                assert torch.equal(qw.gguf_raw(), raw), name
                kept += 1
            elif getattr(mod, "blocks", None) is not None:  # the token embedding in its blocks
                assert torch.equal(mod.blocks, src.f.read_raw(src.t)), name
                kept += 1
            elif canon in params:
                ref = src.read() if not src.t.quantized else _gguf_dequantized(src.f, src.t)
                assert torch.equal(params[canon], ref.to(params[canon].dtype)), name
                checked += 1
    assert kept and checked
    assert llm.model.embed_tokens.weight.dtype == torch.bfloat16


def test_token_embedding_kept_in_blocks_computes_as_the_table(llm, gguf_path):
    """Under the cpu backend the file's token embedding stays in its blocks (the file's rows, no
    table) and the rows a step looks up are dequantized then: teacher-forced logits, and greedy
    tokens of a batch of two decoding on the native path (``HeadPlan.whole``, the rows handed
    in), equal those of the same model holding the table dequantized whole as before."""
    emb = llm.model.embed_tokens
    with GgufFile(gguf_path) as f:
        t = f.tensors["token_embd.weight"]
        assert emb.blocks is not None and emb.block_type == t.type_name
        assert emb.weight.numel() == 0 and torch.equal(emb.blocks, f.read_raw(t))
        table = torch.empty(t.shape, dtype=emb.weight.dtype)
        f.read_float_into(t, table)
    head = llm.model.decode_head()
    assert head.in_blocks is emb and head.whole_ok
    prompt, prompts = [5, 6, 7, 8, 9, 10], [[5, 6, 7, 8], [11, 12, 13]]
    logits = llm.logits(prompt)
    tokens = llm.generate(prompts, 8, ignore_eos=True)
    blocks, weight = emb.blocks, emb.weight
    try:
        emb.blocks, emb.weight = None, torch.nn.Parameter(table, requires_grad=False)
        assert llm.model.decode_head().in_blocks is None
        assert torch.equal(llm.logits(prompt), logits)
        assert llm.generate(prompts, 8, ignore_eos=True) == tokens
    finally:
        emb.blocks, emb.weight = blocks, weight


def test_auto_backend_without_a_device_loads_as_the_cpu_backend(gguf_path):
    """moe_backend auto where there is no device (the daemon's default on a CPU-only machine) is
    the cpu backend from the load on: experts interleaved as read, the embedding in its blocks."""
    llm = LLM(gguf_path, "auto", accelerator="standin", max_model_len=64, kv_tokens=256)
    assert llm.moe.__class__.__name__ == "CpuBackend" and llm.banks.interleaved
    assert llm.model.embed_tokens.blocks is not None


def test_anchor_ids_are_the_reference_tokenizers(llm, builtin_model_dir):
    ref = Tokenizer.from_dir(builtin_model_dir)
    want = {}
    for text, kind in family_spec(llm.config.family).anchors:
        tid = ref.token_to_id(text)
        if tid is not None:
            want[tid] = kind
    assert want and llm._anchor_ids() == want


# ---- dequantization at load ------------------------------------------------------------------

_EMBED_TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "Q5_0", "F16", "BF16")


def _random_blocks(rng: np.random.Generator, kind: Q, rows: int, cols: int) -> np.ndarray:
    """Random bytes of ``rows`` rows of ``kind`` blocks, with finite fp16 scales at the places
    the format keeps them (then every value is finite) in all but the last row (any bytes:
    NaN and infinite scales included)."""
    block, size = gguf.GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, (rows, cols // block * size), dtype=np.uint8)
    at = {"Q6_K": (208,), "Q4_K": (0, 2), "Q5_K": (0, 2)}.get(kind.name, (0,))
    blocks = raw[:-1].reshape(-1, size)
    for p in at:
        d = rng.normal(0, 0.05, blocks.shape[0]).astype(np.float16)
        blocks[:, p : p + 2] = d.view(np.uint8).reshape(-1, 2)
    raw[:-1] = blocks.reshape(rows - 1, -1)
    return raw


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy: NaN scales of the last row
@pytest.mark.parametrize("type_name", _EMBED_TYPES)
def test_embedding_dequantized_as_the_gguf_package_does(tmp_path, type_name):
    """A token embedding of each type an embedding may have: read into bf16 (the model's dtype)
    and fp32 parameters, a slice at a time and whole, it equals the ``gguf`` package's
    dequantization bit for bit (NaN payloads included); F16/BF16 are read as they are."""
    rng = np.random.default_rng(7)
    kind = Q[type_name]
    rows, cols = 523, 512  # rows: several slices of our dequantizer, the last one short
    path = tmp_path / "e.gguf"
    w = gguf.GGUFWriter(path, "qwen3moe")
    if type_name in ("F16", "BF16"):
        vals = rng.normal(0, 1, (rows, cols)).astype(np.float32)
        data = vals.astype(np.float16) if type_name == "F16" else gguf.quants.quantize(vals, kind)
        w.add_tensor("token_embd.weight", data, raw_dtype=kind)
    else:
        raw = _random_blocks(rng, kind, rows, cols)
        w.add_tensor("token_embd.weight", raw, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with GgufFile(path) as f:
        t = f.tensors["token_embd.weight"]
        assert t.type_name == type_name and t.shape == (rows, cols)
        ref = _gguf_dequantized(f, t).float()
        whole = f.read_float(t).float()
        assert torch.equal(whole.view(torch.int32), ref.view(torch.int32))
        threads = torch.get_num_threads()
        for dtype in (torch.float32, torch.bfloat16):
            dest = torch.empty(rows, cols, dtype=dtype)
            f.read_float_into(t, dest, chunk_bytes=40_000)
            assert torch.get_num_threads() == threads  # the workers' setting is their own
            want = ref.to(dtype)
            assert torch.equal(
                dest.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
            )
            if type_name in DEQUANTIZERS:  # kept in its blocks: the rows looked up, dequantized
                emb = Embedding(rows, cols, dtype)
                emb.keep_blocks(f.read_raw(t), type_name)
                ids = torch.tensor([rows - 1, 0, 5, 5, *range(1, rows, 3)], dtype=torch.int64)
                got = emb.rows(ids)
                assert emb.weight.numel() == 0 and got.dtype == torch.float32
                assert torch.equal(got.view(torch.int32), want.float()[ids].view(torch.int32))
