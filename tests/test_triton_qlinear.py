"""The int4 / int8 linears on CUDA (layers/triton_qlinear.py) against the weights the CPU computes with, dense
and grouped (stacked experts); the layers and a mixture-of-experts layer switched onto them; the platform's
move of a quantized model's weights, which keeps fused and stacked layers sharing their storage. The kernel
is compiled where CUDA is; elsewhere it runs on CPU tensors in Triton's interpreter (conftest.py)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from specserve.config import SpecserveError  # noqa: E402
from specserve.layers import triton_qlinear  # noqa: E402
from specserve.layers.quant import (  # noqa: E402
    Int4Linear,
    Int8Linear,
    pack_groups,
    pack_int4_codes,
    pack_int4_scales,
    pack_int8_codes,
    quantize_int4,
    quantize_model,
    use_device_kernels,
)
from specserve.layers.weight_storage import move_storages, weight_tensors  # noqa: E402
from specserve.models.loader import load_model  # noqa: E402
from specserve.platform import CPU, Platform  # noqa: E402
from tests.h100_compile import H100_SHARED_MEMORY, run_uninterpreted, shared_memory_for_h100  # noqa: E402
from tests.test_cuda import assert_close_to_reference, forward_logits  # noqa: E402
from tests.test_kernels import random_int4, random_int8  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.kernel_agnostic] + ([pytest.mark.gpu] if DEVICE == "cuda" else [])
N = 48  # three tiles of 16 outputs: less than one program's 64 columns


def layer(kind: str, k: int, group: int, seed: int = 0, bias: bool = True):
    """A layer in specserve's kernel layout, built without the CPU kernels (the interpreter needs none)."""
    b = torch.randn(N, generator=torch.Generator().manual_seed(seed)) if bias else None
    if kind == "int4":
        w = random_int4(N, k, group, seed)
        groups, supers = pack_int4_scales(w)
        buffers = {"packed": pack_int4_codes(w.q), "scales": groups, "supers": supers}
        return Int4Linear.from_kernel_buffers(buffers, k, group, b)
    q, scales = random_int8(N, k, group, seed)
    buffers = {"packed": pack_int8_codes(q), "scales": pack_groups(scales)}
    return Int8Linear.from_kernel_buffers(buffers, k, group, b)


def buffers(linear, device=DEVICE) -> list[torch.Tensor]:
    return [getattr(linear, name).to(device) for name in linear.KERNEL_BUFFERS]


def reference(x: torch.Tensor, linear) -> torch.Tensor:
    """fp32 x @ w.T + bias with the layer's weight rounded to x's dtype, as the kernel multiplies it."""
    w = linear.weight.to(x.dtype).float()
    y = x.float().cpu() @ w.T
    return y if linear.bias is None else y + linear.bias.float()


def assert_close(y: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32 sums in another order, then one rounding to y's dtype: half a step, at most 2^-8 of the value
    in bf16."""
    half_step = 2.0**-24 if y.dtype == torch.float32 else 2.0**-8
    y = y.float().cpu()
    bound = half_step * expected.abs() + 1e-5 * expected.abs().max()
    assert ((y - expected).abs() <= bound).all(), (y - expected).abs().max()


@pytest.mark.parametrize("kind", ["int4", "int8"])
@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_computes_the_layers_weight(kind, group, dtype):
    """Every byte value of codes, sub-scales, signed sub-minimums and super-block scales; K / G not a
    multiple of a super-block's 8 groups; rows in one program and in several."""
    linear = layer(kind, 5 * 64, group)
    run = triton_qlinear.int4_linear if kind == "int4" else triton_qlinear.int8_linear
    for rows in (1, 5, 70):
        x = torch.randn(rows, linear.in_features).to(DEVICE, dtype)
        y = run(x, *buffers(linear), linear.bias.to(DEVICE))
        assert y.dtype == dtype and y.shape == (rows, N)
        assert_close(y, reference(x, linear))


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_k_split_into_slices_sums_what_one_pass_does(kind, monkeypatch):
    """A launch with few programs (a small layer at decode) splits K into 8 slices, added afterwards: the
    same result as one pass over K (the bias added once), to fp32 rounding."""
    linear = layer(kind, 512, 32)
    run = triton_qlinear.int4_linear if kind == "int4" else triton_qlinear.int8_linear
    x = torch.randn(3, 512, device=DEVICE)
    split = run(x, *buffers(linear), linear.bias.to(DEVICE))
    monkeypatch.setattr(triton_qlinear, "MIN_PROGRAMS", 1)
    whole = run(x, *buffers(linear), linear.bias.to(DEVICE))
    torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-5)
    assert_close(split, reference(x, linear))


