import gc
import weakref
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specserve.layers import kernels
from specserve.layers.linear import (
    ENV_VAR,
    SMALL_OUTPUTS,
    PackedLinear,
    SmallLinear,
    linear_backend,
    onednn_available,
    pack_linears,
)
from tests.tiny_models import build_reference

pytestmark = pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()


BATCH_SIZES = [*range(2, 17), 64]  # verification batches, and a prefill chunk sharing a call with decode rows


def assert_batch_invariant(layer: Callable[[torch.Tensor], torch.Tensor], in_features: int) -> None:
    """Row i of every M-row call is bitwise the row computed alone (M = 1): greedy speculation needs it."""
    x = torch.randn(max(BATCH_SIZES), in_features, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        alone = torch.cat([layer(x[i : i + 1]) for i in range(len(x))])
        for m in BATCH_SIZES:
            y = layer(x[:m])
            assert torch.equal(y, alone[:m]), f"M = {m}: rows off by up to {(y - alone[:m]).abs().max():.2g}"


@pytest.mark.parametrize("in_features,out_features", [(64, 48), (257, 130), (1536, 256)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear(in_features, out_features, bias):
    torch.manual_seed(0)
    dense = nn.Linear(in_features, out_features, bias=bias)
    packed = PackedLinear(dense)
    inputs = [torch.randn(in_features)]  # 1-D
    inputs += [torch.randn(m, in_features) for m in (1, 2, 3, 8, 17, 64)]  # 2-D
    inputs += [torch.randn(2, 5, in_features), torch.randn(1, 1, in_features), torch.randn(1, 2, in_features)]
    inputs += [torch.randn(in_features, 6).t(), torch.randn(4, 3, in_features).transpose(0, 1)]  # strided
    inputs += [torch.randn(0, in_features)]
    with torch.inference_mode():
        for x in inputs:
            y, ref = packed(x), F.linear(x, dense.weight, dense.bias)
            assert y.shape == ref.shape and y.dtype == torch.float32
            if ref.numel():
                assert _rel_err(y, ref) < 1e-4, tuple(x.shape)


@pytest.mark.parametrize(
    "in_features,out_features,bias", [(64, 48, False), (64, 256, True), (257, 130, True), (1536, 256, False)]
)
def test_rows_do_not_depend_on_the_rest_of_the_call(in_features, out_features, bias):
    torch.manual_seed(0)
    assert_batch_invariant(PackedLinear(nn.Linear(in_features, out_features, bias=bias)), in_features)


@pytest.mark.parametrize("in_features,out_features", [(64, 48), (257, 130)])
def test_bf16_linear_is_batch_invariant(in_features, out_features):
    """`dtype="bfloat16"` keeps nn.Linear (not packed): its F.linear must be invariant as well."""
    torch.manual_seed(0)
    dense = nn.Linear(in_features, out_features).to(torch.bfloat16)
    assert_batch_invariant(lambda x: dense(x.to(torch.bfloat16)), in_features)


def test_small_layers_are_replaced_by_default(compiled_kernels):
    """A MoE router or a tiny model's head: left to F.linear, its rows would depend on the batch. With
    specserve's kernels the small ones take SmallLinear, without them oneDNN's PackedLinear."""
    small_kernel = SmallLinear if compiled_kernels else PackedLinear
    model = nn.ModuleDict({"router": nn.Linear(64, 8), "gate": nn.Linear(96, 1), "head": nn.Linear(64, 256)})
    model["wide"] = nn.Linear(64, SMALL_OUTPUTS + 1)
    assert pack_linears(model, enabled=True) == 4
    for name, layer in model.items():
        assert isinstance(layer, PackedLinear if name == "wide" else small_kernel), name
        assert_batch_invariant(layer, layer.in_features)


@pytest.mark.skipif(kernels.ops() is None, reason="specserve's kernels are not built here")
@pytest.mark.parametrize("in_features,out_features", [(64, 48), (257, 130), (2048, 128), (100, 1), (33, 512)])
@pytest.mark.parametrize("bias", [False, True])
def test_small_linear_on_the_kernel(in_features, out_features, bias):
    torch.manual_seed(0)
    dense = nn.Linear(in_features, out_features, bias=bias)
    small = SmallLinear(dense)
    assert small.weight is dense.weight and small.bias is dense.bias
    assert set(small.state_dict()) == set(dense.state_dict())
    x = torch.randn(5, 3, in_features)
    with torch.no_grad():
        bias64 = None if dense.bias is None else dense.bias.double()
        want = F.linear(x.double(), dense.weight.double(), bias64)
        assert _rel_err(small(x).double(), want) < 1e-5
    for path in range(1, min(kernels.load_ops().best_isa(), 2) + 1):  # AVX2, AVX-512
        assert_batch_invariant(
            lambda rows, path=path: kernels.load_ops().fp32_linear(rows, dense.weight, dense.bias, path),
            in_features,
        )
    x.requires_grad_()  # no autograd on the kernel: F.linear then
    small(x).square().sum().backward()
    grad, x.grad = x.grad, None
    dense(x).square().sum().backward()
    torch.testing.assert_close(grad, x.grad)


def test_weight_and_bias_read_like_nn_linear():
    dense = nn.Linear(96, 80)
    packed = PackedLinear(dense)
    assert torch.equal(packed.weight, dense.weight)
    assert packed.bias is dense.bias
    assert (packed.in_features, packed.out_features) == (96, 80)
    assert set(packed.state_dict()) == {"weight", "bias"}
    assert torch.equal(packed.state_dict()["weight"], dense.weight)
    x = torch.randn(2, 96)  # outside no_grad too (parameters require grad)
    assert _rel_err(packed(x).detach(), F.linear(x, dense.weight, dense.bias).detach()) < 1e-4


def test_gradients_flow_as_through_nn_linear():
    """oneDNN's op has no autograd: an input that needs a gradient takes F.linear."""
    dense = nn.Linear(64, 48)
    packed = PackedLinear(dense)
    x = torch.randn(3, 64, requires_grad=True)
    packed(x).square().sum().backward()
    grad, x.grad = x.grad, None
    dense(x).square().sum().backward()
    torch.testing.assert_close(grad, x.grad)


def test_state_dict_load_repacks():
    a, b = nn.Linear(64, 72), nn.Linear(64, 72)
    packed = PackedLinear(a)
    packed.load_state_dict(b.state_dict())
    x = torch.randn(3, 64)
    with torch.no_grad():
        assert _rel_err(packed(x), b(x)) < 1e-4


def test_non_fp32_input_falls_back():
    dense = nn.Linear(64, 32)
    packed = PackedLinear(dense)
    x = torch.randn(2, 64, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(packed(x), F.linear(x, dense.weight.double(), dense.bias.double()))


def test_rejects_non_fp32_weight():
    with pytest.raises(ValueError):
        PackedLinear(nn.Linear(64, 64).to(torch.bfloat16))


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(100, 64)
        self.big = nn.Linear(64, SMALL_OUTPUTS + 1)  # packed, whatever kernels there are
        self.small = nn.Linear(64, 8)  # below min_features
        self.bf16 = nn.Linear(128, 64).to(torch.bfloat16)
        self.head = nn.Linear(64, 100, bias=False)
        self.head.weight = self.embed.weight  # tied


def test_pack_linears_selects_modules():
    model = _Tiny()
    big_weight = weakref.ref(model.big.weight)
    assert pack_linears(model, min_features=16, enabled=True) == 2
    assert isinstance(model.big, PackedLinear) and isinstance(model.head, PackedLinear | SmallLinear)
    assert type(model.small) is nn.Linear and type(model.bf16) is nn.Linear
    gc.collect()
    assert big_weight() is None  # the dense copy of an untied weight is released
    # the tied head keeps reading the embedding's own Parameter
    assert model.head.weight is model.embed.weight
    assert "head.weight" not in dict(model.named_parameters())  # no second copy registered
    ids = torch.tensor([3, 7, 99])
    with torch.no_grad():
        torch.testing.assert_close(model.embed(ids), model.embed.weight[ids])
        h = torch.randn(3, 64)
        assert _rel_err(model.head(h), h @ model.embed.weight.t()) < 1e-4


def test_pack_tied_false_leaves_head():
    model = _Tiny()
    assert pack_linears(model, min_features=16, pack_tied=False, enabled=True) == 1
    assert type(model.head) is nn.Linear and model.head.weight is model.embed.weight


def test_shared_module_packed_once():
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU())
    model.append(model[0])
    assert pack_linears(model, min_features=1, enabled=True) == 1
    assert model[0] is model[2] and isinstance(model[0], PackedLinear | SmallLinear)


def test_disabled_by_env_var(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "torch")
    assert linear_backend() == "torch"
    model = _Tiny()
    assert pack_linears(model) == 0
    assert type(model.big) is nn.Linear
    monkeypatch.setenv(ENV_VAR, "onednn")
    assert pack_linears(model, min_features=16) == 2
    monkeypatch.setenv(ENV_VAR, "bogus")
    with pytest.raises(ValueError):
        linear_backend()


def test_other_dtypes_untouched():
    model = _Tiny().to(torch.bfloat16)
    assert pack_linears(model, min_features=1, enabled=True) == 0


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe"])
def test_tiny_model_outputs_unchanged(arch):
    model = build_reference(arch)
    tied = model.config.tie_word_embeddings
    ids = torch.randint(0, model.config.vocab_size, (2, 11))
    with torch.inference_mode():
        before = model(ids).logits
        n_linear = sum(type(m) is nn.Linear for m in model.modules())
        assert pack_linears(model, min_features=1, enabled=True) == n_linear
        assert not any(type(m) is nn.Linear for m in model.modules())
        after = model(ids).logits
    assert _rel_err(after, before) < 1e-4
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight
