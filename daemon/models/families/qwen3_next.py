"""Qwen3-Next: the Gated-DeltaNet / gated-attention hybrid that Qwen3.5 grew from. Its linear
attention stores q, k, v, z in one projection (and b, a in another) grouped per key head; the
converters below regroup them into the separate projections our GatedDeltaNet layer uses.

The GGUF rules here serve Qwen3.5 too (``hybrid_gguf``). llama.cpp's converter stores ``A_log``
as ``-exp(A_log)``, the conv1d kernel squeezed to [channels, kernel], and every (1 + w) RMSNorm
weight with the 1 added (not the DeltaNet's gated norm); Qwen3-Next's fused ``in_proj_qkvz`` is
split into ``attn_qkv`` (all q, all k, all v) and ``attn_gate`` (z), its ``in_proj_ba`` kept
fused as ``ssm_ba``. Qwen3.5 (``qwen35moe``) also reorders the value heads from grouped by key
head to tiled ([g0v0, g1v0, ..., g0v1, ...]) wherever they appear, when there are more value
than key heads."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..config import ModelConfig
from ..gguf_read import SHARED_EXPERT, Fix, GgufMeta, Target, minus_one
from .qwen3_moe import dense_layers, sparse_step
from .spec import CHATML_ANCHORS, CHATML_TURN_HEADER, FamilySpec, GgufRules, HfRules

if TYPE_CHECKING:
    import torch


def _split_qkvz(cfg: ModelConfig, name: str, w: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """[kh * (2 dk + 2 r dv), H] grouped per key head -> in_proj_qkv [2 kh dk + vh dv, H] and
    in_proj_z [vh dv, H] (r = value heads per key head)."""
    # deferred: torch (config_hf imports every family module and runs without torch)
    import torch

    kh, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r = cfg.linear_num_value_heads // kh
    g = w.view(kh, 2 * dk + 2 * r * dv, -1)
    q, k, v, z = torch.split(g, [dk, dk, r * dv, r * dv], dim=1)
    prefix = name.removesuffix("in_proj_qkvz.weight")
    qkv = torch.cat([t.reshape(-1, w.shape[-1]) for t in (q, k, v)])
    return [
        (prefix + "in_proj_qkv.weight", qkv),
        (prefix + "in_proj_z.weight", z.reshape(-1, w.shape[-1])),
    ]


def _split_ba(cfg: ModelConfig, name: str, w: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """[kh * 2r, H] grouped per key head -> in_proj_b [vh, H] and in_proj_a [vh, H]."""
    kh = cfg.linear_num_key_heads
    r = cfg.linear_num_value_heads // kh
    g = w.view(kh, 2 * r, -1)
    prefix = name.removesuffix("in_proj_ba.weight")
    return [
        (prefix + "in_proj_b.weight", g[:, :r].reshape(-1, w.shape[-1])),
        (prefix + "in_proj_a.weight", g[:, r:].reshape(-1, w.shape[-1])),
    ]


def hybrid_layer_types(text: dict[str, Any], n: int) -> list[str]:
    """Linear attention, with every ``full_attention_interval``-th layer full attention."""
    interval = int(text.get("full_attention_interval", 4))
    return ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]


# the HF rules Qwen3.5 shares: gated attention, (1 + w) norms, per-head q/k norms, a gated
# shared expert, the top-k renormalised unconditionally
HYBRID_FIXED = {"qk_norm": "head", "attention_output_gate": True, "norm_offset": True}


def hybrid_metadata(m: GgufMeta) -> dict[str, Any]:
    """The DeltaNet geometry from llama.cpp's ssm keys (state size = key head dim, group count =
    key heads, time-step rank = value heads, inner size = all value dims); a layer is full
    attention where the file has its ``attn_q``."""
    vh = int(m.get("ssm.time_step_rank"))
    rope: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": float(m.get("rope.freq_base", 10000.0)),
        "partial_rotary_factor": int(m.get("rope.dimension_count", m.head_dim)) / m.head_dim,
    }
    return {
        "linear_num_key_heads": int(m.get("ssm.group_count")),
        "linear_num_value_heads": vh,
        "linear_key_head_dim": int(m.get("ssm.state_size")),
        "linear_value_head_dim": int(m.get("ssm.inner_size")) // vh,
        "linear_conv_kernel_dim": int(m.get("ssm.conv_kernel")),
        "layer_types": [
            "full_attention" if m.has(f"blk.{i}.attn_q.weight") else "linear_attention"
            for i in range(m.n)
        ],
        "shared_expert_intermediate_size": int(m.get("expert_shared_feed_forward_length", 0)),
        "rope_parameters": rope,
    }


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
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    **SHARED_EXPERT,
}


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


def _hybrid_fix(tiled: bool, cfg: ModelConfig, key: str) -> Fix | None:
    """The transform for one hybrid block tensor (value-head reorder first)."""
    if key in _OFFSET_NORMS:
        return minus_one
    if key == "ffn_gate_inp_shexp.weight":  # [H] or [1, H]: our [1, H]
        return lambda t: t.reshape(1, -1)
    untile = tiled and cfg.linear_num_value_heads != cfg.linear_num_key_heads
    kd, dv = cfg.linear_num_key_heads * cfg.linear_key_head_dim, cfg.linear_value_head_dim

    def v_rows(t: torch.Tensor) -> torch.Tensor:  # q and k rows first, then the value rows
        # deferred: torch (config_hf imports every family module and runs without torch)
        import torch

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
        return lambda t: (-(a(t) if a else t)).log()
    if key == "ssm_conv1d.weight":  # [C, K] -> [C, 1, K]
        return lambda t: (v_rows(t) if untile else t).unsqueeze(1)
    return None


def _split_ssm_ba(cfg: ModelConfig, key: str) -> list[Target] | None:
    """Qwen3-Next's fused ``ssm_ba`` [kh * 2r, H], grouped per key head (r b rows, r a rows)."""
    if key != "ssm_ba.weight":
        return None
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


def hybrid_gguf(arch: str, tiled: bool, **more: Any) -> GgufRules:
    """The GGUF rules of a DeltaNet hybrid (``tiled``: value heads stored tiled)."""
    return GgufRules(
        arch=arch,
        experts_key="num_experts",
        norm_topk=True,
        block=_HYBRID_BLOCK,
        block_fix=lambda cfg, key: _hybrid_fix(tiled, cfg, key),
        block_split=_split_ssm_ba,
        top_fix={"output_norm.weight": minus_one},
        **more,
    )


SPEC = FamilySpec(
    architectures=("Qwen3NextForCausalLM",),
    hf=HfRules(
        fixed=HYBRID_FIXED,
        shared_expert="gated",
        norm_topk_default=True,
        layer_types=hybrid_layer_types,
        moe_layers=sparse_step,
    ),
    gguf=hybrid_gguf(
        "qwen3next",
        tiled=False,
        metadata=lambda m: {**dense_layers(m), **hybrid_metadata(m)},
        message_keys={
            "linear_attn.in_proj_b.weight": "ssm_ba.weight",
            "linear_attn.in_proj_a.weight": "ssm_ba.weight",
        },
    ),
    tool_syntax="qwen3_xml",
    reasoning_syntax="think",
    renames=((r"\.mlp\.gate\.weight$", ".mlp.router.weight"),),
    ignore=(r"^mtp\.",),
    anchors=CHATML_ANCHORS,
    turn_header=CHATML_TURN_HEADER,
    converters=(
        (r"linear_attn\.in_proj_qkvz\.weight$", _split_qkvz),
        (r"linear_attn\.in_proj_ba\.weight$", _split_ba),
    ),
)
