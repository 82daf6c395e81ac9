"""Weight-only int8/int4 quantization: formats, layers against their dequantized reference, GGUF block
decoding against gguf's own dequantization, quantized loading, and the engine (greedy and speculative) on
quantized tiny models. Slow tier: the real Qwen2.5-Coder-1.5B read quantized from its GGUF."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT
from torch import nn

from specserve import LLM, SamplingParams, SpecserveError
from specserve.cli import build_parser
from specserve.config import EngineConfig, SpeculativeConfig
from specserve.layers import kernels
from specserve.layers.fusion import project
from specserve.layers.linear import PackedLinear, SmallLinear, pack_linears
from specserve.layers.mlp import GatedMLP
from specserve.layers.quant import (
    COMPUTE_DTYPE,
    Int4Linear,
    Int8Linear,
    TorchInt4,
    fuse_projections,
    int8_from_q8_0,
    quantize_int4,
    quantize_int8,
    quantize_linear,
    quantize_model,
)
from specserve.models import gguf as sgguf
from specserve.models import gguf_quantized, gguf_tensors
from specserve.models.loader import load_model, resolve_model
from tests import test_lossless
from tests.paged_harness import PagedHarness
from tests.test_linear import assert_batch_invariant
from tests.test_loader import gguf_writer, write_tiny_gguf
from tests.tiny_models import VOCAB, build_reference, save_tiny_drafter

MODES = ["int8", "int4"]
# Layers run on specserve's kernel where it is built, else on torch's; both are tested where both exist.
USE_KERNEL = [pytest.param(False, id="torch")] + ([pytest.param(True, id="kernel")] if kernels.ops() else [])
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def random_weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Rows of very different magnitudes, an outlier, a zero row and a constant stretch."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 1, n)[:, None]
    w[0, 5] = 40.0
    w[1] = 0.0
    w[2, :64] = 0.7
    return w


# --------------------------------------------------------------------------------------------- formats


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("k", [256, 352])  # 352: 11 groups of 32, the last super-block partial
def test_int4_round_trip_is_within_half_a_step(group_size, k):
    if k % group_size:
        pytest.skip("K is not a multiple of the group")
    w = random_weight(48, k)
    w[3] = w[3].abs() + 0.5  # a row of positive weights: positive minimums
    quantized = quantize_int4(w, group_size)
    assert quantized.q.dtype == torch.uint8 and int(quantized.q.max()) <= 15
    assert quantized.sub_scales.shape == (48, k // group_size) and quantized.d.shape == (
        48,
        -(-k // group_size // 8),
    )
    assert torch.equal(quantized.d.half().float(), quantized.d)  # fp16 values
    scales = quantized.scales()
    step = scales.repeat_interleave(group_size, dim=1)
    err = (quantized.dequantize() - w).abs()
    assert (err <= 0.5 * step * (1 + 2**-20) + 1e-7 * w.abs()).all()  # the grid covers every group
    assert err.mean() < 0.3 * scales.mean()
    # a step covers the group's range / 15, widened by the minimum's rounding (< dmin) and its own (< d)
    d, dmin = (v.repeat_interleave(8, dim=1)[:, : scales.shape[1]] for v in (quantized.d, quantized.dmin))
    groups = w.reshape(48, -1, group_size)
    assert (scales <= (groups.amax(-1) - groups.amin(-1) + dmin) / 15 + d).all()


@pytest.mark.parametrize("group_size", [32, 64])
def test_int8_round_trip_is_within_half_a_step(group_size):
    w = random_weight(48, 256)
    q, scales = quantize_int8(w, group_size)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127 and scales.shape == (48, 256 // group_size)
    step = scales.repeat_interleave(group_size, dim=1)
    err = (q.float() * step - w).abs()
    # half a step, plus what the scale's rounding to fp16 moves the group's largest weight by
    assert (err <= 0.5 * step * (1 + 2**-20) + 2**-11 * w.abs()).all()
    assert err.mean() < 0.3 * scales.mean()


@pytest.mark.parametrize("use_kernel", USE_KERNEL)
def test_q8_0_codes_are_kept_with_only_the_scale_rounded(use_kernel):
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (32, 128), dtype=torch.int8, generator=g)
    d = torch.rand(32, 4, generator=g) * 0.02 + 1e-3
    layer = Int8Linear(q, d, use_kernel=use_kernel)
    assert layer.on_kernel == use_kernel
    # the kernel stores d in fp16 (Q8_0's own d is fp16: exact), torch's two int4 planes in bf16
    rounded = d.half() if use_kernel else d.to(COMPUTE_DTYPE)
    assert torch.equal(layer.weight, q.float() * rounded.float().repeat_interleave(32, dim=1))
    planes = int8_from_q8_0(q, d)
    assert torch.equal(
        TorchInt4(*planes[0]).weight + TorchInt4(*planes[1]).weight, Int8Linear(q, d, use_kernel=False).weight
    )


# ---------------------------------------------------------------------------------------------- layers


def kernel_error_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """specserve's kernel: half an int8 step of each input block (max|x| / 127 per 32 inputs) times the
    weights it meets, plus fp32 rounding."""
    rows = x.reshape(-1, x.shape[-1])
    steps = rows.abs().reshape(len(rows), -1, 32).amax(-1) / 127
    per_block = weight.abs().reshape(len(weight), -1, 32).sum(-1)
    bound = 0.5 * steps @ per_block.t() + 1e-5 * (rows.abs() @ weight.abs().t())
    return bound.reshape(*x.shape[:-1], len(weight))


def quantized(mode: str, weight, bias=None, use_kernel: bool | None = None, group_size: int = 32):
    if mode == "int8":
        return Int8Linear(*quantize_int8(weight, group_size), bias, use_kernel=use_kernel)
    return Int4Linear(quantize_int4(weight, group_size), bias, use_kernel=use_kernel)


@pytest.mark.parametrize("use_kernel", USE_KERNEL)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("in_features,out_features", [(64, 48), (256, 128), (1536, 256)])
@pytest.mark.parametrize("bias", [False, True])
def test_layer_equals_its_dequantized_reference(mode, in_features, out_features, bias, use_kernel):
    torch.manual_seed(0)
    dense = nn.Linear(in_features, out_features, bias=bias)
    layer = quantized(mode, dense.weight, dense.bias, use_kernel)
    assert layer.on_kernel == use_kernel
    inputs = [torch.randn(in_features)]  # 1-D
    inputs += [torch.randn(m, in_features) for m in (1, 2, 3, 5, 16, 33)]
    inputs += [torch.randn(2, 5, in_features), torch.randn(in_features, 6).t()]  # 3-D, strided
    with torch.inference_mode():
        if use_kernel:  # int8 activations (per block of 32), fp32 out
            for x in inputs:
                y = layer(x)
                ref = F.linear(x, layer.weight, layer.bias)
                assert y.shape == ref.shape and y.dtype == torch.float32
                assert ((y - ref).abs() <= kernel_error_bound(x, layer.weight)).all(), tuple(x.shape)
            assert layer(torch.randn(0, in_features)).shape == (0, out_features)
            return
        # torch's: dequantized fp32 weights of each kernel call (int8 makes two, one per int4 plane)
        planes = [p.weight for p in ([layer.coarse, layer.residual] if mode == "int8" else [layer.plane])]
        weight = sum(planes)
        for x in inputs:
            # the reference: the dequantized weight applied in fp32 to the bf16-rounded input
            x_bf16 = x.to(COMPUTE_DTYPE).float()
            y, products = layer(x), [F.linear(x_bf16, w) for w in planes]
            ref = sum(products) if layer.bias is None else sum(products) + layer.bias
            assert y.shape == ref.shape and y.dtype == torch.float32
            # exact up to fp rounding: fp32 accumulation order, and each call's bf16 output (2^-8 relative)
            bound = 2**-8 * sum(p.abs() for p in products) + 1e-5 * (x_bf16.abs() @ weight.abs().t())
            assert ((y - ref).abs() <= bound).all(), tuple(x.shape)
        assert layer(torch.randn(0, in_features)).shape == (0, out_features)


@pytest.mark.parametrize("use_kernel", USE_KERNEL)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("in_features,out_features", [(64, 256), (512, 256), (1536, 1536)])
def test_layer_is_batch_invariant(mode, in_features, out_features, use_kernel):
    """A row's output does not depend on the other rows: what makes greedy speculation exact."""
    layer = quantized(mode, random_weight(out_features, in_features), None, use_kernel)
    planes = [layer.coarse, layer.residual] if mode == "int8" and not use_kernel else []
    for path in [layer, *planes]:
        assert_batch_invariant(path, in_features)


