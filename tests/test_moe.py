"""Mixture-of-experts layers (specserve/layers/moe.py): quantized experts run in grouped kernel calls whose
rows are bitwise those of each expert's own call, on tiny random Qwen3-MoE and Qwen3.5-MoE; the stacking
adds no memory and is skipped where the experts are not on specserve's kernel; greedy speculation on a
quantized MoE target equals plain greedy decoding."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specserve import LLM, SamplingParams
from specserve.layers import kernels
from specserve.layers.moe import Experts, combine, dispatch, route_topk
from specserve.models.loader import load_model

needs_kernel = pytest.mark.skipif(not kernels.ops(), reason="experts are grouped on specserve's kernel")


def looped_reference(experts: Experts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor):
    """Each expert alone over its rows, its weighted outputs added back expert after expert."""
    out = torch.zeros_like(x)
    for e, expert in enumerate(experts):
        token, slot = (ids == e).nonzero(as_tuple=True)
        if len(token):
            out.index_add_(0, token, expert(x[token]) * weights[token, slot, None])
    return out


def experts_of(model) -> list[Experts]:
    found = [m for m in model.modules() if isinstance(m, Experts)]
    assert found
    return found


def storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@needs_kernel
@pytest.mark.parametrize("mode", ["int4", "int8"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_5_moe"])
def test_grouped_experts_equal_each_expert_alone(arch, mode, tiny_model_dir):
    """M = 1..16 rows (verification blocks) and 37 (a prompt piece), routed at random: bitwise the loop
    over experts, each row bitwise as when it is alone; the experts' layers view the stacked buffers."""
    model, _, _ = load_model(str(tiny_model_dir(arch)), quantization=mode)
    g = torch.Generator().manual_seed(0)
    for experts in experts_of(model):
        assert experts.stacks is not None
        gate_up, down = experts.stacks
        for e, expert in enumerate(experts):
            assert storage(expert.gate_proj.packed) == storage(expert.up_proj.packed)
            assert storage(expert.gate_proj.packed) == storage(gate_up.buffers[0])
            assert storage(expert.down_proj.packed) == storage(down.buffers[0])
            assert torch.equal(expert.down_proj.packed, down.buffers[0][e])
        hidden, top_k = expert.down_proj.out_features, 2
        for m in [*range(1, 17), 37]:
            x = torch.randn(m, hidden, generator=g) * torch.logspace(-1, 1, m)[:, None]
            weights, ids = route_topk(torch.randn(m, len(experts), generator=g), top_k, True)
            got = experts(x, weights, ids)
            assert torch.equal(got, looped_reference(experts, x, weights, ids)), f"M = {m}"
            alone = torch.cat([experts(x[i : i + 1], weights[i : i + 1], ids[i : i + 1]) for i in range(m)])
            assert torch.equal(got, alone), f"M = {m}"


@needs_kernel
def test_grouped_experts_with_many_experts_most_without_rows():
    """128 experts, top 8 (Qwen3-30B-A3B's routing) at small widths: most experts get no row."""
    from specserve.layers.quant import quantize_model

    torch.manual_seed(0)
    experts = Experts(128, 64, 32)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.1)
    quantize_model(experts, "int4")
    assert experts.stacks is not None
    for m in (1, 4, 9, 16):
        x = torch.randn(m, 64)
        weights, ids = route_topk(torch.randn(m, 128), 8, True)
        assert torch.equal(experts(x, weights, ids), looped_reference(experts, x, weights, ids))


