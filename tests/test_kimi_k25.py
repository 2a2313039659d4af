"""Kimi-K2.5 (issue 43 item 3): ``KimiK25ForConditionalGeneration`` served text-only. Its text
model is DeepSeek-V3's architecture (``text_config``, whose ``model_type`` the release spells
``kimi_k2``); the vision tower and the projector are read past.

Two layouts of the same tiny checkpoint load and agree with transformers' Kimi_K25 model run on
text (logits within the fp32 tolerance, greedy tokens identical):
- transformers 5.25's own save: ``language_model.model.blocks.N.*`` (its reverse mapping turns
  the decoder's ``layers`` into ``blocks``; transformers reads it back) and
  ``architectures: ["Kimi_K25ForConditionalGeneration"]``;
- the release's spelling: ``language_model.model.layers.N.*``, ``language_model.lm_head.weight``,
  ``architectures: ["KimiK25ForConditionalGeneration"]``, ``text_config.model_type: "kimi_k2"``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import hf_config, perturb

from freetokend import LLM
from freetokend.engine.runner import Work
from freetokend.models.config_hf import read_config

TOL = 2e-4  # fp32 logits, ours against transformers


@pytest.fixture(scope="module")
def kimi(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Any]:
    """(transformers' save, the release layout, the transformers model in eval mode)."""
    import transformers as tf
    from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25VisionConfig

    root = tmp_path_factory.mktemp("kimi-k25")
    torch.manual_seed(11)
    vision = Kimi_K25VisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        patch_size=2,
        pos_emb_height=4,
        pos_emb_width=4,
        pos_emb_time=1,
    )
    cfg = tf.Kimi_K25Config(
        text_config=hf_config("deepseek_v3").to_dict(),
        vision_config=vision.to_dict(),
        projection_hidden_size=16 * 4,  # the vision width times the 2 x 2 merge
        tie_word_embeddings=False,
    )
    hf = tf.Kimi_K25ForConditionalGeneration(cfg).eval()
    perturb(hf, 12)
    saved = root / "transformers"
    hf.save_pretrained(saved)

    release = root / "release"
    shutil.copytree(saved, release)
    sd = load_file(saved / "model.safetensors")
    renamed = {
        name.replace("language_model.model.blocks.", "language_model.model.layers."): t
        for name, t in sd.items()
    }
    save_file(renamed, release / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((saved / "config.json").read_text())
    raw["architectures"] = ["KimiK25ForConditionalGeneration"]
    raw["text_config"]["model_type"] = "kimi_k2"
    (release / "config.json").write_text(json.dumps(raw))
    return saved, release, hf


def test_the_layouts_are_what_the_test_says(kimi: tuple[Path, Path, Any]) -> None:
    saved, release, _ = kimi
    names = set(load_file(saved / "model.safetensors"))
    assert any(n.startswith("language_model.model.blocks.1.mlp.experts.0.") for n in names)
    assert "language_model.lm_head.weight" in names
    assert any(n.startswith("vision_tower.") for n in names)
    rel = set(load_file(release / "model.safetensors"))
    assert any(n.startswith("language_model.model.layers.1.mlp.experts.0.") for n in rel)
    assert not any(".blocks." in n and n.startswith("language_model.") for n in rel)


@pytest.mark.parametrize("layout", ["transformers", "release"])
def test_text_model_matches_transformers(kimi: tuple[Path, Path, Any], layout: str) -> None:
    saved, release, hf = kimi
    path = saved if layout == "transformers" else release
    cfg = read_config(path)
    assert cfg.family == "deepseek_v3" and cfg.weight_prefix == "model.language_model"
    assert not cfg.tie_word_embeddings
    llm = LLM(path, moe_backend="cpu", max_model_len=64, kv_tokens=256)
    ids = torch.randint(2, 97, (19,), generator=torch.Generator().manual_seed(13)).tolist()
    st = llm.runner.new_state()
    llm.runner.reserve(st, len(ids) + 8)
    ours, theirs = [], []
    seq = list(ids)
    try:
        logits = llm.runner.forward([Work(st, ids)])[-1]
        with torch.no_grad():
            for _ in range(8):
                ref = hf(input_ids=torch.tensor([seq])).logits[0, -1].float()
                assert (logits - ref).abs().max().item() < TOL
                ours.append(int(logits.argmax()))
                theirs.append(int(ref.argmax()))
                seq.append(theirs[-1])
                logits = llm.runner.forward([Work(st, [theirs[-1]])])[-1]
    finally:
        llm.runner.release(st)
    assert ours == theirs
