"""Tensor parallelism on gloo with 2 ranks (tiny random models): shards that make up the whole model, greedy
TP=2 == TP=1 == transformers for every family, speculation at TP=2 equal to plain greedy, a worker that
dies giving a clear error, and `specserve serve --tensor-parallel-size 2` with the openai client."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager

import httpx
import pytest
import torch
import transformers

from specserve import LLM, SamplingParams
from specserve.config import SpecserveError
from specserve.local_port import free_local_port
from specserve.models.loader import load_hf_config
from specserve.models.registry import build_model, model_class
from specserve.models.sharding import Shard, WeightShard, full_parameter_shapes, shard_config
from specserve.parallel import worker
from specserve.parallel.group import TensorParallelError, TensorParallelGroup
from specserve.platform import CPU, Platform
from tests.server_harness import REPO_ROOT, make_client, serve_process
from tests.tiny_models import (
    build_reference,
    save_tiny_chat_model,
    save_tiny_drafter,
    save_tiny_mtp,
)

pytestmark = pytest.mark.kernel_agnostic

TP = 2
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], list(range(40, 70))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@contextmanager
def tensor_parallel_llm(model_dir, **kwargs):
    threads = torch.get_num_threads()
    llm = LLM(str(model_dir), tensor_parallel_size=TP, max_model_len=256, **kwargs)
    try:
        yield llm
    finally:
        llm.engine.close()
    assert torch.get_num_threads() == threads  # the ranks' share of the cores is given back


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def hf_greedy(model, prompts, new_tokens: int) -> list[list[int]]:
    outs = []
    for prompt in prompts:
        ids = model.generate(
            torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
        )
        outs.append(ids[0, len(prompt) :].tolist())
    return outs


# Variants of the tiny models: Gemma 4 with the MoE block beside its MLP and k = v global attention (fused
# gate|up experts), and a vocabulary that 2 ranks do not divide (the last shard is short).
VARIANTS = {
    "gemma4_moe": (
        "gemma4",
        dict(
            enable_moe_block=True,
            num_experts=4,
            top_k_experts=2,
            moe_intermediate_size=32,
            attention_k_eq_v=True,
        ),
    ),
    "qwen3_odd_vocab": ("qwen3", dict(vocab_size=255)),
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """arch -> (saved directory, the transformers model it was saved from)."""
    cache = {}

    def get(arch: str):
        if arch not in cache:
            base, overrides = VARIANTS.get(arch, (arch, {}))
            model = build_reference(base, **overrides)
            model.generation_config.eos_token_id = None
            directory = tmp_path_factory.mktemp(arch)
            model.save_pretrained(directory)
            cache[arch] = (directory, model)
        return cache[arch]

    return get


# ---- sharding, in one process ---------------------------------------------------------------------------


def _shards(model_dir, world_size: int):
    """(full model, [rank 0's model, ...]) with random weights, each rank's cut from the full one."""
    config = load_hf_config(model_dir)
    full = build_model(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in full.parameters():
            p.normal_()
    shapes = full_parameter_shapes(model_class(config), config)
    ranks = []
    for rank in range(world_size):
        local = build_model(shard_config(config, world_size))
        cut = WeightShard(Shard(rank, world_size), shapes, local)
        with torch.no_grad():
            for name, p in local.named_parameters():
                p.copy_(cut.cut(name, full.get_parameter(name)))
        ranks.append(local)
    return full, ranks


def test_shard_config_splits_heads_and_widths_and_replicates_scarce_kv_heads(model_dirs):
    config = load_hf_config(model_dirs("qwen3_5")[0])
    local = shard_config(config, 2)
    assert (local.num_attention_heads, local.num_key_value_heads) == (2, 1)
    assert (local.linear_num_key_heads, local.linear_num_value_heads) == (1, 2)
    assert local.intermediate_size == config.intermediate_size // 2 and local.head_dim == config.head_dim
    with pytest.raises(SpecserveError, match="linear_num_key_heads=2 is not divisible by .*=4"):
        shard_config(config, 4)
    four = shard_config(load_hf_config(model_dirs("qwen3")[0]), 4)  # 2 KV heads over 4 ranks: replicated
    assert (four.num_attention_heads, four.num_key_value_heads) == (1, 1)


ARCHS = ["qwen3", "qwen3_moe", "qwen2", "gemma3", "gemma4", "gemma4_moe", "qwen3_5", "qwen3_odd_vocab"]
# End to end in the default tier: a vocabulary split unevenly, routed experts, Gemma 4's experts, a hybrid;
# every family's shards are checked in-process above, its whole run in the slow tier.
TP_RUN_IN_DEFAULT_TIER = {"qwen3_odd_vocab", "qwen3_moe", "gemma4_moe", "qwen3_5"}


@pytest.mark.parametrize("arch", ARCHS)
def test_the_shards_of_every_weight_make_up_the_whole_one(arch, model_dirs):
    full, (rank0, rank1) = _shards(model_dirs(arch)[0], 2)
    whole = dict(full.named_parameters())
    split = 0
    for name, a in rank0.named_parameters():
        b = rank1.get_parameter(name)
        if a.shape == whole[name].shape:
            assert torch.equal(a, whole[name]) and torch.equal(b, whole[name]), name  # replicated
            continue
        split += 1
        dim = next(d for d in range(a.dim()) if a.shape[d] != whole[name].shape[d])
        segments = WeightShard(Shard(0, 2), {}, rank0).segments.get(name, (a.shape[dim],))
        pieces = [torch.cat(parts, dim) for parts in zip(a.split(segments, dim), b.split(segments, dim))]
        assert torch.equal(torch.cat(pieces, dim), whole[name]), name
    assert split > 0
    size = sum(p.numel() for p in rank0.parameters())
    assert size < 0.8 * sum(p.numel() for p in full.parameters())


def test_a_kv_head_shared_by_two_ranks_is_the_one_their_query_heads_read():
    config = transformers.Qwen3Config(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8,
    )  # fmt: skip
    full = build_model(config)
    with torch.no_grad():
        for p in full.parameters():
            p.normal_()
    shapes = full_parameter_shapes(model_class(config), config)
    k = full.get_parameter("model.layers.0.self_attn.k_proj.weight")
    for rank in range(4):  # query heads [rank]: KV head rank // 2
        local = build_model(shard_config(config, 4))
        cut = WeightShard(Shard(rank, 4), shapes, local).cut("model.layers.0.self_attn.k_proj.weight", k)
        assert torch.equal(cut, k[(rank // 2) * 8 : (rank // 2 + 1) * 8])


# ---- where the ranks run (CUDA's placement, checked on the CPU) -----------------------------------------


class _WorkerGroup:
    """A worker's group that receives `commands` from a driver that is not there, and records what the
    worker opened its collectives on."""

    def __init__(self, shard, commands):
        self.shard, self.commands, self.opened = shard, list(commands), []

    def receive(self):
        return self.commands.pop(0)

    def open_collectives(self, platform):
        self.opened.append(platform)

    def close(self):
        pass


@pytest.mark.parametrize("launcher_local_rank", [None, "0"])
def test_a_worker_loads_its_shard_on_its_own_gpu(monkeypatch, launcher_local_rank):
    """The driver sends its platform (cuda:1) with `load`; worker rank 1 of 2 runs on the next GPU, cuda:2,
    or on cuda:1 where a launcher says it is the first rank of its node."""
    if launcher_local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", launcher_local_rank)
    load = {"model": "m", "dtype": torch.float32, "platform": Platform(torch.device("cuda", 1), "fla")}
    commands = [("load", {**load, "threads": torch.get_num_threads()}), ("shutdown", ())]
    group = None

    def make_group(shard, init_method, timeout_s):
        nonlocal group
        group = _WorkerGroup(shard, commands)
        return group

    loaded = []
    monkeypatch.setattr(worker, "TensorParallelGroup", make_group)
    monkeypatch.setattr(worker, "load_model", lambda **kw: loaded.append(kw) or ("model", None, None))
    monkeypatch.setattr(worker, "install_collectives", lambda model, group: None)
    worker.run_worker(Shard(1, 2), "tcp://driver", 1.0)
    expected = Platform(torch.device("cuda", 2 if launcher_local_rank is None else 1), "fla")
    assert group.opened == [expected]
    assert loaded == [{"model": "m", "dtype": torch.float32, "platform": expected, "shard": Shard(1, 2)}]


def test_a_commands_tensors_cross_on_the_host_and_land_on_the_ranks_device(monkeypatch):
    """A drafter calls the shared head with its hidden states on the driver's GPU: they are sent from the
    host, and each worker computes on its own device (torch's meta device stands in for a worker's GPU)."""
    group = TensorParallelGroup(Shard(0, 1), f"tcp://127.0.0.1:{free_local_port()}", 10.0)
    try:
        group.open_collectives(CPU)
        sent, seen = [], []
        monkeypatch.setattr(group, "send", sent.append)
        group.handlers["head"] = lambda x, rows: seen.append(x.device)
        group.run("head", torch.ones(2, 3), [1])
        assert sent[0][0] == "head" and sent[0][1][0].device.type == "cpu" and sent[0][1][1] == [1]
        assert torch.equal(group.all_reduce(torch.ones(2)), torch.ones(2))  # the collectives' group works
        group.device = torch.device("meta")  # a worker's, as `open_collectives` set it
        commands = [sent[0], ("shutdown", ())]
        monkeypatch.setattr(group, "receive", lambda: commands.pop(0))
        group.serve()
        assert seen == [torch.device("cpu"), torch.device("meta")]
    finally:
        group.close()


# ---- end to end, 2 processes ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "arch", [a if a in TP_RUN_IN_DEFAULT_TIER else pytest.param(a, marks=pytest.mark.slow) for a in ARCHS]
)
def test_greedy_tp2_equals_tp1_and_transformers(arch, model_dirs):
    directory, reference = model_dirs(arch)
    single = token_ids(LLM(str(directory), max_model_len=256).generate(PROMPTS, GREEDY))
    assert single == hf_greedy(reference, PROMPTS, GREEDY.max_tokens)
    with tensor_parallel_llm(directory) as llm:
        assert token_ids(llm.generate(PROMPTS, GREEDY)) == single
        alone = [token_ids(llm.generate([p], GREEDY))[0] for p in PROMPTS]  # batch invariance across ranks
        assert alone == single


def test_speculation_at_tp2_equals_plain_greedy(model_dirs, tmp_path):
    directory, _ = model_dirs("qwen3")
    draft_dir, _ = model_dirs("qwen2")  # another tiny model over the same vocabulary
    dspark_dir = save_tiny_drafter(directory, tmp_path / "dspark", std=0.2)
    repetitive = [[3, 4, 5, 6] * 6, [9, 8, 7] * 8]
    specs = {
        "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
        "draft_model": {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 3},
        "dspark": {"method": "dspark", "model": str(dspark_dir)},
    }
    with tensor_parallel_llm(directory) as llm:
        plain = token_ids(llm.generate(repetitive + PROMPTS, GREEDY))
    for name, spec in specs.items():
        with tensor_parallel_llm(directory, speculative_config=spec) as llm:
            assert token_ids(llm.generate(repetitive + PROMPTS, GREEDY)) == plain, name
            assert llm.engine.spec_stats.num_drafts > 0, name


def test_a_hybrid_target_rolls_back_its_split_recurrent_state_under_speculation(model_dirs):
    directory, _ = model_dirs("qwen3_5")
    save_tiny_mtp(directory)  # its own multi-token-prediction layer, drafting on the driver
    prompts = [[3, 4, 5, 6] * 6, [9, 8, 7] * 8, *PROMPTS]
    plain = token_ids(LLM(str(directory), max_model_len=256).generate(prompts, GREEDY))
    specs = [{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}, {"method": "mtp"}]
    for spec in specs:
        with tensor_parallel_llm(directory, speculative_config=spec) as llm:
            assert token_ids(llm.generate(prompts, GREEDY)) == plain, spec
            stats = llm.engine.spec_stats
            assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, spec  # accepted and rejected


def test_quantized_layers_are_quantized_per_shard(model_dirs):
    directory, _ = model_dirs("qwen3")
    single = token_ids(LLM(str(directory), max_model_len=256, quantization="int8").generate(PROMPTS, GREEDY))
    with tensor_parallel_llm(directory, quantization="int8") as llm:
        assert token_ids(llm.generate(PROMPTS, GREEDY)) == single
        assert any(type(m).__name__ == "Int8Linear" for m in llm.engine.model.modules())


def test_prompt_logprobs_at_tp2(model_dirs):
    directory, _ = model_dirs("gemma3")
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2)
    single = LLM(str(directory), max_model_len=256).generate(PROMPTS[:2], params)
    with tensor_parallel_llm(directory) as llm:
        split = llm.generate(PROMPTS[:2], params)
    for a, b in zip(single, split, strict=True):
        assert a.prompt_logprobs[0] is None and b.prompt_logprobs[0] is None
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):
            assert x.keys() == y.keys()
            assert all(abs(x[t] - y[t]) < 1e-4 for t in x)


def test_a_killed_worker_ends_the_engine_with_a_clear_error(model_dirs, monkeypatch):
    monkeypatch.setenv("SPECSERVE_TP_TIMEOUT", "20")
    directory, _ = model_dirs("qwen3")
    with tensor_parallel_llm(directory) as llm:
        assert token_ids(llm.generate(PROMPTS[:1], GREEDY))
        worker = llm.engine.parallel.workers[0]
        worker.send_signal(signal.SIGKILL)
        worker.wait()
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match="rank 1 exited with code -9"):
            llm.generate(PROMPTS[:1], GREEDY)
        assert time.monotonic() - start < 20
        with pytest.raises(TensorParallelError):  # and at once from then on
            llm.generate(PROMPTS[:1], GREEDY)


def test_serve_with_tensor_parallel_size_2_answers_the_openai_client(tmp_path):
    model_dir = save_tiny_chat_model("qwen3", tmp_path / "model")
    expected = LLM(str(model_dir), max_model_len=256).generate(["Hello there"], GREEDY)[0].outputs[0].text
    with serve_process(model_dir, tmp_path / "server.log", "--tensor-parallel-size", "2") as (server, url):
        client = make_client(url, api_key="none")
        greedy = {"max_tokens": 16, "temperature": 0.0, "extra_body": {"ignore_eos": True}}
        reply = client.completions.create(model=str(model_dir), prompt="Hello there", **greedy)
        assert reply.choices[0].text == expected
        chat = client.chat.completions.create(
            model=str(model_dir), messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
        assert chat.choices[0].message.content is not None
        workers = _children(server.pid)
        assert len(workers) == 1, workers
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0
    assert _is_gone(workers[0])  # the worker went with it


def test_the_server_answers_503_once_a_worker_died(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_TP_TIMEOUT", "20")
    model_dir = save_tiny_chat_model("qwen3", tmp_path / "model")
    with serve_process(model_dir, tmp_path / "server.log", "--tensor-parallel-size", "2") as (server, url):
        body = {"prompt": "Hello", "max_tokens": 4}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
        (worker,) = _children(server.pid)
        os.kill(worker, signal.SIGKILL)
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 503, reply.text
        assert "rank 1 exited" in reply.json()["error"]["message"]
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 503
        assert httpx.get(f"{url}/health").status_code == 503
        assert server.poll() is None  # still up, saying why it cannot serve


def test_torchrun_starts_every_rank_and_rank_0_runs_the_command(tmp_path):
    model_dir = save_tiny_chat_model("qwen3", tmp_path / "model")
    params = SamplingParams(temperature=0.0, max_tokens=12)
    expected = LLM(str(model_dir), max_model_len=256).generate(["Hello there"], params)[0].outputs[0].text
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command = [
        "-m",
        "specserve.cli",
        "generate",
        "--model",
        str(model_dir),
        "Hello there",
        "--temperature",
        "0",
    ]
    command += ["--max-tokens", "12", "--max-model-len", "256", "--tensor-parallel-size", "2"]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(launcher + command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == expected  # rank 0's stream; the worker rank printed nothing


def _is_gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _is_zombie(pid):
            return True
        time.sleep(0.1)
    return False


def _children(pid: int) -> list[int]:
    path = f"/proc/{pid}/task/{pid}/children"
    with open(path) as fh:
        return [int(p) for p in fh.read().split()]


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] == "Z"
    except FileNotFoundError:
        return True
