"""DeepSeek-V4 under the engine (models/deepseek_v4_model.py ``DeepseekV4CausalLM``), beyond
what tests/test_engine_families.py checks for every family: what it loads where (hash tables as
buffers, routed experts in banks, MTP tensors skipped with one log line), that no fast path
picks it up, that the prefix cache is off with a reason, and that a released sequence starts
again from a fresh state. Values against transformers: test_engine_families -k deepseek_v4."""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import make_tiny

from freetokend import LLM
from freetokend.engine.graphs import static_decode_blocker
from freetokend.engine.plan import DECODE_ROWS, MIB, plan_model
from freetokend.engine.runner import Work
from freetokend.experts.backend import moe_activation_bytes
from freetokend.experts.banks import Activation, activation_of
from freetokend.models.deepseek_v4_model import DeepseekV4CausalLM, V4SeqState
from freetokend.models.layers.decode_lane import DecodeLane
from freetokend.models.model import kv_bytes_per_token


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("v4")
    _, hf = make_tiny("deepseek_v4", d, seed=3)
    # an MTP layer's tensors as the release names them: skipped by the loader
    sd = load_file(d / "model.safetensors")
    sd["mtp.0.enorm.weight"] = torch.ones(64)
    sd["mtp.0.ffn.experts.0.w1.weight"] = torch.ones(32, 64)
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    return d, hf


def test_loads_tables_banks_and_skips_mtp(tiny, caplog):
    d, hf = tiny
    with caplog.at_level(logging.INFO):
        llm = LLM(d, moe_backend="cpu", max_model_len=128, kv_tokens=256)
    model = llm.model
    assert isinstance(model, DeepseekV4CausalLM)
    assert llm.config.activation == "swiglu_clamp"
    assert activation_of(llm.config.activation) == Activation.SWIGLU_CLAMP
    # the hash layer's table is a buffer equal to transformers'; no routed expert is a parameter
    ours = model.layers[0].mlp.router.tid2eid
    assert "layers.0.mlp.router.tid2eid" in dict(model.named_buffers())
    assert torch.equal(ours, hf.model.layers[0].mlp.gate.tid2eid.long())
    assert not [n for n, _ in model.named_parameters() if ".experts." in n]
    banks = llm.runner.moe.banks
    assert banks.gate_up.shape == (4 * 8, 2 * 32, 64)
    w1 = hf.model.layers[2].mlp.experts.gate_up_proj[5, :32]  # layer 2, expert 5, gate rows
    assert torch.equal(banks.gate_up[2 * 8 + 5, :32], w1)
    msgs = [r.getMessage() for r in caplog.records]
    assert any("multi-token-prediction" in m and "skipped 2 tensors" in m for m in msgs), msgs
    assert any("prefix cache: off for DeepSeek-V4" in m for m in msgs), msgs
    assert llm.engine.prefix is None


def test_no_fast_path_takes_it(tiny):
    d, _ = tiny
    llm = LLM(d, moe_backend="cpu", max_model_len=128, kv_tokens=256)
    runner = llm.runner
    assert static_decode_blocker(llm.model) is not None and not runner.static_decode
    states = [runner.new_state()]
    assert DecodeLane.make(llm.model, runner.kv, runner.moe, states) is None
    assert llm.model.num_attention_layers == 0  # no paged-pool layer: the state is per sequence


def test_release_gives_a_fresh_state(tiny):
    d, _ = tiny
    llm = LLM(d, moe_backend="cpu", max_model_len=128, kv_tokens=256)
    runner = llm.runner
    ids = list(range(3, 23))
    st = runner.new_state()
    first = runner.forward([Work(st, ids)])
    assert st.v4 is not None and st.v4.num_tokens == st.num_tokens == 20
    runner.release(st)  # preempted: recomputed from its first token
    assert st.v4 is not None and st.v4.num_tokens == 0
    runner.reserve(st, 20)
    again = runner.forward([Work(st, ids)])
    runner.release(st)
    assert torch.equal(first, again)