@needs_kernel
def test_compiled_dispatch_and_combine_equal_torch_bitwise(monkeypatch):
    """moe.cpp's two calls against torch's operators: the rows, counts and slots exactly, the combined sums
    bitwise (products rounded, then added in id order), at decode, verification and prompt sizes, a
    token-less call, routings with unused experts, and a strided x."""
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(37, 80, generator=g)
    for x, top_k, num_experts in [
        (torch.randn(1, 64, generator=g), 8, 128),
        (torch.randn(9, 48, generator=g), 8, 128),
        (torch.randn(16, 7, generator=g), 4, 6),
        (wide[:, 3:36], 2, 4),  # rows 80 floats apart
        (torch.randn(0, 16, generator=g), 2, 4),
    ]:
        n, h = x.shape
        ids = torch.rand(n, num_experts, generator=g).argsort(dim=1)[:, :top_k]  # distinct, in no order
        weights = torch.rand(n, top_k, generator=g)
        y = torch.randn(n * top_k, h, generator=g) * torch.logspace(-3, 3, h)  # sums that round
        compiled = (
            *dispatch(x, ids, num_experts),
            combine(y, weights, ids, dispatch(x, ids, num_experts)[2]),
        )
        with monkeypatch.context() as patch:
            patch.setenv(kernels.ENV_VAR, "1")
            reference = (
                *dispatch(x, ids, num_experts),
                combine(y, weights, ids, dispatch(x, ids, num_experts)[2]),
            )
        for got, want, name in zip(compiled, reference, ("rows", "counts", "slots", "sums"), strict=True):
            assert got.dtype == want.dtype and torch.equal(got, want), (name, x.shape, top_k)


@needs_kernel
def test_compiled_dispatch_and_combine_refuse_bad_routing():
    x = torch.randn(3, 8)
    with pytest.raises(RuntimeError, match="expert id 4 outside"):
        dispatch(x, torch.tensor([[0, 1], [2, 4], [1, 3]]), 4)
    with pytest.raises(RuntimeError, match="slot 9 outside"):
        combine(
            torch.randn(6, 8),
            torch.rand(3, 2),
            torch.tensor([[0, 1], [2, 3], [1, 3]]),
            torch.tensor([[0, 1], [2, 3], [4, 9]]),
        )


@needs_kernel
@pytest.mark.parametrize("arch,stacked", [("qwen3_next", True), ("qwen3_5_moe", False)])
def test_a_shared_expert_of_the_routed_shape_runs_in_their_grouped_calls(arch, stacked, tiny_model_dir):
    """Qwen3-Next's shared expert (as wide as a routed one) is stacked as expert E, routed every token at
    its gate, added last: bitwise the block with the shared expert apart, each row as when it is alone.
    Qwen3.5-MoE's tiny one is wider: kept apart."""
    from specserve.models.qwen import QwenSparseMoe

    model, _, _ = load_model(str(tiny_model_dir(arch)), quantization="int4")
    blocks = [m for m in model.modules() if isinstance(m, QwenSparseMoe)]
    assert blocks and all(b.experts.shared_stacked == stacked for b in blocks)
    g = torch.Generator().manual_seed(0)
    for block in blocks:
        if stacked:
            down = block.experts.stacks[1].buffers[0]
            assert len(down) == len(block.experts) + 1
            assert storage(block.shared_expert.down_proj.packed) == storage(down)
        for m in (1, 5, 9, 37):
            x = torch.randn(m, block.gate.in_features, generator=g)
            got = block(x)
            weights, ids = route_topk(block.gate(x), block.top_k, True)
            gate = torch.sigmoid(block.shared_expert_gate(x).double()).float()
            apart = block.experts(x, weights, ids) + gate * block.shared_expert(x)  # its own calls
            assert torch.equal(got, apart), m
            assert torch.equal(got, torch.cat([block(x[i : i + 1]) for i in range(m)])), m


