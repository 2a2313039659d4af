"""What llama.cpp's converter did to each architecture's tensors, undone: GGUF block tensor names
that only some architectures carry, and the transforms that bring a GGUF tensor back to the
HF layout our parameters keep.

The facts (llama.cpp's convert_hf_to_gguf): the llama architecture permutes Q/K rows for its
interleaved rope. The Qwen3-Next / Qwen3.5 hybrids store ``A_log`` as ``-exp(A_log)``, the conv1d
kernel squeezed to [channels, kernel], and every (1 + w) RMSNorm weight with the 1 added (not
the DeltaNet's gated norm); Qwen3-Next's fused ``in_proj_qkvz`` is split into ``attn_qkv`` (all
q, all k, all v) and ``attn_gate`` (z), its ``in_proj_ba`` kept fused as ``ssm_ba``. Qwen3.5
(``qwen35moe``) reorders the value heads from grouped by key head to tiled
([g0v0, g1v0, ..., g0v1, ...]) wherever they appear, when there are more value than key heads.
DeepSeek-V3 (``deepseek2``) splits ``kv_b_proj`` into ``attn_k_b`` (per head [kv_lora, nope],
transposed) and ``attn_v_b`` (per head [v, kv_lora]). GLM-4.5 (``glm4moe``) and MiniMax-M2
(``minimax-m2``) are stored as they are (rope in the rotate-half order llama.cpp's NEOX rope
takes), their router's correction bias as ``exp_probs_b.bias``, GLM's multi-token-prediction
layer after the decoder layers (skipped). Gemma-4 (``gemma4``) keeps its norms as they are (no
+1), its router's scales as ``ffn_gate_inp.scale`` / ``ffn_down_exps.scale`` and its global
layers' proportional rope as ``rope_freqs`` factors (read into the config).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .config import ModelConfig

Fix = Callable[[torch.Tensor], torch.Tensor]
# (our parameter name under ``layers.N.``, the transform from the GGUF tensor, or None)
Target = tuple[str, Fix | None]

_HYBRIDS = ("qwen3next", "qwen35moe")
# (1 + w) norms stored with the 1 added (block keys; ``output_norm.weight`` is top level)
_OFFSET_NORMS = (
    "attn_norm.weight",
    "post_attention_norm.weight",
    "attn_q_norm.weight",
    "attn_k_norm.weight",
)
_HYBRID_BLOCK = {
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_a": "linear_attn.A_log",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
}
_SHARED = {
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
}
_MLA_BLOCK = {
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    "exp_probs_b.bias": "mlp.score_bias",
}
# Gemma-4's own block names (its four FFN norms, the router's scales, the layer's output
# scale); the rest are the shared ones
_GEMMA4_BLOCK = {
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
    "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
    "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight",
    "ffn_gate_inp.weight": "router.proj.weight",
    "ffn_gate_inp.scale": "router.scale",
    "ffn_down_exps.scale": "router.per_expert_scale",
    "layer_output_scale.weight": "layer_scalar",
}
# the sigmoid routers' score-correction bias (GLM-4.5, MiniMax-M2; DeepSeek's is in _MLA_BLOCK)
_SCORE_BIAS = {"exp_probs_b.bias": "mlp.score_bias"}
# DeepSeek-V3's split kv_b: read together into kv_b_proj (``join_kv_b``)
KV_B_PARTS = ("attn_k_b.weight", "attn_v_b.weight")


def _minus_one(t: torch.Tensor) -> torch.Tensor:
    return t - 1


def _llama_unpermute(n_head: int) -> Fix:
    """The converter stores HF row (head, half, pair) at file row (head, pair, half)."""

    def fix(t: torch.Tensor) -> torch.Tensor:
        rows = t.shape[0]
        return t.reshape(n_head, rows // n_head // 2, 2, -1).transpose(1, 2).reshape(t.shape)

    return fix


def _untile(cfg: ModelConfig, dim: int, head: int) -> Fix:
    """Undoes Qwen3.5's value-head reorder along ``dim`` (``head`` values a value head): file
    order (r, kh, head) back to HF's (kh, r, head), r value heads a key head."""
    kh = cfg.linear_num_key_heads
    r = cfg.linear_num_value_heads // kh

    def fix(t: torch.Tensor) -> torch.Tensor:
        d = dim % t.dim()
        shape = list(t.shape)
        t = t.reshape(*shape[:d], r, kh, head, *shape[d + 1 :]).transpose(d, d + 1)
        return t.reshape(shape)

    return fix


def _hybrid_fix(arch: str, cfg: ModelConfig, key: str) -> Fix | None:
    """The transform for one hybrid linear-attention tensor (value-head reorder first)."""
    untile = arch == "qwen35moe" and cfg.linear_num_value_heads != cfg.linear_num_key_heads
    kd, dv = cfg.linear_num_key_heads * cfg.linear_key_head_dim, cfg.linear_value_head_dim

    def v_rows(t: torch.Tensor) -> torch.Tensor:  # q and k rows first, then the value rows
        return torch.cat([t[: 2 * kd], _untile(cfg, 0, dv)(t[2 * kd :])])

    if key == "attn_qkv.weight":
        return v_rows if untile else None
    if key == "attn_gate.weight":
        return _untile(cfg, 0, dv) if untile else None
    if key in ("ssm_beta.weight", "ssm_alpha.weight", "ssm_dt.bias"):
        return _untile(cfg, 0, 1) if untile else None
    if key == "ssm_out.weight":
        return _untile(cfg, 1, dv) if untile else None
    if key == "ssm_a":
        a = _untile(cfg, 0, 1) if untile else None
        return lambda t: torch.log(-(a(t) if a else t))
    if key == "ssm_conv1d.weight":  # [C, K] -> [C, 1, K]
        return lambda t: (v_rows(t) if untile else t).unsqueeze(1)
    return None


