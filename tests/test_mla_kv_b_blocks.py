"""MLA's attn_k_b / attn_v_b kept in their GGUF blocks (layers/mla.py): a Q8_0 file whose rows
fit the block (every width a multiple of 32, as in the released models) loads them per head in
the file's blocks, no float kv_b_proj, and attention runs absorbed with both products in the
integer-dot kernels, as llama.cpp computes it (tests/test_gguf_llamacpp_convert_slow.py: top-1
1.000 against llama.cpp on the same file, median |dlogit| 2.4e-7). Checked here against a plain
torch computation of the same arithmetic (``qdot_reference``: int8 inputs per 32, exact block
sums), and decode against prefill of the same prompt."""

from __future__ import annotations

import torch
from gguf_files import write_gguf
from tiny_models import make_tiny

from freetokend import LLM
from freetokend.formats.gguf_blocks import qdot_reference
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


def test_q8_0_kv_b_stays_in_blocks_and_runs_absorbed(tmp_path):
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
    # the same prompt by prefill and by decode (the native absorbed decode where built)
    full = llm.logits(IDS)
    out = llm.generate(IDS[:20], max_tokens=4, ignore_eos=True)
    assert out[0] == int(full[19].argmax())
