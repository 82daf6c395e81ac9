"""The GPU tier (`pytest -m gpu`, run by `make gpu-check` on a lent GPU machine; skipped without CUDA): the
engine on CUDA against the CPU's fp32 reference, speculation's exactness there, prefix caching, and the
number of host synchronizations a step costs. docs/cuda.md says what runs on CUDA and how to run this."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

from specserve import LLM, SamplingParams
from specserve.models.loader import load_model
from specserve.platform import CPU, Platform, resolve_platform
from specserve.worker.model_runner import ModelRunner, PieceInput
from tests.test_lossless import (  # noqa: F401 (models, drafters: fixtures)
    CASES,
    DRAFTER_SAMPLES,
    chi_square_pvalue,
    drafters,
    exact_joint,
    models,
    sampled_joint,
)
from tests.tiny_models import save_tiny_drafter

pytestmark = [
    pytest.mark.kernel_agnostic,
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU tier needs a CUDA device"),
]

FAMILIES = ["qwen2", "qwen3", "qwen3_moe", "gemma3", "gemma4", "qwen3_5", "qwen3_5_moe", "qwen3_next"]
PIECES = [  # a prompt chunk, a cached sequence's decode row and a verification block, in one forward
    PieceInput(list(range(3, 40)), 0, [0, 1, 2], state_slot=0),
    PieceInput([7], 20, [3, 4], state_slot=1),
    PieceInput([9, 4, 11, 2], 30, [5, 6, 7], state_slot=2, checkpoint=True),
]


def forward_logits(
    model_dir: str, platform: Platform, dtype: torch.dtype, quantization: str | None = None
) -> torch.Tensor:
    """The logits of PIECES' last rows in one forward (after one that caches their prefixes), on the CPU."""
    model, _, _ = load_model(model_dir, dtype=dtype, platform=platform, quantization=quantization)
    runner = ModelRunner(model, num_blocks=8, block_size=16, dtype=dtype, num_state_slots=3)
    # the cached prefixes the decode row and the block read (KV, recurrent states): a first forward's
    prefixes = [PieceInput(list(range(20)), 0, [3, 4], 1), PieceInput(list(range(30)), 0, [5, 6], 2)]
    runner.forward(prefixes, [0])
    rows = [36, 37, 38, 39, 40, 41]  # the chunk's last row, the decode row, the block's rows
    return runner.forward(PIECES, rows).logits.float().cpu()


@pytest.mark.parametrize(
    "arch, dtype",
    [(arch, torch.bfloat16) for arch in FAMILIES] + [("qwen3", torch.float16), ("qwen3_5", torch.float16)],
)
def test_every_family_on_cuda_matches_the_cpu_fp32_reference(tiny_model_dir, arch, dtype):
    """bf16 (and fp16) on the GPU against fp32 on the CPU (`assert_close_to_reference`)."""
    reference = forward_logits(str(tiny_model_dir(arch)), CPU, torch.float32)
    cuda = forward_logits(str(tiny_model_dir(arch)), resolve_platform("cuda"), dtype)
    assert_close_to_reference(cuda, reference)


def assert_close_to_reference(logits: torch.Tensor, reference: torch.Tensor) -> None:
    """Close in value (5% of the largest logit: bf16's 8 bits of mantissa over a few layers) and the same
    top-1 token wherever the reference's top two are not within that error."""
    scale = reference.abs().max()
    assert (logits - reference).abs().max() < 0.05 * scale
    top2 = reference.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.1 * scale
    assert torch.equal(logits.argmax(-1)[clear], reference.argmax(-1)[clear])


@pytest.mark.parametrize("mode", ["int4", "int8"])
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "qwen3_5_moe", "gemma3"])
def test_quantized_models_on_cuda_match_the_cpu_kernels(tiny_model_dir, arch, mode):
    """The same int4 / int8 weights (specserve's kernel layout, fused projections, stacked experts) on the
    GPU's Triton kernel, bf16 activations, against the CPU's layers in fp32 (specserve's kernel, which also
    rounds activations to int8 per block, where it is built; `assert_close_to_reference`)."""
    reference = forward_logits(str(tiny_model_dir(arch)), CPU, torch.float32, mode)
    cuda = forward_logits(str(tiny_model_dir(arch)), resolve_platform("cuda"), torch.bfloat16, mode)
    assert_close_to_reference(cuda, reference)


