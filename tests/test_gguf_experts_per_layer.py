"""Routed experts whose GGUF block types differ between layers (llama.cpp's Q4_K_M keeps the
ffn_down of about half the layers in Q6_K), kept in their blocks: per-layer block formats
(experts/formats.py ``layered_format``), one native call over every layer's banks and types
(native/dense/qmoe.h QMoeLayer).

Oracles, as tests/test_gguf_experts.py states them:
- ``block_moe_reference`` (plain torch, the kernels' int8 activations, exact block products):
  max |native - reference| <= 1e-3 * max |reference|; and, stronger, a layer's experts computed
  from per-layer banks equal, bit for bit, the same experts as single-pair banks (the same
  kernels read the same bytes).
- the experts dequantized to floats (what an engine without these kernels computes): the int8
  activations move the logits by ~1.5 %: ||d|| / ||logits|| < 3e-2, top-1 agreement >= 95 %.
"""

from __future__ import annotations

import logging
from pathlib import Path

import gguf_files
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_files import write_gguf
from test_gguf_experts import _prompt, _tiny, _TorchBlocks

from freetokend import LLM
from freetokend.experts.banks import ActivationSpec, ExpertBanks, moe_reference
from freetokend.experts.block_executor import BlockExecutor, available, block_moe_reference
from freetokend.experts.formats import (
    FORMATS,
    allocate,
    dequantize_banks,
    expert_rows,
    expert_tensors,
    get_format,
    layered_format,
    quantize_banks,
)
from freetokend.formats.gguf_file import GgufFile
from freetokend.models import gguf_experts
from freetokend.native import qlinear_native

pytestmark = pytest.mark.skipif(not available(), reason="ftdense not built")

ISAS = qlinear_native.isas()
E, H, INTER, K = 3, 256, 256, 4
# gate/up and down types both change between layers; layer 1 and 3 share a down bank
PAIRS = [("q4_k", "q6_k"), ("q4_k", "q4_k"), ("q5_k", "q6_k"), ("q8_0", "q4_k")]
# the fp32 attention kernels: the accelerator stand-in's attention is fp32 torch, and on this
# tiny random model the bf16 attention's roundings (an AVX512-BF16 CPU's default) flip router
# near-ties (measured ||d|| / ||logits|| 9.0e-2 for the offload check below); the experts'
# formats are what this file checks
LOAD = dict(max_model_len=128, kv_tokens=512, cpu_bf16_attention=False)


def _float_banks(n: int, seed: int) -> ExpertBanks:
    g = torch.Generator().manual_seed(seed)
    return ExpertBanks(
        torch.randn(n, 2 * INTER, H, generator=g) * 0.06,
        torch.randn(n, H, INTER, generator=g) * 0.06,
    )


