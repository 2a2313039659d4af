"""Spilled session snapshots on disk (issue 15): fsynced around the rename, a checksum per
tensor, every tensor checked on load, private modes whatever the umask.

A damaged file (a tensor of the wrong shape past the first, or a flipped byte in the last
tensor's data) is deleted with a warning when a request would resume from it; that request
prefills instead and the request batched beside it is unharmed: both give the outputs of an
engine without prefix reuse. Before the fix a wrong-shaped state reached the sequence and the
engine step failed the whole batch; flipped KV bytes were loaded as they were.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

import pytest
import torch
from agent_sessions import TOOLS, make_session
from safetensors import safe_open
from safetensors.torch import save_file

import freetokend.kv.spill as spill_mod
from freetokend import LLM
from freetokend.engine.sampler import SamplingParams

KW = dict(max_model_len=4096, kv_tokens=16384, dtype="float32")


@pytest.fixture(scope="module", autouse=True)
def one_thread():  # type: ignore[no-untyped-def]
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def serve(llm: LLM, prompts: list[list[int]], gen: int = 5) -> list[tuple[list[int], int]]:
    """Runs prompts together (one batch): (generated ids, num_cached_tokens) for each."""
    eng = llm.engine
    rids = [f"r{i}" for i in range(len(prompts))]
    for rid, p in zip(rids, prompts, strict=True):
        eng.add_request(rid, p, SamplingParams(max_tokens=gen, ignore_eos=True))
    out: dict[str, list[int]] = {r: [] for r in rids}
    cached: dict[str, int] = {}
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id].append(o.token_id)
            cached[o.request_id] = o.num_cached_tokens
    return [(out[r], cached[r]) for r in rids]


def prompts_of(llm: LLM, turns: int, seed: int) -> list[list[int]]:
    session = make_session("opencode", turns, seed=seed, output_lines=4, every=10)
    render = llm.chat_template.render
    return [
        llm.tokenizer.encode(render(session.messages(t), tools=TOOLS, add_generation_prompt=True))
        for t in range(turns)
    ]


def rewrite(path: Path, change) -> None:  # type: ignore[no-untyped-def]
    """Rewrites a spill file with ``change(tensors)`` applied; digests (when the format has
    them) recomputed, so only what ``change`` did is wrong."""
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    change(tensors)
    if "checksums" in meta:
        meta["checksums"] = json.dumps(
            {
                n: hashlib.blake2b(
                    t.contiguous().reshape(-1).view(torch.uint8).numpy().data, digest_size=16
                ).hexdigest()
                for n, t in tensors.items()
            }
        )
    save_file(tensors, str(path), meta)


def wrong_ssm_shape(t: dict[str, torch.Tensor]) -> None:
    t["ssm"] = t["ssm"][:, :, :-1].contiguous()


def flip_v_byte(path: Path) -> None:
    """One byte of the last tensor's data (v), in place: the header still reads fine."""
    with safe_open(str(path), framework="pt") as f:
        v = f.get_tensor("v")
    data = bytearray(path.read_bytes())
    needle = v.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()[-64:]
    at = data.rindex(needle) + 10
    data[at] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def spilled(builtin_model_dir, tmp_path_factory):  # type: ignore[no-untyped-def]
    """A state folder where an engine served three turns and spilled, under umask 022; and
    the reference engine (no prefix reuse)."""
    state = tmp_path_factory.mktemp("spill-state")
    old = os.umask(0o022)
    calls: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace
    mp = pytest.MonkeyPatch()
    mp.setattr(spill_mod.os, "fsync", lambda fd: (calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))), real_fsync(fd))[1])  # fmt: skip
    mp.setattr(spill_mod.os, "replace", lambda a, b: (calls.append(("replace", str(b))), real_replace(a, b))[1])  # fmt: skip
    try:
        a = LLM(builtin_model_dir, state_dir=state, **KW)
        prompts = prompts_of(a, 4, seed=5)
        for p in prompts[:3]:
            serve(a, [p])
        report = a.close()
    finally:
        mp.undo()
        os.umask(old)
    assert report.files >= 2
    ref = LLM(builtin_model_dir, prefix_cache=False, **KW)
    return state, prompts, calls, ref


def test_files_are_private_and_synced_around_the_rename(spilled) -> None:  # type: ignore[no-untyped-def]
    state, _, calls, _ = spilled
    files = sorted((state / "snapshots").rglob("*.safetensors"))
    for f in files:
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
        assert stat.S_IMODE(f.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE((state / "snapshots").stat().st_mode) == 0o700
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    for name in ("state.db", "state.db-wal"):
        if (state / name).exists():
            assert stat.S_IMODE((state / name).stat().st_mode) == 0o600, name
    # per file: fsync(temporary file), rename, fsync(folder)
    for f in files:
        i = calls.index(("replace", str(f)))
        assert calls[i - 1] == ("fsync", str(f.with_suffix(".tmp"))), calls[i - 1 : i + 2]
        assert calls[i + 1] == ("fsync", str(f.parent)), calls[i - 1 : i + 2]


@pytest.mark.parametrize("damage", ["wrong-ssm-shape", "flipped-v-byte"])
def test_a_damaged_file_is_deleted_and_the_batch_unharmed(
    spilled, builtin_model_dir, tmp_path, damage, caplog
) -> None:  # type: ignore[no-untyped-def]
    src, prompts, _, ref = spilled
    state = tmp_path / "state"
    import shutil

    shutil.copytree(src, state)
    files = sorted((state / "snapshots").rglob("*.safetensors"))
    for f in files:  # every file: the request cannot fall back to an intact shallower one
        if damage == "wrong-ssm-shape":
            rewrite(f, wrong_ssm_shape)
        else:
            flip_v_byte(f)
    b = LLM(builtin_model_dir, state_dir=state, **KW)
    other = prompts_of(b, 1, seed=9)[0]  # an unrelated request in the same batch
    [(out, cached), (out_other, _)] = serve(b, [prompts[3], other])
    assert cached == 0 and b.engine.prefix.spill.loaded == 0
    assert out == serve(ref, [prompts[3]])[0][0]
    assert out_other == serve(ref, [other])[0][0]
    deleted = [f for f in files if not f.exists()]
    assert deleted, "the damaged file it tried was kept"
    assert "deleting damaged spilled snapshot" in caplog.text
    assert ("ssm" if damage == "wrong-ssm-shape" else "v: checksum mismatch") in caplog.text
    b.close()