def test_greedy_ngram_speculation_on_cuda_agrees_with_plain_greedy(tiny_model_dir, record_property):
    """Reported, and asserted exact only where it can be: attention (Triton) is batch-invariant, cuBLAS's
    GEMMs are not (a row's bits depend on how many rows share the call), so a verified token may differ
    from the decoded one where two logits tie within bf16's rounding."""
    model = str(tiny_model_dir("qwen3"))
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [9, 9, 9, 9]]
    plain = LLM(model, device="cuda").generate(prompts, params)
    spec = LLM(model, device="cuda", speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    drafted = spec.generate(prompts, params)
    same = sum(
        a == b for p, d in zip(plain, drafted) for a, b in zip(p.outputs[0].token_ids, d.outputs[0].token_ids)
    )
    agreement = same / sum(len(p.outputs[0].token_ids) for p in plain)
    record_property("greedy_agreement", agreement)
    print(f"greedy ngram speculation on CUDA: {agreement:.1%} of tokens as plain greedy")
    assert spec.engine.spec_stats.num_accepted_tokens > 0
    assert [p.outputs[0].token_ids[0] for p in plain] == [d.outputs[0].token_ids[0] for d in drafted]
    assert all(len(d.outputs[0].token_ids) == 48 for d in drafted)


@pytest.mark.parametrize(
    "drafter",
    ["draft_model", "dspark_vanilla", "dspark_scheduled", "dflash", "eagle3", "speculators_dflash2"],
)
def test_speculative_sampling_on_cuda_keeps_the_target_distribution(drafter, models, drafters):  # noqa: F811
    """test_lossless.py's check on the GPU, with its poor drafters: sampled continuations (greedy requests
    on other prompts in the same batches) against the exact joint distribution of the first 3 tokens,
    enumerated with transformers. fp32, so that the greedy requests' logits do not tie."""
    reference, target_dir, _, _ = models
    params = CASES["temperature_1"]
    n, on_cuda = DRAFTER_SAMPLES, {"device": "cuda", "dtype": "float32"}
    counts = sampled_joint(target_dir, drafters[drafter], params, 3, n, **on_cuda)
    assert chi_square_pvalue(counts, exact_joint(reference, params, 3), n) > 0.001


def test_prefix_caching_on_cuda_a_b_a(tiny_model_dir):
    model = str(tiny_model_dir("qwen3"))
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    a, b = list(range(3, 70)), list(range(3, 40)) + [100, 101, 102]  # B shares A's first blocks
    cached = LLM(model, device="cuda", block_size=16)
    first, with_b, again = (cached.generate([p], params)[0] for p in (a, b, a))
    assert with_b.num_cached_tokens == 32 and again.num_cached_tokens == 64
    fresh = LLM(model, device="cuda", enable_prefix_caching=False).generate([a], params)[0]
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == fresh.outputs[0].token_ids


def _syncs_per_decode_step(model: str, num_requests: int) -> float:
    llm = LLM(model, device="cuda", max_num_seqs=num_requests)
    params = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True)
    for i in range(num_requests):
        llm.engine.add_request([3 + i, 4, 5], params)
    llm.engine.step()  # the prefill
    llm.engine.step()  # the first decode step captures its bucket's CUDA graph
    torch.cuda.synchronize()
    counted = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(5):
                before = len(caught)
                llm.engine.step()
                counted.append(len(caught) - before)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum(counted) / len(counted)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])  # experts in grouped matmuls
def test_a_decode_step_synchronizes_once_whatever_the_batch(tiny_model_dir, record_property, arch):
    """torch flags every hidden device -> host synchronization (`set_sync_debug_mode`): a step reads its
    sampled tokens back once, not once per request or token."""
    model = str(tiny_model_dir(arch))
    one, eight = _syncs_per_decode_step(model, 1), _syncs_per_decode_step(model, 8)
    record_property("syncs_per_step", (one, eight))
    assert one == eight <= 2


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism on CUDA needs two GPUs")
def test_tensor_parallel_over_two_gpus_equals_one_gpu(tiny_model_dir, tmp_path):
    """TP=2 on cuda:0 and cuda:1 (NCCL collectives; with DSpark, the target's split embedding and head called
    by the drafter as commands, its tensors sent through the host) against TP=1 on cuda:0, greedy. fp32 and
    eager both: the partial sums and cuBLAS's batch-dependent GEMMs change the rounding only, far below the
    tiny random model's logit gaps."""
    model = str(tiny_model_dir("qwen3"))
    common = dict(device="cuda", dtype="float32", enforce_eager=True, kv_cache_memory="256MiB")
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13], list(range(40, 70)), [3, 4, 5, 6] * 6]
    single = [o.outputs[0].token_ids for o in LLM(model, **common).generate(prompts, params)]
    dspark = {"method": "dspark", "model": str(save_tiny_drafter(model, tmp_path / "dspark", std=0.2))}
    for spec in (None, dspark):
        llm = LLM(model, tensor_parallel_size=2, speculative_config=spec, **common)
        try:
            group = llm.engine.parallel.group
            assert dist.get_backend(group.collectives) == "nccl" and group.device == torch.device("cuda", 0)
            assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == single, spec
            assert spec is None or llm.engine.spec_stats.num_drafts > 0
        finally:
            llm.engine.close()
