"""End-to-end engine behaviour on tiny random models: greedy parity with transformers, batching,
chunked prefill, preemption, seeds, streaming and argument errors."""

from __future__ import annotations

import pytest
import torch

from specserve import LLM, SamplingParams, SpecserveError
from tests.tiny_models import ARCHS, VOCAB, build_reference, save_tiny_chat_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


def prompts(n: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, VOCAB, (int(torch.randint(3, 40, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


def hf_greedy(arch: str, prompt: list[int], new_tokens: int) -> list[int]:
    model = build_reference(arch)
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(arch, tiny_model_dir):
    llm = LLM(str(tiny_model_dir(arch)), kv_cache_memory="16MiB", max_model_len=256)
    batch = prompts(5)
    outs = llm.generate(batch, GREEDY)
    for prompt, out in zip(batch, outs):
        assert out.outputs[0].token_ids == hf_greedy(arch, prompt, 64)
        assert out.outputs[0].finish_reason == "length"


@pytest.fixture(scope="module")
def qwen3_dir(tiny_model_dir):
    return str(tiny_model_dir("qwen3"))


def test_batch_invariance(qwen3_dir):
    llm = LLM(qwen3_dir, kv_cache_memory="16MiB", max_model_len=256)
    batch = prompts(8, seed=3)
    together = [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY)]
    alone = [llm.generate([p], GREEDY)[0].outputs[0].token_ids for p in batch]
    assert together == alone


def test_chunked_prefill_and_small_token_budget(qwen3_dir):
    batch = prompts(4, seed=5)
    reference = [o.outputs[0].token_ids for o in LLM(qwen3_dir, max_model_len=256).generate(batch, GREEDY)]
    small = LLM(qwen3_dir, max_model_len=256, max_num_batched_tokens=7, max_num_seqs=2)
    assert [o.outputs[0].token_ids for o in small.generate(batch, GREEDY)] == reference


def test_preemption_recomputes_to_the_same_output(qwen3_dir):
    batch = prompts(6, seed=7)
    reference = [o.outputs[0].token_ids for o in LLM(qwen3_dir, max_model_len=128).generate(batch, GREEDY)]
    # 3 layers x 2 (k, v) x 2 kv heads x 16 dims x 4 bytes = 768 bytes per token: 160 tokens of cache,
    # room for about two of these requests at a time.
    tight = LLM(qwen3_dir, max_model_len=128, kv_cache_memory=160 * 768, block_size=4)
    outs = tight.generate(batch, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert tight.engine.block_manager.num_used_blocks == 0


def test_seeded_sampling_is_reproducible_and_batch_independent(qwen3_dir):
    llm = LLM(qwen3_dir, max_model_len=256)
    prompt = prompts(1, seed=9)[0]
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=32, ignore_eos=True)
    alone = llm.generate([prompt], params)[0].outputs[0].token_ids
    mixed = llm.generate(
        prompts(5, seed=11) + [prompt],
        [SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True)] * 5 + [params],
    )
    assert mixed[-1].outputs[0].token_ids == alone
    other = llm.generate([prompt], SamplingParams(temperature=1.0, seed=4321, max_tokens=32, ignore_eos=True))
    assert other[0].outputs[0].token_ids != alone


def test_stop_token_ids_and_max_tokens(qwen3_dir):
    llm = LLM(qwen3_dir, max_model_len=256)
    prompt = prompts(1, seed=13)[0]
    full = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    stop_at = full[10]
    first = full.index(stop_at)
    out = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=64, stop_token_ids=[stop_at], ignore_eos=True)
    )[0]
    assert out.outputs[0].token_ids == full[: first + 1]
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", stop_at)
    short = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))[0]
    assert short.outputs[0].token_ids == full[:5] and short.outputs[0].finish_reason == "length"


def test_generation_stops_at_max_model_len(qwen3_dir):
    llm = LLM(qwen3_dir, max_model_len=40)
    out = llm.generate(
        [list(range(3, 33))], SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    )[0]
    assert len(out.outputs[0].token_ids) == 10 and out.outputs[0].finish_reason == "length"


def test_stream_deltas_add_up_and_early_close_frees_cache(qwen3_dir):
    llm = LLM(qwen3_dir, max_model_len=256)
    prompt = prompts(1, seed=15)[0]
    final = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    deltas = [u.outputs[0].delta_token_ids for u in llm.stream(prompt, GREEDY)]
    assert sum(deltas, []) == final
    stream = llm.stream(prompt, GREEDY)
    next(stream)
    stream.close()
    assert llm.engine.block_manager.num_used_blocks == 0 and not llm.engine.has_unfinished