@pytest.mark.parametrize("use_kernel", USE_KERNEL)
def test_int4_codes_read_back(use_kernel):
    quantized = quantize_int4(random_weight(64, 256), 32)
    layer = Int4Linear(quantized, use_kernel=use_kernel)
    assert torch.equal(layer.codes(), quantized.q)
    if use_kernel:  # the two levels exactly
        assert all(torch.equal(a, b) for a, b in zip(layer.int4_weights(), quantized))
        assert torch.equal(layer.weight, quantized.dequantize())
    else:  # torch's kernel: (q - 8) * s + z with s and z rounded to bf16
        scales, mins = quantized.scales(), quantized.mins()
        zeros = (mins + 8 * scales).to(COMPUTE_DTYPE).float()
        expected = (quantized.q.float() - 8) * scales.to(COMPUTE_DTYPE).float().repeat_interleave(32, 1)
        assert torch.equal(layer.weight, expected + zeros.repeat_interleave(32, 1))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_every_linear_of_a_quantized_model_is_batch_invariant(mode, arch, tiny_model_dir):
    """The quantized layers and those left fp32 (int8's head, MoE routers), as the loader leaves them."""
    model, _, _ = load_model(str(tiny_model_dir(arch)), quantization=mode)
    kinds = nn.Linear | PackedLinear | Int8Linear | Int4Linear
    layers = {id(m): (name, m) for name, m in model.named_modules() if isinstance(m, kinds)}
    for name, layer in layers.values():
        try:
            assert_batch_invariant(layer, layer.in_features)
        except AssertionError as exc:
            raise AssertionError(f"{name} ({type(layer).__name__}): {exc}") from None
    assert isinstance(model.lm_head, PackedLinear | SmallLinear) == (mode == "int8")  # int8 keeps it fp32