def _split_ba(cfg: ModelConfig) -> list[Target]:
    """Qwen3-Next's fused ``ssm_ba`` [kh * 2r, H], grouped per key head (r b rows, r a rows)."""
    kh = cfg.linear_num_key_heads
    r = cfg.linear_num_value_heads // kh

    def part(first: bool) -> Fix:
        def fix(t: torch.Tensor) -> torch.Tensor:
            g = t.reshape(kh, 2 * r, -1)
            return (g[:, :r] if first else g[:, r:]).reshape(kh * r, -1)

        return fix

    return [
        ("linear_attn.in_proj_b.weight", part(True)),
        ("linear_attn.in_proj_a.weight", part(False)),
    ]


def block_targets(arch: str, cfg: ModelConfig, key: str, common: dict[str, str]) -> list[Target]:
    """Where the GGUF block tensor ``blk.N.<key>`` goes (``common``: the names every
    architecture shares); [] for a tensor read with another (DeepSeek's ``attn_v_b``).
    KeyError: a tensor this architecture does not have."""
    if arch in _HYBRIDS:
        if key == "ssm_ba.weight":
            return _split_ba(cfg)
        if key == "ffn_gate_inp_shexp.weight":  # [H] or [1, H]: our [1, H]
            return [("mlp.shared_expert_gate.weight", lambda t: t.reshape(1, -1))]
        if key in _HYBRID_BLOCK:
            return [(_HYBRID_BLOCK[key], _hybrid_fix(arch, cfg, key))]
        if key in _SHARED:
            return [(_SHARED[key], None)]
        return [(common[key], _minus_one if key in _OFFSET_NORMS else None)]
    if arch == "deepseek2":
        if key in KV_B_PARTS:
            return []
        if key in _MLA_BLOCK:
            return [(_MLA_BLOCK[key], None)]
        if key in _SHARED:
            return [(_SHARED[key], None)]
        return [(common[key], None)]
    if arch == "gemma4":
        return [(_GEMMA4_BLOCK[key] if key in _GEMMA4_BLOCK else common[key], None)]
    if arch in ("glm4moe", "minimax-m2"):
        if key in _SCORE_BIAS:
            return [(_SCORE_BIAS[key], None)]
        if key in _SHARED and arch == "glm4moe":
            return [(_SHARED[key], None)]
        return [(common[key], None)]
    if arch == "llama" and key in ("attn_q.weight", "attn_k.weight"):
        heads = cfg.num_heads if key == "attn_q.weight" else cfg.num_kv_heads
        return [(common[key], _llama_unpermute(heads))]
    return [(common[key], None)]


def top_fix(arch: str, name: str) -> Fix | None:
    """The transform of a top-level tensor (the hybrids' final (1 + w) norm)."""
    return _minus_one if arch in _HYBRIDS and name == "output_norm.weight" else None


def join_kv_b(cfg: ModelConfig, k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """DeepSeek's ``attn_k_b`` [heads, kv_lora, nope] and ``attn_v_b`` [heads, v, kv_lora] back
    into ``kv_b_proj`` [heads * (nope + v), kv_lora]."""
    h, r = cfg.num_heads, cfg.kv_lora_rank
    k = k_b.reshape(h, r, cfg.qk_nope_head_dim).transpose(1, 2)
    v = v_b.reshape(h, cfg.v_head_dim, r)
    return torch.cat([k, v], dim=1).reshape(-1, r)


def split_gate_up(cfg: ModelConfig) -> dict[str, Fix]:
    """The gate and up halves of a fused ``ffn_gate_up_exps`` [E, 2I, H] (the converter's
    ``--fuse-gate-up-exps``: gate rows, then up rows)."""
    i = cfg.moe_intermediate_size
    return {"gate": lambda t: t[:, :i], "up": lambda t: t[:, i:]}


def block_key(arch: str, ours: str) -> str | None:
    """The GGUF block key that fills our parameter ``ours`` (under ``layers.N.``) in ``arch``,
    for messages; None where the shared table names it."""
    if arch == "qwen3next" and ours in (
        "linear_attn.in_proj_b.weight",
        "linear_attn.in_proj_a.weight",
    ):
        return "ssm_ba.weight"
    if arch in _HYBRIDS and ours == "mlp.shared_expert_gate.weight":
        return "ffn_gate_inp_shexp.weight"
    tables = [_SHARED] + ([_HYBRID_BLOCK] if arch in _HYBRIDS else [])
    tables += [_MLA_BLOCK] if arch == "deepseek2" else []
    tables += [_SCORE_BIAS] if arch in ("glm4moe", "minimax-m2") else []
    tables += [_GEMMA4_BLOCK] if arch == "gemma4" else []
    for table in tables:
        for key, name in table.items():
            if name == ours:
                return key
    return None
