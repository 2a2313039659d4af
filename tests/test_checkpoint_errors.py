"""Bad configs and bad checkpoints fail with a message naming the field, tensor and file."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny

from freetokend.models.config import ConfigError
from freetokend.models.config_hf import read_config
from freetokend.models.loader import CheckpointError, load_model


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3moe")
    make_tiny("qwen3_moe", d, seed=5)
    return d


@pytest.fixture
def ckpt(good, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(good, d)
    return d


def _edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(d, fn):
    path = d / "model.safetensors"
    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_good_checkpoint_loads(ckpt):
    model, banks = load_model(ckpt)
    assert banks.num_flat == model.cfg.num_moe_layers * model.cfg.num_experts


@pytest.mark.parametrize(
    "change, field",
    [
        ({"architectures": ["LlamaForCausalLM"]}, "architectures"),
        ({"architectures": None}, "architectures"),
        ({"hidden_size": None}, "hidden_size"),
        ({"num_experts_per_tok": 99}, "num_experts_per_tok"),
        ({"num_attention_heads": "four"}, "num_attention_heads"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1.0}}, "rope_type"),
    ],
)
def test_bad_config_names_the_field(ckpt, change, field):
    _edit_config(ckpt, **change)
    with pytest.raises(ConfigError, match=field):
        read_config(ckpt)


def test_config_not_json(ckpt):
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        read_config(ckpt)


def test_missing_tensor(ckpt):
    _edit_tensors(ckpt, lambda t: t.pop("model.layers.0.self_attn.k_proj.weight"))
    with pytest.raises(CheckpointError, match=r"layers\.0\.self_attn\.k_proj\.weight"):
        load_model(ckpt)


def test_missing_expert_tensor(ckpt):
    _edit_tensors(ckpt, lambda t: t.pop("model.layers.2.mlp.experts.3.down_proj.weight"))
    with pytest.raises(CheckpointError, match="layer 2 expert 3"):
        load_model(ckpt)


def test_unexpected_tensor(ckpt):
    _edit_tensors(
        ckpt, lambda t: t.__setitem__("model.layers.0.self_attn.extra.weight", torch.zeros(2))
    )
    with pytest.raises(
        CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.extra\.weight'.*"
    ):
        load_model(ckpt)


def test_shape_mismatch(ckpt):
    def shrink(t):
        t["model.layers.0.self_attn.q_proj.weight"] = t["model.layers.0.self_attn.q_proj.weight"][
            :-1
        ]

    _edit_tensors(ckpt, shrink)
    with pytest.raises(CheckpointError, match=r"q_proj\.weight' has shape .* expected"):
        load_model(ckpt)


def test_dtype_mismatch(ckpt):
    def to_int(t):
        t["model.norm.weight"] = t["model.norm.weight"].to(torch.int32)

    _edit_tensors(ckpt, to_int)
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight' has dtype torch\.int32"):
        load_model(ckpt)


def test_corrupt_header(ckpt):
    path = ckpt / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:8] + b"{garbage" + data[16:])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(ckpt)


def test_truncated_file(ckpt):
    path = ckpt / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(ckpt)


def test_missing_shard(ckpt):
    index = {
        "metadata": {},
        "weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"},
    }
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        load_model(ckpt)


def test_sharded_and_fused_layout_loads_identically(ckpt, tmp_path):
    """transformers writes per-expert tensors; fuse them ([E, 2I, H] / [E, H, I]) and spread the
    checkpoint over two shards: the loaded banks and parameters are identical."""
    ref_model, ref_banks = load_model(ckpt)
    tensors = load_file(str(ckpt / "model.safetensors"))
    per_expert = re.compile(r"^(.*\.mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    fused: dict[str, torch.Tensor] = {}
    groups: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, t in tensors.items():
        if m := per_expert.match(name):
            groups.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = t
        else:
            fused[name] = t
    for (base, proj), by_e in groups.items():
        stacked = torch.stack([by_e[e] for e in sorted(by_e)])
        if proj == "down_proj":
            fused[base + "down_proj"] = stacked
        elif proj == "gate_proj":
            up = torch.stack([groups[(base, "up_proj")][e] for e in sorted(by_e)])
            fused[base + "gate_up_proj"] = torch.cat([stacked, up], dim=1)
    out = tmp_path / "sharded"
    out.mkdir()
    shutil.copy(ckpt / "config.json", out / "config.json")
    names = sorted(fused)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file(
            {n: fused[n].contiguous() for n in part}, str(out / fname), metadata={"format": "pt"}
        )
        weight_map.update(dict.fromkeys(part, fname))
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    assert not (out / "model.safetensors").exists()
    model, banks = load_model(out)
    assert torch.equal(banks.gate_up, ref_banks.gate_up)
    assert torch.equal(banks.down, ref_banks.down)
    for (n, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters(), strict=True):
        assert torch.equal(p, q), n
