"""llama.cpp's converter for the hybrid (Qwen3-Next ``qwen3next``, Qwen3.5-MoE ``qwen35moe``), MLA
(DeepSeek-V3 and GLM-4.7-Flash, both ``deepseek2``; with the Lightning Indexer DeepSeek-V3.2
``deepseek32`` and GLM-5 ``glm-dsa``) and sigmoid-router (GLM-4.5 ``glm4moe``,
MiniMax-M2 ``minimax-m2``) families, reproduced for test files from the facts of
convert_hf_to_gguf.py (our code): the tensor transforms it applies before naming, and the
metadata keys it writes. Tensors come out under HF names (the ``gguf`` name map names them) or,
where the converter names them itself, under GGUF names (``blk.N.…``)."""

from __future__ import annotations

from typing import Any

import gguf
import torch

HYBRIDS = ("qwen3_next", "qwen3_5_moe")
DSA = ("deepseek_v32", "glm_moe_dsa")  # deepseek32 / glm-dsa: deepseek2's tensors + the indexer
MLA = ("deepseek_v3", "glm4_moe_lite", *DSA)  # llama.cpp writes the first two as deepseek2
SIGMOID = ("glm4_moe", "minimax_m2")  # llama.cpp's glm4moe / minimax-m2: named as they are


def _tile_v(t: torch.Tensor, dim: int, kh: int, r: int, d: int) -> torch.Tensor:
    """Qwen3.5's value-head reorder: grouped by key head (kh, r, d) -> tiled (r, kh, d)."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], kh, r, d, *shape[dim + 1 :]).transpose(dim, dim + 1)
    return t.reshape(shape)


def _qwen35_reorder(c: Any, key: str, t: torch.Tensor) -> torch.Tensor:
    kh, vh = c.linear_num_key_heads, c.linear_num_value_heads
    if kh == vh or ".linear_attn." not in key:
        return t
    r, dk, dv = vh // kh, c.linear_key_head_dim, c.linear_value_head_dim
    qk = 2 * kh * dk
    if key.endswith("in_proj_qkv.weight"):
        return torch.cat([t[:qk], _tile_v(t[qk:], 0, kh, r, dv)])
    if key.endswith("in_proj_z.weight"):
        return _tile_v(t, 0, kh, r, dv)
    if key.endswith(("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias")):
        return _tile_v(t, 0, kh, r, 1)
    if key.endswith("conv1d.weight"):
        t = t.squeeze()
        return torch.cat([t[:qk], _tile_v(t[qk:], 0, kh, r, dv)])
    if key.endswith("out_proj.weight"):
        return _tile_v(t, 1, kh, r, dv)
    return t


def hybrid_tensor(family: str, c: Any, key: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """One HF tensor of a hybrid as the converter emits it: [(HF or GGUF name, tensor)]."""
    if family == "qwen3_5_moe":
        t = _qwen35_reorder(c, key, t)
    if key.endswith(".A_log"):
        t = -torch.exp(t)
    elif key.endswith(".dt_bias"):
        key = key.removesuffix(".dt_bias") + ".dt_proj.bias"
    elif "conv1d" in key:
        t = t.squeeze()
    elif key.endswith("norm.weight") and not key.endswith("linear_attn.norm.weight"):
        t = t + 1
    if key.endswith("in_proj_qkvz.weight"):  # per key head [q, k, v, z] -> all q, k, v | all z
        kh, dk = c.linear_num_key_heads, c.linear_key_head_dim
        rv = c.linear_num_value_heads // kh * c.linear_value_head_dim
        g = t.reshape(kh, 2 * dk + 2 * rv, -1)
        q, k, v, z = torch.split(g, [dk, dk, rv, rv], dim=1)
        blk = f"blk.{key.split('.')[2]}"
        qkv = torch.cat([x.reshape(-1, t.shape[-1]) for x in (q, k, v)])
        return [
            (f"{blk}.attn_qkv.weight", qkv),
            (f"{blk}.attn_gate.weight", z.reshape(-1, t.shape[-1])),
        ]
    return [(key, t)]


def deepseek_tensor(c: Any, key: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """DeepSeek-V3: kv_b split into k_b (per head transposed) and v_b; the router's bias named
    as a bias of ``e_score_correction``."""
    if key.endswith("kv_b_proj.weight"):
        h, nope, v = c.num_key_value_heads, c.qk_nope_head_dim, c.v_head_dim
        k_b, v_b = torch.split(t.reshape(h, nope + v, -1), [nope, v], dim=1)
        return [
            (key.replace("kv_b_proj", "k_b_proj"), k_b.transpose(1, 2)),
            (key.replace("kv_b_proj", "v_b_proj"), v_b),
        ]
    if key.endswith("e_score_correction_bias"):
        return [(key.replace("e_score_correction_bias", "e_score_correction.bias"), t)]
    return [(key, t)]


def score_bias_tensor(key: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """GLM-4.5 / MiniMax-M2: only the router's correction bias renamed (a bias of
    ``e_score_correction``, which the name map knows as ``exp_probs_b``)."""
    return [(key.replace("e_score_correction_bias", "e_score_correction.bias"), t)]


def mtp_tensors(c: Any, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """GLM's multi-token-prediction layer as the converter appends it (``blk.<n>``, a decoder
    layer plus its ``nextn.*`` tensors). transformers does not build it, so its values are made
    up: the last decoder layer's tensors, scaled, and the nextn projections."""
    n, h = c.num_hidden_layers, c.hidden_size
    last = f"blk.{n - 1}."
    out = {f"blk.{n}." + k[len(last) :]: t * 0.5 for k, t in tensors.items() if k.startswith(last)}
    g = torch.Generator().manual_seed(n)
    out[f"blk.{n}.nextn.eh_proj.weight"] = torch.randn(h, 2 * h, generator=g)
    for norm in ("enorm", "hnorm", "shared_head_norm"):
        out[f"blk.{n}.nextn.{norm}.weight"] = torch.ones(h)
    return out


