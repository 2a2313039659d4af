"""The "mid" random MoE checkpoint of the decode benchmark (Qwen3-30B-A3B layer geometry).

Qwen3MoeForCausalLM, hidden 2048, 128 experts (top-8) of moe_intermediate 768, 32 query / 4 KV
heads of dim 128, 4 layers, bf16, vocab 50257 (see decode_tokenizer for why). Written once per
cache folder, one safetensors shard per decoder layer (plus one for embeddings / norm / lm_head)
with HF per-expert tensor names, so building holds at most one shard (1.2 GB) in memory.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from decode_tokenizer import VOCAB_SIZE, tokenizer_kind, write_tokenizer

_BUILD_VERSION = 1  # bump when the weights or config below change


@dataclass(frozen=True)
class Geometry:
    hidden: int = 2048
    layers: int = 4
    experts: int = 128
    top_k: int = 8
    moe_inter: int = 768
    heads: int = 32
    kv_heads: int = 4
    head_dim: int = 128
    vocab: int = VOCAB_SIZE
    max_position: int = 4096  # the context the file declares (bench_server: 32k prompts)

    def hf_config(self) -> dict[str, object]:
        return {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "hidden_size": self.hidden,
            "intermediate_size": 6144,
            "moe_intermediate_size": self.moe_inter,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "num_experts": self.experts,
            "num_experts_per_tok": self.top_k,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "vocab_size": self.vocab,
            "max_position_embeddings": self.max_position,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "dtype": "bfloat16",
            "bos_token_id": self.vocab - 1,
            "eos_token_id": self.vocab - 1,
            "use_cache": True,
            "output_router_logits": False,
            "router_aux_loss_coef": 0.001,
        }

    def bytes_per_token(self, expert_bytes_per_weight: float = 2.0) -> int:
        """Weight bytes one decoded token reads: attention, router and lm_head in bf16, the
        top-k experts at ``expert_bytes_per_weight`` (2 for bf16, 17/32 for MXFP4).

        Norms and the single embedding row are negligible and left out.
        """
        h, d = self.hidden, self.head_dim
        attn = h * d * (2 * self.heads + 2 * self.kv_heads)
        router = h * self.experts
        experts = self.top_k * 3 * h * self.moe_inter
        dense = 2 * (self.layers * (attn + router) + self.vocab * h)
        return dense + int(self.layers * experts * expert_bytes_per_weight)


def _randn(gen: torch.Generator, *shape: int, std: float = 0.02) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * std).to(torch.bfloat16)


def _layer_tensors(g: Geometry, i: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    h, d, p = g.hidden, g.head_dim, f"model.layers.{i}."
    t = {
        p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        p + "self_attn.q_proj.weight": _randn(gen, g.heads * d, h),
        p + "self_attn.k_proj.weight": _randn(gen, g.kv_heads * d, h),
        p + "self_attn.v_proj.weight": _randn(gen, g.kv_heads * d, h),
        p + "self_attn.o_proj.weight": _randn(gen, h, g.heads * d),
        p + "self_attn.q_norm.weight": torch.ones(d, dtype=torch.bfloat16),
        p + "self_attn.k_norm.weight": torch.ones(d, dtype=torch.bfloat16),
        p + "mlp.gate.weight": _randn(gen, g.experts, h, std=0.1),
    }
    for e in range(g.experts):
        q = f"{p}mlp.experts.{e}."
        t[q + "gate_proj.weight"] = _randn(gen, g.moe_inter, h)
        t[q + "up_proj.weight"] = _randn(gen, g.moe_inter, h)
        t[q + "down_proj.weight"] = _randn(gen, h, g.moe_inter)
    return t


def _outer_tensors(g: Geometry, gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        "model.embed_tokens.weight": _randn(gen, g.vocab, g.hidden, std=1.0),
        "model.norm.weight": torch.ones(g.hidden, dtype=torch.bfloat16),
        "lm_head.weight": _randn(gen, g.vocab, g.hidden),
    }


def _stamp(g: Geometry) -> dict[str, object]:
    geometry = asdict(g)
    if g.max_position == 4096:  # the default before the field existed: earlier builds stay valid
        del geometry["max_position"]
    return {"version": _BUILD_VERSION, "geometry": geometry}


def build_checkpoint(out_dir: Path, vocab_gguf: Path | None, g: Geometry = Geometry()) -> Path:
    """Builds (or reuses) the checkpoint in `out_dir`; rewrites only the tokenizer when a GPT-2
    vocabulary became available since the last build. Returns `out_dir`."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    stamp_path = out_dir / "ft_bench_build.json"
    if not (stamp_path.exists() and json.loads(stamp_path.read_text()) == _stamp(g)):
        gen = torch.Generator().manual_seed(1234)
        shards = [(f"model-{i:05d}.safetensors", i) for i in range(g.layers)]
        shards.append(("model-outer.safetensors", -1))
        weight_map: dict[str, str] = {}
        total = 0
        for name, layer in shards:
            tensors = _layer_tensors(g, layer, gen) if layer >= 0 else _outer_tensors(g, gen)
            tmp = out_dir / (name + ".tmp")
            save_file(tensors, str(tmp), metadata={"format": "pt"})
            os.replace(tmp, out_dir / name)
            weight_map.update(dict.fromkeys(tensors, name))
            total += sum(v.numel() * v.element_size() for v in tensors.values())
            del tensors
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
        (out_dir / "config.json").write_text(json.dumps(g.hf_config(), indent=1))
        (out_dir / "generation_config.json").write_text(
            json.dumps(
                {"bos_token_id": g.vocab - 1, "eos_token_id": g.vocab - 1, "do_sample": False}
            )
        )
        for stale in ("tokenizer.json", "tokenizer_config.json"):
            (out_dir / stale).unlink(missing_ok=True)
        stamp_path.write_text(json.dumps(_stamp(g)))
    kind = tokenizer_kind(out_dir)
    if kind is None or (kind != "gpt2" and vocab_gguf is not None and vocab_gguf.exists()):
        write_tokenizer(out_dir, vocab_gguf)
    return out_dir
