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
from freetokend.engine.runner import Work
from freetokend.experts.banks import Activation, activation_of
from freetokend.models.deepseek_v4_model import DeepseekV4CausalLM
from freetokend.models.layers.decode_lane import DecodeLane


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
