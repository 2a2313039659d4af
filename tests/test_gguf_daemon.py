"""GGUF files through the daemon and ftctl: ``freetokend --model X.gguf`` serves it,
``ftctl models load Y.gguf`` loads another, ``ftctl checkpoint --model X.gguf --out DIR`` writes
an FTW folder that loads to the same logits (with the tokenizer and template of the file)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
from gguf_files import write_gguf
from server_support.daemon import _pythonpath, start_daemon
from tiny_models import make_tiny

from freetokend import LLM
from freetokend.engine.tokenizer import Tokenizer
from freetokend.formats.direct_read import open_direct

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def files(builtin_model_dir, tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("gguf-daemon")
    vocab = Tokenizer.from_dir(builtin_model_dir).vocab_size
    out = {}
    for name, seed in (("qa", 3), ("qb", 5)):
        hf = make_tiny("qwen3_moe", d / name, seed=seed, mlp_only_layers=[], vocab_size=vocab)[1]
        out[name] = write_gguf(
            "qwen3_moe", hf, d / f"{name}-F32.gguf", tokenizer=builtin_model_dir, pre="qwen35"
        )
        shutil.rmtree(d / name)
    return out


def _ftctl(*args: str, socket: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": _pythonpath()}
    cmd = [sys.executable, "-m", "ftctl.main", *args, *(["--socket", socket] if socket else [])]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=REPO)


def test_daemon_serves_a_gguf_and_ftctl_loads_another(files):
    sock_dir = Path(tempfile.mkdtemp(prefix="ftgguf-", dir="/tmp"))
    sock = str(sock_dir / "admin.sock")
    d = start_daemon("--model", str(files["qa"]), "--kv-tokens", "2048", "--admin-socket", sock)
    try:
        body = {
            "model": "qa-F32",
            "messages": [{"role": "user", "content": "Grüße"}],
            "max_tokens": 6,
            "temperature": 0,
        }
        status, out = d.post("/v1/chat/completions", body)
        assert status == 200, out
        assert out["model"] == "qa-F32"
        proc = _ftctl("models", "load", str(files["qb"]), "--json", socket=sock)
        assert proc.returncode == 0, proc.stderr
        loaded = json.loads(proc.stdout)
        assert loaded["name"] == "qb-F32" and loaded["state"] == "resident"
        # ftctl bench bw reads the active model's GGUF file for B_D, the disk tier's way
        proc = _ftctl("bench", "bw", "--json", socket=sock)
        assert proc.returncode == 0, proc.stderr
        prof = json.loads(proc.stdout)
        assert prof["b_d"] > 0 and prof["b_p"] > 0 and prof["b_h"] > 0
        assert prof["disk_path"] == str(files["qa"]) and prof["disk_note"] == "the GGUF file"
        assert prof["disk_direct"] == _direct(files["qa"])
    finally:
        d.stop()
        shutil.rmtree(sock_dir, ignore_errors=True)


def _direct(path: Path) -> bool:
    """Whether the file system takes O_DIRECT reads of ``path`` (not tmpfs)."""
    fd = open_direct(path)
    if fd is not None:
        os.close(fd)
    return fd is not None


def test_ftw_from_gguf_gives_the_same_logits_and_tokenizer(files, tmp_path):
    out = tmp_path / "ftw"
    proc = _ftctl("checkpoint", "--model", str(files["qa"]), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert (out / "ftw.json").exists() and (out / "tokenizer.json").exists()
    src = LLM(files["qa"], max_model_len=64, kv_tokens=256)
    ftw = LLM(out, max_model_len=64, kv_tokens=256)
    ids = src.tokenizer.encode("Hello wörld, 日本語")
    assert ftw.tokenizer.encode("Hello wörld, 日本語") == ids
    assert torch.equal(src.logits(ids), ftw.logits(ids))
    msgs = [{"role": "user", "content": "hi"}]
    assert ftw.chat_template.render(msgs, add_generation_prompt=True) == (
        src.chat_template.render(msgs, add_generation_prompt=True)
    )
    assert src._eos_ids() == ftw._eos_ids()


def test_fingerprint_is_keyed_on_the_file(files, tmp_path):
    from freetokend.store import model_fingerprint

    copy = tmp_path / "qa-F32.gguf"
    shutil.copy(files["qa"], copy)
    fp = model_fingerprint(copy)
    assert fp == model_fingerprint(copy) and fp != model_fingerprint(files["qb"])
    os.utime(copy, ns=(1, 1))
    assert model_fingerprint(copy) != fp


def test_daemon_disk_tier_serves_and_ftctl_stats_counts_reads(builtin_model_dir, tmp_path):
    """--disk-tier on: the experts stay in the file (Q8_0 blocks), a RAM cache of one layer's
    experts holds what a step uses; the answers are the resident pool's, and ftctl stats shows
    the cache's misses and the bytes read. Killed (SIGKILL) mid-request, it restarts over the
    same file and answers the same."""
    vocab = Tokenizer.from_dir(builtin_model_dir).vocab_size
    hf = make_tiny("qwen3_moe", tmp_path / "hf", seed=3, mlp_only_layers=[], vocab_size=vocab)[1]
    path = write_gguf(
        "qwen3_moe",
        hf,
        tmp_path / "qt-Q8_0.gguf",
        "q8_0",
        tokenizer=builtin_model_dir,
        pre="qwen35",
    )
    ref = LLM(path, "cpu", max_model_len=128, kv_tokens=512)
    assert ref.banks.format == "q8_0"
    sock_dir = Path(tempfile.mkdtemp(prefix="ftdisk-", dir="/tmp"))
    sock = str(sock_dir / "admin.sock")
    args = (
        "--model", str(path), "--moe-backend", "cpu", "--kv-tokens", "2048", "--admin-socket",
        sock, "--disk-tier", "on", "--expert-cache-gb", "0.000001",
    )  # fmt: skip
    d = start_daemon(*args)
    try:
        body = {"model": "qt-Q8_0", "prompt": "Hello there", "max_tokens": 8, "temperature": 0}
        status, out = d.post("/v1/completions", {**body, "ignore_eos": True})
        assert status == 200, out
        ids = ref.tokenizer.encode("Hello there")
        want = ref.tokenizer.decode(ref.generate(ids, 8, ignore_eos=True))
        assert out["choices"][0]["text"] == want
        proc = _ftctl("stats", "--json", socket=sock)
        assert proc.returncode == 0, proc.stderr
        (row,) = json.loads(proc.stdout)
        assert row["expert_misses"] > 0 and row["disk_bytes_read"] > 0
        # every fill a miss or an expert read ahead (the next layer's, while one computes)
        assert row["expert_misses"] <= row["expert_fills"]
        assert row["expert_fills"] <= row["expert_misses"] + row["disk_read_ahead"]
        assert _ftctl("stats", socket=sock).returncode == 0  # the table's "disk reads" column
        # kill -9 in the middle of a request (reads in flight, some read ahead), then a restart
        # over the same file answers as before: the tier writes nothing but its RAM slots
        errors: list[object] = []

        def long_request() -> None:
            try:
                got = d.post("/v1/completions", {**body, "max_tokens": 500, "ignore_eos": True})
                errors.append(("answered", got))
            except Exception as e:  # the connection dies with the daemon
                errors.append(e)

        t = threading.Thread(target=long_request)
        t.start()
        time.sleep(0.3)
        assert t.is_alive(), errors  # still decoding
        assert d.stop(signal.SIGKILL) == -signal.SIGKILL
        t.join(30)
        assert len(errors) == 1 and isinstance(errors[0], Exception), errors
        d = start_daemon(*args)
        status, out = d.post("/v1/completions", {**body, "ignore_eos": True})
        assert status == 200, out
        assert out["choices"][0]["text"] == want
    finally:
        d.stop()
        shutil.rmtree(sock_dir, ignore_errors=True)