def test_experts_in_grouped_matmuls_match_their_loop(tiny_model_dir):
    """The GPU's path (`use_grouped_mm`, run here on the CPU): two `torch._grouped_mm` calls a layer over
    the experts' stacked weights (views: the experts re-pointed at them), no host read, so the model's
    steps may be captured; against the loop within fp32 rounding. Qwen's experts and Gemma 4's (gelu)."""
    from specserve.models.gemma import GemmaForCausalLM
    from specserve.worker.cuda_graphs import graph_refusal
    from tests.test_gemma import CONFIGS

    model, _, _ = load_model(str(tiny_model_dir("qwen3_moe")))
    assert "experts" in graph_refusal(model)
    gemma = GemmaForCausalLM(CONFIGS["gemma4_moe"]()).model.layers[0].experts
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in gemma.parameters():
            p.normal_(0, 0.1, generator=g)
    layers = [*experts_of(model), gemma]
    assert gemma[0].act is not layers[0][0].act
    for experts in layers:
        num, hidden = len(experts), experts[0].down_proj.out_features
        cases = []
        for m in (1, 5, 9, 37):
            x = torch.randn(m, hidden, generator=g)
            weights, ids = route_topk(torch.randn(m, num, generator=g), 2, True)
            cases.append((x, weights, ids, experts(x, weights, ids)))
        assert experts.reads_host
        experts.use_grouped_mm()
        assert not experts.reads_host
        assert storage(experts[1].up_proj.weight) == storage(experts.dense[0])  # views, not copies
        for x, weights, ids, looped in cases:
            got = experts(x, weights, ids)
            assert got.shape == looped.shape and torch.allclose(got, looped, rtol=1e-5, atol=1e-6), len(x)
    assert graph_refusal(model) is None


def test_experts_off_the_kernel_keep_the_loop(tiny_model_dir):
    """Unquantized (fp32) experts are not stacked; they run one by one, as the reference does."""
    model, _, _ = load_model(str(tiny_model_dir("qwen3_moe")))
    experts = experts_of(model)[0]
    assert experts.stacks is None and not experts.stack_experts()
    x = torch.randn(5, experts[0].down_proj.out_features)
    weights, ids = route_topk(torch.randn(5, len(experts)), 2, True)
    assert torch.equal(experts(x, weights, ids), looped_reference(experts, x, weights, ids))
    assert experts(x[:0], weights[:0], ids[:0]).shape == (0, x.shape[1])


@needs_kernel
@pytest.mark.parametrize(
    "arch,mode",
    [("qwen3_moe", "int4"), ("qwen3_moe", "int8"), ("qwen3_5_moe", "int4"), ("qwen3_next", "int4")],
)
def test_greedy_speculation_on_a_quantized_moe_target_is_exact(arch, mode, tiny_model_dir):
    target = str(tiny_model_dir(arch))
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 9, 10, 11, 9, 10]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    config = dict(max_model_len=64, kv_cache_memory="16MiB", quantization=mode)
    expected = [o.outputs[0].token_ids for o in LLM(target, **config).generate(prompts, params)]
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    llm = LLM(target, speculative_config=spec, **config)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    assert llm.engine.spec_stats.num_drafts > 0
    assert all(e.stacks is not None for e in experts_of(llm.engine.model))


@needs_kernel
def test_stacking_experts_keeps_no_freed_memory(monkeypatch):
    """Fusing and stacking free every expert's buffers piece by piece into larger ones; the heap's freed
    pages go back to the OS a layer at a time, or a whole model's experts would be held twice (a 30B
    MoE's load peaked at ~1.8x its size)."""
    import gc

    from specserve.layers.huge_pages import trim_heap
    from specserve.layers.quant import fuse_projections, quantize_model

    def resident() -> int:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * 4096

    torch.manual_seed(0)
    layers = nn.ModuleList(Experts(64, 512, 384) for _ in range(4))
    with torch.no_grad():
        for p in layers.parameters():
            p.normal_(0, 0.1)
    quantize_model(layers, "int4", fuse=False)
    expert_bytes = sum(b.nbytes for b in layers.buffers())
    gc.collect()
    trim_heap()
    before = resident()
    fuse_projections(layers)
    assert all(experts.stacks is not None for experts in layers)
    assert resident() - before < 0.2 * expert_bytes, (resident() - before, expert_bytes)