def glm4moe_metadata(w: gguf.GGUFWriter, c: Any) -> None:
    """GLM-4.5's keys after the generic ones (block_count already counts the nextn layers)."""
    rope = c.rope_parameters
    w.add_rope_dimension_count(int(c.head_dim * rope.get("partial_rotary_factor", 0.5)))
    w.add_expert_count(c.n_routed_experts)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_expert_shared_count(c.n_shared_experts)
    w.add_leading_dense_block_count(c.first_k_dense_replace)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_weights_scale(c.routed_scaling_factor)
    w.add_expert_weights_norm(c.norm_topk_prob)
    w.add_expert_group_count(c.n_group)
    w.add_expert_group_used_count(c.topk_group)
    w.add_nextn_predict_layers(c.num_nextn_predict_layers)


def minimax_metadata(w: gguf.GGUFWriter, c: Any) -> None:
    w.add_expert_count(c.num_local_experts)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)  # config's scoring_func
    w.add_expert_feed_forward_length(c.intermediate_size)
    w.add_rope_dimension_count(c.rotary_dim)


def gemma4_tensor(c: Any, key: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
    """Gemma-4's tensors the converter names itself (None: the name map's): the router's two
    scales, the layer's output scale, the fused experts as they are ([E, 2I, H], [E, H, I])."""
    if not key.startswith("model.layers."):
        return None
    blk = f"blk.{key.split('.')[2]}"
    for suffix, name in (
        ("router.scale", "ffn_gate_inp.scale"),
        ("router.per_expert_scale", "ffn_down_exps.scale"),
        ("layer_scalar", "layer_output_scale.weight"),
        ("experts.gate_up_proj", "ffn_gate_up_exps.weight"),
        ("experts.down_proj", "ffn_down_exps.weight"),
    ):
        if key.endswith(suffix):
            return [(f"{blk}.{name}", t)]
    return None


def _gemma4_geometry(c: Any) -> tuple[dict[str, Any], list[int], list[int]]:
    """(config dict, head dim and KV heads per layer): transformers keeps the global layers'
    values in ``per_layer_config``."""
    d = c.to_dict()
    over = {int(k): v for k, v in (d.get("per_layer_config") or {}).items()}
    n = d["num_hidden_layers"]
    dims = [int(over.get(i, {}).get("head_dim", d["head_dim"])) for i in range(n)]
    kv = [
        int(over.get(i, {}).get("num_key_value_heads", d["num_key_value_heads"])) for i in range(n)
    ]
    return d, dims, kv


def _global_dim(d: dict[str, Any], dims: list[int]) -> int:
    full = [dims[i] for i, t in enumerate(d["layer_types"]) if t == "full_attention"]
    return full[0] if full else d["head_dim"]


def gemma4_rope_freqs(c: Any) -> torch.Tensor:
    """The global layers' proportional rope as ggml's NEOX rope takes it: a factor per rotary
    pair, 1 where HF's proportional rope rotates, 1e30 (no rotation) elsewhere."""
    d, dims, _ = _gemma4_geometry(c)
    full_dim = _global_dim(d, dims)
    partial = d["rope_parameters"]["full_attention"].get("partial_rotary_factor", 1.0)
    rot = int(full_dim * partial / 2)
    return torch.tensor([1.0] * rot + [1e30] * (full_dim // 2 - rot))


def gemma4_metadata(w: gguf.GGUFWriter, c: Any) -> None:
    """After block count, context, embedding length and head count: each layer type's geometry
    (global layers: ``key_length``, their ``head_count_kv`` entries; sliding ones: ``*_swa``)."""
    d, dims, kv = _gemma4_geometry(c)
    sliding = [t == "sliding_attention" for t in d["layer_types"]]
    full_dim = _global_dim(d, dims)
    w.add_head_count_kv(kv if len(set(kv)) > 1 else kv[0])
    w.add_key_length(full_dim)
    w.add_value_length(full_dim)
    w.add_key_length_swa(d["head_dim"])
    w.add_value_length_swa(d["head_dim"])
    w.add_layer_norm_rms_eps(d["rms_norm_eps"])
    rope = d["rope_parameters"]
    w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    w.add_rope_dimension_count(full_dim)
    w.add_rope_dimension_count_swa(d["head_dim"])
    if d.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(d["final_logit_softcapping"])
    w.add_sliding_window(d["sliding_window"])
    w.add_sliding_window_pattern(sliding)
    n, shared = d["num_hidden_layers"], d.get("num_kv_shared_layers") or 0
    w.add_shared_kv_layers(shared)
    w.add_embedding_length_per_layer_input(d.get("hidden_size_per_layer_input") or 0)
    ffn = d["intermediate_size"]
    if d.get("use_double_wide_mlp"):
        w.add_feed_forward_length([ffn if i < n - shared else 2 * ffn for i in range(n)])
    else:
        w.add_feed_forward_length(ffn)
    w.add_expert_count(d["num_experts"])
    w.add_expert_used_count(d["top_k_experts"])
    w.add_expert_feed_forward_length(d["moe_intermediate_size"])


def hybrid_metadata(w: gguf.GGUFWriter, family: str, c: Any) -> None:
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    w.add_ssm_conv_kernel(c.linear_conv_kernel_dim)
    w.add_ssm_state_size(c.linear_key_head_dim)
    w.add_ssm_group_count(c.linear_num_key_heads)
    w.add_ssm_time_step_rank(c.linear_num_value_heads)
    w.add_ssm_inner_size(c.linear_value_head_dim * c.linear_num_value_heads)
    full = [i for i, t in enumerate(c.layer_types) if t == "full_attention"]
    w.add_full_attention_interval(full[0] + 1)
    partial = c.rope_parameters.get("partial_rotary_factor", 0.25)
    w.add_rope_dimension_count(int(c.head_dim * partial))
    if family == "qwen3_5_moe":  # the checkpoint's, padded to 4; Qwen3.5's default if absent
        sections = list(c.rope_parameters.get("mrope_section") or [11, 11, 10])
        w.add_rope_dimension_sections((sections + [0] * 4)[:4])


def deepseek_metadata(w: gguf.GGUFWriter, c: Any, gating: bool = True) -> None:
    """After the generic keys (``gguf_files._metadata``, which writes the HF KV head count):
    MLA as MQA with one KV head and kv_lora + rope sized keys. ``gating``: the router's
    ``expert_gating_func`` (the converter writes it from a config.json ``scoring_func``, which
    DeepSeek-V3's has and transformers' DSA configs do not)."""
    w.add_head_count_kv(1)
    dense = getattr(c, "first_k_dense_replace", None)
    if dense is None:  # GLM-4.7-Flash: its config.json's first_k_dense_replace
        kinds = list(c.mlp_layer_types)
        dense = kinds.index("sparse") if "sparse" in kinds else len(kinds)
    w.add_leading_dense_block_count(dense)
    w.add_vocab_size(c.vocab_size)
    if c.q_lora_rank is not None:
        w.add_q_lora_rank(c.q_lora_rank)
    w.add_kv_lora_rank(c.kv_lora_rank)
    w.add_key_length(c.kv_lora_rank + c.qk_rope_head_dim)
    w.add_value_length(c.kv_lora_rank)
    w.add_key_length_mla(c.qk_nope_head_dim + c.qk_rope_head_dim)
    w.add_value_length_mla(c.v_head_dim)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_expert_count(c.n_routed_experts)
    w.add_expert_shared_count(c.n_shared_experts)
    w.add_expert_weights_scale(c.routed_scaling_factor)
    if c.norm_topk_prob:
        w.add_expert_weights_norm(True)
    if gating:
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_group_count(c.n_group)
    w.add_expert_group_used_count(c.topk_group)
    w.add_rope_dimension_count(c.qk_rope_head_dim)
    rope = c.rope_parameters
    if rope.get("rope_type") == "yarn":  # the generic yarn keys, and mscale_all_dim as 0.1 x
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def dsa_metadata(w: gguf.GGUFWriter, family: str, c: Any) -> None:
    """DeepSeek-V3.2 / GLM-5 after ``deepseek_metadata``: the nextn layers where the config
    counts them, the indexer's geometry; GLM-5's rope dimension count scaled by its partial
    rotary factor (written over deepseek2's) and its indexer layers (True: full)."""
    if (mtp := getattr(c, "num_nextn_predict_layers", None)) is not None:
        w.add_nextn_predict_layers(mtp)
    w.add_uint32(f"{w.arch}.attention.indexer.head_count", c.index_n_heads)
    w.add_uint32(f"{w.arch}.attention.indexer.key_length", c.index_head_dim)
    w.add_uint32(f"{w.arch}.attention.indexer.top_k", c.index_topk)
    if family == "glm_moe_dsa":
        partial = c.rope_parameters.get("partial_rotary_factor", 1.0)
        w.add_rope_dimension_count(int(c.qk_rope_head_dim * partial))
        if (kinds := getattr(c, "indexer_types", None)) is not None:
            w.add_array(f"{w.arch}.attention.indexer.types", [k == "full" for k in kinds])


# DeepSeek-V4: transformers' names (under model.layers.N. / model.) -> llama.cpp's, the converter's
# table (conversion/deepseek.py, on the release's names, which transformers' conversion mapping
# renames one for one); no transform. The routed experts are the generic ones.
_V4_COMPRESSOR = {"kv_proj.weight": "kv", "gate_proj.weight": "gate", "position_bias": "ape"}
V4_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.sinks": "attn_sinks.weight",
    "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_norm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_proj.weight": "attn_kv.weight",
    "self_attn.kv_norm.weight": "attn_kv_a_norm.weight",
    "self_attn.o_a_proj.weight": "attn_output_a.weight",
    "self_attn.o_b_proj.weight": "attn_output_b.weight",
    "self_attn.compressor.indexer.q_b_proj.weight": "indexer.attn_q_b.weight",
    "self_attn.compressor.indexer.scorer.weights_proj.weight": "indexer.proj.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "mlp.gate.tid2eid": "ffn_gate_tid2eid.weight",
    **{
        f"mlp.shared_experts.{p}_proj.weight": f"ffn_{p}_shexp.weight"
        for p in ("gate", "up", "down")
    },
    **{
        f"{h}_hc.{p}": f"hc_{h}_{p}.weight"
        for h in ("attn", "ffn")
        for p in ("fn", "base", "scale")
    },
    **{
        f"self_attn.compressor.{pre}{a}": f"{g}_compressor_{b}.weight"
        for pre, g in (("", "attn"), ("indexer.", "indexer"))
        for a, b in (*_V4_COMPRESSOR.items(), ("kv_norm.weight", "norm"))
    },
}
V4_TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    **{f"model.hc_head.hc_{p}": f"output_hc_{p}.weight" for p in ("fn", "base", "scale")},
}


def v4_name(key: str) -> str:
    """The GGUF name of a transformers DeepSeek-V4 tensor (not a routed expert)."""
    if key in V4_TOP:
        return V4_TOP[key]
    _, _, layer, rest = key.split(".", 3)
    return f"blk.{layer}.{V4_LAYER[rest]}"


def v4_metadata(w: gguf.GGUFWriter, c: Any) -> None:
    """After block count, context, embedding length and head count: what the converter writes
    from the release's config.json (its keys computed here from transformers' form)."""
    a, n = w.arch, c.num_hidden_layers
    rope = c.rope_parameters
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(rope["main"]["rope_theta"])
    comp = rope["compress"]
    if comp.get("rope_type") == "yarn":  # the release's flat rope_scaling
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(comp["factor"])
        w.add_rope_scaling_orig_ctx_len(comp["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(comp["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(comp["beta_slow"])
    w.add_expert_count(c.n_routed_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_uint32(f"{a}.expert_gating_func", 4)  # SQRTSOFTPLUS (scoring_func)
    w.add_rope_dimension_count(c.qk_rope_head_dim)
    w.add_q_lora_rank(c.q_lora_rank)
    w.add_sliding_window(c.sliding_window)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_expert_shared_count(c.n_shared_experts)
    w.add_expert_weights_scale(c.routed_scaling_factor)
    w.add_expert_weights_norm(c.norm_topk_prob)
    w.add_array(f"{a}.swiglu_clamp_exp", [float(c.swiglu_limit)] * n)
    w.add_array(f"{a}.swiglu_clamp_shexp", [float(c.swiglu_limit)] * n)
    w.add_uint32(f"{a}.attention.indexer.head_count", c.index_n_heads)
    w.add_uint32(f"{a}.attention.indexer.key_length", c.index_head_dim)
    w.add_uint32(f"{a}.attention.indexer.top_k", c.index_topk)
    w.add_uint32(f"{a}.attention.output_group_count", c.o_groups)
    w.add_uint32(f"{a}.attention.output_lora_rank", c.o_lora_rank)
    rates = {"sliding_attention": 0, **c.compress_rates}
    w.add_array(f"{a}.attention.compress_ratios", [int(rates[t]) for t in c.layer_types])
    w.add_float32(f"{a}.attention.compress_rope_freq_base", comp["rope_theta"])
    w.add_uint32(f"{a}.hyper_connection.count", c.hc_mult)
    w.add_uint32(f"{a}.hyper_connection.sinkhorn_iterations", c.hc_sinkhorn_iters)
    w.add_float32(f"{a}.hyper_connection.epsilon", c.hc_eps)
    w.add_uint32(f"{a}.hash_layer_count", sum(t == "hash_moe" for t in c.mlp_layer_types))
    w.add_uint32(f"{a}.embedding_length_out", c.hidden_size * c.hc_mult)


def hf_value(family: str, c: Any, key: str, tensors: dict[str, torch.Tensor], name: Any) -> Any:
    """The inverse: HF tensor ``key`` of a hybrid or DeepSeek-V3 model from the file's tensors
    (``name``: HF name -> GGUF name); None for a key the generic inverse handles."""
    if family == "deepseek_v4":
        return tensors[v4_name(key)]
    if family not in (*HYBRIDS, *MLA, *SIGMOID, "gemma4"):
        return None
    blk = f"blk.{key.split('.')[2]}" if key.startswith("model.layers.") else ""
    if family == "gemma4":
        converted = gemma4_tensor(c, key, torch.empty(0))
        return tensors[converted[0][0]] if converted else None
    if family in SIGMOID:
        if key.endswith("e_score_correction_bias"):
            return tensors[f"{blk}.exp_probs_b.bias"]
        return None
    if family in MLA:
        if key.endswith("kv_b_proj.weight"):
            h, r = c.num_key_value_heads, c.kv_lora_rank
            k_b = tensors[f"{blk}.attn_k_b.weight"].reshape(h, r, -1).transpose(1, 2)
            v_b = tensors[f"{blk}.attn_v_b.weight"].reshape(h, -1, r)
            return torch.cat([k_b, v_b], 1).reshape(-1, r)
        if key.endswith("e_score_correction_bias"):
            return tensors[f"{blk}.exp_probs_b.bias"]
        return None
    kh, vh = c.linear_num_key_heads, c.linear_num_value_heads
    r, dk, dv = vh // kh, c.linear_key_head_dim, c.linear_value_head_dim
    qk = 2 * kh * dk
    tiled = family == "qwen3_5_moe" and kh != vh

    def untile(t: torch.Tensor, dim: int, d: int) -> torch.Tensor:
        return _tile_v(t, dim, r, kh, d) if tiled else t  # (r, kh, d) -> (kh, r, d)

    def g(suffix: str) -> torch.Tensor:
        return tensors[f"{blk}.{suffix}"]

    if key.endswith("in_proj_qkvz.weight"):
        qkv, z = g("attn_qkv.weight"), g("attn_gate.weight")
        h = qkv.shape[-1]
        parts = [qkv[: kh * dk], qkv[kh * dk : qk], qkv[qk:], z]
        return torch.cat([p.reshape(kh, -1, h) for p in parts], 1).reshape(-1, h)
    if key.endswith("in_proj_ba.weight"):
        return g("ssm_ba.weight")
    if key.endswith("in_proj_qkv.weight"):
        t = g("attn_qkv.weight")
        return torch.cat([t[:qk], untile(t[qk:], 0, dv)])
    if key.endswith("in_proj_z.weight"):
        return untile(g("attn_gate.weight"), 0, dv)
    if key.endswith(("in_proj_b.weight", "in_proj_a.weight")):
        return untile(g("ssm_beta.weight" if "in_proj_b" in key else "ssm_alpha.weight"), 0, 1)
    if key.endswith(".A_log"):
        return untile(torch.log(-g("ssm_a")), 0, 1)
    if key.endswith(".dt_bias"):
        return untile(g("ssm_dt.bias"), 0, 1)
    if key.endswith("conv1d.weight"):
        t = g("ssm_conv1d.weight")
        return torch.cat([t[:qk], untile(t[qk:], 0, dv)])
    if key.endswith("out_proj.weight"):
        return untile(g("ssm_out.weight"), 1, dv)
    if key.endswith("norm.weight") and not key.endswith("linear_attn.norm.weight"):
        return tensors[name(key)] - 1
    return None
