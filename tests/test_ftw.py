"""FTW: bit-exact round trips of every family, alignment, refusal of broken folders, atomic writes."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from tiny_models import FAMILIES, make_tiny

from freetokend import LLM
from freetokend.checkpoint.ftw import FtwError
from freetokend.checkpoint.ftw_index import ALIGN, INDEX_NAME, fingerprint, read_index
from freetokend.checkpoint.ftw_write import write_ftw
from freetokend.experts.formats import quantize_banks
from freetokend.models.ftw_convert import convert, model_tensors
from freetokend.models.ftw_loader import load_ftw
from freetokend.models.loader import CheckpointError, load_model


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(2, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _assert_same_weights(a: tuple, b: tuple) -> None:
    (m1, b1), (m2, b2) = a, b
    p1, p2 = dict(m1.named_parameters()), dict(m2.named_parameters())
    assert p1.keys() == p2.keys()
    for n in p1:
        assert p1[n].dtype == p2[n].dtype and torch.equal(p1[n], p2[n]), n
    t1, t2 = b1.all_tensors(), b2.all_tensors()
    assert t1.keys() == t2.keys() and b1.format == b2.format
    for n in t1:
        assert t1[n].dtype == t2[n].dtype and torch.equal(t1[n], t2[n]), n


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """A converted tiny qwen3_moe, shared by the read-only tests."""
    d = tmp_path_factory.mktemp("qwen")
    make_tiny("qwen3_moe", d / "hf", seed=7)
    (d / "hf" / "tokenizer_config.json").write_text('{"model_max_length": 512}')
    (d / "hf" / "chat_template.jinja").write_text("{{ messages }}")
    convert(d / "hf", d / "ftw")
    return d / "hf", d / "ftw"


@pytest.fixture
def broken(qwen, tmp_path):
    """A private copy of the converted folder, to damage."""
    import shutil

    dest = tmp_path / "ftw"
    shutil.copytree(qwen[1], dest)
    return dest


# ---- round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_generates_identical_tokens(family, tmp_path):
    make_tiny(family, tmp_path / "hf", seed=11)
    convert(tmp_path / "hf", tmp_path / "ftw")
    _assert_same_weights(load_model(tmp_path / "hf"), load_ftw(tmp_path / "ftw"))
    ids = _prompt(10, seed=1)
    kw = dict(max_model_len=256, kv_tokens=1024)
    ref = LLM(tmp_path / "hf", **kw).generate(ids, max_tokens=8, ignore_eos=True)
    got = LLM(tmp_path / "ftw", **kw).generate(ids, max_tokens=8, ignore_eos=True)
    assert len(ref) == 8 and got == ref


def test_round_trip_bf16_with_expert_biases(tmp_path):
    make_tiny("gpt_oss", tmp_path / "hf", seed=2, dtype=torch.bfloat16)
    convert(tmp_path / "hf", tmp_path / "ftw")
    hf, ftw = load_model(tmp_path / "hf"), load_ftw(tmp_path / "ftw", verify=True)
    assert ftw[1].gate_up.dtype == torch.bfloat16 and ftw[1].gate_up_bias is not None
    _assert_same_weights(hf, ftw)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "fp8_block"])
def test_quantized_banks_round_trip(qwen, tmp_path, fmt):
    model, banks = load_model(qwen[0])
    qb = quantize_banks(banks, fmt)
    cfg_bytes = (qwen[0] / "config.json").read_bytes()
    write_ftw(tmp_path / "q", model_tensors(model, qb), cfg_bytes, [], fmt)
    _assert_same_weights((model, qb), load_ftw(tmp_path / "q"))


def test_direct_and_buffered_reads_agree(qwen):
    _assert_same_weights(load_ftw(qwen[1], direct=True), load_ftw(qwen[1], direct=False, threads=1))


def test_refused_direct_reads_fall_back_to_buffered(qwen, monkeypatch):
    """Some filesystems accept O_DIRECT at open and fail the reads with EINVAL."""
    from freetokend.checkpoint import ftw_io

    real, refused = ftw_io._pread_full, []

    def pread(fd: int, buf: memoryview, offset: int, path: object) -> None:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0):
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        real(fd, buf, offset, path)

    monkeypatch.setattr(ftw_io, "_pread_full", pread)
    _assert_same_weights(load_model(qwen[0]), load_ftw(qwen[1], threads=3))
    assert refused


# ---- layout -----------------------------------------------------------------------------------


def test_layout_is_aligned_and_fingerprinted(qwen):
    hf, ftw = qwen
    idx = read_index(ftw)
    assert {e.file for e in idx.tensors} == {"dense.bin", "experts.bin"}
    for e in idx.tensors:
        assert e.offset % ALIGN == 0
    for name, size in idx.files.items():
        assert size % ALIGN == 0 and (ftw / name).stat().st_size == size
    assert idx.fingerprint == fingerprint((hf / "config.json").read_bytes(), idx.tensors)
    assert (ftw / "config.json").read_bytes() == (hf / "config.json").read_bytes()
    for aux in ("generation_config.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (ftw / aux).read_bytes() == (hf / aux).read_bytes()
    assert not list(ftw.glob("*.safetensors"))
    model, banks = load_ftw(ftw)
    for t in [*banks.all_tensors().values(), *model.parameters()]:
        assert t.data_ptr() % ALIGN == 0
    # bank extents hold the flat_id-major banks byte for byte
    e = next(e for e in idx.tensors if e.name == "experts.down")
    raw = (ftw / "experts.bin").read_bytes()[e.offset : e.offset + e.nbytes]
    assert raw == banks.down.contiguous().view(torch.uint8).numpy().tobytes()


# ---- refusing broken folders ------------------------------------------------------------------


def test_missing_index_refused(broken):
    (broken / INDEX_NAME).unlink()
    with pytest.raises(FtwError, match="no ftw.json"):
        load_ftw(broken)
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_model(broken)


def test_truncated_data_file_refused(broken):
    path = broken / "experts.bin"
    os.truncate(path, path.stat().st_size - ALIGN)
    with pytest.raises(FtwError, match=r"experts\.bin: .*truncated"):
        load_model(broken)


@pytest.mark.parametrize("field", ["offset", "shape"])
def test_tampered_index_refused(broken, field):
    raw = json.loads((broken / INDEX_NAME).read_text())
    t = next(t for t in raw["tensors"] if t["name"] == "experts.gate_up")  # [N, 2I, H]
    t[field] = (
        t[field] + ALIGN
        if field == "offset"
        else [t["shape"][0] // 2, t["shape"][1] * 2, t["shape"][2]]
    )
    (broken / INDEX_NAME).write_text(json.dumps(raw))
    with pytest.raises(FtwError, match="fingerprint mismatch"):
        load_ftw(broken)


def test_edited_config_refused(broken):
    cfg = json.loads((broken / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-3
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FtwError, match="fingerprint mismatch"):
        load_ftw(broken)


def test_corrupted_bytes_caught_by_verify(broken):
    with (broken / "dense.bin").open("r+b") as f:
        f.seek(8)
        byte = f.read(1)
        f.seek(8)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(FtwError, match="content hash mismatch"):
        load_ftw(broken, verify=True)


def test_other_version_refused(broken):
    raw = json.loads((broken / INDEX_NAME).read_text())
    raw["version"] = 99
    (broken / INDEX_NAME).write_text(json.dumps(raw))
    with pytest.raises(FtwError, match="version 99 is not supported"):
        load_ftw(broken)


# ---- atomic writes ----------------------------------------------------------------------------


def _interrupt_at(fraction: float):
    def progress(phase: str, done: int, total: int) -> None:
        if phase == "write" and done >= fraction * total:
            raise KeyboardInterrupt

    return progress


def test_interrupted_write_leaves_nothing(qwen, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        convert(qwen[0], out, progress=_interrupt_at(0.5))
    assert not out.exists() and list(tmp_path.iterdir()) == []
    with pytest.raises(FtwError):
        load_ftw(out)


def test_interrupted_force_keeps_the_old_folder(qwen, tmp_path):
    out = tmp_path / "out"
    first = convert(qwen[0], out)
    with pytest.raises(FtwError, match="already exists"):
        convert(qwen[0], out)
    with pytest.raises(KeyboardInterrupt):
        convert(qwen[0], out, force=True, progress=_interrupt_at(0.3))
    assert read_index(out).fingerprint == first.fingerprint
    assert convert(qwen[0], out, force=True).fingerprint == first.fingerprint
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_force_never_replaces_a_foreign_folder(qwen, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FtwError, match="not an FTW checkpoint folder"):
        convert(qwen[0], tmp_path, force=True)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_killed_conversion_is_not_loadable_and_cleaned_up(qwen, tmp_path):
    out = tmp_path / "out"
    script = textwrap.dedent(f"""
        import os
        from freetokend.models.ftw_convert import convert
        def progress(phase, done, total):
            if done >= total // 2:
                os._exit(3)  # no cleanup: as if killed
        convert({str(qwen[0])!r}, {str(out)!r}, progress=progress)
    """)
    proc = subprocess.run([sys.executable, "-c", script], env=os.environ.copy(), timeout=120)
    assert proc.returncode == 3
    assert not out.exists()
    (tmp,) = tmp_path.glob("out.tmp-*")
    assert (tmp / "dense.bin").exists() and not (tmp / INDEX_NAME).exists()
    with pytest.raises(FtwError, match="unfinished conversion"):
        load_ftw(tmp)
    convert(qwen[0], out)  # the dead writer's folder is removed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    load_ftw(out)


# ---- ftctl checkpoint -------------------------------------------------------------------------


def _ftctl(*argv: str) -> int:
    import argparse

    from ftctl import checkpoint

    parser = argparse.ArgumentParser()
    checkpoint.add_parser(parser.add_subparsers())
    args = parser.parse_args(["checkpoint", *argv])
    return args.run(args)


def test_ftctl_checkpoint(qwen, tmp_path, capsys):
    out = tmp_path / "out"
    assert _ftctl("--model", str(qwen[0]), "--out", str(out)) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    _assert_same_weights(load_model(qwen[0]), load_ftw(out))
    assert _ftctl("--model", str(qwen[0]), "--out", str(out)) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already exists" in err
    assert _ftctl("--model", str(tmp_path / "nope"), "--out", str(out)) == 1
    assert _ftctl("--model", str(qwen[0]), "--out", str(out), "--force") == 0