def test_per_layer_format_names_banks_and_rows() -> None:
    assert layered_format([("q4_k", "q6_k")] * 3) == "q4_k/q6_k"  # one pair: the plain name
    name = layered_format([*PAIRS[:1] * 2, *PAIRS[1:]])
    assert name == "layers:q4_k/q6_k*2,q4_k,q5_k/q6_k,q8_0/q4_k"
    fmt = get_format(name)
    assert fmt.layer_types == (PAIRS[0], *PAIRS) and fmt.in_blocks
    assert name not in FORMATS  # built from its name, not listed among the choices
    with pytest.raises(ValueError, match="canonical"):
        get_format("layers:q4_k,q4_k")  # a run written twice
    with pytest.raises(ValueError, match="not a GGUF block format"):
        get_format("layers:q4_k,bf16")

    n = E * len(PAIRS)
    fmt = get_format(layered_format(PAIRS))
    shapes = fmt.shapes(n, H, INTER, torch.bfloat16)
    assert shapes == {  # one bank per projection and type, only its layers' experts: no padding
        "gate_up": ((2 * E, 2 * INTER, 144), torch.uint8),
        "gate_up.q5_k": ((E, 2 * INTER, 176), torch.uint8),
        "gate_up.q8_0": ((E, 2 * INTER, 8 * 34), torch.uint8),
        "down": ((2 * E, H, 210), torch.uint8),
        "down.q4_k": ((2 * E, H, 144), torch.uint8),
    }
    total = sum(torch.Size(s).numel() for s, _ in shapes.values())
    banks = allocate(fmt.name, n, H, INTER, torch.bfloat16)
    assert banks.num_flat == n and sum(t.numel() for t in banks.all_tensors().values()) == total
    assert banks.nbytes_per_expert() == fmt.nbytes_per_expert(H, INTER, torch.bfloat16)
    assert banks.nbytes_per_expert() == -(-total // n)
    # flat id 3 * E + 1: expert 1 of layer 3, row E + 1 of the q4_k down bank (layer 1 is first)
    assert (
        expert_rows(banks, "down", 3 * E + 1, 1).data_ptr()
        == banks.extra["down.q4_k"][E + 1].data_ptr()
    )
    with pytest.raises(ValueError, match="more than one layer"):
        expert_rows(banks, "down", E - 1, 2)

    # quantize_banks writes each layer in its own pair's blocks
    fb = _float_banks(n, seed=1)
    q = quantize_banks(fb, fmt.name)
    for layer, pair in enumerate(PAIRS):
        single = FORMATS["/".join(pair) if pair[0] != pair[1] else pair[0]]
        fid = layer * E + 2
        want = single.quantize(fb.gate_up[fid], fb.down[fid], torch.float32)
        assert torch.equal(expert_rows(q, "gate_up", fid, 1)[0], want["gate_up"])
        assert torch.equal(expert_rows(q, "down", fid, 1)[0], want["down"])


@pytest.fixture(scope="module")
def layered() -> ExpertBanks:
    return quantize_banks(_float_banks(E * len(PAIRS), seed=3), layered_format(PAIRS))


@pytest.mark.parametrize("t", [1, 3, 48])
def test_native_per_layer_banks_match_the_references_on_every_isa(
    layered: ExpertBanks, t: int
) -> None:
    banks, n = layered, E * len(PAIRS)
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, H, generator=g)
    ids = torch.stack([torch.randperm(n, generator=g)[:K] for _ in range(t)]).int()  # layers mix
    ids[0, -1] = -1
    w = torch.rand(t, K, generator=g)
    spec = ActivationSpec()
    ref = block_moe_reference(x, ids, w, banks, spec)
    deq = moe_reference(x, ids, w, dequantize_banks(banks), spec)
    scale = ref.abs().max().item()
    assert scale > 0.1
    for isa in ISAS:
        out = BlockExecutor(banks, spec, isa, chunk_bytes=16 * H).forward(x, ids, w)
        assert (out - ref).abs().max().item() <= 1e-3 * scale, isa
        assert ((out - deq).norm() / deq.norm()).item() < 3e-2, isa
    # each layer against its experts as banks of the layer's single pair (a copy of the same
    # bytes): the same kernels, so equal bit for bit (a wrong layer's bank, row or type is not)
    ex = BlockExecutor(banks, spec)
    for layer, (gu, dn) in enumerate(PAIRS):
        gate_up, down = (expert_rows(banks, p, layer * E, E).clone() for p in ("gate_up", "down"))
        single = ExpertBanks(gate_up, down, format=gu if gu == dn else f"{gu}/{dn}")
        local = torch.randint(0, E, (t, 2), generator=g).int()
        wl = torch.rand(t, 2, generator=g)
        got = ex.forward(x, local + layer * E, wl)
        assert torch.equal(got, BlockExecutor(single, spec).forward(x, local, wl)), layer