@pytest.mark.parametrize("mode", MODES)
def test_quantize_model_replaces_what_the_kernel_takes(mode):
    model = nn.ModuleDict(
        {
            "up": nn.Linear(64, 128),
            "odd": nn.Linear(64, 40),  # N % 16 != 0: the kernel packs output channels by 16
            "narrow": nn.Linear(24, 64),  # no group size (>= 32) divides K
            "mlp": nn.ModuleDict({"gate": nn.Linear(64, 32)}),  # a MoE router: stays fp32
            "lm_head": nn.Linear(64, 256),
        }
    )
    quantized = {"int8": Int8Linear, "int4": Int4Linear}[mode]
    assert quantize_model(model, mode) == (1 if mode == "int8" else 2)
    assert isinstance(model["up"], quantized) and type(model["odd"]) is nn.Linear
    assert type(model["narrow"]) is nn.Linear and type(model["mlp"]["gate"]) is nn.Linear
    # the head: quantized by default in int4 (speed), kept fp32 in int8 (bf16 logits reorder near ties)
    assert isinstance(model["lm_head"], quantized) == (mode == "int4")
    assert quantize_model(model, mode, lm_head=True) == (1 if mode == "int8" else 0)
    assert isinstance(model["lm_head"], quantized)
    with pytest.raises(SpecserveError, match="quantization must be one of"):
        quantize_model(model, "int3")


needs_kernel = pytest.mark.skipif(not kernels.ops(), reason="projections are fused on specserve's kernel")


@needs_kernel
@pytest.mark.parametrize("mode", MODES)
def test_projections_of_one_input_are_fused_with_the_same_bits(mode, tiny_model_dir):
    """q/k/v (with Qwen2's biases) and gate/up run as one layer each: outputs bitwise those of the layers
    alone, which keep working on views of the fused buffers; the model's logits do not change."""
    model, _, _ = load_model(str(tiny_model_dir("qwen2")), quantization=mode)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    groups = [(attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)]
    x = torch.randn(5, attn.q_proj.in_features)
    for layers in groups:
        fusion = layers[0].fusion
        assert fusion.members == layers
        for layer, together in zip(layers, project(x, *layers), strict=True):
            assert torch.equal(together, layer(x))
            assert (
                layer.packed.untyped_storage().data_ptr() == fusion.layer.packed.untyped_storage().data_ptr()
            )
    assert attn.q_proj.fusion.layer.bias is not None  # Qwen2's q/k/v biases, side by side
    tokens = prompts(1)[0]
    fused_logits = PagedHarness(model, num_blocks=32).step([(0, tokens)])[0]
    for module in model.modules():
        module.__dict__.pop("fusion", None)  # every projection called on its own again
    assert torch.equal(PagedHarness(model, num_blocks=32).step([(0, tokens)])[0][0], fused_logits[0])


