"""MLA's attn_k_b / attn_v_b kept in their GGUF blocks (layers/mla.py): a Q8_0 file whose rows
fit the block (every width a multiple of 32, as in the released models) loads them per head in
the file's blocks, no float kv_b_proj, and attention runs absorbed with both products in the
integer-dot kernels, as llama.cpp computes it (tests/test_gguf_llamacpp_convert_slow.py: top-1
1.000 against llama.cpp on the same file, median |dlogit| 2.4e-7). Checked here against a plain
torch computation of the same arithmetic (``qdot_reference``: int8 inputs per 32, exact block
sums), and decode against prefill of the same prompt. The device backends read float weights:
placement widens these blocks (``widen_kept_blocks``), DeepSeek-V4's grouped o_a_proj and
hyper-connection mixes too."""

from __future__ import annotations

import torch
from gguf_files import write_gguf
from tiny_models import make_tiny

from freetokend import LLM
from freetokend.formats.gguf_blocks import qdot_reference
from freetokend.models.layers import mla
from freetokend.models.layers.mla import causal_mask

ALIGNED = dict(q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=32, v_head_dim=16)
IDS = torch.randint(2, 90, (24,), generator=torch.Generator().manual_seed(5)).tolist()


def _reference(attn, q, kc, allowed):
    """absorbed attention in fp64 on qdot_reference's per-head products."""
    k_b, v_b = attn.kv_b_blocks
    h, dn, kvr, dr = attn.heads, attn.dn, attn.kvr, attn.dr
    q_lat = torch.stack(
        [qdot_reference(k_b[i].gguf_raw(), "q8_0", q[:, i, :dn]) for i in range(h)], 1
    )
    qa = torch.cat([q_lat, q[..., dn:]], -1).double()
    keys = kc[:, : kvr + dr].double()
    s = torch.einsum("nhd,cd->nhc", qa, keys) * attn.scale
    s = s.masked_fill(~allowed[:, None], float("-inf")).softmax(-1)
    lat = torch.einsum("nhc,cr->nhr", s, keys[:, :kvr]).float()
    return torch.stack([qdot_reference(v_b[i].gguf_raw(), "q8_0", lat[:, i]) for i in range(h)], 1)


def test_q8_0_kv_b_stays_in_blocks_and_runs_absorbed(tmp_path, monkeypatch):
    hf = make_tiny("deepseek_v32", tmp_path / "hf", seed=3, **ALIGNED)[1]
    path = write_gguf("deepseek_v32", hf, tmp_path / "m-Q8_0.gguf", "q8_0")
    llm = LLM(path, max_model_len=64, kv_tokens=256, dtype="float32")
    for layer in llm.model.layers:
        attn = layer.self_attn
        assert attn.kv_b_proj is None and attn.kv_b_blocks is not None
        k_b, v_b = attn.kv_b_blocks
        assert len(k_b) == len(v_b) == attn.heads
        assert {w.fmt for w in (*k_b, *v_b)} == {"q8_0"}
        assert (k_b[0].rows, k_b[0].cols, v_b[0].rows, v_b[0].cols) == (32, 32, 16, 32)
    attn = llm.model.layers[1].self_attn
    g = torch.Generator().manual_seed(0)
    q = torch.randn(5, attn.heads, attn.dn + attn.dr, generator=g)
    kc = torch.randn(9, attn.kvr + attn.dr, generator=g)
    allowed = causal_mask(5, 9, 4, q.device)
    got = attn.absorbed_attention(q, kc, allowed)
    want = _reference(attn, q, kc, allowed)
    assert (got - want).abs().max().item() < 1e-4, (got - want).abs().max().item()
    # in blocks of 2 query tokens (the bound a long chunk of many heads is cut by): the same
    monkeypatch.setattr(mla, "_ABSORB_BLOCK", 2 * attn.heads * 9)
    blocked = attn.absorbed_attention(q, kc, allowed)
    assert (blocked - got).abs().max().item() < 1e-6  # SDPA's own row blocking may differ
    monkeypatch.undo()
    # the same prompt by prefill and by decode (the native absorbed decode where built)
    full = llm.logits(IDS)
    out = llm.generate(IDS[:20], max_tokens=4, ignore_eos=True)
    assert out[0] == int(full[19].argmax())


def test_device_placement_widens_the_kept_blocks(tmp_path):
    """The fused backend (the stand-in accelerator) reads float weights on its device: placement
    widens kv_b's blocks into kv_b_proj there (``widen_kept_blocks``), as it dequantizes a
    Linear's, and the tokens are the cpu backend's up to the int8 inputs the cpu computes with
    (the first token, checked, is far from a tie)."""
    hf = make_tiny("deepseek_v32", tmp_path / "hf", seed=3, **ALIGNED)[1]
    path = write_gguf("deepseek_v32", hf, tmp_path / "m-Q8_0.gguf", "q8_0")
    kw = dict(max_model_len=64, kv_tokens=256, dtype="float32")
    cpu = LLM(path, **kw)
    dev = LLM(path, "fused", accelerator="standin", **kw)
    for layer in dev.model.layers:
        attn = layer.self_attn
        assert attn.kv_b_blocks is None and attn.kv_b_proj.weight.dtype == torch.bfloat16
    # the prompt that ends where the cpu's top-1 margin is widest (past the index top-k)
    top2 = cpu.logits(IDS).topk(2, -1).values
    margin = top2[:, 0] - top2[:, 1]
    n = 8 + int(margin[8:].argmax()) + 1
    assert margin[n - 1].item() > 0.2, margin[n - 1].item()  # bf16 weights cannot flip it
    a = cpu.generate(IDS[:n], max_tokens=1, ignore_eos=True)
    b = dev.generate(IDS[:n], max_tokens=1, ignore_eos=True)
    assert a == b


def test_v4_blocks_outside_linear_widen_on_the_device(tmp_path):
    """DeepSeek-V4's grouped o_a_proj and hyper-connection mixes stay in a Q8_0 file's blocks
    on the cpu and are widened by the placement (the mixes in fp32, as released)."""
    from gguf_files import write_gguf as write

    hf = make_tiny("deepseek_v4", tmp_path / "hf", seed=3, head_dim=64, q_lora_rank=32)[1]
    path = write("deepseek_v4", hf, tmp_path / "v4-Q8_0.gguf", "q8_0")
    kw = dict(max_model_len=64, kv_tokens=256, dtype="float32")
    cpu = LLM(path, **kw)
    held = [n for n, m in cpu.model.named_modules() if getattr(m, "block_param", "") == "fn"]
    assert all(cpu.model.get_submodule(n).qweight is not None for n in held), held
    assert cpu.model.layers[0].self_attn.o_a_proj.qweight is not None
    dev = LLM(path, "fused", accelerator="standin", **kw)
    layer = dev.model.layers[0]
    assert layer.attn_hc.qweight is None and layer.attn_hc.fn.dtype == torch.float32
    assert layer.self_attn.o_a_proj.qweight is None
    assert layer.self_attn.o_a_proj.weight.dtype == torch.bfloat16
    assert dev.model.hc_head.fn.numel() > 0
    assert len(dev.generate(IDS[:12], max_tokens=2, ignore_eos=True)) == 2