def test_k_splits_fill_a_launch_with_slices_that_divide_its_steps():
    assert triton_qlinear.k_splits(16, 16) == 8  # at most MAX_SPLITS
    assert triton_qlinear.k_splits(100, 16) == 4  # 400 programs: enough
    assert triton_qlinear.k_splits(100, 6) == 2  # 6 steps: not in 4 slices
    assert triton_qlinear.k_splits(300, 16) == triton_qlinear.k_splits(1, 5) == 1


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_grouped_call_gives_each_layers_rows_its_own_result(kind):
    """Rows sorted by layer through stacked buffers, a layer without rows among them: each row as its
    layer's own dense call computes it."""
    layers = [layer(kind, 128, 32, seed, bias=False) for seed in range(3)]
    stacked = [torch.stack(parts) for parts in zip(*(buffers(x) for x in layers), strict=True)]
    counts = torch.tensor([2, 0, 5], device=DEVICE)
    x = torch.randn(7, 128, device=DEVICE)
    run = triton_qlinear.int4_grouped_linear if kind == "int4" else triton_qlinear.int8_grouped_linear
    y = run(x, counts, *stacked)
    dense = triton_qlinear.int4_linear if kind == "int4" else triton_qlinear.int8_linear
    for linear, rows in zip(layers, (slice(0, 2), slice(2, 2), slice(2, 7)), strict=True):
        torch.testing.assert_close(y[rows], dense(x[rows], *buffers(linear)), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_a_layer_on_device_kernels_keeps_its_input_shape_and_dtype(kind):
    linear = layer(kind, 128, 32)
    use_device_kernels(linear, triton_qlinear)
    linear.to(DEVICE)
    x = torch.randn(2, 3, 128).to(DEVICE, torch.bfloat16)
    y = linear(x)
    assert y.shape == (2, 3, N) and y.dtype == torch.bfloat16
    assert_close(y.reshape(6, N), reference(x.reshape(6, 128), linear))


def test_a_layer_in_torchs_cpu_form_is_refused():
    from specserve.layers.quant import DEFAULT_GROUP_SIZE

    linear = Int4Linear(quantize_int4(torch.randn(N, 64), DEFAULT_GROUP_SIZE), use_kernel=False)
    with pytest.raises(SpecserveError, match="torch's CPU int4 form"):
        use_device_kernels(torch.nn.Sequential(linear), triton_qlinear)


# (int4, grouped, bias, group size, rows a program): decode and prefill shapes, experts, Q4_K's groups and
# wider ones
COMPILED = [
    (True, False, True, 32, 16),
    (True, False, False, 128, 64),
    (True, True, False, 32, 16),
    (False, False, True, 32, 64),
    (False, True, False, 32, 16),
]


def print_shared_memory_compiled_for_h100() -> None:
    """The shared memory each COMPILED config needs on an H100 in bf16, printed (tests/h100_compile.py)."""
    for int4, grouped, bias, group, block_m in COMPILED:
        constants = {"INT4": int4, "GROUPED": grouped, "HAS_BIAS": bias, "GROUP": group, "SUPERS": 2}
        constants |= {"BLOCK_M": block_m, "BLOCK_N": 64, "BLOCK_K": min(group, 64), "WIDEN": False}
        types = {"x": "*bf16", "out": "*bf16", "bias": "*fp32", "offsets": "*i32"}
        types |= {"packed": "*u8", "groups": "*u8", "supers": "*fp16"} if int4 else {}
        types |= {} if int4 else {"packed": "*i8", "groups": "*fp16", "supers": "*fp16"}
        print(shared_memory_for_h100(triton_qlinear._quantized_linear_kernel, types, constants))


@pytest.mark.skipif(DEVICE == "cuda", reason="the tests above compile it for this GPU")
def test_the_kernel_compiles_for_an_h100():
    shared = run_uninterpreted("tests.test_triton_qlinear:print_shared_memory_compiled_for_h100")
    assert len(shared) == len(COMPILED) and max(shared) <= H100_SHARED_MEMORY, shared


def quantized_moe(tiny_model_dir, mode: str):
    """A tiny Qwen3-MoE quantized into the kernel layout as for CUDA (the CPU kernels need not be built
    here), its experts' gate and up fused and the experts stacked; and its first experts layer."""
    model, _, _ = load_model(str(tiny_model_dir("qwen3_moe")))
    quantize_model(model, mode, use_kernel=True)
    return model, next(m for m in model.modules() if getattr(m, "stacks", None))


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_moe_layer_on_device_kernels_groups_as_it_loops(tiny_model_dir, mode):
    """A quantized Qwen3-MoE's experts, stacked, in the device's grouped calls: each token's output as the
    experts one by one on the same kernel give it."""
    model, experts = quantized_moe(tiny_model_dir, mode)
    use_device_kernels(model, triton_qlinear)
    model.to(DEVICE)
    hidden = experts[0].down_proj.out_features
    x = torch.randn(6, hidden, device=DEVICE)
    ids = torch.stack([torch.randperm(len(experts))[:2] for _ in range(6)]).to(DEVICE)
    weights = torch.rand(6, 2, device=DEVICE)
    grouped = experts(x, weights, ids)
    stacks, experts.stacks = experts.stacks, None  # the loop over experts, each layer alone
    looped = experts(x, weights, ids)
    experts.stacks = stacks
    torch.testing.assert_close(grouped, looped, rtol=1e-5, atol=1e-5)


def test_moving_the_weights_keeps_fused_and_stacked_layers_sharing_storage(tiny_model_dir):
    """Each storage is copied once (a copy per storage, not per tensor: the memory is not doubled), the
    stacks' own references move with the registered buffers, and the model computes what it did."""
    model, experts = quantized_moe(tiny_model_dir, "int4")
    use_device_kernels(model, triton_qlinear)
    fusion = experts[0].gate_proj.fusion
    x = torch.randn(6, experts[0].down_proj.out_features)
    ids = torch.stack([torch.randperm(len(experts))[:2] for _ in range(6)])
    weights = torch.rand(6, 2)
    before = experts(x, weights, ids)

    def storages() -> dict[int, int]:
        return {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in weight_tensors(model)}

    old = storages()
    move_storages(list(weight_tensors(model)), torch.clone)
    new = storages()
    assert not set(old) & set(new) and len(new) == len(old)
    assert sum(new.values()) <= sum(old.values())
    shared = experts[0].gate_proj.packed.untyped_storage()._cdata
    assert fusion.layer.packed.untyped_storage()._cdata == shared
    assert experts.stacks[0].buffers[0].untyped_storage()._cdata == shared
    assert all(t.untyped_storage()._cdata in new for stack in experts.stacks for t in stack.buffers)
    assert torch.equal(experts(x, weights, ids), before)


def test_a_view_moves_with_the_span_it_uses_only():
    big = torch.arange(4096, dtype=torch.float32)
    view = big[1000:1010]
    neighbour = big[1005:1020].view(torch.int32)  # another dtype on the same storage
    move_storages([view, neighbour], torch.clone)
    assert view.untyped_storage()._cdata == neighbour.untyped_storage()._cdata
    assert view.untyped_storage().nbytes() <= 20 * 4 + 16
    assert torch.equal(view, torch.arange(1000, 1010, dtype=torch.float32))
    assert torch.equal(neighbour.view(torch.float32), torch.arange(1005, 1020, dtype=torch.float32))


class InterpretedCuda(Platform):
    """What `place` does for a GPU, on CPU tensors: its CUDA branch (weights moved a storage at a time,
    Triton's attention and quantized linears installed), the kernels interpreted."""

    is_cuda = True

    def groups_on_device(self, dtype: torch.dtype) -> bool:
        return False  # torch._grouped_mm's device-side path is a GPU's


class WithoutQuantizedOps:
    """specserve's CPU ops but the quantized linears' (`torch.ops.specserve` while a model placed for CUDA
    runs: a layer the placement left on them fails)."""

    def __init__(self):
        self.ops = getattr(torch.ops, "specserve", None)

    def __getattr__(self, name: str):
        if name.startswith(("int4_", "int8_")):
            raise AssertionError(f"{name}: a CPU op in a model placed for CUDA")
        return getattr(self.ops, name)


@pytest.mark.skipif(DEVICE == "cuda", reason="the GPU tier runs the real thing")
@pytest.mark.parametrize("arch, mode", [("qwen3", None), ("qwen3", "int4"), ("qwen3_moe", "int8")])
def test_a_quantized_model_placed_as_for_cuda_computes_as_on_the_cpu(tiny_model_dir, monkeypatch, arch, mode):
    """A prompt chunk, a decode row and a verification block in one forward of a model placed as for CUDA
    (attention on Triton's kernel; quantized: fused projections and stacked experts on the Triton
    quantized linears) give the logits the CPU's layers give, to the CPU kernel's rounding of
    activations."""
    from specserve.layers import triton_attention

    reference = forward_logits(str(tiny_model_dir(arch)), CPU, torch.float32, mode)
    calls = {"dense": 0, "grouped": 0, "attention": 0}

    def launch(x, counts, *args, real=triton_qlinear._launch):
        calls["dense" if counts is None else "grouped"] += 1
        return real(x, counts, *args)

    def attention(*args, real=triton_attention.triton_paged_attention):
        calls["attention"] += 1
        return real(*args)

    monkeypatch.setattr(triton_qlinear, "_launch", launch)
    monkeypatch.setattr(triton_attention, "triton_paged_attention", attention)
    monkeypatch.setattr(torch.ops, "specserve", WithoutQuantizedOps(), raising=False)
    platform = InterpretedCuda(torch.device("cpu"), "torch")  # (fla's kernels: tests/test_gdn_fla.py)
    placed = forward_logits(str(tiny_model_dir(arch)), platform, torch.float32, mode)
    assert_close_to_reference(placed, reference)
    assert calls["attention"] and bool(calls["dense"]) == (mode is not None)
    assert bool(calls["grouped"]) == (arch == "qwen3_moe")
