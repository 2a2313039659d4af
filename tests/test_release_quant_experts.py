"""Routed experts quantized by their publisher, loaded packed (issue 43 item 2): NVFP4 in both
conventions (compressed-tensors ``nvfp4-pack-quantized``; ModelOpt ``NVFP4``) into our ``nvfp4``
banks, and compressed-tensors' INT4 ``pack-quantized`` groups (Kimi-K2-Thinking / K2.5) into our
GGUF-block ``q4_0`` banks, with no dequantize at load.

The fixtures are tiny transformers checkpoints (tests/tiny_models.py) whose routed experts this
file quantizes with its own packers, written from the formats' definitions (not freetokend's
code, so a layout error on our side cannot cancel out), and writes in the release layout:

- NVFP4: e2m1 codes (0..7: 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 the sign), two a byte, element 2j
  in the low nibble; an e4m3 scale per 16 inputs; a per-projection multiplier g, a power of two
  (so that compressed-tensors' ``weight_global_scale`` 1 / g is exact and both conventions hold
  the same values). compressed-tensors: ``weight_packed`` / ``weight_scale`` /
  ``weight_global_scale`` (= 1 / g) / ``input_global_scale``; ModelOpt: ``weight`` (uint8) /
  ``weight_scale`` / ``weight_scale_2`` (= g) / ``input_scale``, and an FP8 KV cache's
  ``k_scale`` / ``v_scale``. The activation and KV scales are there to be ignored.
- INT4: q in [-8, 7] per 32-input group with a bf16 scale, w = scale * q; q + 8 packed eight a
  little-endian int32, value i at bits 4i (compressed-tensors' pack_to_int32), ``weight_shape``.

The shared experts (and with NVFP4 layer 0's dense MLP) are packed too: those load widened to
float, equal to the oracle's dequantized weights.

The oracle is transformers on the same weights dequantized to float32. NVFP4 experts are
computed in fp32 from the packed bytes: logits within 2e-4 (test_engine_families's fp32
tolerance), greedy tokens up to a near-tie. Q4_0 experts go through the integer kernels (int8
activations, as llama.cpp): there the peer identical by construction is our engine on the
dequantized float checkpoint quantizing its experts to q4_0 at load (each group of the fixture
holds a -8, so the reference quantizer's d is the group's scale): the same bank bytes, so the
same tokens; against transformers the logits are within the activations' int8 rounding.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from greedy_check import FP32_MARGIN, HfScorer, assert_greedy_agrees, hf_greedy
from runner_steps import logits_in_steps
from safetensors.torch import load_file, save_file
from tiny_models import hf_model_class, make_tiny

from freetokend import LLM
from freetokend.engine.plan import plan_model, pool_bytes
from freetokend.experts.formats import allocate
from freetokend.formats.errors import CheckpointError
from freetokend.models.config import ConfigError
from freetokend.models.config_hf import read_config
from freetokend.models.fill import _Loaded  # a tensor in memory as the loader's source
from freetokend.models.loader import _Source
from freetokend.models.release_experts import ReleaseExperts
from freetokend.models.release_quant import ReleaseQuant

ATOL = 2e-4  # fp32 on both sides, summation order only
EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
# the dense linears the fixtures also quantize (widened to float at load): the shared experts,
# and with NVFP4 layer 0's dense MLP (its intermediate size, 48, is no multiple of 32)
DENSE = {
    "nvfp4": re.compile(
        r"(\.mlp\.shared_experts\.|^model\.layers\.0\.mlp\.)(gate|up|down)_proj\.weight$"
    ),
    "int4": re.compile(r"\.mlp\.shared_experts\.(gate|up|down)_proj\.weight$"),
}
E2M1 = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
)

CT_NVFP4 = {
    "quant_method": "compressed-tensors",
    "format": "nvfp4-pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                        "group_size": 16, "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                                  "group_size": 16, "symmetric": True, "dynamic": "local"},
        }
    },
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*mlp\\.gate$"],
}  # fmt: skip
MODELOPT_NVFP4 = {
    "quant_method": "modelopt",
    "quant_algo": "NVFP4",
    "group_size": 16,
    "producer": {"name": "modelopt"},
    "exclude_modules": ["lm_head", "model.layers.*.self_attn*", "model.layers.*.mlp.gate"],
}  # fmt: skip
CT_INT4 = {  # Kimi-K2-Thinking's, less its exclusion of the shared experts
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "input_activations": None,
            "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32,
                        "symmetric": True, "dynamic": False, "observer": "minmax"},
        }
    },
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
}  # fmt: skip


# ---- the packers, from the formats' definitions ------------------------------------------------


def nvfp4_pack(w: torch.Tensor, g: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[R, C] with multiplier g -> (uint8 [R, C/2], e4m3 [R, C/16], the dequantized [R, C])."""
    r, c = w.shape
    blocks = w.reshape(r, c // 16, 16)
    scale = (blocks.abs().amax(-1) / 6.0 / g).to(torch.float8_e4m3fn)
    eff = scale.float() * g
    x = blocks / eff.clamp(min=1e-30).unsqueeze(-1)
    codes = (x.unsqueeze(-1) - E2M1).abs().argmin(-1).reshape(r, c)  # nearest e2m1 value
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    deq = (E2M1[codes].reshape(r, c // 16, 16) * eff.unsqueeze(-1)).reshape(r, c)
    return packed, scale, deq


def int4_pack(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """[R, C] -> (int32 [R, C/8], bf16 scales [R, C/32], q [R, C], the dequantized [R, C]).
    Each group's largest magnitude is set to -8 (see the module docstring)."""
    r, c = w.shape
    blocks = w.reshape(r, c // 32, 32)
    scale = (blocks.abs().amax(-1) / 8.0).to(torch.bfloat16)
    q = (blocks / scale.float().unsqueeze(-1)).round().clamp(-8, 7)
    q.scatter_(-1, q.abs().argmax(-1, keepdim=True), -8.0)
    q = q.reshape(r, c).long()
    u = (q + 8).reshape(r, c // 8, 8)
    word = (u << (4 * torch.arange(8))).sum(-1)  # value i at bits 4i
    packed = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)
    deq = (q.reshape(r, c // 32, 32).float() * scale.float().unsqueeze(-1)).reshape(r, c)
    return packed, scale, q, deq


def q4_0_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """GGUF Q4_0 rows from the definition: per 32 inputs fp16 d, then byte j = (q_j + 8) |
    (q_{j+16} + 8) << 4."""
    r, c = q.shape
    u = (q + 8).reshape(r, c // 32, 32).to(torch.uint8)
    qs = u[..., :16] | (u[..., 16:] << 4)
    d = scale.to(torch.float16).view(torch.uint8).reshape(r, c // 32, 2)
    return torch.cat([d, qs], dim=-1).reshape(r, c // 32 * 18)


# ---- fixtures ------------------------------------------------------------------------------------


def write_release(src: Path, out: dict[str, Path], kind: str) -> dict[str, torch.Tensor]:
    """``src`` (transformers' save) with its routed experts quantized: ``kind`` "nvfp4" writes
    ``out["ct"]`` and ``out["modelopt"]``, "int4" ``out["ct"]``; returns the float32 tensors
    (``src``'s names) of the oracle, the experts dequantized."""
    sd = load_file(src / "model.safetensors")
    oracle = dict(sd)
    files: dict[str, dict[str, torch.Tensor]] = {k: {} for k in out}
    for name, t in sd.items():
        m = EXPERT.search(name) or DENSE[kind].search(name)
        if m is None:
            for f in files.values():
                f[name] = t
            continue
        base = name.removesuffix(".weight")
        if kind == "nvfp4":
            amax = float(t.abs().max())
            g = 2.0 ** round(torch.log2(torch.tensor(amax / (6 * 448))).item())
            g *= 4.0 if name.endswith("up_proj.weight") else 1.0  # gate, up: different ones
            packed, scale, oracle[name] = nvfp4_pack(t.float(), g)
            files["ct"][base + ".weight_packed"] = packed
            files["ct"][base + ".weight_scale"] = scale
            files["ct"][base + ".weight_global_scale"] = torch.tensor([1.0 / g])
            files["ct"][base + ".input_global_scale"] = torch.tensor([3.0])
            files["modelopt"][base + ".weight"] = packed
            files["modelopt"][base + ".weight_scale"] = scale
            files["modelopt"][base + ".weight_scale_2"] = torch.tensor(g)
            files["modelopt"][base + ".input_scale"] = torch.tensor(0.5)
        else:
            packed, scale, _, oracle[name] = int4_pack(t.float())
            files["ct"][base + ".weight_packed"] = packed
            files["ct"][base + ".weight_scale"] = scale
            files["ct"][base + ".weight_shape"] = torch.tensor(list(t.shape))
    if "modelopt" in files:  # an FP8 KV cache's scales (ModelOpt's kv_cache_quant_algo)
        files["modelopt"]["model.layers.1.self_attn.kv_b_proj.k_scale"] = torch.tensor(0.1)
        files["modelopt"]["model.layers.1.self_attn.kv_b_proj.v_scale"] = torch.tensor(0.2)
    cfg = json.loads((src / "config.json").read_text())
    quant = {"ct": CT_NVFP4 if kind == "nvfp4" else CT_INT4, "modelopt": MODELOPT_NVFP4}
    for k, d in out.items():
        d.mkdir()
        save_file(files[k], d / "model.safetensors", metadata={"format": "pt"})
        (d / "config.json").write_text(json.dumps({**cfg, "quantization_config": quant[k]}))
    return oracle


def _oracle_dir(src: Path, sd: dict[str, torch.Tensor], dst: Path) -> Path:
    shutil.copytree(src, dst)
    save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def glm_nvfp4(tmp_path_factory):
    """GLM-5 (glm_moe_dsa) with NVFP4 experts: (ct dir, modelopt dir, oracle dir, oracle HF)."""
    root = tmp_path_factory.mktemp("glm-nvfp4")
    src, _ = make_tiny("glm_moe_dsa", root / "hf", seed=5)
    dirs = {"ct": root / "ct", "modelopt": root / "modelopt"}
    oracle = _oracle_dir(src, write_release(src, dirs, "nvfp4"), root / "oracle")
    hf = hf_model_class("glm_moe_dsa").from_pretrained(oracle, dtype=torch.float32).eval()
    return dirs["ct"], dirs["modelopt"], oracle, hf


@pytest.fixture(scope="module")
def kimi_int4(tmp_path_factory):
    """DeepSeek-V3 (Kimi-K2's architecture) with INT4 experts: (ct dir, oracle dir, HF)."""
    root = tmp_path_factory.mktemp("kimi-int4")
    src, _ = make_tiny("deepseek_v3", root / "hf", seed=6)
    oracle = _oracle_dir(src, write_release(src, {"ct": root / "ct"}, "int4"), root / "oracle")
    hf = hf_model_class("deepseek_v3").from_pretrained(oracle, dtype=torch.float32).eval()
    return root / "ct", oracle, hf


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 97, (n,), generator=g).tolist()


def _load(path: Path, monkeypatch, **kw) -> LLM:
    """LLM on ``path``; the routed experts' weights are not read into a copy on the way."""
    read = _Source.read

    def no_float_expert(self):
        t = read(self)
        assert not (".experts." in self.info.name and self.info.name.endswith(".weight")), (
            self.info.name  # ModelOpt's packed weight goes straight into its bank (into)
        )
        return t

    monkeypatch.setattr(_Source, "read", no_float_expert)
    try:
        return LLM(path, moe_backend="cpu", max_model_len=128, kv_tokens=256, **kw)
    finally:
        monkeypatch.undo()


# ---- config.json -------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["glm_moe_dsa", "deepseek_v32", "deepseek_v3"])
def test_quantization_configs_name_our_formats(family, tmp_path):
    import tiny_models

    base = tiny_models.hf_config(family).to_dict()
    base["architectures"] = [hf_model_class(family).__name__]
    for q, fmt in ((CT_NVFP4, "nvfp4"), (MODELOPT_NVFP4, "nvfp4"), (CT_INT4, "q4_0")):
        (tmp_path / "config.json").write_text(json.dumps({**base, "quantization_config": q}))
        assert read_config(tmp_path).expert_format == fmt
    # ModelOpt's older exports: the quantization in hf_quant_config.json beside config.json
    (tmp_path / "config.json").write_text(json.dumps(base))
    body = {k: v for k, v in MODELOPT_NVFP4.items() if k not in ("quant_method", "producer")}
    hfq = {"producer": {"name": "modelopt", "version": "0.29"}, "quantization": body}
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(hfq))
    assert read_config(tmp_path).expert_format == "nvfp4"
    (tmp_path / "hf_quant_config.json").unlink()
    bad = [
        ({**MODELOPT_NVFP4, "quant_algo": "FP8"}, "quant_algo' = 'FP8'"),
        ({**CT_INT4, "quantization_status": "frozen"}, "only compressed"),
    ]
    for group in ({"symmetric": False}, {"num_bits": 8}, {"group_size": 16}):
        g0 = CT_INT4["config_groups"]["group_0"]
        weights = {**g0["weights"], **group}
        bad.append(({**CT_INT4, "config_groups": {"g": {**g0, "weights": weights}}}, "int 4-bit"))
    for q, msg in bad:
        (tmp_path / "config.json").write_text(json.dumps({**base, "quantization_config": q}))
        with pytest.raises(ConfigError, match=msg):
            read_config(tmp_path)


# ---- NVFP4 ---------------------------------------------------------------------------------------


def test_nvfp4_both_conventions_load_packed_and_match_transformers(glm_nvfp4, monkeypatch):
    ct, modelopt, oracle, hf = glm_nvfp4
    sd = load_file(ct / "model.safetensors")
    oracle_sd = load_file(oracle / "model.safetensors")
    ids = _prompt(20, 1)
    want = HfScorer(hf).logits(ids)
    engines = {k: _load(d, monkeypatch) for k, d in (("ct", ct), ("modelopt", modelopt))}
    e, i = 8, 32
    for llm in engines.values():
        b = llm.banks
        assert llm.config.expert_format == b.format == "nvfp4"
        assert type(llm.moe.executor).__name__ == "CpuExecutor"  # the native packed kernels
        # the file's bytes: layer 2 (MoE layer 1) expert 3's up rows and scales, down's global
        fid, base = 1 * e + 3, "model.layers.2.mlp.experts.3."
        assert torch.equal(b.gate_up[fid, i:], sd[base + "up_proj.weight_packed"])
        assert torch.equal(
            b.extra["gate_up_scale"][fid, i:].view(torch.uint8),
            sd[base + "up_proj.weight_scale"].view(torch.uint8),
        )
        glob = [1 / float(sd[base + f"{p}_proj.weight_global_scale"]) for p in ("gate", "up")]
        assert b.extra["gate_up_global"][fid].tolist() == glob and glob[1] == 4 * glob[0]
        assert b.extra["down_global"][fid].item() == 1 / float(
            sd[base + "down_proj.weight_global_scale"]
        )
        assert not [n for n, _ in llm.model.named_parameters() if ".experts." in n]
        params = dict(llm.model.named_parameters())  # the packed dense weights, widened
        for mine, theirs in (
            ("layers.2.mlp.shared_expert.up_proj.weight", "model.layers.2.mlp.shared_experts."),
            ("layers.0.mlp.down_proj.weight", "model.layers.0.mlp."),
        ):
            want_w = oracle_sd[theirs + mine.rsplit(".", 2)[-2] + ".weight"]
            assert torch.equal(params[mine], want_w), mine
    for name in ("gate_up", "down", "gate_up_scale", "gate_up_global", "down_global"):
        a, m = (engines[k].banks.all_tensors()[name] for k in ("ct", "modelopt"))
        assert torch.equal(a.view(torch.uint8), m.view(torch.uint8)), name
    # against transformers on the dequantized weights
    for llm in engines.values():
        got = _logits_steps(llm, ids)
        assert (got - want[-7:]).abs().max().item() < ATOL  # measured 1.5e-6
    prompts = [_prompt(9, 2), _prompt(15, 3)]
    outs = {k: llm.generate(prompts, max_tokens=16, ignore_eos=True) for k, llm in engines.items()}
    assert outs["ct"] == outs["modelopt"]  # the same banks: the same arithmetic
    theirs = [hf_greedy(hf, p, 16) for p in prompts]
    assert_greedy_agrees(outs["ct"], theirs, prompts, HfScorer(hf), FP32_MARGIN, "nvfp4")
    for llm in engines.values():
        llm.close()


def _logits_steps(llm: LLM, ids: list[int]) -> torch.Tensor:
    """The last 7 positions' logits, prefill then decode steps."""
    return logits_in_steps(llm, ids, [len(ids) - 6] + [1] * 6)[-7:]


# ---- INT4 -> q4_0 --------------------------------------------------------------------------------


def test_int4_loads_as_q4_0_blocks_and_matches(kimi_int4, monkeypatch):
    ct, oracle, hf = kimi_int4
    sd = load_file(ct / "model.safetensors")
    llm = _load(ct, monkeypatch)
    b = llm.banks
    assert llm.config.expert_format == b.format == "q4_0" and b.gate_up.dtype == torch.uint8
    assert type(llm.moe.executor).__name__ == "BlockExecutor"  # the integer kernels
    i = 32
    base = "model.layers.1.mlp.experts.6."  # MoE layer 0
    for fid, part, rows in ((6, "up", slice(i, None)), (6, "down", slice(None))):
        src = load_file(oracle / "model.safetensors")[base + f"{part}_proj.weight"]
        _, scale, q, _ = int4_pack(src)  # the fixture's packing again, from its float weights
        assert torch.equal(scale, sd[base + f"{part}_proj.weight_scale"])
        bank = b.down if part == "down" else b.gate_up
        assert torch.equal(bank[fid, rows], q4_0_rows(q, scale))
    # the identical peer: the dequantized float checkpoint, its experts quantized to q4_0 at load
    widened = dict(llm.model.named_parameters())["layers.1.mlp.shared_expert.down_proj.weight"]
    want_w = load_file(oracle / "model.safetensors")[
        "model.layers.1.mlp.shared_experts.down_proj.weight"
    ]
    assert torch.equal(widened, want_w)  # the packed shared expert, widened
    peer = LLM(oracle, moe_backend="cpu", max_model_len=128, kv_tokens=256, quantize_experts="q4_0")
    assert torch.equal(peer.banks.gate_up, b.gate_up) and torch.equal(peer.banks.down, b.down)
    prompts = [_prompt(11, 4), _prompt(17, 5)]
    ours = llm.generate(prompts, max_tokens=16, ignore_eos=True)
    assert ours == peer.generate(prompts, max_tokens=16, ignore_eos=True)
    ids = _prompt(20, 7)
    want = HfScorer(hf).logits(ids)
    got = llm.logits(ids)
    # the integer kernels' int8 activations (per 32 inputs, as llama.cpp) part them: measured
    # ||d|| / ||logits|| 1.1e-2 (max |d| 3.3e-2); a misplaced nibble or scale is O(1)
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 3e-2, rel
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.95
    llm.close()
    peer.close()


def test_int4_scale_outside_fp16_is_refused(kimi_int4, tmp_path):
    ct, _, _ = kimi_int4
    shutil.copytree(ct, tmp_path / "ck")
    sd = load_file(tmp_path / "ck" / "model.safetensors")
    name = "model.layers.2.mlp.experts.0.down_proj.weight_scale"
    sd[name] = sd[name].clone()
    sd[name][3, 0] = 2.0**17  # a bf16 value beyond fp16's 65504
    save_file(sd, tmp_path / "ck" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="fp16 .* does not hold exactly"):
        LLM(tmp_path / "ck", moe_backend="cpu", max_model_len=64, kv_tokens=128)


def test_packed_dense_weight_without_its_scales_is_refused(kimi_int4, tmp_path):
    ct, _, _ = kimi_int4
    shutil.copytree(ct, tmp_path / "ck")
    sd = load_file(tmp_path / "ck" / "model.safetensors")
    del sd["model.layers.1.mlp.shared_experts.up_proj.weight_shape"]
    save_file(sd, tmp_path / "ck" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="has no 'model.layers.1.mlp.shared_experts.up_"):
        LLM(tmp_path / "ck", moe_backend="cpu", max_model_len=64, kv_tokens=128)


# ---- ftctl plan ----------------------------------------------------------------------------------


def test_plan_counts_packed_expert_bytes(glm_nvfp4, kimi_int4):
    for d, fmt in ((glm_nvfp4[0], "nvfp4"), (glm_nvfp4[1], "nvfp4"), (kimi_int4[0], "q4_0")):
        plan = plan_model(d, vram_mib=1024, ram_mib=1 << 20, backend="cpu")
        cfg = read_config(d)
        assert plan.fits and plan.expert_format == fmt
        assert plan.parts_mib["expert_pool"] * 2**20 == pool_bytes(cfg) < pool_bytes(cfg, "bf16")


# ---- the readers on their own ----------------------------------------------------------------


def test_int4_groups_of_64_give_each_block_its_group_scale():
    """A group of 64 inputs is two Q4_0 blocks with the same d (lossless all the same)."""
    h, i = 128, 64
    rq = ReleaseQuant("compressed-tensors", "q4_0", 64)
    banks = allocate("q4_0", 2, h, i, torch.float32)
    reader = ReleaseExperts(rq, banks, h, i)
    g = torch.Generator().manual_seed(3)
    w = torch.randn(i, h, generator=g)
    packed, scale32, q, _ = int4_pack(w)  # groups of 32 ...
    scale = scale32[:, 0::2]  # ... but one scale per 64: the values are q * its group's scale
    for kind, t in (("weight_packed", packed), ("weight_scale", scale)):
        reader.put(1, "up_proj", kind, _Loaded(t), "up", Path("x"))
    assert torch.equal(banks.gate_up[1, i:], q4_0_rows(q, scale.repeat_interleave(2, dim=1)))
    with pytest.raises(CheckpointError, match="groups of 64 do not divide"):
        ReleaseExperts(rq, allocate("q4_0", 1, 96, 64, torch.float32), 96, 64)


def test_compressed_tensors_global_scale_is_the_divisor():
    """compressed-tensors divides by ``weight_global_scale``: our multiplier is its reciprocal
    (rounded once to fp32 where it is no power of two); ModelOpt's ``weight_scale_2`` is the
    multiplier itself."""
    h, i = 32, 16
    for method, kind, stored, want in (
        ("compressed-tensors", "weight_global_scale", 3.0, torch.tensor(1 / 3.0).item()),
        ("modelopt", "weight_scale_2", 3.0, 3.0),
    ):
        banks = allocate("nvfp4", 1, h, i, torch.float32)
        reader = ReleaseExperts(ReleaseQuant(method, "nvfp4", 16), banks, h, i)
        reader.put(0, "up_proj", kind, _Loaded(torch.tensor([stored])), "g", Path("x"))
        reader.put(0, "down_proj", kind, _Loaded(torch.tensor([stored])), "g", Path("x"))
        assert banks.extra["gate_up_global"][0, 1].item() == want
        assert banks.extra["down_global"][0, 0].item() == want
        assert (
            reader.put(0, "down_proj", "input_scale", _Loaded(torch.tensor(1.0)), "a", Path("x"))
            is None
        )
        with pytest.raises(CheckpointError, match="one finite positive"):
            reader.put(0, "gate_proj", kind, _Loaded(torch.tensor([0.0])), "g", Path("x"))


def test_ftw_conversion_keeps_the_packed_experts(kimi_int4, glm_nvfp4, tmp_path):
    """``ftctl checkpoint`` of a release: the FTW folder stores the banks as loaded (q4_0 blocks,
    nvfp4 codes / scales / globals) and loads back to the same bytes."""
    from freetokend.models.ftw_convert import convert
    from freetokend.models.loader import load_model

    for src, fmt in ((kimi_int4[0], "q4_0"), (glm_nvfp4[1], "nvfp4")):
        out = tmp_path / fmt
        assert convert(src, out).expert_format == fmt
        _, want = load_model(src)
        _, got = load_model(out)
        assert got.format == fmt
        for name, t in want.all_tensors().items():
            assert torch.equal(got.all_tensors()[name].view(torch.uint8), t.view(torch.uint8))


def test_exclusions_as_each_convention_writes_them():
    """compressed-tensors: exact module names or ``re:`` patterns matched from the start;
    ModelOpt: globs."""
    from freetokend.models.release_quant import release_quant

    ct = release_quant(CT_INT4, "config.json")
    mo = release_quant(MODELOPT_NVFP4, "config.json")
    assert ct is not None and mo is not None
    assert ct.excluded("lm_head") and ct.excluded("model.layers.3.self_attn.q_a_proj")
    assert ct.excluded("model.layers.0.mlp.down_proj")
    assert not ct.excluded("model.layers.3.mlp.experts.7.down_proj")
    assert mo.excluded("model.layers.3.self_attn.kv_b_proj") and mo.excluded(
        "model.layers.9.mlp.gate"
    )
    assert not mo.excluded("model.layers.3.mlp.experts.7.up_proj")
    assert release_quant({"quant_method": "fp8"}, "config.json") is None


def test_a_float_routed_expert_in_a_packed_checkpoint_is_refused(glm_nvfp4, tmp_path):
    ct = glm_nvfp4[0]
    shutil.copytree(ct, tmp_path / "ck")
    sd = load_file(tmp_path / "ck" / "model.safetensors")
    base = "model.layers.1.mlp.experts.0.gate_proj."
    for k in ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"):
        del sd[base + k]
    sd[base + "weight"] = torch.zeros(32, 64)
    save_file(sd, tmp_path / "ck" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="a float routed expert, not in the config's excl"):
        LLM(tmp_path / "ck", moe_backend="cpu", max_model_len=64, kv_tokens=128)