def test_a_step_without_logits_rows(tiny):
    """A prefill chunk that wants no logits (a long prompt's first chunks, or a chunk cut at a
    snapshot point) runs: the last hyper-connection head over zero rows."""
    d, _ = tiny
    llm = LLM(d, moe_backend="cpu", max_model_len=128, kv_tokens=256, prefix_cache=False)
    runner = llm.runner
    st = runner.new_state()
    out = runner.forward([Work(st, list(range(3, 12)), want_logits=False)])
    assert out.shape == (0, 97) and st.num_tokens == 9
    runner.release(st)

# ---- accounting: what a V4 sequence holds beside the KV pool -------------------------------------

# the tiny config: window 8 (7 keys) of head_dim 32 in 4 layers; CSA (rate 4) compressor width 64
# with a [4, 32] overlap, its indexer width 32 with a [4, 16] overlap; HCA (rate 8) width 32
PER_TOKEN = 2 * 4 * (32 + 16) // 4 + 4 * 32 // 8  # the entries: 112 bytes per token
PER_SEQ = (
    4 * 7 * 32 * 4 + 2 * (2 * 3 * 64 * 4 + 2 * 4 * 32 * 4) + 2 * (2 * 3 * 32 * 4 + 2 * 4 * 16 * 4)
)
PER_SEQ += 2 * 7 * 32 * 4  # the HCA layer's open window


def test_state_bytes_are_what_the_state_holds(tiny):
    """The model's formula for a sequence's state equals the tensors' bytes at every length
    (prefill, then decode steps through open and closing windows), within the per-sequence
    and per-token bounds the planner uses."""
    d, _ = tiny
    llm = LLM(d, moe_backend="cpu", max_model_len=128, kv_tokens=256, prefix_cache=False)
    model, runner = llm.model, llm.runner
    assert isinstance(model, DeepseekV4CausalLM)
    assert model.state_bytes_per_token() == PER_TOKEN
    assert model.state_bytes_per_seq() == PER_SEQ
    assert kv_bytes_per_token(model) == PER_TOKEN  # no pool layer: the entries alone
    st = runner.new_state()
    assert st.v4 is not None and st.v4.nbytes == model.state_bytes(0) == 0
    runner.forward([Work(st, list(range(3, 16)))])  # 13 tokens
    for t in range(16, 40):
        assert isinstance(st.v4, V4SeqState)
        n = st.v4.num_tokens
        assert st.v4.nbytes == model.state_bytes(n), n
        assert st.v4.nbytes <= PER_SEQ + n * PER_TOKEN
        runner.forward([Work(st, [t])])
    runner.release(st)


def test_plan_counts_the_state(tiny):
    """`ftctl plan` counts V4's entries with the KV pool's tokens and its windows per decode
    row, on the card and on the host; the slot budget of a V4 engine on a card reserves them."""
    d, _ = tiny
    on_card = plan_model(d, vram_mib=1024, ram_mib=1 << 20, backend="offload")
    assert on_card.fits, on_card.reason
    assert on_card.parts_mib["kv_cache"] == on_card.kv_tokens * PER_TOKEN / MIB > 0
    assert on_card.parts_mib["model_state"] == DECODE_ROWS * PER_SEQ / MIB
    assert on_card.placement["model_state"] == "cuda"
    host = plan_model(d, vram_mib=1024, ram_mib=1 << 20, backend="cpu")
    assert host.parts_mib["kv_cache"] == host.kv_tokens * PER_TOKEN / MIB > 0
    llm = LLM(d, "offload", accelerator="fake-cuda", vram_mib=1024, kv_tokens=512, max_batch=4)
    try:
        assert llm.slot_budget.kv_bytes_per_token == PER_TOKEN
        assert llm.slot_budget.kv_reserve_tokens == 512
        # the snapshots' budget (V4's state lives on the card) and 4 sequences' fixed state
        cfg, ec = llm.config, llm.engine_config
        act = moe_activation_bytes(ec.max_step_tokens, cfg.top_k, 64, 32)
        snapshots = int(ec.snapshot_budget_mb * 2**20)
        assert llm.slot_budget.activation_bytes == act + snapshots + 4 * PER_SEQ
    finally:
        llm.close()
