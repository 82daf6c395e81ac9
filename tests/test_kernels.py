"""The compiled int4 / int8 kernels (specserve/layers/kernels): activation quantization, every ISA path
bitwise equal to the scalar one, batch invariance (a row's output is bitwise the same whatever M), and
exactness against references in torch; the build's fallback. Skipped where the kernels are not built
(SPECSERVE_NO_KERNELS=1, no compiler): the layers then run on torch's kernel (tests/test_quant.py)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

from specserve.layers import kernels
from specserve.layers.quant import (
    Int4Linear,
    Int4Weights,
    Int8Linear,
    pack_groups,
    pack_int4_codes,
    pack_int4_scales,
    pack_int8_codes,
    unpack_groups,
    unpack_int4_codes,
    unpack_int4_scales,
    unpack_int8_codes,
)

ops = kernels.load_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="specserve's kernels are not built here")
ISAS = list(range(ops.best_isa() + 1)) if ops is not None else []  # 0 scalar, 1 AVX2, 2 AVX-512 VNNI, 3 AMX
# (K, N, group size); from 8 rows at K = 2304 AMX takes the output tiles two by two (activations past L1)
SHAPES = [(64, 16, 32), (320, 48, 32), (256, 32, 64), (512, 16, 128), (2304, 48, 32)]


def quantize_rows_reference(x: torch.Tensor):
    """The kernel's activation quantization in torch: per block of 32, codes round(x * 127 / max|x|)."""
    blocks = x.reshape(len(x), -1, 32)
    amax = blocks.abs().amax(-1)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    q = torch.round(blocks * inv[..., None]).to(torch.int8)
    scale = amax / 127
    return q.reshape(x.shape), scale, scale * q.sum(-1, dtype=torch.int32).float()


def random_int4(n: int, k: int, group: int, seed: int = 0) -> Int4Weights:
    """Every byte value of the two levels, K / G not always a multiple of the 8 groups of a super-block."""
    g = torch.Generator().manual_seed(seed)
    groups, supers = k // group, -(-k // group // 8)
    return Int4Weights(
        torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g),
        (torch.rand(n, supers, generator=g) * 1e-4 + 1e-5).half().float(),
        (torch.rand(n, supers, generator=g) * 1e-3).half().float(),
        torch.randint(0, 256, (n, groups), dtype=torch.uint8, generator=g),
        torch.randint(-128, 128, (n, groups), dtype=torch.int8, generator=g),
    )


