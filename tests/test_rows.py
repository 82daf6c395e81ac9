"""The row-wise kernels between the linear layers (specserve/layers/kernels/rows.cpp): RMSNorm with the
residual add, rotary embedding with the KV cache write, gated activations, Gated DeltaNet's delta-rule
inputs. Against float64 references and
the torch code they replace, batch invariant (a row's bits alone and among others), on strided views and
dims that end in a partial vector. Skipped where the kernels are not built: the layers then run torch's
ops, which the rest of the suite covers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specserve.layers import kernels
from specserve.layers.attention import KVCache
from specserve.layers.mlp import GatedMLP
from specserve.layers.norm import GatedRMSNorm, RMSNorm
from specserve.layers.rotary import RotaryEmbedding

ops = kernels.ops()
pytestmark = pytest.mark.skipif(ops is None, reason="specserve's kernels are not built here")


def rows_of(m: int, dim: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, dim, generator=g) * torch.logspace(-3, 2, m)[:, None]


def assert_rows_alone_equal(call, x: torch.Tensor, *others: torch.Tensor) -> None:
    """Bitwise: the call on all rows, on each row alone, and on a prefill-sized batch (split over threads)."""
    together = call(x, *others)
    for i in range(len(x)):
        assert torch.equal(call(x[i : i + 1], *(o[i : i + 1] for o in others)), together[i : i + 1])


@pytest.mark.parametrize("dim", [1536, 100, 8])
@pytest.mark.parametrize("offset,with_weight", [(0.0, True), (1.0, True), (0.0, False)])
def test_rms_norm_against_float64(dim, offset, with_weight):
    x = rows_of(37, dim)
    weight = torch.randn(dim) if with_weight else None
    got = ops.rms_norm(x, weight, 1e-6, offset)
    xd = x.double()
    want = xd / (xd.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    if with_weight:
        want = want * (offset + weight.double())
    assert ((got - want).abs() <= 1e-6 * want.abs() + 1e-30).all()
    assert_rows_alone_equal(lambda r: ops.rms_norm(r, weight, 1e-6, offset), x)


def test_add_rms_norm_returns_the_exact_sum_and_its_norm():
    x, residual, weight = rows_of(37, 200), rows_of(37, 200, seed=1), torch.randn(200)
    total, normed = ops.add_rms_norm(x, residual, weight, 1e-5, 0.0)
    assert torch.equal(total, x + residual)
    assert torch.equal(normed, ops.rms_norm(x + residual, weight, 1e-5, 0.0))
    assert_rows_alone_equal(lambda a, b: ops.add_rms_norm(a, b, weight, 1e-5, 0.0)[1], x, residual)


def test_rms_norm_reads_strided_heads_of_a_fused_projection():
    fused = rows_of(5, 3 * 64)
    q = fused[:, :128].view(5, 2, 64)  # rows 192 apart: not contiguous
    weight = torch.randn(64)
    assert torch.equal(ops.rms_norm(q, weight, 1e-6, 0.0), ops.rms_norm(q.contiguous(), weight, 1e-6, 0.0))


@pytest.mark.parametrize("offset,scale_in_fp32", [(0.0, False), (1.0, True)])
def test_rms_norm_module_on_the_kernel_follows_torch(offset, scale_in_fp32):
    norm = RMSNorm(96, 1e-6, offset=offset, scale_in_fp32=scale_in_fp32)
    torch.nn.init.normal_(norm.weight)
    x = rows_of(9, 96)
    with torch.inference_mode():
        got = norm(x)
        norm.on_kernel = False
        want = norm(x)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-30)


def test_autograd_takes_torch_s_ops():
    norm = RMSNorm(32)
    x = rows_of(3, 32).requires_grad_()
    norm(x).sum().backward()
    assert x.grad is not None and norm.weight.grad is not None


def rotary_case(rot_dims: int, head_dim: int, n: int = 7):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot_dims, 2).float() / rot_dims))
    rotary = RotaryEmbedding(inv_freq, attention_scaling=0.9)
    positions = torch.arange(n) * 37 + 3
    fused = rows_of(n, (4 + 2 + 2) * head_dim)  # q (4 heads), k, v (2 each): views of one projection
    q, k, v = (t.view(n, -1, head_dim) for t in fused.split([4 * head_dim, 2 * head_dim, 2 * head_dim], -1))
    cache = KVCache(torch.zeros(4, 16, 2, head_dim), torch.zeros(4, 16, 2, head_dim))
    slots = torch.randperm(64)[:n]
    return rotary, positions, q, k, v, cache, slots


@pytest.mark.parametrize("rot_dims,head_dim", [(128, 128), (32, 64), (24, 48)])
def test_rotate_and_cache_is_bitwise_torch_s_rotary_and_cache_write(rot_dims, head_dim):
    rotary, positions, q, k, v, cache, slots = rotary_case(rot_dims, head_dim)
    want_q, want_k = rotary(positions, q, k)
    want_cache = KVCache(cache.k.clone(), cache.v.clone())
    want_cache.write(slots, want_k, v)
    got_q = rotary.rotate_and_cache(positions, q, k, v, cache, slots)
    assert got_q.data_ptr() == q.data_ptr()  # in place
    assert torch.equal(got_q, want_q) and torch.equal(k, want_k)
    assert torch.equal(cache.k, want_cache.k) and torch.equal(cache.v, want_cache.v)


def test_rotate_and_cache_writes_v_before_rotating_k_when_they_are_one_tensor():
    rotary, positions, q, k, _, cache, slots = rotary_case(64, 64)
    unrotated = k.clone()
    rotary.rotate_and_cache(positions, q, k, k, cache, slots)  # Gemma 4: V is K before RoPE
    assert torch.equal(cache.v.view(-1, 2, 64)[slots], unrotated)
    assert torch.equal(cache.k.view(-1, 2, 64)[slots], k)


def test_rotate_and_cache_checks_its_slots():
    rotary, positions, q, k, v, cache, _ = rotary_case(64, 64)
    with pytest.raises(RuntimeError, match="is not in the cache"):
        rotary.rotate_and_cache(positions, q, k, v, cache, torch.full((7,), 64))


@pytest.mark.parametrize("act,code", [("silu", 0), ("gelu_pytorch_tanh", 1)])
@pytest.mark.parametrize("dim", [8960, 100])
def test_gated_activation_against_float64(act, code, dim):
    fused = rows_of(37, 2 * dim) * 3
    gate, up = fused.split([dim, dim], -1)  # strided halves, as the fused projection gives them
    got = ops.gated_activation(gate, up, code)
    g = gate.double()
    activated = F.silu(g) if act == "silu" else F.gelu(g, approximate="tanh")
    want = activated * up.double()
    # relative to |gate * up|: where the activation is ~0 its tiny value may differ in relative terms
    assert ((got - want).abs() <= 1e-6 * (g * up.double()).abs() + 1e-30).all()
    assert_rows_alone_equal(lambda a, b: ops.gated_activation(a, b, code), gate, up)


def test_gated_mlp_on_the_kernel_follows_torch():
    mlp = GatedMLP(64, 160, "silu")
    x = rows_of(5, 64, seed=3)
    with torch.inference_mode():
        got = mlp(x)
        mlp.kernel_act = None
        want = mlp(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def delta_rule_inputs_float64(conv, a, b, a_log, dt_bias, key_heads: int, dk: int) -> list[torch.Tensor]:
    """Gated DeltaNet's steps from its conv to its delta rule (transformers' math) in float64."""
    n, key_dim = len(conv), key_heads * dk
    q, k, v = F.silu(conv.double()).split([key_dim, key_dim, conv.shape[1] - 2 * key_dim], -1)
    q, k = (t.reshape(n, key_heads, dk) for t in (q, k))
    q = q / (q.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt() * dk**-0.5
    k = k / (k.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
    g = -a_log.double().exp() * F.softplus(a.double() + dt_bias.double())
    return [q, k, v.reshape(n, a.shape[1], -1), g, g.exp(), b.double().sigmoid()]


@pytest.mark.parametrize(
    "key_heads,dk,heads,dv",
    [(2, 128, 4, 128), (3, 12, 6, 10)],  # Qwen3.5's head sizes; heads that end in a partial vector
)
def test_gdn_delta_rule_inputs_against_float64(key_heads, dk, heads, dv):
    n = 9
    conv = rows_of(n, 2 * key_heads * dk + heads * dv) * 3
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(2, n, heads, generator=g) * 8  # softplus past its threshold of 20 included
    a_log, dt_bias = torch.randn(2, heads, generator=g)
    got = ops.gdn_delta_rule_inputs(conv, a, b, a_log, dt_bias, key_heads, dk, 1e-6)
    want = delta_rule_inputs_float64(conv, a, b, a_log, dt_bias, key_heads, dk)
    names = ("q", "k", "v", "g", "decay", "beta")
    for name, x, y in zip(names, got, want, strict=True):
        assert x.dtype == torch.float32 and x.shape == y.shape, name
        # relative, or to the row's scale where a value is ~0 (silu far below 0, a normalised ~0 entry)
        assert ((x - y).abs() <= 1e-6 * y.abs() + 1e-6 * y.abs().amax(-1, keepdim=True) + 1e-30).all(), name
    for i in range(len(names)):
        assert_rows_alone_equal(
            lambda c, a, b, i=i: ops.gdn_delta_rule_inputs(c, a, b, a_log, dt_bias, key_heads, dk, 1e-6)[i],
            conv,
            a,
            b,
        )


def test_gated_rms_norm_on_the_kernel_follows_torch():
    norm = GatedRMSNorm(32, 1e-6)
    torch.nn.init.normal_(norm.weight)
    x = rows_of(6, 4 * 32).view(6, 4, 32)
    gate = rows_of(6, 3 * 4 * 32, seed=4)[:, 32:160].view(6, 4, 32)  # z: a strided part of a fused projection
    with torch.inference_mode():
        got = norm(x, gate)
        norm.on_kernel = False
        want = norm(x, gate)
        norm.on_kernel = True
        assert_rows_alone_equal(norm, x, gate)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