@pytest.mark.parametrize(
    "gate,up,fused",
    [
        (("int4", 32, True), ("int4", 32, True), True),
        (("int8", 32, True), ("int8", 32, True), True),
        (("int4", 32, True), ("int8", 32, True), False),  # two formats
        (("int4", 32, True), ("int4", 64, True), False),  # two group sizes
        (("int4", 32, False), ("int4", 32, False), False),  # torch's kernel
    ],
)
def test_only_layers_of_one_format_on_the_kernel_are_fused(gate, up, fused):
    if (gate[2] or up[2]) and not kernels.ops():
        pytest.skip("needs specserve's kernel")
    mlp = GatedMLP(64, 128)
    for name, (mode, group, on_kernel) in (("gate_proj", gate), ("up_proj", up)):
        setattr(mlp, name, quantized(mode, random_weight(128, 64), use_kernel=on_kernel, group_size=group))
    x = torch.randn(3, 64)
    alone = mlp(x)
    assert fuse_projections(mlp) == int(fused) and fuse_projections(mlp) == 0  # once only
    assert (getattr(mlp.gate_proj, "fusion", None) is not None) == fused
    assert torch.equal(mlp(x), alone)


@pytest.mark.parametrize("mode", MODES)
def test_quantizing_packed_layers_equals_quantizing_dense_ones(mode):
    torch.manual_seed(0)
    dense = nn.Sequential(nn.Linear(128, 256), nn.SiLU(), nn.Linear(256, 128))
    packed = copy.deepcopy(dense)
    assert pack_linears(packed, min_features=1, enabled=True) == 2
    assert isinstance(packed[0], PackedLinear | SmallLinear)
    assert quantize_model(dense, mode) == quantize_model(packed, mode) == 2
    x = torch.randn(3, 128)
    with torch.inference_mode():
        assert torch.equal(dense(x), packed(x))


# ------------------------------------------------------------------------------------------------ GGUF


def random_q4_k(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Valid Q4_K rows (gguf-py cannot quantize to Q4_K): random codes and 6-bit pairs, small fp16 d/dmin."""
    blocks = rng.integers(0, 256, (rows, cols // 256, 144), dtype=np.uint8)
    for start in (0, 2):  # d, then dmin
        halves = rng.uniform(1e-3, 1e-2, (rows, cols // 256)).astype(np.float16)
        blocks[..., start : start + 2] = halves[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


def gguf_blocks(qtype: QT, x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    return random_q4_k(*x.shape, rng) if qtype == QT.Q4_K else gguf.quants.quantize(x, qtype)


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_K])
def test_block_decoding_equals_gguf_dequantization(qtype):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((48, 512)).astype(np.float32)
    raw = gguf_blocks(qtype, x, rng)
    expected = gguf.quants.dequantize(raw, qtype)
    if qtype == QT.Q8_0:
        q, scales = gguf_quantized.decode_q8_0(raw)
        decoded = q.float().view(48, -1, 32) * scales[..., None]
    else:
        weights = gguf_quantized.decode_q4_k(raw)
        assert weights.q.dtype == torch.uint8 and int(weights.q.max()) <= 15 and weights.group_size == 32
        decoded = weights.dequantize()
    np.testing.assert_array_equal(decoded.reshape(48, 512).numpy(), expected)


def assert_int4_from_blocks(layer: Int4Linear, expected: torch.Tensor, q4_k: bool) -> None:
    """Q4_K blocks map in with their codes and two-level scales: exactly on specserve's kernel (its format),
    with scale and zero rounded to bf16 on torch's. Others (Q4_0) are requantized: within half a step."""
    assert isinstance(layer, Int4Linear) and layer.group_size == 32
    if q4_k and layer.on_kernel:
        assert torch.equal(layer.weight, expected)
        return
    scales, mins = (v.repeat_interleave(32, dim=1) for v in layer.scales_and_mins())
    bound = torch.zeros_like(expected) if q4_k else 0.5 * scales * (1 + 2**-20) + 1e-7
    if not layer.on_kernel:
        bound += 2**-8 * (16 * scales.abs() + mins.abs())
    assert ((layer.weight - expected).abs() <= bound).all()


@pytest.mark.parametrize("use_kernel", USE_KERNEL)
@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_K])
def test_int4_layer_from_q4_blocks(qtype, use_kernel, monkeypatch):
    rng = np.random.default_rng(1)
    raw = gguf_blocks(qtype, rng.standard_normal((64, 256)).astype(np.float32), rng)
    tensor = SimpleNamespace(ggml_type=qtype, data=raw)
    plan = gguf_tensors.PlannedTensor("w", (64, 256), 0)
    monkeypatch.setenv(kernels.ENV_VAR, "0" if use_kernel else "1")
    layer = gguf_quantized.quantized_linear_from_gguf(tensor, plan, "int4", None)
    assert layer.on_kernel == use_kernel
    expected = torch.from_numpy(gguf.quants.dequantize(raw, qtype))
    assert_int4_from_blocks(layer, expected, qtype == QT.Q4_K)


