"""ftctl against a real daemon: status, stats, cache resizes (idle and behind running requests),
model switching A -> B -> A without re-reading weights, the bandwidth bench, errors.

One daemon (offload backend on the stand-in accelerator, so the expert slot cache is real)
serves model A, a copy of the built-in tiny model; model B is the same architecture with other
weights, so its greedy output differs.

Slot counts stay at or above the distinct experts one step routes per layer (top-4 of 32: a
5-token prompt needs 20, a 12-token one 48): below that the offload backend sends the overflow
routes to the CPU, which is the same math summed in another order, so long greedy runs may part.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from server_support.daemon import _pythonpath, start_daemon

REPO = Path(__file__).resolve().parents[1]
PROMPT = "The quick brown fox"
LONG = 250  # tokens: several seconds of decoding, so ftctl acts while the request runs


@pytest.fixture(scope="module")
def models(builtin_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("models")
    a = Path(shutil.copytree(builtin_model_dir, root / "model-a"))
    b = Path(shutil.copytree(builtin_model_dir, root / "model-b"))
    weights = load_file(b / "model.safetensors")
    save_file({k: (v.flip(0) if v.dim() == 2 else v) for k, v in weights.items()},
              b / "model.safetensors", metadata={"format": "pt"})  # fmt: skip
    return {"a": a, "b": b}


@pytest.fixture(scope="module")
def daemon(models: dict[str, Path]):  # type: ignore[no-untyped-def]
    sock_dir = Path(tempfile.mkdtemp(prefix="ftctl-", dir="/tmp"))
    d = start_daemon(
        "--model", str(models["a"]), "--moe-backend", "offload", "--accelerator", "standin",
        "--moe-slots", "40", "--kv-tokens", "2048", "--admin-socket", str(sock_dir / "admin.sock"),
    )  # fmt: skip
    d.socket = str(sock_dir / "admin.sock")  # type: ignore[attr-defined]
    yield d
    d.stop()
    shutil.rmtree(sock_dir, ignore_errors=True)


def ftctl(d: Any, *args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": _pythonpath()}
    cmd = [sys.executable, "-m", "ftctl.main", *args, "--socket", d.socket]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    if ok:
        assert proc.returncode == 0, proc.stderr
    return proc


def ftjson(d: Any, *args: str) -> Any:
    return json.loads(ftctl(d, *args, "--json").stdout)


def complete(
    d: Any, model: str, max_tokens: int = 8, prompt: str = PROMPT, long: bool = False
) -> tuple[int, Any]:
    """Greedy completion; ``long``: ignore end-of-sequence (runs all ``max_tokens`` steps)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    if long:
        body["ignore_eos"] = True
    status, out = d.post("/v1/completions", body)
    return status, (out["choices"][0]["text"] if status == 200 else out)