def test_native_layer_table_is_checked(layered: ExpertBanks) -> None:
    from freetokend.native import dense_native

    n = E * len(PAIRS)
    x, w = torch.randn(2, H), torch.rand(2, K)
    ex = BlockExecutor(layered, ActivationSpec())
    with pytest.raises(IndexError, match="outside"):
        ex.forward(x, torch.full((2, K), n, dtype=torch.int32), w)
    ptr = layered.gate_up.data_ptr()
    args = dict(gate_up=0, down=0, gate_up_type=0, down_type=0, gate_up_bias=0, down_bias=0)
    args |= dict(bias_bf16=False, hidden=H, inter=INTER, act=0, alpha=1.0, limit=7.0)
    with pytest.raises(ValueError, match="number of layers times layer_experts"):
        dense_native._native.QMoe(
            **args, num_flat=7, layers=[(ptr, ptr, 1, 1)] * 2, layer_experts=3
        )
    with pytest.raises(ValueError, match="multiple of the down type"):  # q4_k down, I = 32
        dense_native._native.QMoe(
            **(args | dict(inter=32)), num_flat=6, layers=[(ptr, ptr, 0, 1)] * 2, layer_experts=3
        )


# ---- GGUF files -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    return _tiny(tmp_path_factory.mktemp("qexp_layers"))  # 3 MoE layers, H = I = 256


def _write(hf, path: Path, types: list[tuple[Q, Q]], monkeypatch) -> Path:  # type: ignore[no-untyped-def]
    """A GGUF file whose block b's experts have gate/up type types[b][0], down types[b][1]
    (everything else F32)."""
    plain = gguf_files.quantize

    def per_layer(name: str, t: torch.Tensor, kind: str):  # type: ignore[no-untyped-def]
        if name.endswith("_exps.weight"):
            gu, dn = types[int(name.split(".")[1])]
            return gguf_files._quantize_as(t, dn if "ffn_down" in name else gu)
        return plain(name, t, kind)

    with monkeypatch.context() as m:
        m.setattr(gguf_files, "quantize", per_layer)
        return write_gguf("qwen3_moe", hf, path, "f32")


CASES = {  # as llama.cpp's Q4_K_M: some layers' ffn_down in Q6_K; and gate/up by layer too
    "q4_k_m": ([(Q.Q4_K, Q.Q6_K), (Q.Q4_K, Q.Q4_K), (Q.Q4_K, Q.Q6_K)], "layers:q4_k/q6_k,q4_k,q4_k/q6_k"),
    "gate_up": ([(Q.Q4_K, Q.Q6_K), (Q.Q8_0, Q.Q4_K), (Q.Q6_K, Q.Q6_K)], "layers:q4_k/q6_k,q8_0/q4_k,q6_k"),
}  # fmt: skip


