"""Tiny GGUF files written from tiny HF checkpoints, in llama.cpp's conventions: tensor names from
the ``gguf`` package's own name map, stacked experts, Q/K rows permuted for the llama
architecture, metadata under llama.cpp's keys. Types: F32, BF16, Q8_0 (``gguf.quants``) and a
K-quant mix (Q4_K / Q6_K blocks made by ``kquants``; other rows Q8_0/Q5_0/Q4_0)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf_convert import (
    DSA,
    HYBRIDS,
    MLA,
    SIGMOID,
    deepseek_metadata,
    deepseek_tensor,
    dsa_metadata,
    gemma4_metadata,
    gemma4_rope_freqs,
    gemma4_tensor,
    glm4moe_metadata,
    hf_value,
    hybrid_metadata,
    hybrid_tensor,
    minimax_metadata,
    mtp_tensors,
    score_bias_tensor,
    v4_metadata,
    v4_name,
)

ARCH = {
    "qwen3_moe": "qwen3moe",
    "olmoe": "olmoe",
    "mixtral": "llama",
    "gpt_oss": "gpt-oss",
    "qwen3_next": "qwen3next",
    "qwen3_5_moe": "qwen35moe",
    "deepseek_v3": "deepseek2",
    "glm4_moe": "glm4moe",
    "glm4_moe_lite": "deepseek2",  # GLM-4.7-Flash: llama.cpp writes it as DeepSeek
    "minimax_m2": "minimax-m2",
    "gemma4": "gemma4",
    "deepseek_v32": "deepseek32",
    "glm_moe_dsa": "glm-dsa",
    "deepseek_v4": "deepseek4",
}
_MODEL_ARCH = {
    "qwen3moe": gguf.MODEL_ARCH.QWEN3MOE,
    "olmoe": gguf.MODEL_ARCH.OLMOE,
    "llama": gguf.MODEL_ARCH.LLAMA,
    "gpt-oss": gguf.MODEL_ARCH.GPT_OSS,
    "qwen3next": gguf.MODEL_ARCH.QWEN3NEXT,
    "qwen35moe": gguf.MODEL_ARCH.QWEN35MOE,
    "deepseek2": gguf.MODEL_ARCH.DEEPSEEK2,
    "glm4moe": gguf.MODEL_ARCH.GLM4_MOE,
    "minimax-m2": gguf.MODEL_ARCH.MINIMAXM2,
    "gemma4": gguf.MODEL_ARCH.GEMMA4,
    # the installed gguf package predates deepseek32; its tensors are glm-dsa's (llama.cpp's
    # constants.py lists the same ones for both), so glm-dsa's name map names them
    "deepseek32": gguf.MODEL_ARCH.GLM_DSA,
    "glm-dsa": gguf.MODEL_ARCH.GLM_DSA,
    # nor deepseek4: its names come from gguf_convert's table (this map names none of them)
    "deepseek4": gguf.MODEL_ARCH.DEEPSEEK2,
}


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's Q/K row permutation for its interleaved rope (convert_hf_to_gguf)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def gguf_tensors(family: str, hf: Any) -> dict[str, torch.Tensor]:
    """GGUF name -> float tensor (torch order) for an HF model of ``family``."""
    c = hf.config
    arch = ARCH[family]
    names = gguf.get_tensor_name_map(_MODEL_ARCH[arch], c.num_hidden_layers)
    out: dict[str, torch.Tensor] = {}
    mtp = family in ("glm4_moe", *DSA) and getattr(c, "num_nextn_predict_layers", 0)
    for key, t in hf.state_dict().items():
        t = t.detach().float()
        if "rotary_emb" in key:
            continue
        if ".mlp.experts." in key:
            layer = int(key.split(".")[2])
            part = key.rsplit(".", 1)[1]
            blk = f"blk.{layer}"
            if family == "gpt_oss":
                if part == "gate_up_proj":  # [E, H, 2I] interleaved -> gate/up [E, I, H]
                    t = t.transpose(1, 2)
                    out[f"{blk}.ffn_gate_exps.weight"] = t[:, 0::2]
                    out[f"{blk}.ffn_up_exps.weight"] = t[:, 1::2]
                elif part == "gate_up_proj_bias":
                    out[f"{blk}.ffn_gate_exps.bias"] = t[:, 0::2]
                    out[f"{blk}.ffn_up_exps.bias"] = t[:, 1::2]
                elif part == "down_proj":
                    out[f"{blk}.ffn_down_exps.weight"] = t.transpose(1, 2)
                else:
                    out[f"{blk}.ffn_down_exps.bias"] = t
            elif part == "gate_up_proj":  # [E, 2I, H]: gate rows then up rows
                i = t.shape[1] // 2
                out[f"{blk}.ffn_gate_exps.weight"] = t[:, :i]
                out[f"{blk}.ffn_up_exps.weight"] = t[:, i:]
            else:
                out[f"{blk}.ffn_down_exps.weight"] = t
            continue
        if family in HYBRIDS:
            converted = hybrid_tensor(family, c, key, t)
        elif family in MLA:
            converted = deepseek_tensor(c, key, t)
        elif family in SIGMOID:
            converted = score_bias_tensor(key, t)
        elif family == "gemma4":
            converted = gemma4_tensor(c, key, t) or [(key, t)]
        elif family == "deepseek_v4":
            converted = [(v4_name(key), t)]
        else:
            converted = [(key, t)]
        for key, t in converted:
            named = key.startswith("blk.") or family == "deepseek_v4"  # named by the converter
            name = key if named else _gguf_name(names, key)
            if arch == "llama" and key.endswith(("q_proj.weight", "k_proj.weight")):
                heads = c.num_attention_heads if "q_proj" in key else c.num_key_value_heads
                t = _permute(t, heads)
            out[name] = t.contiguous()
    if mtp:  # GLM's nextn layer after the decoder layers (block_count counts it)
        out.update(mtp_tensors(c, out))
    if family == "gemma4":
        out["rope_freqs.weight"] = gemma4_rope_freqs(c)
    return out


def _gguf_name(names: gguf.TensorNameMap, key: str) -> str:
    name = names.get_name(key, try_suffixes=(".weight", ".bias"))
    if name is None:
        raise KeyError(f"no GGUF name for {key}")
    return name + ".weight" if name.endswith("attn_sinks") else name


def _metadata(w: gguf.GGUFWriter, family: str, c: Any) -> None:
    mtp = getattr(c, "num_nextn_predict_layers", 0) if family in ("glm4_moe", *DSA) else 0
    w.add_block_count(c.num_hidden_layers + mtp)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_head_count(c.num_attention_heads)
    if family == "gemma4":
        gemma4_metadata(w, c)
        return
    if family == "deepseek_v4":
        v4_metadata(w, c)
        return
    if family in MLA:
        deepseek_metadata(w, c, gating=family not in DSA)
    else:
        w.add_head_count_kv(c.num_key_value_heads)
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    rope = getattr(c, "rope_parameters", None) or {}
    w.add_rope_freq_base(float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))))
    if family in HYBRIDS:
        hybrid_metadata(w, family, c)
    if family in DSA:
        dsa_metadata(w, family, c)
    if family == "glm4_moe":
        glm4moe_metadata(w, c)
    elif family == "minimax_m2":
        minimax_metadata(w, c)
    elif family not in MLA:  # (their expert count is among the MLA keys)
        w.add_expert_count(getattr(c, "num_experts", None) or c.num_local_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    if getattr(c, "intermediate_size", None):
        w.add_feed_forward_length(c.intermediate_size)
    if family == "qwen3_moe":
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    elif family == "gpt_oss":  # llama.cpp's gpt-oss reads only this key (its converter writes it)
        w.add_expert_feed_forward_length(c.intermediate_size)
    if family == "olmoe" and c.clip_qkv is not None:
        w.add_clamp_kqv(c.clip_qkv)
    if family == "gpt_oss":
        w.add_sliding_window(c.sliding_window)
        if rope.get("rope_type") == "yarn":
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(rope["factor"])
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])


def quantize(name: str, t: torch.Tensor, kind: str) -> tuple[np.ndarray, Q]:
    """The stored array and type of one tensor in a file of ``kind`` (f32 | bf16 | q8_0 | kmix):
    norms, biases and sinks stay F32 as llama.cpp keeps them."""
    a = t.numpy().astype(np.float32)
    if name.endswith("tid2eid.weight"):  # DeepSeek-V4's token id -> experts table: I32
        return t.numpy().astype(np.int32), Q.I32
    if kind == "f32" or t.dim() == 1 or name.endswith((".bias", "attn_sinks.weight")):
        return a, Q.F32
    if name.endswith("ffn_gate_inp.weight"):  # routers stay F32 as llama.cpp keeps them
        return a, Q.F32
    if t.shape[0] == 1 or name.endswith("ssm_conv1d.weight"):  # 1-D to ggml; conv kept as is
        return a, Q.F32
    if kind == "nvfp4":  # experts NVFP4 (write_gguf: nvfp4_stack), the rest F32
        return a, Q.F32
    if kind == "mxfp4":  # GPT-OSS files: experts MXFP4, the rest kept as is (F32 here)
        if name.endswith("_exps.weight"):
            return gguf.quants.quantize(a, Q.MXFP4), Q.MXFP4
        return a, Q.F32
    if kind == "bf16":
        return gguf.quants.quantize(a, Q.BF16), Q.BF16
    if kind == "q8_0" and a.shape[-1] % 32:  # rows Q8_0 cannot block: F16 here (llama.cpp's
        return gguf.quants.quantize(a, Q.F16), Q.F16  # quantizer also picks another type)
    if kind == "q8_0":
        return gguf.quants.quantize(a, Q.Q8_0), Q.Q8_0
    from kquants import quantize_q4_k, quantize_q6_k

    row = a.shape[-1]
    if row % 256 == 0:  # a Q4_K_M-like mix: most Q4_K, down/output Q6_K
        if name.endswith(("ffn_down_exps.weight", "output.weight", "attn_v.weight")):
            return quantize_q6_k(a), Q.Q6_K
        return quantize_q4_k(a), Q.Q4_K
    qt = Q.Q5_0 if "attn" in name else Q.Q4_0 if "exps" in name else Q.Q8_0
    return gguf.quants.quantize(a, qt), qt


def _quantize_as(t: torch.Tensor, qt: Q) -> tuple[np.ndarray, Q]:
    from kquants import quantize_q4_k, quantize_q6_k

    a = t.numpy().astype(np.float32)
    if qt == Q.Q4_K:
        return quantize_q4_k(a), qt
    if qt == Q.Q6_K:
        return quantize_q6_k(a), qt
    return gguf.quants.quantize(a, qt), qt


def write_gguf(
    family: str,
    hf: Any,
    path: Path,
    kind: str = "f32",
    *,
    tokenizer: Path | None = None,
    pre: str = "qwen2",
    drop: tuple[str, ...] = (),
    split_max_tensors: int = 0,
    expert_types: tuple[Q, Q] | None = None,
    meta: dict[str, str] | None = None,
) -> Path:
    """Writes ``hf`` (an HF model of ``family``) as a GGUF file of ``kind``; ``drop``: tensor
    names left out (for missing-tensor tests); ``tokenizer``: an HF folder whose byte-level BPE
    tokenizer and chat template go into the metadata (``pre``: llama.cpp's pre-tokenizer name);
    ``expert_types``: (gate/up, down) types of the expert weights (Q8_0, Q4_K or Q6_K), every
    other tensor as ``kind`` says; ``meta``: more string keys (``general.basename``, ...)."""
    arch = ARCH[family]
    w = gguf.GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    _metadata(w, family, hf.config)
    for key, value in (meta or {}).items():
        w.add_string(key, value)
    if tokenizer is not None:
        write_tokenizer(w, tokenizer, pre)
    else:
        w.add_eos_token_id(hf.config.eos_token_id)
        w.add_bos_token_id(hf.config.bos_token_id)
    for name, t in gguf_tensors(family, hf).items():
        if name in drop:
            continue
        data, qt = quantize(name, t, kind)
        if family == "deepseek_v4" and name.endswith("_exps.weight"):  # the converter repacks
            data, qt = gguf.quants.quantize(t.numpy(), Q.MXFP4), Q.MXFP4  # the release's FP4
        if expert_types is not None and name.endswith("_exps.weight"):
            data, qt = _quantize_as(t, expert_types[1 if "ffn_down" in name else 0])
        if kind == "nvfp4" and name.endswith(("_exps.weight", "attn_output.weight")):
            # the experts, and one dense weight a layer (the converter writes any NVFP4 linear)
            dense = not name.endswith("_exps.weight")
            data, scale = nvfp4_stack(t[None] if dense else t)
            w.add_tensor(name.replace(".weight", ".scale"), scale)
            data, qt = (data[0] if dense else data), Q.NVFP4
        w.add_tensor(name, data, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def nvfp4_stack(t: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """A stacked expert weight [E, rows, cols] as llama.cpp's converter writes an NVFP4
    checkpoint's experts: per expert a global scale (amax / (6 * 448), the ``.scale`` tensor,
    [E] F32) and rows of ggml super-blocks of 64 inputs (4 UE4M3 scale bytes, one per 16 inputs,
    then 32 code bytes: sub-block s's byte j holds its inputs j and j + 8 in its low and high
    nibbles). The codes and scales come from our ``nv_quant`` (the checkpoints' packing: inputs
    2k and 2k + 1 in a byte); the oracle that reads them back is the ``gguf`` package's
    dequantizer (``dequantized_reference``)."""
    from freetokend.experts.microscale import nv_global, nv_quant, unpack_nibbles

    e, rows, cols = t.shape
    out, scales = [], []
    for x in range(e):
        glob = nv_global(t[x])
        packed, bs = nv_quant(t[x], glob)
        codes = unpack_nibbles(packed).reshape(rows, cols // 16, 16)
        qs = (codes[..., :8] | (codes[..., 8:] << 4)).reshape(rows, cols // 64, 32)
        d = bs.view(torch.uint8).reshape(rows, cols // 64, 4)
        out.append(torch.cat((d, qs), dim=-1).reshape(rows, cols // 64 * 36))
        scales.append(glob)
    return torch.stack(out).numpy(), np.array(scales, dtype=np.float32)


def write_tokenizer(w: gguf.GGUFWriter, folder: Path, pre: str) -> None:
    """An HF byte-level BPE tokenizer (tokenizer.json + tokenizer_config.json) as llama.cpp's
    converter stores it: tokens by id, types (1 normal, 3 control = special added token,
    4 user-defined = other added token), merges, special ids, chat template."""
    import json

    tok = json.loads((folder / "tokenizer.json").read_text())
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    vocab: dict[str, int] = dict(tok["model"]["vocab"])
    types = {i: 1 for i in vocab.values()}
    for a in tok["added_tokens"]:
        vocab[a["content"]] = a["id"]
        types[a["id"]] = 3 if a["special"] else 4
    by_id = {i: t for t, i in vocab.items()}
    n = max(by_id) + 1
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list([by_id.get(i, f"[PAD{i}]") for i in range(n)])
    w.add_token_types([types.get(i, 5) for i in range(n)])
    w.add_token_merges(merges)
    w.add_eos_token_id(vocab[cfg["eos_token"]])
    w.add_pad_token_id(vocab[cfg["pad_token"]])
    w.add_add_bos_token(False)
    w.add_chat_template(cfg["chat_template"])


def dequantized_reference(family: str, hf: Any, path: Path) -> None:
    """Loads the file's (dequantized) tensors back into ``hf`` in place: the oracle for
    quantized files is transformers on the very weights the file holds."""
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(path)
    stored = {t.name: (t.tensor_type, np.array(t.data)) for t in reader.tensors}
    want = gguf_tensors(family, hf)
    back: dict[str, torch.Tensor] = {}
    for name, t in want.items():
        qt, raw = stored[name]
        vals = raw if qt == Q.I32 else dequantize(raw, qt)
        back[name] = torch.from_numpy(vals.astype(np.float32)).reshape(t.shape)
        scale = stored.get(name.removesuffix(".weight") + ".scale")  # NVFP4's global scales
        if qt == Q.NVFP4 and scale is not None:  # one an expert, or one for a dense weight
            glob = torch.from_numpy(scale[1].astype(np.float32))
            back[name] *= glob.view(-1, 1, 1) if name.endswith("_exps.weight") else glob[0]
    _load_back(family, hf, back)


def _load_back(family: str, hf: Any, tensors: dict[str, torch.Tensor]) -> None:
    """Inverse of ``gguf_tensors``: writes GGUF-named tensors into the HF model's parameters."""
    c = hf.config
    arch = ARCH[family]
    names = gguf.get_tensor_name_map(_MODEL_ARCH[arch], c.num_hidden_layers)
    sd = hf.state_dict()
    with torch.no_grad():
        for key, p in sd.items():
            if "rotary_emb" in key:
                continue
            if ".mlp.experts." in key:
                layer, part = int(key.split(".")[2]), key.rsplit(".", 1)[1]
                g = lambda s, b=f"blk.{layer}.ffn_": tensors[b + s]  # noqa: E731
                if family == "gpt_oss":
                    if part == "gate_up_proj":
                        t = torch.stack([g("gate_exps.weight"), g("up_exps.weight")], 2)
                        t = t.reshape(t.shape[0], -1, t.shape[-1]).transpose(1, 2)
                    elif part == "gate_up_proj_bias":
                        t = torch.stack([g("gate_exps.bias"), g("up_exps.bias")], 2).flatten(1)
                    elif part == "down_proj":
                        t = g("down_exps.weight").transpose(1, 2)
                    else:
                        t = g("down_exps.bias")
                elif part == "gate_up_proj":
                    t = torch.cat([g("gate_exps.weight"), g("up_exps.weight")], 1)
                else:
                    t = g("down_exps.weight")
            elif (t := hf_value(family, c, key, tensors, lambda k: _gguf_name(names, k))) is None:
                t = tensors[_gguf_name(names, key)]
                if arch == "llama" and key.endswith(("q_proj.weight", "k_proj.weight")):
                    heads = c.num_attention_heads if "q_proj" in key else c.num_key_value_heads
                    d = t.shape[0] // heads
                    t = t.reshape(heads, d // 2, 2, -1).swapaxes(1, 2).reshape(t.shape)
            p.copy_(t.reshape(p.shape).to(p.dtype))


def int_dot_reference(hf: Any, llm: Any) -> list[str]:
    """Makes every projection of ``hf`` that ``llm`` keeps in GGUF blocks compute the way the
    native integer-dot kernels do (``gguf_blocks.qdot_reference``: the input quantized to int8
    per 32 values, exact block dot products), on the same raw rows; returns their names. With
    ``dequantized_reference`` before it, transformers is then the oracle for the whole file,
    activation quantization included, so a router that flips on the int8 inputs flips in both."""
    from freetokend.formats.gguf_blocks import qdot_reference

    done = []
    absorbed = []
    for name, mod in llm.model.named_modules():
        if getattr(mod, "kv_b_blocks", None) is not None:  # after its projections' own
            absorbed.append((name, mod))
        qw = getattr(mod, "qweight", None)
        if qw is None:
            continue
        fused = _fused_target(hf, name)
        if fused is not None:
            if name.rpartition(".")[2] == _FUSED[fused.rpartition(".")[2]][0]:
                done += _fused_reference(hf, llm, fused)
            continue
        target = _hf_module(hf, name)
        if getattr(mod, "block_param", "weight") != "weight":  # a hyper-connection's fn
            _mixes_reference(target, qw)
            done.append(name)
            continue
        if hasattr(mod, "groups"):  # DeepSeek-V4's grouped o_a_proj: each group's rows
            target.forward = _grouped_reference(qw, mod.groups)
            done.append(name)
            continue

        def forward(x: torch.Tensor, qw: Any = qw, bias: Any = target.bias) -> torch.Tensor:
            y = qdot_reference(
                qw.gguf_raw(), qw.fmt, qw.permuted_input(x.reshape(-1, qw.cols).float())
            )
            y = y if bias is None else y + bias.float()
            return y.reshape(*x.shape[:-1], qw.rows).to(x.dtype)

        target.forward = forward
        done.append(name)
    for name, mod in absorbed:
        _absorbed_mla_reference(_hf_module(hf, name), mod)
    return done


def _absorbed_mla_reference(target: Any, ours: Any) -> None:
    """transformers' MLA attention ``target`` run absorbed with kv_b's GGUF parts in their
    blocks (checked equal to its kv_b_proj, dequantized), as ``ours`` (layers/mla.py) and
    llama.cpp compute it: its own forward with the
    query's non-rotated part folded into the latent space per head (``qdot_reference`` on
    attn_k_b's rows), keys and values the latents themselves, and each head's attention output
    taken through attn_v_b's rows before o_proj."""
    from freetokend.formats.gguf_blocks import qdot_reference

    assert hasattr(target, "expand_kv"), type(target).__name__
    k_b, v_b = ours.kv_b_blocks
    h, dn, dr, kvr, dv = ours.heads, ours.dn, ours.dr, ours.kvr, ours.dv
    # the per-head rows, dequantized, are kv_b_proj as ``dequantized_reference`` loaded it
    k = torch.stack([w.dequantize() for w in k_b]).transpose(1, 2)  # [h, dn, kvr]
    v = torch.stack([w.dequantize() for w in v_b])  # [h, dv, kvr]
    joined = torch.cat([k, v], 1).reshape(-1, kvr)
    assert torch.allclose(joined, target.kv_b_proj.weight.float(), rtol=1e-6, atol=1e-7)
    q_mod = target.q_b_proj if target.q_lora_rank else target.q_proj
    q_inner, o_inner, plain = q_mod.forward, target.o_proj.forward, target.forward

    def per_head(x: torch.Tensor, ws: list, width: int) -> torch.Tensor:
        flat = x.reshape(-1, h, width).float()
        ys = [
            qdot_reference(ws[i].gguf_raw(), ws[i].fmt, flat[:, i].contiguous()) for i in range(h)
        ]
        return torch.stack(ys, 1)

    def q_forward(x: torch.Tensor) -> torch.Tensor:
        q = q_inner(x)
        heads = q.reshape(-1, h, dn + dr)
        lat = per_head(heads[..., :dn], k_b, dn)
        out = torch.cat([lat, heads[..., dn:].float()], -1)
        return out.reshape(*q.shape[:-1], h * (kvr + dr)).to(q.dtype)

    def expand_kv(kv_nope: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, _, n, _ = kv_nope.shape
        keys = torch.cat([kv_nope, k_rot], -1).expand(b, h, n, kvr + dr)
        return keys, kv_nope.expand(b, h, n, kvr)

    def o_forward(x: torch.Tensor) -> torch.Tensor:
        v = per_head(x, v_b, kvr).reshape(*x.shape[:-1], h * dv)
        return o_inner(v.to(x.dtype))

    def forward(*args: Any, **kw: Any) -> Any:
        widths = target.qk_head_dim, target.qk_nope_head_dim
        target.qk_head_dim, target.qk_nope_head_dim = kvr + dr, kvr
        try:
            return plain(*args, **kw)
        finally:
            target.qk_head_dim, target.qk_nope_head_dim = widths

    q_mod.forward, target.o_proj.forward = q_forward, o_forward
    target.expand_kv, target.forward = expand_kv, forward


def _mixes_reference(target: Any, qw: Any) -> None:
    """transformers' hyper-connection (or head) ``target`` with its mixing projection computed
    the integer-dot way on ``qw``'s rows: its forward runs with ``F.linear`` on a weight of
    ``qw``'s shape (the mixing weight: the module's only one) taken by ``qdot_reference``."""
    from freetokend.formats.gguf_blocks import qdot_reference

    plain = target.forward

    def forward(*args: Any, **kw: Any) -> Any:
        linear = F.linear

        def mixed(x: torch.Tensor, w: torch.Tensor, b: Any = None) -> torch.Tensor:
            if tuple(w.shape) != (qw.rows, qw.cols) or b is not None:
                return linear(x, w, b)
            y = qdot_reference(qw.gguf_raw(), qw.fmt, x.reshape(-1, qw.cols).float())
            return y.reshape(*x.shape[:-1], qw.rows)

        F.linear = mixed
        try:
            return plain(*args, **kw)
        finally:
            F.linear = linear

    target.forward = forward


def _grouped_reference(qw: Any, groups: int) -> Any:
    """A grouped projection's forward (x [..., G, d_in] -> [..., G, d_out]) computed the
    integer-dot way, group g on rows [g * d_out, (g + 1) * d_out) of ``qw``."""
    from freetokend.formats.gguf_blocks import qdot_reference

    raw, n = qw.gguf_raw(), qw.rows // groups

    def forward(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, groups, qw.cols).float()
        ys = [
            qdot_reference(raw[g * n : (g + 1) * n], qw.fmt, flat[:, g].contiguous())
            for g in range(groups)
        ]
        return torch.stack(ys, 1).reshape(*x.shape[:-1], n).to(x.dtype)

    return forward


# Qwen3-Next's linear attention: our in_proj_qkv and in_proj_z are transformers' one
# in_proj_qkvz, our in_proj_b and in_proj_a its in_proj_ba, whose rows are grouped per key head
# ([q, k, v, z] and [b, a] each; families/qwen3_next.py splits them)
_FUSED = {
    "in_proj_qkvz": ("in_proj_qkv", "in_proj_z"),
    "in_proj_ba": ("in_proj_b", "in_proj_a"),
}
_PART_OF = {part: fused for fused, parts in _FUSED.items() for part in parts}


def _fused_target(hf: Any, name: str) -> str | None:
    """transformers' fused projection that our ``name`` is part of (Qwen3-Next; Qwen3.5 has
    the parts apart), or None."""
    prefix, _, last = name.rpartition(".")
    if last not in _PART_OF:
        return None
    try:
        _hf_module(hf, name)
    except KeyError:
        return f"{prefix}.{_PART_OF[last]}"
    return None


def _fused_reference(hf: Any, llm: Any, fused: str) -> list[str]:
    """transformers' fused projection computed from our kept parts as the kernels do, their
    outputs regrouped per key head; -> the parts' names."""
    from freetokend.formats.gguf_blocks import qdot_reference

    prefix, _, last = fused.rpartition(".")
    names = [f"{prefix}.{p}" for p in _FUSED[last]]
    qws = [llm.model.get_submodule(n).qweight for n in names]
    if any(q is None for q in qws):
        raise AssertionError(f"{fused}: its parts {names} are kept in blocks together")
    cfg = llm.config
    kh, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    # the per-key-head pieces of each part's output, in the fused order
    pieces = [[kh * dk, kh * dk, -1], [-1]] if last == "in_proj_qkvz" else [[-1], [-1]]

    def forward(x: torch.Tensor) -> torch.Tensor:
        xf = x.reshape(-1, qws[0].cols).float()
        n, groups = xf.shape[0], []
        for qw, sizes in zip(qws, pieces, strict=True):
            y = qdot_reference(qw.gguf_raw(), qw.fmt, qw.permuted_input(xf))
            sizes = [s if s > 0 else y.shape[1] - sum(t for t in sizes if t > 0) for s in sizes]
            groups += [t.reshape(n, kh, -1) for t in y.split(sizes, -1)]
        return torch.cat(groups, -1).reshape(*x.shape[:-1], -1).to(x.dtype)

    _hf_module(hf, fused).forward = forward
    return names


def _hf_weight(hf: Any, llm: Any, name: str) -> torch.Tensor:
    """transformers' weight for our projection ``name`` (Qwen3-Next's fused ones split as we
    load them)."""
    fused = _fused_target(hf, name)
    if fused is None:
        return _hf_module(hf, name).weight.detach().float()
    from freetokend.models.families import qwen3_next

    split = qwen3_next._split_qkvz if fused.endswith("qkvz") else qwen3_next._split_ba
    w = _hf_module(hf, fused).weight.detach().float()
    last = fused.rpartition(".")[2]
    parts = dict(split(llm.config, f"{last}.weight", w))
    return parts[name.rpartition(".")[2] + ".weight"]


def prompt(n: int, seed: int) -> list[int]:
    """n random token ids of the tiny models' vocabulary, seeded."""
    return torch.randint(2, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_logits(hf: Any, ids: list[int]) -> torch.Tensor:
    """transformers' teacher-forced logits [len(ids), vocab] fp32."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def kmix_logit_errors(
    family: str, hf: Any, folder: Path, want_types: set[str], expert_types: Any = None
) -> tuple[Any, torch.Tensor]:
    """A Q4_K_M-like file of ``hf`` (``quantize``'s kmix) in ``folder``, holding at least the
    GGUF types ``want_types``, loaded in fp32; transformers gets the file's dequantized weights
    and computes the projections we keep in blocks as our kernels do, the K-quant ones among
    them, whose rows must be the file's. -> (the LLM, max |logit diff| per position of a
    24-token prompt)."""
    import gguf

    from freetokend import LLM

    path = write_gguf(family, hf, folder / "m-Q4_K_M.gguf", "kmix", expert_types=expert_types)
    types = {t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert want_types <= types, types
    llm = LLM(path, max_model_len=256, kv_tokens=2048, dtype="float32")
    dequantized_reference(family, hf, path)
    kept = int_dot_reference(hf, llm)
    fmts = {llm.model.get_submodule(n).qweight.fmt for n in kept}
    assert {"q4_k", "q6_k"} <= fmts, fmts  # the K-quant projections stay in their blocks
    assert_kept_rows_are_the_files(hf, llm, kept, family)
    ids = prompt(24, seed=2)
    return llm, (llm.logits(ids) - hf_logits(hf, ids)).abs().amax(-1)


def assert_kept_rows_are_the_files(hf: Any, llm: Any, kept: list[str], label: str = "") -> None:
    """``int_dot_reference`` computes with our raw rows, so it cannot see them misplaced: each
    kept projection's rows, dequantized, must equal the weights ``dequantized_reference`` put
    into ``hf`` from the file (llama's Q/K permutation undone row by row)."""
    for name in kept:
        qw = llm.model.get_submodule(name).qweight
        want = _hf_weight(hf, llm, name)
        got = qw.dequantize()  # in our input order (QuantWeight.in_perm)
        assert got.shape == want.shape, name
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-7), f"{label} {name} ({qw.fmt})"


# DeepSeek-V4: our module paths -> transformers' (its indexer sits in the compressor)
_V4_MODULES = (
    (".self_attn.indexer.compressor.", ".self_attn.compressor.indexer."),
    (".self_attn.indexer.weights_proj", ".self_attn.compressor.indexer.scorer.weights_proj"),
    (".self_attn.indexer.", ".self_attn.compressor.indexer."),
    (".mlp.router", ".mlp.gate"),
)


def _hf_module(hf: Any, ours: str) -> Any:
    """The transformers module of one of our projection names (the model's prefix varies)."""
    names = [ours, ours.replace(".shared_expert.", ".shared_experts.")]  # DeepSeek's plural
    for a, b in _V4_MODULES:
        if a in names[-1]:
            names.append(names[-1].replace(a, b, 1))
    for prefix in ("model.", "", "model.language_model."):
        for name in names:
            try:
                return hf.get_submodule(prefix + name)
            except AttributeError:
                continue
    raise KeyError(f"no module for {ours!r} in {type(hf).__name__}")


def against_transformers_gguf_loader(
    family: str, folder: Path, kind: str, tokenizer: Path, **over: Any
) -> float:
    """Max |logit diff| between ``LLM`` and transformers' own GGUF loader
    (``from_pretrained(gguf_file=...)``: its metadata map, name map, dequantizers and undoing
    of the converter's transforms) on one file of ``kind``, written from a tiny checkpoint of
    ``family`` (``over``: its config overrides) with ``tokenizer``'s vocabulary, which
    transformers requires. transformers must build the same model class with every parameter
    taken from the file (nothing left at its random init); the projections we keep in blocks
    compute in it as our kernels do (``int_dot_reference``)."""
    import transformers as tf
    from tiny_models import make_tiny

    from freetokend import LLM
    from freetokend.engine.tokenizer import Tokenizer

    vocab = Tokenizer.from_dir(tokenizer).vocab_size
    hf = make_tiny(family, folder / "hf", seed=3, vocab_size=vocab, **over)[1]
    path = write_gguf(family, hf, folder / "m.gguf", kind, tokenizer=tokenizer)
    ref, info = tf.AutoModelForCausalLM.from_pretrained(
        str(folder), gguf_file=path.name, dtype=torch.float32, output_loading_info=True
    )
    assert ref.config.model_type == hf.config.model_type, type(ref).__name__
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    llm = LLM(path, max_model_len=64, kv_tokens=256, dtype="float32")
    int_dot_reference(ref, llm)
    ids = torch.randint(2, vocab, (32,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        want = ref.eval()(torch.tensor([ids])).logits[0].float()
    return float((llm.logits(ids) - want).abs().max())


def write_skeleton_gguf(family: str, config: Any, path: Path, expert_type: Q = Q.Q4_K) -> Path:
    """A GGUF file of ``config``'s geometry whose tensor data is a hole: the header as
    ``write_gguf`` writes it (experts in ``expert_type``, routers and vectors F32, every other
    matrix Q8_0), then the file extended to its full size without writing the blocks (a sparse
    file: a real model's size, no disk). For what reads only a header and a size (ftctl plan)."""
    import transformers

    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(config)
    w = gguf.GGUFWriter(path, ARCH[family])
    _metadata(w, family, config)
    align = 32  # GGUF's default alignment, as the writer pads
    data = 0
    for name, t in gguf_tensors(family, hf).items():
        if name.endswith("_exps.weight"):
            qt = expert_type
        elif t.dim() == 1 or name.endswith("ffn_gate_inp.weight"):
            qt = Q.F32
        else:
            qt = Q.Q8_0
        block, size = gguf.GGML_QUANT_SIZES[qt]
        nbytes = t.numel() // block * size
        w.add_tensor_info(name, list(t.shape), np.dtype(np.float32), nbytes, raw_dtype=qt)
        data += -(-nbytes // align) * align
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    start = -(-path.stat().st_size // align) * align
    os.truncate(path, start + data)
    return path


def kmix_qwen3_moe(d: Path, tokenizer_dir: Path, seed: int, kind: str = "kmix") -> Path:
    """A tiny Qwen3-MoE GGUF file in ``d``: hidden 256, every layer MoE, Q4_K gate/up and Q6_K
    down experts, the tokenizer (and vocabulary) of ``tokenizer_dir``'s model; ``kind`` "bf16":
    every matrix BF16 instead (the converter's output before quantizing)."""
    from tiny_models import make_tiny

    from freetokend.engine.tokenizer import Tokenizer

    vocab = Tokenizer.from_dir(tokenizer_dir).vocab_size
    over = dict(hidden_size=256, moe_intermediate_size=256, mlp_only_layers=[], vocab_size=vocab)
    hf = make_tiny("qwen3_moe", d / "hf", seed=seed, **over)[1]
    return write_gguf(
        "qwen3_moe", hf, d / "m.gguf", kind, tokenizer=tokenizer_dir,
        expert_types=(Q.Q4_K, Q.Q6_K) if kind == "kmix" else None,
    )  # fmt: skip