def wait_running(d: Any, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if json.loads(d.get("/health")[1])["in_flight"] >= 1:
            return
        time.sleep(0.02)
    raise AssertionError("the request never started running")


def test_status_stats_and_cache(daemon: Any) -> None:
    status = ftjson(daemon, "status")
    assert status["active_model"] == "model-a" and status["http_url"] == daemon.url
    assert status["admin_socket"] == daemon.socket and "NVML" in status["vram_watch"]
    assert complete(daemon, "model-a")[0] == 200
    (row,) = ftjson(daemon, "stats")
    assert row["active"] and row["tokens_generated"] > 0 and row["requests_finished"] >= 1
    assert row["expert_hits"] + row["expert_misses"] > 0 and row["ttft_p50_s"] > 0
    info = ftjson(daemon, "cache")
    assert (info["moe_slots"], info["kv_tokens"], info["moe_slots_max"]) == (40, 2048, 192)
    table = ftctl(daemon, "cache").stdout
    assert "40 / 192 slots" in table and "2048 tokens" in table


def test_resize_when_idle_keeps_host_pool_and_output(daemon: Any) -> None:
    before = ftjson(daemon, "cache")
    _, text = complete(daemon, "model-a", 12)
    after = ftjson(daemon, "cache", "--moe", "64", "--kv", "4k")
    assert (after["moe_slots"], after["kv_tokens"]) == (64, 4096)
    assert after["host_pool_ptrs"] == before["host_pool_ptrs"]
    assert complete(daemon, "model-a", 12) == (200, text)
    shrunk = ftjson(daemon, "cache", "--moe", "24", "--kv", "1k")
    assert (shrunk["moe_slots"], shrunk["kv_tokens"]) == (24, 1024)
    assert shrunk["host_pool_ptrs"] == before["host_pool_ptrs"]
    assert complete(daemon, "model-a", 12) == (200, text)
    assert ftjson(daemon, "models")["models"][0]["weight_loads"] == 1


def test_resize_queued_behind_a_running_request(daemon: Any) -> None:
    ftjson(daemon, "cache", "--moe", "64")
    # The first run fills the prefix cache; the reference is a run that resumes from it, as the
    # request below will (on a bf16 model a resumed prefill rounds differently from a whole one).
    complete(daemon, "model-a", LONG, prompt="Once upon a time", long=True)
    _, text = complete(daemon, "model-a", LONG, prompt="Once upon a time", long=True)
    before = ftjson(daemon, "cache")
    result: dict[str, Any] = {}

    def long_request() -> None:
        result["out"] = complete(daemon, "model-a", LONG, prompt="Once upon a time", long=True)
        result["done_at"] = time.monotonic()

    t = threading.Thread(target=long_request)
    t.start()
    wait_running(daemon)
    applied = ftjson(daemon, "cache", "--moe", "56", "--kv", "3k")
    applied_at = time.monotonic()
    t.join(300)
    assert (applied["moe_slots"], applied["kv_tokens"]) == (56, 3072)
    assert applied_at < result["done_at"]  # applied between steps, with the request running
    assert applied["host_pool_ptrs"] == before["host_pool_ptrs"]
    assert result["out"] == (200, text)  # greedy output unchanged by the resize mid-way


def test_switch_a_b_a_reads_no_weights(daemon: Any, models: dict[str, Path]) -> None:
    _, text_a = complete(daemon, "model-a", 10)
    loaded = ftjson(daemon, "models", "load", str(models["b"]))
    assert loaded["name"] == "model-b" and loaded["state"] == "resident"
    switched = ftjson(daemon, "models", "switch", "model-b")
    assert switched["name"] == "model-b" and switched["state"] == "active"
    status, text_b = complete(daemon, "model-b", 10)
    assert status == 200 and text_b != text_a
    status, err = complete(daemon, "model-a", 10)  # auto_switch is off
    assert status == 404 and "ftctl models switch model-a" in json.dumps(err)
    # A's weights are gone from disk: switching back must come from its resident host pool.
    weights = models["a"] / "model.safetensors"
    hidden = weights.with_name("hidden.safetensors")
    weights.rename(hidden)
    try:
        # a long request on B is in flight: it finishes before the switch returns. Told by B's
        # engine-side count of finished requests as the switch returned, not by when the
        # client and ftctl got their answers (the daemon sends both within milliseconds)
        def finished_b() -> int:
            return next(r for r in ftjson(daemon, "stats") if r["name"] == "model-b")[
                "requests_finished"
            ]

        before = finished_b()
        result: dict[str, Any] = {}
        t = threading.Thread(
            target=lambda: result.update(out=complete(daemon, "model-b", LONG, long=True))
        )
        t.start()
        wait_running(daemon)
        back = ftjson(daemon, "models", "switch", "model-a")
        assert finished_b() == before + 1  # (seconds of decoding were left had it not waited)
        t.join(300)
        assert back["state"] == "active" and result["out"][0] == 200
        assert len(result["out"][1]) > 0
        assert complete(daemon, "model-a", 10) == (200, text_a)
    finally:
        hidden.rename(weights)
    listed = {m["name"]: m for m in ftjson(daemon, "models")["models"]}
    assert listed["model-a"]["weight_loads"] == 1 and listed["model-b"]["weight_loads"] == 1
    assert listed["model-a"]["state"] == "active" and listed["model-b"]["state"] == "resident"
    assert "model-b" in ftctl(daemon, "models").stdout
    ftjson(daemon, "models", "unload", "model-b")
    assert [m["name"] for m in ftjson(daemon, "models")["models"]] == ["model-a"]


def test_bench_bw_and_launch(daemon: Any, models: dict[str, Path]) -> None:
    prof = ftjson(daemon, "bench", "bw")
    assert prof["b_p"] > 0 and prof["b_h"] > 0 and prof["accelerator"] == "standin"
    assert prof["expert_bytes"] == ftjson(daemon, "cache")["expert_bytes"]
    # B_D of a model folder: the reads of its largest safetensors file (this one has one)
    assert prof["b_d"] > 0 and isinstance(prof["disk_direct"], bool)
    assert prof["disk_path"] == str(models["a"] / "model.safetensors")
    assert prof["disk_note"] == "the folder's safetensors file"
    table = ftctl(daemon, "bench", "bw").stdout
    assert "B_D (disk reads for the disk tier)" in table and "model.safetensors" in table
    plan = ftjson(daemon, "launch", "claude", "--dry-run")
    ((path, text),) = plan["files"].items()
    assert json.loads(text)["env"]["ANTHROPIC_BASE_URL"] == daemon.url
    assert plan["command"][:3] == ["claude", "--settings", path]


def test_errors_are_one_line(daemon: Any) -> None:
    for args, needle in (
        (("cache", "--moe", "100000"), "--moe must be in [1, 192]"),
        (("models", "switch", "nope"), "nope"),
        (("models", "unload", "model-a"), "active model"),
    ):
        proc = ftctl(daemon, *args, ok=False)
        assert proc.returncode == 1 and proc.stderr.startswith("ftctl: "), proc.stderr
        assert needle in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    env = {**os.environ, "PYTHONPATH": _pythonpath()}
    proc = subprocess.run(
        [sys.executable, "-m", "ftctl.main", "status", "--socket", "/nonexistent/admin.sock"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 1 and proc.stderr.startswith("ftctl: no daemon listening at")