H, FFN, HEADS, KV_HEADS, VOCAB_GGUF = 256, 512, 4, 2, 64
# One tensor of each kind the loader meets: mapped straight (Q4_K for int4, Q8_0 for int8) or not.
GGUF_TYPES = {
    "attn_q": QT.Q4_K,
    "attn_k": QT.Q4_0,
    "attn_v": QT.Q8_0,
    "attn_output": QT.F32,
    "ffn_gate": QT.Q4_K,
    "ffn_up": QT.Q4_0,
    "ffn_down": QT.Q8_0,
}


def write_quantized_gguf(path) -> dict[str, tuple[QT, np.ndarray]]:
    """A one-layer Qwen2 GGUF with Q4_K/Q4_0/Q8_0/F32 linear weights; {hf name: (type, dequantized)}."""
    rng = np.random.default_rng(0)
    w = gguf_writer(path, "qwen2", 1, H, FFN, HEADS, KV_HEADS)
    kv = KV_HEADS * H // HEADS
    shapes = {
        "attn_q": (H, H),
        "attn_k": (kv, H),
        "attn_v": (kv, H),
        "attn_output": (H, H),
        "ffn_gate": (FFN, H),
        "ffn_up": (FFN, H),
        "ffn_down": (H, FFN),
    }
    expected: dict[str, tuple[QT, np.ndarray]] = {}
    for name, shape in shapes.items():
        x = (0.05 * rng.standard_normal(shape)).astype(np.float32)
        qtype = GGUF_TYPES[name]
        raw = x if qtype == QT.F32 else gguf_blocks(qtype, x, rng)
        w.add_tensor(f"blk.0.{name}.weight", raw, raw_dtype=None if qtype == QT.F32 else qtype)
        value = x if qtype == QT.F32 else gguf.quants.dequantize(raw, qtype).reshape(shape)
        expected[f"model.layers.0.{gguf_tensors._LAYER_COMMON[name]}.weight"] = (qtype, value)
    for name, size in (("attn_q", H), ("attn_k", kv), ("attn_v", kv)):
        w.add_tensor(f"blk.0.{name}.bias", (0.1 * rng.standard_normal(size)).astype(np.float32))
    for name in ("blk.0.attn_norm", "blk.0.ffn_norm", "output_norm"):
        w.add_tensor(f"{name}.weight", np.ones(H, np.float32))
    w.add_tensor("token_embd.weight", rng.standard_normal((VOCAB_GGUF, H)).astype(np.float32))
    raw = random_q4_k(VOCAB_GGUF, H, rng)
    w.add_tensor("output.weight", raw, raw_dtype=QT.Q4_K)
    expected["lm_head.weight"] = (QT.Q4_K, gguf.quants.dequantize(raw, QT.Q4_K).reshape(VOCAB_GGUF, H))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def test_quantized_loading_reads_the_gguf_blocks(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "tiny-quantized.gguf"
    expected = write_quantized_gguf(src)
    model_dir = resolve_model(str(src))
    assert sgguf.gguf_source(model_dir) == src.resolve()
    for mode in MODES:
        model, _, _ = load_model(str(model_dir), quantization=mode)
        for name, (qtype, value) in expected.items():
            layer, value = model.get_submodule(name.removesuffix(".weight")), torch.from_numpy(value)
            if mode == "int4" and qtype in (QT.Q4_0, QT.Q4_K):
                assert_int4_from_blocks(layer, value, qtype == QT.Q4_K)
            elif mode == "int8" and qtype == QT.Q8_0:  # the codes, with d rounded to bf16
                assert isinstance(layer, Int8Linear)
                assert ((layer.weight - value).abs() <= 2**-8 * value.abs()).all()
            elif mode == "int8" and name == "lm_head.weight":  # int8 keeps the head fp32
                assert isinstance(layer, nn.Linear | PackedLinear) and torch.equal(layer.weight, value)
            else:  # dequantized, then quantized exactly as a dense weight would be
                reference = quantize_linear(value, None, mode)
                assert type(layer) is type(reference) and torch.equal(layer.weight, reference.weight)
        llm = tiny_llm(str(src), quantization=mode)
        out = llm.generate([[1, 5, 9, 2]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("arch", ["qwen2", "qwen3moe"])
def test_quantized_gguf_loading_equals_quantizing_the_conversion(arch, tmp_path, monkeypatch):
    """F32 and Q8_0 tensors (int4), F32 tensors (int8), stacked experts: the GGUF path gives the same
    layers as quantizing the fp32 conversion; routers stay fp32."""
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "cache"))
    src = tmp_path / f"tiny-{arch}.gguf"
    write_tiny_gguf(src, arch)
    model_dir = resolve_model(str(src))
    for mode in MODES:
        from_gguf, _, _ = load_model(str(model_dir), quantization=mode)
        dense, _, _ = load_model(str(model_dir))
        assert quantize_model(dense, mode) > 0
        layers = dict(from_gguf.named_modules())
        for name, module in dense.named_modules():
            if isinstance(module, Int8Linear | Int4Linear) and not name.endswith((".coarse", ".residual")):
                assert type(layers[name]) is type(module), name
                # int8 from Q8_0 keeps the file's codes instead: checked in the test above
                if not (mode == "int8" and name.endswith(("q_proj", "up_proj"))):
                    assert torch.equal(layers[name].weight, module.weight), name
        if arch == "qwen3moe":
            assert isinstance(layers["model.layers.0.mlp.gate"], nn.Linear | PackedLinear)
            assert isinstance(layers["model.layers.0.mlp.experts.3.down_proj"], Int8Linear | Int4Linear)


@pytest.mark.parametrize("mode", MODES)
def test_a_tied_head_gets_its_own_quantized_copy(mode, tiny_model_dir):
    model, _, _ = load_model(str(tiny_model_dir("qwen2")))
    embedding = model.model.embed_tokens.weight
    assert model.lm_head.weight is embedding
    quantize_model(model, mode, lm_head=True)
    assert isinstance(model.lm_head, Int8Linear | Int4Linear)
    assert model.model.embed_tokens.weight is embedding and embedding.dtype == torch.float32


# ---------------------------------------------------------------------------------------------- engine


def tiny_llm(model: str, **kwargs) -> LLM:
    return LLM(model, max_model_len=64, kv_cache_memory="16MiB", **kwargs)


def plain_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy decoding by re-running the whole sequence through the model each step (no cache reuse)."""
    tokens = list(prompt)
    for _ in range(new_tokens):
        logits, _ = PagedHarness(model, num_blocks=32).step([(0, tokens)])
        tokens.append(int(logits[0][-1].argmax()))
    return tokens[len(prompt) :]


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, VOCAB, (int(torch.randint(3, 30, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe", "gemma3"])
def test_engine_greedy_equals_plain_forward_greedy(mode, arch, tiny_model_dir):
    llm = tiny_llm(str(tiny_model_dir(arch)), quantization=mode)
    model = llm.engine.model
    assert any(isinstance(m, Int8Linear | Int4Linear) for m in model.modules())
    batch = prompts(3)
    outs = llm.generate(batch, GREEDY)
    for prompt, out in zip(batch, outs):
        assert out.outputs[0].token_ids == plain_greedy(model, prompt, GREEDY.max_tokens)


@pytest.mark.parametrize("mode", MODES)
def test_greedy_speculation_on_a_quantized_target_is_exact(mode, tiny_model_dir):
    target = str(tiny_model_dir("qwen3"))
    batch = prompts(4, seed=2)
    plain = tiny_llm(target, quantization=mode)
    expected = [o.outputs[0].token_ids for o in plain.generate(batch, GREEDY)]
    specs = [
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
        {"method": "draft_model", "model": str(tiny_model_dir("qwen2")), "num_speculative_tokens": 4},
    ]
    for spec in specs:
        llm = tiny_llm(target, quantization=mode, speculative_config=spec)
        assert [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY)] == expected
        assert llm.engine.spec_stats.num_drafts > 0


@pytest.fixture(scope="module")
def near_tie_model(tmp_path_factory):
    """near_tie_model(attention) -> the tiny Qwen3 with its head's rows in pairs 2^-22 apart (relative): the
    two logits of a pair tie to within rounding at every step, so a kernel whose row result depends on the
    batch flips greedy tokens. attention=False zeroes v_proj: attention then adds exactly 0, and what is
    left to differ is the linear layers alone."""
    cache = {}

    def get(attention: bool) -> str:
        if attention not in cache:
            model = build_reference("qwen3")
            with torch.no_grad():
                head = model.lm_head.weight
                noise = torch.randn(head[0::2].shape, generator=torch.Generator().manual_seed(0))
                head[1::2] = head[0::2] * (1 + 2**-22 * noise)
                if not attention:
                    for layer in model.model.layers:
                        layer.self_attn.v_proj.weight.zero_()
            model.generation_config.eos_token_id = None
            cache[attention] = tmp_path_factory.mktemp("near-tie")
            model.save_pretrained(cache[attention])
        return str(cache[attention])

    return get


def assert_greedy_speculation_is_exact(model: str, mode: str | None) -> None:
    """64 tokens of several prompts, decoded alone (1 row a step), together, and verified by ngram
    speculation (up to 5 rows a sequence): the same tokens, near ties included."""
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    batch = prompts(4)

    def llm(**kwargs) -> LLM:
        return LLM(model, quantization=mode, max_model_len=128, kv_cache_memory="16MiB", **kwargs)

    plain = llm()
    alone = [plain.generate([p], params)[0].outputs[0].token_ids for p in batch]
    assert [o.outputs[0].token_ids for o in plain.generate(batch, params)] == alone
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    speculative = llm(speculative_config=spec)
    assert [o.outputs[0].token_ids for o in speculative.generate(batch, params)] == alone
    assert speculative.engine.spec_stats.num_accepted_tokens > 0


@pytest.mark.parametrize("mode", [*MODES, None])
def test_greedy_ngram_speculation_equals_greedy_decoding(mode, near_tie_model):
    """Every linear path (int8, int4, and the fp32 layers each leaves, or all of fp32) is batch invariant."""
    assert_greedy_speculation_is_exact(near_tie_model(attention=False), mode)


def test_greedy_ngram_speculation_equals_greedy_decoding_with_attention(near_tie_model):
    """Attention too: a verified row is attended as it is decoded alone (layers/attention.py)."""
    assert_greedy_speculation_is_exact(near_tie_model(attention=True), None)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("method", ["draft_model", "dspark"])
def test_a_drafter_is_quantized_independently_of_the_target(mode, method, tiny_model_dir, tmp_path):
    target = str(tiny_model_dir("qwen3"))
    batch = prompts(3, seed=4)
    reference = tiny_llm(target)
    expected = [o.outputs[0].token_ids for o in reference.generate(batch, GREEDY)]
    model = target if method == "draft_model" else str(save_tiny_drafter(target, tmp_path / "d", std=0.2))
    spec = {"method": method, "model": model, "num_speculative_tokens": 3, "quantization": mode}
    llm = tiny_llm(target, speculative_config=spec)
    drafter = llm.engine.speculator.drafter
    draft_net = drafter.runner.model if method == "draft_model" else drafter.model
    assert any(isinstance(m, Int8Linear | Int4Linear) for m in draft_net.modules())
    assert not any(isinstance(m, Int8Linear | Int4Linear) for m in llm.engine.model.modules())
    assert [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY)] == expected
    stats = llm.engine.spec_stats
    assert stats.num_drafts > 0
    if method == "draft_model" and mode == "int4":  # the target drafting for itself, now slightly off
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_speculative_quantization_is_checked():
    with pytest.raises(SpecserveError, match="quantization must be None or one of int8, int4"):
        SpeculativeConfig(method="draft_model", model="m", quantization="int3")
    with pytest.raises(SpecserveError, match="'ngram' has none"):
        SpeculativeConfig(method="ngram", quantization="int8")


class QuantizedReference:
    """`reference(ids).logits` as test_lossless.exact_joint wants it, from our own (quantized) model."""

    def __init__(self, model):
        self.model = model

    def __call__(self, ids: torch.Tensor) -> SimpleNamespace:
        harness = PagedHarness(self.model, num_blocks=4 * len(ids))
        logits, _ = harness.step([(i, row.tolist()) for i, row in enumerate(ids)])
        return SimpleNamespace(logits=torch.stack([piece[-1:] for piece in logits]))


def test_speculative_sampling_on_a_quantized_target_is_lossless(tmp_path):
    """The core harness: sampled continuations follow the quantized target's exact distribution."""
    target_dir, draft_dir = tmp_path / "target", tmp_path / "draft"
    fp32_target = test_lossless.make_model(target_dir, 0, 60.0)
    test_lossless.make_model(draft_dir, 0, 15.0)
    params = test_lossless.CASES["temperature_1"]
    target = tiny_llm(str(target_dir), quantization="int4")
    exact = test_lossless.exact_joint(QuantizedReference(target.engine.model), params, 3)
    spec = {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 3}
    llm = LLM(
        str(target_dir),
        max_model_len=64,
        max_num_seqs=1024,
        max_num_batched_tokens=8192,
        quantization="int4",
        speculative_config=spec,
    )
    n = test_lossless.NUM_SAMPLES
    outs = llm.generate([test_lossless.PROMPT] * n, params)
    counts: dict[tuple[int, ...], int] = {}
    for o in outs:
        key = tuple(o.outputs[0].token_ids[:3])
        counts[key] = counts.get(key, 0) + 1
    assert 0.1 < llm.engine.spec_stats.acceptance_rate < 0.9
    assert test_lossless.chi_square_pvalue(counts, exact, n) > 0.001
    # power: the samples do tell the quantized target from the fp32 model it was made from
    exact_fp32 = test_lossless.exact_joint(fp32_target, params, 3)
    assert test_lossless.chi_square_pvalue(counts, exact_fp32, n) < 1e-6


# ------------------------------------------------------------------------------------------ arguments


def test_quantization_argument_is_checked():
    assert EngineConfig(model="m", quantization="int4").quantization == "int4"
    with pytest.raises(SpecserveError, match="quantization must be None or one of int8, int4"):
        EngineConfig(model="m", quantization="fp8")
    args = build_parser().parse_args(["generate", "--quantization", "int8", "hi"])
    assert args.quantization == "int8"


# ------------------------------------------------------------------------------------------- real model


@pytest.mark.slow
def test_real_qwen_is_read_quantized_from_its_gguf():
    """Qwen2.5-Coder-1.5B: Q4_K layers map straight into int4 (the fp32 conversion is gguf's dequantization
    of the same blocks), and int8 greedy output equals fp32's on chat prompts."""
    from specserve.models.loader import iter_checkpoint_tensors

    name = "qwen2.5-coder-1.5b"
    try:
        model_dir = resolve_model(name)
    except SpecserveError as exc:
        pytest.skip(f"local model {name} unavailable: {exc}")
    if sgguf.gguf_source(model_dir) is None:
        pytest.skip(f"the GGUF file {name} was converted from is gone")
    wanted = {"model.layers.0.mlp.up_proj.weight", "model.layers.0.self_attn.q_proj.weight"}  # Q4_K
    dense = {k: v for k, v in iter_checkpoint_tensors(model_dir) if k in wanted}
    model, _, _ = load_model(name, quantization="int4")
    for key, weight in dense.items():
        assert_int4_from_blocks(model.get_submodule(key.removesuffix(".weight")), weight, q4_k=True)
    del model
    questions = ("Write a Python function that merges two sorted lists.", "What does `yield` do?")
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outputs = []
    for mode in (None, "int8"):
        llm = LLM(name, quantization=mode, max_model_len=512, kv_cache_memory="256MiB")
        chats = [
            {"prompt_token_ids": llm.apply_chat_template([{"role": "user", "content": q}])} for q in questions
        ]
        outputs.append([o.outputs[0].token_ids for o in llm.generate(chats, params)])
        del llm
    assert outputs[0] == outputs[1]