def test_logprobs(qwen3_dir):
    llm = LLM(qwen3_dir, max_model_len=256)
    out = llm.generate(
        [prompts(1)[0]], SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, ignore_eos=True)
    )[0]
    steps = out.outputs[0].logprobs
    assert len(steps) == 4
    for token, step in zip(out.outputs[0].token_ids, steps):
        assert token in step and len(step) == 3  # greedy token is the top-1
        assert max(step.values()) == step[token] <= 0.0


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=-0.5),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(top_k=-2),
        dict(top_k=0),
        dict(max_tokens=0),
        dict(min_p=2.0),
        dict(logprobs=-1),
        # bool is an int to Python: top_k=True reached torch.topk mid-step and broke the engine
        dict(top_k=True),
        dict(logprobs=True),
        dict(max_tokens=True),
        dict(temperature=float("inf")),
        dict(temperature=None),
        dict(repetition_penalty=float("inf")),
        dict(presence_penalty="1"),
        dict(seed=2**64),
        dict(seed=1.5),
        dict(seed=True),
        dict(stop=5),
        dict(stop={"a": 1}),
        dict(stop_token_ids=5),
        dict(stop_token_ids=[True]),
        dict(ignore_eos="no"),
    ],
)
def test_bad_sampling_params(kwargs):
    with pytest.raises(SpecserveError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)


def test_bad_requests_fail_before_anything_runs(qwen3_dir):
    llm = LLM(qwen3_dir, max_model_len=32)
    with pytest.raises(SpecserveError, match="max_model_len"):
        llm.generate([[5] * 10, [5] * 40], GREEDY)
    with pytest.raises(SpecserveError, match="empty"):
        llm.generate([[5, 6], []], GREEDY)
    with pytest.raises(SpecserveError, match="token ids"):
        llm.generate([[5, VOCAB + 3]], GREEDY)
    with pytest.raises(SpecserveError, match="no tokenizer"):
        llm.generate(["hello"], GREEDY)
    with pytest.raises(SpecserveError, match="sampling_params"):
        llm.generate([[5], [6]], [GREEDY])
    with pytest.raises(SpecserveError, match="sampling_params must be SamplingParams or a list, got dict"):
        llm.generate([[5]], {"max_tokens": 3})
    assert not llm.engine.has_unfinished


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(model="no-such-model"), "no-such-model"),
        (dict(max_model_len=1), "max_model_len"),
        (dict(max_model_len=100_000), "context length"),
        (dict(kv_cache_memory="1KiB"), "kv_cache_memory"),
        (dict(kv_cache_memory="lots"), "memory size"),
        (dict(dtype="int3"), "dtype"),
    ],
)
def test_bad_engine_arguments(kwargs, match, qwen3_dir):
    with pytest.raises(SpecserveError, match=match):
        LLM(**{"model": qwen3_dir, **kwargs})


def test_a_failed_step_leaves_the_engine_usable(qwen3_dir, monkeypatch):
    llm = LLM(qwen3_dir, kv_cache_memory="16MiB", max_model_len=64)
    batch = prompts(2, seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    reference = [o.outputs[0].token_ids for o in llm.generate(batch, params)]
    sampler = llm.engine.sampler

    def fail_once(*args):
        monkeypatch.setattr(llm.engine, "sampler", sampler)
        raise RuntimeError("boom")

    monkeypatch.setattr(llm.engine, "sampler", fail_once)
    with pytest.raises(RuntimeError, match="boom"):
        llm.generate(batch, params)
    assert not llm.engine.has_unfinished
    assert [o.outputs[0].token_ids for o in llm.generate(batch, params)] == reference


@pytest.mark.parametrize(
    "prompt, match",
    [
        (None, "prompt"),
        (5, "prompt"),
        ([{"prompt_token_ids": None}], "token ids"),
        ([{"prompt_token_ids": [5, 6], "prompt_token_id": [7]}], "prompt dict"),
        ([{"prompt": "hi", "prompt_token_ids": [5]}], "prompt dict"),
    ],
)
def test_bad_prompts(prompt, match, qwen3_dir):
    llm = LLM(qwen3_dir, max_model_len=32)
    with pytest.raises(SpecserveError, match=match):
        llm.generate(prompt, GREEDY)


def test_stop_token_ids_outside_the_vocabulary(qwen3_dir):
    llm = LLM(qwen3_dir, max_model_len=32)
    with pytest.raises(SpecserveError, match="stop_token_ids"):
        llm.generate([[5, 6]], SamplingParams(stop_token_ids=[VOCAB]))


@pytest.fixture(scope="module")
def chat_llm(tmp_path_factory):
    return LLM(str(save_tiny_chat_model("qwen3", tmp_path_factory.mktemp("chat"))), max_model_len=64)


@pytest.mark.parametrize(
    "messages, kwargs, match",
    [
        # the template rendered these as their Python repr: a prompt the caller never wrote
        ([{"role": "user", "content": 5}], {}, "content"),
        ([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], {}, "content"),
        ([{"role": "user", "content": None}], {}, "content"),  # null only beside an assistant's tool_calls
        ([{"role": None, "content": "hi"}], {}, "role"),
        ({"role": "user", "content": "hi"}, {}, "messages"),
        (None, {}, "messages"),
        ([{"role": "user", "content": "hi"}], {"chat_template_kwargs": 5}, "chat_template_kwargs"),
    ],
)
def test_bad_chat_messages(messages, kwargs, match, chat_llm):
    with pytest.raises(SpecserveError, match=match):
        chat_llm.chat(messages, GREEDY, **kwargs)
    assert chat_llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2))
