"""The built-in tiny Qwen3.5-MoE checkpoint: deterministic, atomic, loadable by transformers."""

from __future__ import annotations

import copy
import hashlib
import json
import time
import unicodedata
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from freetokend.engine.chat_template import ChatTemplate
from freetokend.engine.tokenizer import Tokenizer
from freetokend.models import builtin
from freetokend.models.builtin import BUILTIN_NAME, ensure_builtin_model


def file_hashes(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def test_generation_is_deterministic_and_fast(builtin_model_dir: Path, tmp_path: Path) -> None:
    start = time.perf_counter()
    again = ensure_builtin_model(tmp_path)
    elapsed = time.perf_counter() - start
    assert again == tmp_path / "models" / BUILTIN_NAME
    assert file_hashes(again) == file_hashes(builtin_model_dir)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(
        file_hashes(again)
    )
    assert elapsed < 5.0


def test_second_call_reuses_and_leaves_no_temp_dirs(builtin_model_dir: Path) -> None:
    weights = builtin_model_dir / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert ensure_builtin_model(builtin_model_dir.parent.parent) == builtin_model_dir
    assert weights.stat().st_mtime_ns == mtime
    assert [p.name for p in builtin_model_dir.parent.iterdir()] == [BUILTIN_NAME]
    assert builtin_model_dir.stat().st_mode & 0o777 == 0o755  # not mkdtemp's 0700
    assert weights.stat().st_mode & 0o777 == 0o644


def test_interrupted_generation_leaves_nothing_loadable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def crash(cfg: dict) -> dict:
        raise KeyboardInterrupt  # e.g. the user stops the daemon mid-write

    with monkeypatch.context() as m:
        m.setattr(builtin, "build_weights", crash)
        with pytest.raises(KeyboardInterrupt):
            ensure_builtin_model(tmp_path)
    assert list((tmp_path / "models").iterdir()) == []
    assert (ensure_builtin_model(tmp_path) / "model.safetensors").is_file()


def test_stale_version_is_regenerated(builtin_model_dir: Path, tmp_path: Path) -> None:
    target = ensure_builtin_model(tmp_path)
    (target / "freetoken_builtin.json").write_text(json.dumps({"version": -1}))
    (target / "model.safetensors").write_bytes(b"junk")
    assert file_hashes(ensure_builtin_model(tmp_path)) == file_hashes(builtin_model_dir)


def test_config_describes_a_hybrid_moe(builtin_model_dir: Path) -> None:
    cfg = json.loads((builtin_model_dir / "config.json").read_text())
    tok = Tokenizer.from_dir(builtin_model_dir)
    assert cfg["architectures"] == ["Qwen3_5MoeForCausalLM"]
    assert set(cfg["layer_types"]) == {"linear_attention", "full_attention"}
    assert 4 <= cfg["num_hidden_layers"] <= 8 and cfg["vocab_size"] == tok.vocab_size
    assert cfg["num_experts"] >= 16 and cfg["num_experts_per_tok"] == 4
    gen = json.loads((builtin_model_dir / "generation_config.json").read_text())
    assert set(gen["eos_token_id"]) == set(tok.eos_token_ids)
    with safe_open(str(builtin_model_dir / "model.safetensors"), "pt") as f:
        e, i, h = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["hidden_size"]
        assert f.get_slice("model.layers.0.mlp.experts.gate_up_proj").get_shape() == [e, 2 * i, h]
        assert f.get_slice("model.layers.0.mlp.experts.down_proj").get_shape() == [e, h, i]


@pytest.fixture(scope="module")
def hf_bf16(builtin_model_dir: Path) -> torch.nn.Module:
    """The checkpoint as transformers loads it (in its stored dtype), loaded once."""
    loaded: Any = AutoModelForCausalLM.from_pretrained(builtin_model_dir, output_loading_info=True)
    model, info = loaded
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set() and not info["error_msgs"]
    return model.eval()


@pytest.fixture(scope="module")
def hf_model(hf_bf16: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(hf_bf16).float()


def test_transformers_loads_and_runs(hf_model: torch.nn.Module, builtin_model_dir: Path) -> None:
    assert type(hf_model).__name__ == "Qwen3_5MoeForCausalLM"
    tok = Tokenizer.from_dir(builtin_model_dir)
    prompts = ["Hello, the weather is", "def f(x):\n    return"]
    with torch.no_grad():
        outs = [hf_model(torch.tensor([tok.encode(p)]), output_router_logits=True) for p in prompts]
    for out in outs:
        assert torch.isfinite(out.logits).all()
        assert out.logits.shape[-1] == tok.vocab_size
    # the next-token distribution depends on the context, and is neither flat nor one-hot
    last = [torch.softmax(o.logits[0, -1], dim=-1) for o in outs]
    assert (last[0] - last[1]).abs().sum() > 0.2
    assert all(0.05 < p.max() < 0.99 for p in last)
    # routers make clear choices: the 4th and 5th expert logits rarely tie
    for router_logits in outs[0].router_logits:
        top5 = router_logits.topk(5, dim=-1).values
        assert (top5[:, 3] - top5[:, 4]).min() > 1e-4


def test_bf16_checkpoint_runs_in_bf16(hf_bf16: torch.nn.Module) -> None:
    assert hf_bf16.dtype == torch.bfloat16
    with torch.no_grad():
        logits = hf_bf16(torch.tensor([[1, 2, 3, 4, 5, 6]])).logits
    assert torch.isfinite(logits).all()


@pytest.fixture(scope="module")
def tok(builtin_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(builtin_model_dir)


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=80))
def test_tokenizer_round_trips_any_unicode(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


def test_transformers_tokenizer_agrees(builtin_model_dir: Path, tok: Tokenizer) -> None:
    """transformers' Qwen3_5Tokenizer adds an NFC normaliser that our tokenizer.json lacks (so
    that ours round-trips exactly); on NFC text both give the same ids."""
    ours = tok
    hf = AutoTokenizer.from_pretrained(builtin_model_dir)
    texts = [
        "Hello world, the cat",
        "<|im_start|>user\nhi<|im_end|>\n",
        "日本語 🎉 café 42",
        "  x\n\n",
    ]
    for text in texts:
        text = unicodedata.normalize("NFC", text)
        assert hf.encode(text, add_special_tokens=False) == ours.encode(text)
        assert hf.decode(ours.encode(text)) == text
    assert hf.eos_token == "<|im_end|>" and hf.pad_token == "<|endoftext|>"


def test_chat_template_renders_identically(builtin_model_dir: Path) -> None:
    hf = AutoTokenizer.from_pretrained(builtin_model_dir)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "f", "arguments": {}}}],
        },
        {"role": "tool", "content": "42"},
    ]
    tools: Any = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    ours = ChatTemplate.from_dir(builtin_model_dir).render(
        messages, tools=tools, enable_thinking=False
    )
    theirs = hf.apply_chat_template(
        messages,  # type: ignore[arg-type]
        tools=tools,
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=False,
    )
    assert ours == theirs
