"""`ftctl plan` on the seed articles' headline setups (issue 42 item 7, issue 43 item 5).

- DeepSeek-V4-Flash on the desktop: a 32 GiB card with 256 GiB of RAM, and on 24 GiB with
  128 GiB;
- GLM-5.2 (NVFP4 experts) on the workstation: a 96 GiB card with 512 GiB of RAM, and on
  48 GiB with 256 GiB.

Each plan's verdict, and its numbers against hand-computed sizes written here. What the plans
find:

- The packed pools fit those hosts' RAM only under the ``cpu`` backend, which computes mxfp4 and
  nvfp4 experts packed. The device backends (offload, hybrid) compute from a bf16 copy of the
  pool that they keep on the host beside it (``accelerator_banks``), 3.8x (mxfp4) and 3.6x
  (nvfp4) its size: 516 GiB for V4-Flash, 1.3 TiB for GLM-5.2. So with the card in use neither
  model fits its "fits" host, although the card side fits (dense weights, KV at 128k, slots).
  The ``cpu`` backend is what fits: every part on the host, the card idle.
- On the smaller hosts the packed pool alone exceeds the RAM: only the disk tier could hold it,
  and the disk tier takes GGUF experts in a block format only (these are safetensors mxfp4 /
  nvfp4). GLM-5.2's dense weights (35 GiB) fit a 48 GiB card, but not with 128k of context
  beside them.

Geometries (no weights: the plan reads config.json only).

DeepSeek-V4-Flash, as the release's config.json spells it (legacy keys: compress_ratios,
num_hash_layers, qk_rope_head_dim, rope_scaling; quantization_config fp8 with expert_dtype fp4):
hidden 4096, moe_intermediate 2048, 256 routed experts top-6 and one shared, 64 heads of 512,
one KV head, q LoRA 1024, o LoRA 1024 in 8 groups, index 64 heads x 128 top-512, vocab 129280,
sliding window 128, hyper-connections x4, 3 hash layers, YaRN x16 over 65536: a 5-layer cut of
the release's config.json (inference-optimization/DeepSeek-V4-Flash-bf16-dequantized-5layers)
and transformers 5.25's DeepseekV4Config defaults agree on all of these. 43 layers: NeMo
AutoModel's model page and transformers' defaults. The compress ratios per layer (0, 0, then 4
on even and 128 on odd layers, and the MTP layer's 0) follow the model card as antirez/ds4's
MODEL_CARD.md summarises it; routed_scaling_factor 1.5 and swiglu_limit 10 are transformers'
defaults (not checked against the release file). Totals: the experts 277.0B parameters and the
dense part 7.3B (below): 284.4B, the model card's 284B; the mxfp4 pool 147.2 GB (the brief's
~140 GB).

GLM-5.2: GLM-5's geometry (GLM-5 technical report as glennklockwood.com tabulates it, and
transformers' GlmMoeDsaConfig defaults): hidden 6144, 78 layers of which the first 3 dense
(intermediate 12288), moe_intermediate 2048, 256 routed experts top-8 and one shared, 64 heads,
q LoRA 2048, kv LoRA 512, qk nope 192 + rope 64, v 256, index 32 heads x 128 top-2048, vocab
154880. GLM-5.2 keeps it (the write-ups of GLM-5.2 give the same 256 experts, 78 / 3 dense
blocks, 6144 wide), adding IndexShare and a 1M context. Derived, not read from the release:
``indexer_types`` (IndexShare: "groups of 4 adjacent sparse attention layers share a single
indexer": an indexer every 4th layer, layer 0 first), max_position_embeddings 1048576 (the 1M
context) and rope_theta (no effect on sizes). Totals: experts 724.8B + dense 18.7B = 743.5B,
and the MTP layer (not loaded, not planned) adds ~9.7B: 753B, the brief's figure. The NVFP4
checkpoint's quantization_config is ModelOpt's (quant_method "modelopt", quant_algo "NVFP4",
group size 16; routed experts only, the rest bf16, as modal-labs/glm-5.2-nvfp4-experts-only
describes): the loader reads it as the ``nvfp4`` expert format of experts/formats.py (e2m1
packed two per byte, an e4m3 scale per 16 inputs, fp32 global scales: gate, up and down), and so
does the plan (the tests below also pass ``--expert-format nvfp4``, which gives the same). The pool: 407.7 GB, with the bf16 dense part
445 GB (the brief's 433 GB checkpoint: within 3 %).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ftctl.main import main

MIB, GIB = 1 << 20, 1 << 30
CONTEXT_MIB = 512  # the fake card's CUDA context (placement: the KV share is of what is left)

# ---- DeepSeek-V4-Flash -------------------------------------------------------------------------

V4_LAYERS, V4_H, V4_I, V4_E, V4_VOCAB = 43, 4096, 2048, 256, 129280
V4_RATIOS = [0, 0] + [4 if i % 2 == 0 else 128 for i in range(2, V4_LAYERS)] + [0]  # + MTP
V4_CSA, V4_HCA = V4_RATIOS[:V4_LAYERS].count(4), V4_RATIOS[:V4_LAYERS].count(128)  # 21, 20

V4_FLASH = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": V4_VOCAB,
    "hidden_size": V4_H,
    "moe_intermediate_size": V4_I,
    "num_hidden_layers": V4_LAYERS,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1024,
    "o_lora_rank": 1024,
    "o_groups": 8,
    "n_routed_experts": V4_E,
    "n_shared_experts": 1,
    "num_experts_per_tok": 6,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "hidden_act": "silu",
    "swiglu_limit": 10.0,
    "max_position_embeddings": 1048576,
    "rope_theta": 10000,
    "compress_rope_theta": 160000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16,
        "beta_fast": 32,
        "beta_slow": 1,
        "original_max_position_embeddings": 65536,
    },
    "compress_ratios": V4_RATIOS,
    "sliding_window": 128,
    "num_hash_layers": 3,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "num_nextn_predict_layers": 1,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "quantization_config": {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
    },
    "expert_dtype": "fp4",
}

V4_EXPERTS = V4_LAYERS * V4_E  # 11008 routed experts (no dense layer)
V4_EXPERT_WEIGHTS = 3 * V4_H * V4_I  # gate, up, down
# mxfp4: half a byte per weight and an e8m0 scale byte per 32: 147.2 GB = 137.1 GiB
V4_POOL = V4_EXPERTS * (V4_EXPERT_WEIGHTS // 2 + V4_EXPERT_WEIGHTS // 32)
V4_POOL_BF16 = V4_EXPERTS * V4_EXPERT_WEIGHTS * 2  # the device backends' copy: 516 GiB
# the dense part in bf16 (FP8 in the checkpoint, widened at load): embeddings and head; per layer
# q_a, q_b (64 x 512 heads), kv, o_a (8 groups of 4096 -> 1024), o_b, router, the shared
# expert; CSA layers' compressor (overlap: 2 x 1024 wide, kv and gate) and indexer (its
# compressor 2 x 256, q_b to 64 x 128, weights 64); HCA layers' compressor (kv and gate of 512);
# and fp32: the hyper-connection mixers (24 x 4 x 4096, attention and MLP). Left out, < 0.1 %:
# norms, sinks, score biases, compressor position biases.
V4_DENSE = 2 * (
    2 * V4_VOCAB * V4_H
    + V4_LAYERS * (
        1024 * V4_H + 1024 * 64 * 512 + 512 * V4_H + 8 * 4096 * 1024 + 8 * 1024 * V4_H
        + V4_E * V4_H + 3 * V4_I * V4_H
    )
    + V4_CSA * (2 * 1024 * V4_H + 2 * 256 * V4_H + 1024 * 64 * 128 + 64 * V4_H)
    + V4_HCA * (2 * 512 * V4_H)
) + 4 * V4_LAYERS * 2 * 24 * 4 * V4_H  # fmt: skip
# its state per token: compressed entries (fp32) of head dim 512, one per rate tokens, and a CSA
# layer's indexer entries of 128, in the KV pages' regions (16-token pages: 4 CSA rows a page; an
# HCA entry per 128 tokens takes a row of one page in 8, the page's one row): 16000 bytes (no
# paged K / V: V4's attention keeps its window's keys per sequence)
V4_STATE_PER_TOKEN = V4_CSA * (4 * 512 // 4 + 4 * 128 // 4) + V4_HCA * (4 * 512 // 16)
# per sequence whatever its length: each layer's window of 127 keys (fp32, 512), each
# compressor's open rows (rate - 1, twice the width: kv and gate) and CSA's overlap (2 x rate
# rows of the entry width): 21.6 MiB; the plan holds 32 sequences (the engine's max batch)
V4_STATE_PER_SEQ = (
    V4_LAYERS * 4 * 127 * 512
    + V4_CSA * 4 * (2 * 3 * 1024 + 2 * 4 * 512)  # the CSA compressor: overlap, width 2 x 512
    + V4_CSA * 4 * (2 * 3 * 256 + 2 * 4 * 128)  # its indexer's compressor (128)
    + V4_HCA * 4 * (2 * 127 * 512)
)  # fmt: skip
DECODE_ROWS = 32
CTX_128K = 131072


def _write(tmp: Path, name: str, cfg: dict) -> Path:
    d = tmp / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d  # no weights: the plan needs none


def _plan(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict, str]:
    rc = main(["plan", *argv, "--json"])
    out = capsys.readouterr()
    return rc, json.loads(out.out), out.err


def _mib(plan: dict, part: str) -> float:
    return float(plan["parts_mib"][part])


def _slots(plan: dict, top_k: int, hidden: int, inter: int, experts: int, reserved: int) -> int:
    """The slot count by hand (experts/backend.py's sizing): 0.9 of the card's memory after
    the CUDA context and the dense weights, less ``reserved`` (the KV pool, and what the model
    keeps per sequence, its snapshots' budget and decode attention's buffers), a 512-token
    prompt chunk's MoE activations (fp32: the routes' outputs, the input, one expert's weights,
    its work rows) and the slot cache's state (8 bytes an expert), over the bf16 slot and its
    21 bytes of maps."""
    free = (plan["vram_mib"] - CONTEXT_MIB - _mib(plan, "dense_weights")) * MIB
    t = 512
    act = 4 * (t * top_k * hidden + t * hidden + 3 * inter * hidden + t * (3 * inter + hidden))
    room = int(free * 0.9) - reserved - act - 8 * experts
    return room // (3 * hidden * inter * 2 + 21)


def test_v4_flash_fits_32gib_and_256gib_on_the_cpu_backend(tmp_path, capsys) -> None:
    d = _write(tmp_path, "DeepSeek-V4-Flash", V4_FLASH)
    rc, plan, err = _plan(
        capsys, "--model", str(d), "--vram", "32GiB", "--ram", "256GiB", "--backend", "cpu"
    )
    assert rc == 0 and plan["fits"], err
    assert plan["expert_format"] == "mxfp4"
    assert plan["parts_mib"]["expert_pool"] == V4_POOL / MIB  # 140352 MiB, exact
    assert "expert_pool_bf16" not in plan["parts_mib"]  # computed packed
    assert _mib(plan, "dense_weights") == pytest.approx(V4_DENSE / MIB, rel=1e-3)  # 13.7 GiB
    # 128k of context on the host: 13760 bytes a token (1720 MiB), the windows of 32 sequences
    assert plan["kv_tokens"] == CTX_128K
    assert _mib(plan, "kv_cache") == CTX_128K * V4_STATE_PER_TOKEN / MIB
    assert _mib(plan, "model_state") == DECODE_ROWS * V4_STATE_PER_SEQ / MIB  # 691.6 MiB
    # everything on the host: 153.3 GiB of 256 (pool, dense, KV and state, 256 MiB snapshots)
    assert set(plan["placement"].values()) == {"cpu"} and plan["slots"] == 0
    want = V4_POOL + V4_DENSE + CTX_128K * V4_STATE_PER_TOKEN + DECODE_ROWS * V4_STATE_PER_SEQ
    assert plan["ram_peak_mib"] == pytest.approx(want / MIB + 256, rel=1e-3)
    assert plan["vram_peak_mib"] <= CONTEXT_MIB  # the card idle
    print(f"\nV4-Flash, 32 GiB / 256 GiB, cpu: {json.dumps(plan)}")


# reserved on the card beside the slots: 128k tokens of state entries, 32 sequences' windows and
# the snapshots' budget (256 MiB); V4 has no paged decode attention. Within a slot: the dense
# part's buffers (the hash layers' token tables, 18.6 MB) are not in dense_weights.
V4_RESERVED = CTX_128K * V4_STATE_PER_TOKEN + DECODE_ROWS * V4_STATE_PER_SEQ + 256 * MIB
V4_SLOT = 3 * V4_H * V4_I * 2  # bf16 gate, up, down: 48 MiB


def _v4_card(plan: dict, card_mib: int, slots: int) -> None:
    """The card side of an offload plan: dense weights, 128k of context (V4's state on the
    card), ``slots`` slots; the peak at least the context, dense weights and slots (V4's state
    entries and windows grow with the sequences: a plan reserves them, allocates nothing)."""
    for part in ("embeddings", "attention", "router", "shared_experts", "lm_head", "kv_cache"):
        assert plan["placement"][part] == "cuda", part
    assert plan["placement"]["model_state"] == "cuda"
    assert _mib(plan, "dense_weights") == pytest.approx(V4_DENSE / MIB, rel=1e-3)
    assert plan["kv_tokens"] == CTX_128K  # a quarter of what is left holds far more: capped
    assert plan["slot_mib"] == V4_SLOT / MIB
    assert abs(plan["slots"] - _slots(plan, 6, V4_H, V4_I, V4_EXPERTS, V4_RESERVED)) <= 1
    assert plan["slots"] == slots
    low = CONTEXT_MIB + _mib(plan, "dense_weights") + slots * V4_SLOT / MIB
    assert low <= plan["vram_peak_mib"] <= card_mib


def test_v4_flash_with_the_32gib_card_needs_the_pool_twice_on_the_host(tmp_path, capsys) -> None:
    """The card side fits (dense weights, 128k of context, 276 slots); the host
    does not: offload keeps the packed pool and its bf16 copy, 653 GiB."""
    d = _write(tmp_path, "DeepSeek-V4-Flash", V4_FLASH)
    rc, plan, err = _plan(capsys, "--model", str(d), "--vram", "32GiB", "--ram", "256GiB")
    assert rc == 1 and not plan["fits"] and plan["backend"] == "offload"
    assert plan["parts_mib"]["expert_pool"] == V4_POOL / MIB
    assert plan["parts_mib"]["expert_pool_bf16"] == V4_POOL_BF16 / MIB  # 528384 MiB
    # the peak: both, and the transient of making the copy (an expert's fp32 work, < 3 experts)
    both = (V4_POOL + V4_POOL_BF16) / MIB
    assert both <= plan["ram_peak_mib"] <= both + 3 * 4 * V4_EXPERT_WEIGHTS / MIB
    assert plan["reason"].startswith(
        f"host RAM: {plan['ram_peak_mib']:.0f} MiB needed (expert pool 140352 MiB as mxfp4, "
        "its bf16 copy for the device slots 528384 MiB), 262144 MiB available"
    )
    assert "the cpu backend computes mxfp4 experts packed" in plan["reason"]
    assert "does not fit: host RAM" in err
    _v4_card(plan, 32 * 1024, 276)
    print(f"\nV4-Flash, 32 GiB / 256 GiB, offload: {json.dumps(plan)}")


@pytest.mark.parametrize("backend", ["auto", "cpu"])
def test_v4_flash_does_not_fit_24gib_and_128gib(tmp_path, capsys, backend) -> None:
    """128 GiB of RAM is below the packed pool alone (137 GiB): no backend fits; only the disk
    tier could hold the pool, and it takes GGUF block experts only."""
    d = _write(tmp_path, "DeepSeek-V4-Flash", V4_FLASH)
    rc, plan, err = _plan(
        capsys, "--model", str(d), "--vram", "24GiB", "--ram", "128GiB", "--backend", backend
    )
    assert rc == 1 and not plan["fits"]
    assert V4_POOL > 128 * GIB
    assert "expert pool 140352 MiB as mxfp4" in plan["reason"]
    assert "131072 MiB available" in plan["reason"]
    assert "the mxfp4 expert pool alone exceeds it" in plan["reason"]
    assert "disk tier takes GGUF experts in a block format" in plan["reason"]
    if backend == "cpu":  # and the rest on the host: 153.6 GiB
        assert "dense weights 14005 MiB, KV pool of 131072 tokens 2692 MiB" in plan["reason"]
    else:  # the card part fits 24 GiB (123 slots): only the host fails
        assert "its bf16 copy for the device slots 528384 MiB" in plan["reason"]
        _v4_card(plan, 24 * 1024, 123)
    print(f"\nV4-Flash, 24 GiB / 128 GiB, {backend}: {plan['reason']}")


# ---- GLM-5.2 -----------------------------------------------------------------------------------

GLM_LAYERS, GLM_DENSE_LAYERS, GLM_H, GLM_I, GLM_E, GLM_VOCAB = 78, 3, 6144, 2048, 256, 154880
GLM_INDEXERS = list(range(0, GLM_LAYERS, 4))  # IndexShare: 20 layers with their own indexer

GLM_5_2_NVFP4 = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "vocab_size": GLM_VOCAB,
    "hidden_size": GLM_H,
    "intermediate_size": 12288,
    "moe_intermediate_size": GLM_I,
    "num_hidden_layers": GLM_LAYERS,
    "first_k_dense_replace": GLM_DENSE_LAYERS,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "n_routed_experts": GLM_E,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "routed_scaling_factor": 2.5,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "q_lora_rank": 2048,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "v_head_dim": 256,
    "index_n_heads": 32,
    "index_head_dim": 128,
    "index_topk": 2048,
    "indexer_types": ["full" if i in GLM_INDEXERS else "shared" for i in range(GLM_LAYERS)],
    "hidden_act": "silu",
    "max_position_embeddings": 1048576,
    "rope_theta": 1000000,
    "rms_norm_eps": 1e-5,
    "num_nextn_predict_layers": 1,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
    "attention_bias": False,
    "quantization_config": {  # ModelOpt's export (abbreviated): routed experts only
        "quant_method": "modelopt",
        "quant_algo": "NVFP4",
        "group_size": 16,
        "kv_cache_quant_algo": None,
        "producer": {"name": "modelopt"},
        "ignore": ["lm_head", "model.layers.*.self_attn*", "model.layers.*.mlp.shared_experts*"],
    },
}

GLM_EXPERTS = (GLM_LAYERS - GLM_DENSE_LAYERS) * GLM_E  # 19200
GLM_EXPERT_WEIGHTS = 3 * GLM_H * GLM_I
# nvfp4: half a byte per weight, an e4m3 scale byte per 16, three fp32 global scales: 407.7 GB
GLM_POOL = GLM_EXPERTS * (GLM_EXPERT_WEIGHTS // 2 + GLM_EXPERT_WEIGHTS // 16 + 3 * 4)
GLM_POOL_BF16 = GLM_EXPERTS * GLM_EXPERT_WEIGHTS * 2  # 1.3 TiB
# bf16: embeddings and lm_head; per layer MLA (q_a 2048, q_b to 64 x (192 + 64), kv_a to
# 512 + 64, kv_b 512 to 64 x (192 + 256), o from 64 x 256); the 3 dense MLPs (12288); the 75
# shared experts; the 20 indexers (wq_b 2048 to 32 x 128, wk 128); fp32: the 75 routers and the
# indexers' weights_proj (32). Left out, < 0.01 %: norms, score biases.
GLM_DENSE = 2 * (
    2 * GLM_VOCAB * GLM_H
    + GLM_LAYERS * (
        2048 * GLM_H + 2048 * 64 * 256 + 576 * GLM_H + 512 * 64 * 448 + 64 * 256 * GLM_H
    )
    + GLM_DENSE_LAYERS * 3 * 12288 * GLM_H
    + (GLM_LAYERS - GLM_DENSE_LAYERS) * 3 * GLM_I * GLM_H
    + len(GLM_INDEXERS) * (2048 * 32 * 128 + 128 * GLM_H)
) + 4 * (
    (GLM_LAYERS - GLM_DENSE_LAYERS) * GLM_E * GLM_H + len(GLM_INDEXERS) * 32 * GLM_H
)  # fmt: skip
# the paged pool per token: the latent (512 + rope 64) per layer and the index key (128) in the
# 20 layers with an indexer, bf16, in K and in V alike (KVPool allocates V for MLA too, unused):
# 185.5 KiB
GLM_KV_PER_TOKEN = 2 * 2 * (GLM_LAYERS * 576 + len(GLM_INDEXERS) * 128)


@pytest.fixture()
def glm_dir(tmp_path: Path) -> Path:
    return _write(tmp_path, "GLM-5.2-NVFP4", GLM_5_2_NVFP4)


def test_glm_5_2_nvfp4_format_comes_from_config_json(glm_dir, capsys) -> None:
    """ModelOpt's NVFP4 quantization_config is read (models/release_quant.py): the plan holds the
    experts as nvfp4 without ``--expert-format``, the same pool as with it."""
    rc, plan, err = _plan(
        capsys, "--model", str(glm_dir), "--vram", "96GiB", "--ram", "512GiB", "--backend", "cpu"
    )
    assert rc == 0 and plan["fits"], err
    assert plan["expert_format"] == "nvfp4"
    assert plan["parts_mib"]["expert_pool"] == GLM_POOL / MIB


def test_glm_5_2_fits_96gib_and_512gib_on_the_cpu_backend(glm_dir, capsys) -> None:
    rc, plan, err = _plan(
        capsys, "--model", str(glm_dir), "--vram", "96GiB", "--ram", "512GiB",
        "--backend", "cpu", "--expert-format", "nvfp4",
    )  # fmt: skip
    assert rc == 0 and plan["fits"], err
    assert plan["expert_format"] == "nvfp4"
    assert plan["parts_mib"]["expert_pool"] == GLM_POOL / MIB  # 379.7 GiB, exact
    assert _mib(plan, "dense_weights") == pytest.approx(GLM_DENSE / MIB, rel=1e-4)  # 34.9 GiB
    assert plan["kv_tokens"] == CTX_128K
    assert _mib(plan, "kv_cache") == CTX_128K * GLM_KV_PER_TOKEN / MIB  # 23.2 GiB
    # everything on the host: 438 GiB of 512
    assert set(plan["placement"].values()) == {"cpu"} and plan["slots"] == 0
    want = GLM_POOL + GLM_DENSE + CTX_128K * GLM_KV_PER_TOKEN
    assert plan["ram_peak_mib"] == pytest.approx(want / MIB + 256, rel=1e-4)
    assert plan["ram_peak_mib"] < 440 * 1024
    assert plan["vram_peak_mib"] <= CONTEXT_MIB
    print(f"\nGLM-5.2 NVFP4, 96 GiB / 512 GiB, cpu: {json.dumps(plan)}")


def test_glm_5_2_with_the_96gib_card_holds_128k_but_not_the_bf16_copy(glm_dir, capsys) -> None:
    """On the card: the dense weights, 128k of context and 439 slots (peak within 96 GiB); on
    the host the packed pool and its bf16 copy: 1.7 TiB of 512 GiB."""
    rc, plan, err = _plan(
        capsys, "--model", str(glm_dir), "--vram", "96GiB", "--ram", "512GiB",
        "--expert-format", "nvfp4", "--kv-tokens", str(CTX_128K),
    )  # fmt: skip
    assert rc == 1 and not plan["fits"] and plan["backend"] == "offload"
    assert plan["parts_mib"]["expert_pool_bf16"] == GLM_POOL_BF16 / MIB  # 1350 GiB
    both = (GLM_POOL + GLM_POOL_BF16) / MIB
    assert both <= plan["ram_peak_mib"] <= both + 3 * 4 * GLM_EXPERT_WEIGHTS / MIB
    assert (
        f"expert pool {GLM_POOL / MIB:.0f} MiB as nvfp4, its bf16 copy for the device slots "
        f"{GLM_POOL_BF16 / MIB:.0f} MiB), 524288 MiB available" in plan["reason"]
    )
    assert "524288 MiB available" in plan["reason"]
    assert "the cpu backend computes nvfp4 experts packed" in plan["reason"]
    for part in ("embeddings", "attention", "dense_mlp", "shared_experts", "lm_head", "kv_cache"):
        assert plan["placement"][part] == "cuda", part
    assert _mib(plan, "dense_weights") == pytest.approx(GLM_DENSE / MIB, rel=1e-4)
    assert plan["kv_tokens"] == CTX_128K
    kv = CTX_128K * GLM_KV_PER_TOKEN / MIB
    assert _mib(plan, "kv_cache") == kv
    slot = 3 * GLM_H * GLM_I * 2  # bf16: 72 MiB
    assert plan["slot_mib"] == slot / MIB
    # reserved beside the slots: the KV pool and decode attention's buffers (32 rows over 128k
    # keys: 255 MiB); no state or snapshots of its own: 439 slots, 30.9 GiB
    reserved = CTX_128K * GLM_KV_PER_TOKEN + int(_mib(plan, "decode_attention") * MIB)
    assert plan["slots"] == _slots(plan, 8, GLM_H, GLM_I, GLM_EXPERTS, reserved) == 439
    low = CONTEXT_MIB + _mib(plan, "dense_weights") + kv + plan["slots"] * slot / MIB
    assert low <= plan["vram_peak_mib"] <= 96 * 1024  # 89.6 GiB
    print(f"\nGLM-5.2 NVFP4, 96 GiB / 512 GiB, offload at 128k: {json.dumps(plan)}")


def test_glm_5_2_does_not_fit_48gib_and_256gib(glm_dir, capsys) -> None:
    """The packed pool alone (380 GiB) exceeds 256 GiB of RAM; the dense weights (34.9 GiB) fit
    the 48 GiB card, but 128k of context (23.2 GiB) does not fit beside them."""
    args = ["--model", str(glm_dir), "--vram", "48GiB", "--ram", "256GiB"]
    args += ["--expert-format", "nvfp4"]
    rc, plan, err = _plan(capsys, *args)
    assert rc == 1 and not plan["fits"]
    assert GLM_POOL > 256 * GIB
    assert f"expert pool {GLM_POOL / MIB:.0f} MiB as nvfp4" in plan["reason"]
    assert "262144 MiB available" in plan["reason"]
    assert "the nvfp4 expert pool alone exceeds it" in plan["reason"]
    assert "disk tier takes GGUF experts in a block format" in plan["reason"]
    # the card side fits with the default KV pool: a quarter of what the dense weights leave
    assert plan["placement"]["dense_mlp"] == "cuda" and plan["slots"] > 0
    left = 48 * 1024 - CONTEXT_MIB - _mib(plan, "dense_weights")
    assert plan["kv_tokens"] == int(left * MIB / 4) // GLM_KV_PER_TOKEN  # 17866
    assert plan["vram_peak_mib"] <= 48 * 1024
    rc, plan, err = _plan(capsys, *args, "--kv-tokens", str(CTX_128K))
    assert rc == 1 and not plan["fits"]
    kv = CTX_128K * GLM_KV_PER_TOKEN / MIB
    assert (
        f"KV pages for 131072 tokens do not fit the device: {kv:.0f} MiB needed" in plan["reason"]
    )
    assert f"{left:.0f} MiB free" in plan["reason"]
    print(f"\nGLM-5.2 NVFP4, 48 GiB / 256 GiB at 128k: {plan['reason']}")