def random_int8(n: int, k: int, group: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)  # -128 too: Q8_0 may hold it
    return q, (torch.rand(n, k // group, generator=g) * 0.02 + 1e-3).half().float()


def int4_call(w: Int4Weights, bias=None):
    packed, (groups, supers) = pack_int4_codes(w.q), pack_int4_scales(w)
    return lambda x, isa=-1: ops.int4_linear(x, packed, groups, supers, bias, isa)


def int8_call(q, scales, bias=None):
    packed, s = pack_int8_codes(q), pack_groups(scales)
    return lambda x, isa=-1: ops.int8_linear(x, packed, s, bias, isa)


def inputs(m: int, k: int, seed: int = 1) -> torch.Tensor:
    """Rows of different magnitudes, a zero block and a lone outlier."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 1, m)[:, None]
    x[0, :32] = 0
    x[-1, 40] = 300.0
    return x


def test_layouts_round_trip():
    w = random_int4(48, 320, 32)
    assert torch.equal(unpack_int4_codes(pack_int4_codes(w.q)), w.q)
    for got, want in zip(unpack_int4_scales(w.q, *pack_int4_scales(w)), w):
        assert torch.equal(got, want)
    q8, scales = random_int8(32, 128, 32)
    assert torch.equal(unpack_int8_codes(pack_int8_codes(q8)), q8)
    assert torch.equal(unpack_groups(pack_groups(scales)), scales)


@pytest.mark.parametrize("isa", ISAS)
def test_activation_quantization_equals_the_reference_bitwise(isa):
    x = inputs(5, 256)
    for got, want in zip(ops.quantize_rows(x, isa), quantize_rows_reference(x)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("k,n,group", SHAPES)
@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_every_path_equals_the_scalar_one_and_rows_do_not_depend_on_m(mode, k, n, group):
    """Bitwise: each ISA path against the scalar path, and each row of an M-row call (M = 1..17, 32: one
    pass of the AVX2 and AMX paths and past it, and a prefill-sized 37) against that row computed alone;
    -1 (the best path, which may change with M) too."""
    weights = (random_int4(n, k, group),) if mode == "int4" else random_int8(n, k, group)
    bias = torch.randn(n)
    call = (int4_call if mode == "int4" else int8_call)(*weights, bias)
    x = inputs(37, k)
    scalar = call(x, 0)
    for isa in [*ISAS, -1]:
        alone = torch.cat([call(x[i : i + 1], isa) for i in range(len(x))])
        assert torch.equal(alone, scalar), f"path {isa} differs from the scalar one"
        for m in [*range(1, 18), 32, 37]:
            assert torch.equal(call(x[:m], isa), alone[:m]), f"path {isa}, M = {m}"


@pytest.fixture
def torch_threads():
    """Restores torch's intra-op thread count after a test that changes it."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_kernel_runs_on_torch_s_threads(torch_threads):
    """Built with OpenMP: else ATen's parallel_for is a serial loop inside the extension."""
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        assert ops.parallel_threads() == threads


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_outputs_do_not_depend_on_the_thread_count(mode, torch_threads):
    k, n, group = 4096, 16 * 37, 64  # enough output tiles for every thread to take some; AMX pairs them
    weights = (random_int4(n, k, group),) if mode == "int4" else random_int8(n, k, group)
    call = (int4_call if mode == "int4" else int8_call)(*weights, torch.randn(n))
    x = inputs(9, k)
    torch.set_num_threads(1)
    for isa in ISAS:
        for m in (5, 9):  # AMX takes output tiles two by two up to 8 rows (odd ones alone), one by one past
            alone = call(x[:m], isa)
            for threads in (2, 3):
                torch.set_num_threads(threads)
                assert torch.equal(call(x[:m], isa), alone), f"path {isa}, M = {m}, {threads} threads"
            torch.set_num_threads(1)


@pytest.mark.parametrize("k,n,group", SHAPES)
@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_kernel_equals_the_reference_with_the_same_activation_codes(mode, k, n, group):
    """Against torch with the same int8 activations: exact integer dot products per block, so only the
    order in which the fp32 block terms are summed differs (the kernel adds them in order with fma)."""
    if mode == "int4":
        w4 = random_int4(n, k, group)
        call, (q, scales, mins) = int4_call(w4), (w4.q, w4.scales(), w4.mins())
    else:
        (q, scales), mins = random_int8(n, k, group), None
        call = int8_call(q, scales)
    x = inputs(16, k)
    xq, xs, xsum = quantize_rows_reference(x)
    q = q.to(torch.int64).reshape(n, -1, 32)
    dots = torch.einsum("mbi,nbi->mnb", xq.to(torch.int64).reshape(16, -1, 32), q).double()
    per_block = lambda v: v.repeat_interleave(group // 32, dim=1)  # [N, K / G] -> [N, K / 32]
    # each block term exactly (float64), with the one fp32 product the kernel rounds: weight x input scale
    terms = [dots * (per_block(scales)[None] * xs[:, None]).double()]
    if mode == "int4":
        terms.append(per_block(mins)[None].double() * xsum[:, None].double())
    reference = sum(t.sum(-1) for t in terms)
    bound = 2 * (k // 32) * 2**-24 * sum(t.abs().sum(-1) for t in terms)  # one rounding per fma
    assert ((call(x).double() - reference).abs() <= bound).all()


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_layer_on_the_kernel_against_the_dequantized_fp32_matmul(mode):
    """The int8 rounding of the activations is the error: at most half a step (max|x| / 127 per block of
    32) times the weights it meets, and about 0.5% of the output's scale on random data."""
    k, n = 512, 64
    x = inputs(8, k)
    if mode == "int4":
        layer = Int4Linear(random_int4(n, k, 32), use_kernel=True)
    else:
        layer = Int8Linear(*random_int8(n, k, 32), use_kernel=True)
    assert layer.on_kernel
    ref = x @ layer.weight.t()
    y = layer(x)
    steps = x.abs().reshape(8, -1, 32).amax(-1) / 127
    bound = 0.5 * steps @ layer.weight.abs().reshape(n, -1, 32).sum(-1).t() + 1e-5 * (
        x.abs() @ layer.weight.abs().t()
    )
    assert ((y - ref).abs() <= bound).all()
    assert ((y - ref).norm(dim=1) / ref.norm(dim=1)).max() < 0.01


def stacked_experts(mode: str, experts: int, n: int, k: int, group: int):
    """(each expert's own call, the grouped op's stacked buffers) for random experts of one shape."""
    calls, buffers = [], []
    for e in range(experts):
        if mode == "int4":
            w = random_int4(n, k, group, seed=e)
            calls.append(int4_call(w))
            buffers.append((pack_int4_codes(w.q), *pack_int4_scales(w)))
        else:
            q, scales = random_int8(n, k, group, seed=e)
            calls.append(int8_call(q, scales))
            buffers.append((pack_int8_codes(q), pack_groups(scales)))
    return calls, [torch.stack(parts) for parts in zip(*buffers, strict=True)]


def grouped_op(mode: str):
    return ops.int4_grouped_linear if mode == "int4" else ops.int8_grouped_linear


@pytest.mark.parametrize("k,n,group", SHAPES)
@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_grouped_call_equals_each_expert_s_own_call(mode, k, n, group, torch_threads):
    """Rows sorted by expert (expert 2 never gets one), M = 0..17 and 37: bitwise each expert's own call
    over its rows, on every path but AMX (which grouped calls do not take) and the automatic one, on 1 and
    2 threads."""
    experts = 5
    calls, stacked = stacked_experts(mode, experts, n, k, group)
    x = inputs(37, k)
    g = torch.Generator().manual_seed(2)
    for m in [*range(18), 37]:
        ids = torch.randint(0, experts, (m,), generator=g)
        ids[ids == 2] = 3
        counts = torch.bincount(ids, minlength=experts)
        parts = x[:m].split(counts.tolist())
        want = torch.cat([calls[e](part, 0) for e, part in enumerate(parts)])
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for isa in [*[i for i in ISAS if i < 3], -1]:
                got = grouped_op(mode)(x[:m], counts, *stacked, isa)
                assert torch.equal(got, want), f"path {isa}, M = {m}, {threads} threads"


def test_grouped_call_checks():
    _, stacked = stacked_experts("int4", 2, 16, 64, 32)
    grouped = grouped_op("int4")
    x = torch.randn(3, 64)
    with pytest.raises(RuntimeError, match="counts add up to 2 rows, x has 3"):
        grouped(x, torch.tensor([1, 1]), *stacked)
    with pytest.raises(RuntimeError, match="counts: int64"):
        grouped(x, torch.tensor([1, 2], dtype=torch.int32), *stacked)
    with pytest.raises(RuntimeError, match="negative count"):
        grouped(x, torch.tensor([-1, 4]), *stacked)
    with pytest.raises(RuntimeError, match="codes do not match"):
        grouped(torch.randn(3, 96), torch.tensor([1, 2]), *stacked)
    with pytest.raises(RuntimeError, match="one number of experts"):
        grouped(x, torch.tensor([1, 2]), stacked[0], stacked[1][:1], stacked[2])
    if ops.best_isa() == 3:
        with pytest.raises(RuntimeError, match="no AMX path"):
            grouped(x, torch.tensor([1, 2]), *stacked, 3)


def test_empty_input_and_shape_checks():
    call = int4_call(random_int4(16, 64, 32))
    assert call(torch.zeros(0, 64)).shape == (0, 16)
    with pytest.raises(RuntimeError, match="K must be a multiple of 32"):
        ops.quantize_rows(torch.zeros(2, 40))
    with pytest.raises(RuntimeError, match="codes do not match"):
        call(torch.zeros(2, 96))


def test_a_failed_build_falls_back_with_one_log_line(tmp_path, monkeypatch, caplog):
    broken = tmp_path / "qlinear.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(kernels, "SOURCES", [broken])
    monkeypatch.setattr(kernels, "_loaded", {})
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING, logger=kernels.__name__):
        assert kernels.load_ops() is None and kernels.ops() is None
        assert kernels.isa_name() == "torch"
    assert len(caplog.records) == 1 and "unavailable" in caplog.records[0].getMessage()
    # and the layers then take torch's kernel
    monkeypatch.setenv(kernels.ENV_VAR, "1")
    monkeypatch.setattr(kernels, "_loaded", {})
    assert kernels.disabled() and kernels.load_ops() is None
    assert not Int4Linear(random_int4(16, 64, 32)).on_kernel


CAPPED_RUN = """
import sys, torch
from specserve.layers import kernels
x, w, buffers, want = torch.load(sys.argv[1])
ops = kernels.load_ops()
assert torch.equal(ops.int4_linear(x, *buffers), want)
try:
    ops.fp32_linear(x, w, None, 2)
    avx512 = "taken"
except RuntimeError as exc:
    avx512 = "refused" if "not supported" in str(exc) else str(exc)
print(kernels.isa_name(), ops.best_isa(), avx512)
"""


def test_specserve_isa_caps_every_kernel_path(tmp_path):
    """SPECSERVE_ISA=avx2 on a machine with more: the quantized layers take AVX2's path, with the same bits
    as the uncapped process, and the kernels that pick AVX-512 or AVX2 refuse AVX-512; a bad name fails."""
    w = random_int4(16, 64, 32)
    buffers = (pack_int4_codes(w.q), *pack_int4_scales(w))
    x = inputs(3, 64)
    torch.save((x, torch.randn(16, 64), buffers, ops.int4_linear(x, *buffers)), tmp_path / "inputs.pt")

    def run(isa: str) -> subprocess.CompletedProcess:
        env = {**os.environ, kernels.ISA_ENV_VAR: isa}
        command = [sys.executable, "-c", CAPPED_RUN, str(tmp_path / "inputs.pt")]
        return subprocess.run(command, env=env, capture_output=True, text=True)

    capped = run("avx2")
    assert capped.returncode == 0, capped.stderr
    name, best, avx512 = capped.stdout.split()
    assert (name, best, avx512) == ("avx2", "1", "refused")  # on AVX-512 machines, refused by the cap
    wrong = run("avx3")
    assert wrong.returncode != 0 and "SPECSERVE_ISA='avx3': expected one of scalar, avx2" in wrong.stderr


def test_a_bad_specserve_isa_is_refused_at_every_load(monkeypatch):
    monkeypatch.setattr(kernels, "_loaded", {})
    monkeypatch.setenv(kernels.ISA_ENV_VAR, "avx3")
    for _ in range(2):  # not a silent fallback the second time
        with pytest.raises(ValueError, match="expected one of"):
            kernels.load_ops()
