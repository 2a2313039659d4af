"""Expert formats: bit layouts on hand-made values, round trips within each format's error bound."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from freetokend.experts.banks import Activation, ActivationSpec, ExpertBanks, moe_reference
from freetokend.experts.formats import (
    FORMATS,
    allocate,
    dequantize_banks,
    dequantize_expert,
    get_format,
    layer_experts,
    layered_format,
    quantize_banks,
)
from freetokend.experts.microscale import (
    E2M1_VALUES,
    e2m1_decode,
    e2m1_encode,
    e8m0_decode,
    pack_nibbles,
    unpack_nibbles,
)

H, INTER = 128, 96  # multiples of 32; INTER < 128 leaves partial fp8 blocks


def _weights(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(2 * INTER, H, generator=g) * 0.05
    down = torch.randn(H, INTER, generator=g) * 0.05
    gate_up[3, 7] = 0.0  # an exact zero and a lone outlier per matrix
    down[5, 1] = 0.9
    return gate_up, down


# ---- bit layouts ------------------------------------------------------------------------------


def test_e2m1_table_follows_the_bit_fields():
    for code in range(16):
        s, e, m = (code >> 3) & 1, (code >> 1) & 3, code & 1
        mag = m * 0.5 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2)  # exponent bias 1
        val = -mag if s else mag
        assert E2M1_VALUES[code].item() == val
        assert e2m1_decode(torch.tensor([code], dtype=torch.uint8)).item() == val
    assert torch.signbit(E2M1_VALUES[8])  # code 8 is -0


def test_e2m1_encode_ties_to_even_and_saturates():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 100.0, -0.3, -5.1, 0.0])
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -0.5, -6.0, 0.0]
    assert e2m1_decode(e2m1_encode(x)).tolist() == want
    assert e2m1_encode(torch.tensor([1.5, -6.0])).tolist() == [0b0011, 0b1111]


@given(st.floats(min_value=-6.0, max_value=6.0, allow_nan=False, width=32))
def test_e2m1_encode_is_nearest(v):
    got = e2m1_decode(e2m1_encode(torch.tensor([v]))).item()
    assert abs(got - v) == (E2M1_VALUES - v).abs().min().item()


def test_nibble_order_low_first():
    codes = torch.tensor([[1, 2, 15, 9]], dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.tolist() == [[0x21, 0x9F]]
    assert torch.equal(unpack_nibbles(packed), codes)


def test_e8m0_bias_127():
    e = torch.tensor([127, 128, 126, 0, 254], dtype=torch.uint8)
    assert e8m0_decode(e).tolist() == [1.0, 2.0, 0.5, 2.0**-127, 2.0**127]


def test_fp8_e4m3_bytes():
    b = torch.tensor([0x38, 0x40, 0x7E, 0x01, 0xB8], dtype=torch.uint8)
    assert b.view(torch.float8_e4m3fn).float().tolist() == [1.0, 2.0, 448.0, 2.0**-9, -1.0]


def test_mxfp4_hand_made_expert():
    shapes = get_format("mxfp4").specs(32, 32, torch.bfloat16)
    t = {n: torch.zeros(s, dtype=dt) for n, (s, dt) in shapes.items()}
    t["gate_up"][:] = 0x21  # elements 0.5, 1.0, 0.5, 1.0, ...
    t["gate_up_scale"][:] = 127
    t["gate_up_scale"][0] = 128  # row 0 doubled
    t["gate_up_scale"][1] = 126  # row 1 halved
    t["down"][0, 0] = 0x9F  # elements -6, -0.5 then zeros
    t["down_scale"][:] = 127
    gate_up, down = get_format("mxfp4").dequantize(t)
    assert gate_up.shape == (64, 32) and down.shape == (32, 32)
    assert gate_up[0, :4].tolist() == [1.0, 2.0, 1.0, 2.0]
    assert gate_up[1, :4].tolist() == [0.25, 0.5, 0.25, 0.5]
    assert gate_up[2, :2].tolist() == [0.5, 1.0]
    assert down[0, :3].tolist() == [-6.0, -0.5, 0.0]


def test_nvfp4_hand_made_expert():
    fmt = get_format("nvfp4")
    t = {n: torch.zeros(s, dtype=dt) for n, (s, dt) in fmt.specs(16, 16, torch.bfloat16).items()}
    t["gate_up"][:, 0] = 0x9F  # elements -6, -0.5
    t["gate_up_scale"].view(torch.uint8)[:] = 0x40  # fp8 2.0
    t["gate_up_global"][:] = torch.tensor([0.5, 0.25])  # gate, up
    t["down"][3, 1] = 0x01  # element 2 = 0.5, element 3 = 0
    t["down_scale"].view(torch.uint8)[:] = 0x38  # fp8 1.0
    t["down_global"][0] = 4.0
    gate_up, down = fmt.dequantize(t)
    assert gate_up[0, :2].tolist() == [-6.0, -0.5]  # * 2 * 0.5
    assert gate_up[16, :2].tolist() == [-3.0, -0.25]  # up half: * 2 * 0.25
    assert down[3, :4].tolist() == [0.0, 0.0, 2.0, 0.0]


def test_fp8_block_hand_made_halves_blocked_separately():
    fmt = get_format("fp8_block")
    h, i = 160, 64  # partial blocks along H; gate and up each one block row
    t = {n: torch.zeros(s, dtype=dt) for n, (s, dt) in fmt.specs(h, i, torch.bfloat16).items()}
    assert t["gate_up_scale"].shape == (2, 2) and t["down_scale"].shape == (2, 1)
    t["gate_up"].view(torch.uint8)[:] = 0x38  # 1.0
    t["gate_up_scale"][:] = torch.tensor([[2.0, 3.0], [5.0, 7.0]])
    t["down"].view(torch.uint8)[:] = 0xB8  # -1.0
    t["down_scale"][:] = torch.tensor([[2.0], [3.0]])
    gate_up, down = fmt.dequantize(t)
    assert gate_up[0, 0] == 2.0 and gate_up[63, 159] == 3.0  # gate rows
    assert gate_up[64, 0] == 5.0 and gate_up[127, 128] == 7.0  # up rows use the second scale row
    assert down[127, 0] == -2.0 and down[128, 63] == -3.0


# ---- round trips ------------------------------------------------------------------------------


def _scale_of(
    name: str, q: dict[str, torch.Tensor], which: str, shape: tuple[int, int]
) -> torch.Tensor:
    """The per-element effective scale X of a quantised matrix (which = gate_up | down)."""
    r, c = shape
    if name == "mxfp4":
        return e8m0_decode(q[f"{which}_scale"]).repeat_interleave(32, 1)
    glob = q[f"{which}_global"]
    per_row = glob.repeat_interleave(r // len(glob)).unsqueeze(1)
    return q[f"{which}_scale"].float().repeat_interleave(16, 1) * per_row


@pytest.mark.parametrize(
    "dtype,rel", [(torch.float32, 0.0), (torch.bfloat16, 2.0**-8), (torch.float16, 2.0**-11)]
)
def test_bf16_round_trip(dtype, rel):
    ref = _weights(0)
    q = get_format("bf16").quantize(*ref, dtype)
    assert q["gate_up"].dtype == dtype
    for r, d in zip(ref, get_format("bf16").dequantize(q), strict=True):
        # half an ulp; below the smallest normal the (subnormal) step stays that of the smallest normal
        assert ((d - r).abs() <= rel * r.abs().clamp(min=torch.finfo(dtype).smallest_normal)).all()


def test_fp8_block_round_trip():
    ref = _weights(1)
    q = get_format("fp8_block").quantize(*ref, torch.bfloat16)
    gs = q["gate_up_scale"]
    # each scale is its block's amax / 448 (gate block row 0, up block row 1)
    assert torch.isclose(gs[0, 0], ref[0][:INTER, :128].abs().max() / 448)
    assert torch.isclose(gs[1, 0], ref[0][INTER:, :128].abs().max() / 448)
    deq = get_format("fp8_block").dequantize(q)
    scales = {
        "gate_up": torch.cat(
            [gs[0:1].repeat_interleave(INTER, 0), gs[1:2].repeat_interleave(INTER, 0)]
        ),
        "down": q["down_scale"].repeat_interleave(128, 0)[:H],
    }
    for which, r, d in zip(("gate_up", "down"), ref, deq, strict=True):
        x = scales[which].repeat_interleave(128, 1)[:, : r.shape[1]]
        # 3 mantissa bits: half an ulp is 2^-4 relative; subnormals (below 2^-6) step 2^-9
        bound = torch.maximum(r.abs() * 2.0**-4, x * 2.0**-10)
        assert ((d - r).abs() <= bound * 1.0001).all()


@pytest.mark.parametrize("name", ["mxfp4", "nvfp4"])
def test_fp4_round_trip(name):
    ref = _weights(2)
    fmt = get_format(name)
    q = fmt.quantize(*ref, torch.bfloat16)
    for which, r, d in zip(("gate_up", "down"), ref, fmt.dequantize(q), strict=True):
        x = _scale_of(name, q, which, tuple(r.shape))
        # e2m1 steps are 0.5 below 2, 1 up to 4, 2 up to 6: half a step <= max(|v|, 1) / 4
        bound = 0.25 * torch.maximum(r.abs(), x)
        assert ((d - r).abs() <= bound * 1.0001).all(), name
        rel = (d - r).norm() / r.norm()
        assert rel < 0.15, f"{name} {which}: relative error {rel}"


def test_mxfp4_scale_is_smallest_unsaturated_power_of_two():
    ref = _weights(3)
    q = get_format("mxfp4").quantize(*ref, torch.bfloat16)
    amax = ref[1].reshape(H, INTER // 32, 32).abs().amax(-1)
    x = e8m0_decode(q["down_scale"])
    assert (amax <= 6 * x).all() and (amax > 3 * x).all()
    # re-quantising dequantised weights is exact: every value is already on the grid
    deq = get_format("mxfp4").dequantize(q)
    again = get_format("mxfp4").dequantize(get_format("mxfp4").quantize(*deq, torch.bfloat16))
    assert all(torch.equal(a, b) for a, b in zip(deq, again, strict=True))


def test_nvfp4_global_scale_puts_largest_block_on_fp8_max():
    ref = _weights(4)
    q = get_format("nvfp4").quantize(*ref, torch.bfloat16)
    assert torch.isclose(q["down_global"][0], ref[1].abs().max() / (6 * 448))
    assert q["down_scale"].float().max() == 448.0
    assert q["gate_up_global"].shape == (2,)


# ---- schemas and banks ------------------------------------------------------------------------


# formats whose blocks divide these sizes (the 256-input K-quant blocks: test_gguf_experts)
@pytest.mark.parametrize(
    "name", [n for n, f in FORMATS.items() if H % f.multiples()[0] == INTER % f.multiples()[1] == 0]
)
def test_schema_matches_quantize_output(name):
    fmt = get_format(name)
    q = fmt.quantize(*_weights(5), torch.bfloat16)
    specs = fmt.specs(H, INTER, torch.bfloat16)
    assert set(q) == set(specs)
    for n, (shape, dt) in specs.items():
        assert tuple(q[n].shape) == shape and q[n].dtype == dt, n
    banks = allocate(name, 6, H, INTER, torch.bfloat16, bias=True)
    assert banks.format == name
    sizes = sum(
        t[0].numel() * t.element_size() for n, t in banks.all_tensors().items() if "bias" not in n
    )
    assert sizes == fmt.nbytes_per_expert(H, INTER, torch.bfloat16)
    bias = sum(t[0].numel() * t.element_size() for n, t in banks.tensors().items() if "bias" in n)
    assert banks.nbytes_per_expert() == sizes + bias  # the scale banks count


def test_dims_must_fit_the_packing():
    with pytest.raises(ValueError, match="multiples of 32"):
        get_format("mxfp4").specs(48, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="unknown expert format 'int3'"):
        get_format("int3")


def test_per_layer_banks_count_their_flat_ids():
    """``ExpertBanks.num_flat`` of per-layer block banks: the rows of their gate_up banks, one
    per gate_up type (banks.py parses no format name), E experts a MoE layer; biases apart."""
    e, h, i = 3, 256, 256
    pairs = [("q4_k", "q6_k"), ("q5_k", "q6_k"), ("q4_k", "q4_k"), ("q8_0", "q6_k")]
    with torch.device("meta"):
        banks = allocate(layered_format(pairs), e * len(pairs), h, i, torch.bfloat16, bias=True)
    assert {"gate_up.q5_k", "gate_up.q8_0"} <= set(banks.extra) and banks.gate_up_bias is not None
    assert banks.num_flat == e * len(pairs) == layer_experts(banks) * len(pairs)


@pytest.mark.parametrize("name", ["fp8_block", "mxfp4", "nvfp4"])
def test_quantized_banks_reference_moe(name):
    n = 4
    pairs = [_weights(10 + k) for k in range(n)]
    dense = ExpertBanks(torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs]))
    qb = quantize_banks(dense, name)
    assert qb.format == name and set(qb.extra) == set(
        get_format(name).specs(H, INTER, torch.float32)
    ) - {"gate_up", "down"}
    deq = dequantize_banks(qb)
    # expert fid of the banks is expert fid of the input, quantised on its own
    for fid in range(n):
        alone = get_format(name).dequantize(get_format(name).quantize(*pairs[fid], torch.float32))
        assert torch.equal(deq.gate_up[fid], alone[0]) and torch.equal(deq.down[fid], alone[1])
        assert torch.equal(dequantize_expert(qb, fid)[1], alone[1])
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, H, generator=g)
    ids = torch.randint(0, n, (5, 2), generator=g)
    w = torch.rand(5, 2, generator=g)
    act = ActivationSpec(Activation.SILU)
    ref = moe_reference(x, ids, w, dense, act)
    got = moe_reference(x, ids, w, deq, act)
    # the output error stays within the weights' relative errors, which roughly add up
    eps = sum(
        (
            (deq.gate_up - dense.gate_up).norm() / dense.gate_up.norm(),
            (deq.down - dense.down).norm() / dense.down.norm(),
        )
    )
    assert ((got - ref).norm() / ref.norm()) < 1.5 * eps