class _FloatExperts:
    """An engine's experts computed by the plain-torch reference (fp32 activations)."""

    def __init__(self, llm: LLM) -> None:
        self.banks, self.act = llm.banks, llm.moe.act

    def forward(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return moe_reference(x, ids, w, self.banks, self.act)


def _f64(banks: ExpertBanks) -> ExpertBanks:
    return ExpertBanks(banks.gate_up.double(), banks.down.double())


def _record_moe_calls(llm: LLM, ids: list[int]) -> list[tuple[torch.Tensor, ...]]:
    """(x, flat ids, weights, output) of each executor call while ``llm`` computes ``ids``."""
    inner, calls = llm.moe.executor, []

    class Recorder:
        def forward(self, x: torch.Tensor, fid: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            out = inner.forward(x, fid, w)
            calls.append((x.clone(), fid.clone(), w.clone(), out.clone()))
            return out

    llm.moe.executor = Recorder()
    try:
        llm.logits(ids)
    finally:
        llm.moe.executor = inner
    return calls


def _expert_bytes(path: Path) -> tuple[int, dict[str, torch.Tensor]]:
    with GgufFile(path) as f:
        raw = {n: f.read_raw(t).clone() for n, t in f.tensors.items() if "_exps." in n}
        return sum(t.nbytes for n, t in f.tensors.items() if "_exps." in n), raw


@pytest.mark.parametrize("case", sorted(CASES))
def test_gguf_per_layer_expert_types_stay_in_blocks(  # type: ignore[no-untyped-def]
    tiny, tmp_path: Path, monkeypatch, caplog, case: str
) -> None:
    _, hf = tiny
    types, fmt = CASES[case]
    path = _write(hf, tmp_path / "m.gguf", types, monkeypatch)
    with caplog.at_level(logging.INFO):
        llm = LLM(path, "cpu", **LOAD)
    assert llm.banks.format == fmt and isinstance(llm.moe.executor, BlockExecutor)
    assert "keeping 9 expert tensors quantized (per-layer" in caplog.text
    assert "dequantizing" not in caplog.text

    # the banks hold the file's blocks byte for byte, and nothing else: RAM = the file's bytes
    file_bytes, raw = _expert_bytes(path)
    e = hf.config.num_experts
    for b in range(3):  # GGUF rows (expert_tensors undoes the cpu backend's interleaving)
        rows = [expert_tensors(llm.banks, fid) for fid in range(b * e, (b + 1) * e)]
        gate_up = torch.stack([r["gate_up"] for r in rows])
        assert torch.equal(gate_up[:, :INTER], raw[f"blk.{b}.ffn_gate_exps.weight"])
        assert torch.equal(gate_up[:, INTER:], raw[f"blk.{b}.ffn_up_exps.weight"])
        assert torch.equal(
            torch.stack([r["down"] for r in rows]), raw[f"blk.{b}.ffn_down_exps.weight"]
        )
    bank_bytes = sum(t.nbytes for t in llm.banks.all_tensors().values())
    assert bank_bytes == file_bytes

    oracle = LLM(path, "cpu", **LOAD)  # the same banks, computed by the torch block reference
    oracle.moe.executor = _TorchBlocks(oracle)
    with monkeypatch.context() as m:
        m.setattr(gguf_experts, "block_expert_format", lambda *a: None)
        deq = LLM(path, "cpu", **LOAD)  # the experts dequantized at load (the old path)
    assert deq.banks.format == "bf16"
    deq_bytes = sum(t.nbytes for t in deq.banks.all_tensors().values())
    assert deq_bytes > 2 * bank_bytes  # bf16: 2 bytes a weight against 0.56-1.06 in blocks
    # the reference computes its bf16 experts in plain torch on fp32 activations, whatever the
    # executor's ISA default: the bf16-dot kernels (auto's pick in 47049f5, opt-in since) round x
    # and act to bf16, a second activation rounding these bounds do not budget, and on this tiny
    # random model any rounding change can flip a router near-tie. Measured with the bf16-dot
    # reference: gate_up, seed 4, ||d|| / ||logits|| 5.1e-2 (1.5e-2 with fp32 activations; one
    # token's routed set moves in the last layer); q4_k_m, seed 5, the offload path 1.1e-1
    # (8e-3; three routed sets move)
    deq.moe.executor = _FloatExperts(deq)

    # each MoE layer's call on the same inputs (so the same routes): the kept blocks against
    # fp64 on the dequantized blocks; only the int8 activations part them (measured 1.6-1.8e-2
    # on each layer of both cases with the K-quants' 256-input activation groups, 1.2e-2 when
    # they read 32-input ones); a wrong layer's bank, row or type is O(1) here (flat ids read
    # one layer off, as an off-by-one layer table would: 1.4 on every layer)
    calls = _record_moe_calls(llm, _prompt(24, seed=4))
    assert len(calls) == 3
    exact = dequantize_banks(llm.banks)
    for layer, (x, fid, w, out) in enumerate(calls):
        assert bool(((fid // e == layer) | (fid < 0)).all())  # flat ids of this layer only
        want64 = moe_reference(x.double(), fid, w.double(), _f64(exact), llm.moe.act)
        assert ((out.double() - want64).norm() / want64.norm()).item() < 3e-2, layer
    # teacher-forced, against the dequantized experts (measured ||d|| / ||logits|| 5.4e-2 for
    # gate_up, 2.0e-2 for q4_k_m, top-1 all equal; 1.5e-2 for both when the K-quants read
    # 32-input activation groups instead of llama.cpp's 256). Greedy decoding is checked against the torch
    # block reference instead: on this tiny random model the int8 activations flip router
    # near-ties (a uniform q4_k/q6_k file, on the single-pair path, parts from its dequantized
    # load by up to 8e-2 relative on other prompts, measured), which the dequantized load
    # cannot tell from a bug.
    ids = _prompt(24, seed=4)
    got, want = llm.logits(ids), deq.logits(ids)
    assert 1e-3 < (got - want).abs().max() and (got - want).norm() / want.norm() < 8e-2
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.95
    seq = llm.generate(ids, 16, ignore_eos=True)
    assert seq == oracle.generate(ids, 16, ignore_eos=True)
    # fp64 reference sums against fp32 kernels over a bf16 model: an ulp apart, then a step of
    # a bf16 or int8 rounding further on: measured <= 1.9e-2 with 32-input activation groups,
    # 5.8e-2 (gate_up) with the K-quants' 256; a wrong layer's bank, row or type moves the
    # logits by O(1) (the dequantized load's scale)
    assert (llm.logits(ids + seq) - oracle.logits(ids + seq)).abs().max() < 0.1

    # an accelerator backend dequantizes the per-layer banks for the device (stand-in: the
    # offload path and its slot cache on the CPU) and computes float experts as ``deq`` does
    off = LLM(path, "offload", accelerator="standin", moe_slots=4, **LOAD)
    assert off.moe.host_format == fmt
    ids = _prompt(24, seed=5)
    got, want = off.logits(ids), deq.logits(ids)
    assert (got - want).norm() / want.norm() < 3e-2
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.95


def test_block_expert_format_per_layer() -> None:
    from types import SimpleNamespace

    def t(name: str):  # type: ignore[no-untyped-def]
        return SimpleNamespace(type_name=name, quantized=name not in ("F32", "BF16"))

    def fmt(*layers: tuple[str, str, str], inter: int = INTER) -> str | None:
        tensors = {
            f"blk.{b}.ffn_{p}_exps.weight": t(ty)
            for b, types in enumerate(layers)
            for p, ty in zip(("gate", "up", "down"), types, strict=True)
        }
        return gguf_experts.block_expert_format(tensors, H, inter)  # type: ignore[arg-type]

    assert fmt(("Q4_K", "Q4_K", "Q6_K"), ("Q4_K", "Q4_K", "Q6_K")) == "q4_k/q6_k"
    assert fmt(*[("Q4_K", "Q4_K", d) for d in ("Q6_K", "Q6_K", "Q4_K", "Q6_K")]) == (
        "layers:q4_k/q6_k*2,q4_k,q4_k/q6_k"
    )
    assert fmt(("Q4_K", "Q4_K", "Q8_0"), ("Q5_K", "Q5_K", "Q8_0")) == "layers:q4_k/q8_0,q5_k/q8_0"
    assert fmt(("Q4_K", "Q8_0", "Q8_0"), ("Q4_K", "Q4_K", "Q8_0")) is None  # gate != up
    assert fmt(("Q4_K", "Q4_K", "Q8_0"), ("IQ2_XS", "IQ2_XS", "Q8_0")) is None  # no kernel
    assert fmt(("Q4_K", "Q4_K", "Q8_0"), ("F32", "F32", "F32")) is None  # one layer float
    # I = 32: q8_0 down fits, but a layer's q4_k down needs I a multiple of 256
    assert fmt(("Q8_0", "Q8_0", "Q8_0"), ("Q8_0", "Q8_0", "Q4_K"), inter=32) is None


def test_ftw_conversion_keeps_per_layer_blocks(tiny, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """`ftctl checkpoint --model X.gguf`: the FTW folder stores every per-layer bank as it is."""
    from freetokend.models.ftw_convert import convert

    _, hf = tiny
    types, fmt = CASES["gate_up"]
    path = _write(hf, tmp_path / "m.gguf", types, monkeypatch)
    convert(path, tmp_path / "ftw")
    src, ftw = (LLM(p, "cpu", **LOAD) for p in (path, tmp_path / "ftw"))
    assert ftw.banks.format == src.banks.format == fmt
    assert isinstance(ftw.moe.executor, BlockExecutor)
    a, b = src.banks.all_tensors(), ftw.banks.all_tensors()
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    ids = _prompt(16, seed=8)
    assert torch.equal(ftw.logits(ids), src.logits(ids))
