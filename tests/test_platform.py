"""The platform layer (specserve/platform.py): which device a `device` string means, what "auto" picks, what
CUDA refuses, and that a forward keeps every tensor where the model lives (checked on torch's meta device,
where a host tensor mixed into most ops raises, as it would beside a GPU; not every op checks: an embedding
lookup with host indices passes there)."""

import argparse
import json
import time

import pytest
import torch

from specserve.cli_args import add_engine_args, engine_kwargs
from specserve.config import EngineConfig, SpecserveError
from specserve.layers import kernels
from specserve.layers.quant import Int4Linear, quantize_int4
from specserve.layers.transfer import to_device, to_host
from specserve.models.loader import load_model
from specserve.platform import CPU, Platform, check_device, local_rank, resolve_platform
from specserve.worker.cuda_graphs import GraphConfig
from specserve.worker.model_runner import ModelRunner, PieceInput

pytestmark = pytest.mark.kernel_agnostic


@pytest.fixture
def two_gpus(monkeypatch):
    """torch as it is on a machine with two CUDA devices (nothing is allocated on them)."""
    monkeypatch.delenv("SPECSERVE_AUTO_DEVICE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.delenv("SPECSERVE_AUTO_DEVICE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.parametrize(
    "text, normal", [("auto", "auto"), ("CPU", "cpu"), ("cuda", "cuda"), ("cuda:1", "cuda:1")]
)
def test_device_strings_are_normalised(text, normal):
    assert check_device(text) == normal


@pytest.mark.parametrize("text", ["gpu", "cuda:", "cuda:x", "", "mps", "cpu:0"])
def test_a_bad_device_string_names_the_accepted_forms(text):
    with pytest.raises(SpecserveError, match="'auto', 'cpu', 'cuda' or 'cuda:N'"):
        check_device(text)


def test_auto_is_the_cpu_without_a_gpu(no_gpu):
    assert resolve_platform("auto") is CPU
    assert EngineConfig(model="m", device="auto").platform is CPU


def test_cuda_without_a_gpu_is_a_clear_error(no_gpu):
    with pytest.raises(SpecserveError, match="torch sees no CUDA device"):
        resolve_platform("cuda")
    with pytest.raises(SpecserveError, match="no CUDA device"):
        EngineConfig(model="m", device="cuda:0")


def test_auto_is_cuda_where_torch_sees_a_gpu(two_gpus, monkeypatch):
    platform = resolve_platform("auto")
    assert platform.device == torch.device("cuda", 0) and platform.is_cuda
    assert platform.delta_rule == "fla"
    assert resolve_platform("cuda:1").device == torch.device("cuda", 1)
    with pytest.raises(SpecserveError, match=r"2 CUDA device\(s\), cuda:0 to cuda:1"):
        resolve_platform("cuda:2")
    monkeypatch.setenv("SPECSERVE_AUTO_DEVICE", "cpu")  # what the CPU suite pins
    assert resolve_platform("auto") is CPU


def test_cuda_computes_in_bf16_and_refuses_what_it_cannot_run_yet(two_gpus):
    config = EngineConfig(model="m", device="cuda")
    assert config.dtype == "bfloat16" and "CUDA" in config.dtype_reason
    assert EngineConfig(model="m", device="cuda", dtype="float32").dtype == "float32"
    assert EngineConfig(model="m", device="cuda", quantization="int4").quantization == "int4"
    assert EngineConfig(model="m", device="cuda", dtype="fp16").dtype == "float16"


@pytest.mark.parametrize("capability", [(9, 0), (8, 0)])
def test_experts_group_on_the_device_where_grouped_mm_reads_no_host(two_gpus, monkeypatch, capability):
    """torch._grouped_mm's fast path (bf16, Hopper / Blackwell) keeps group sizes on the GPU; its fallback
    (fp32, older GPUs) loops on the host, so the experts keep theirs (and the steps are not captured)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    cuda = Platform(torch.device("cuda"), "fla")
    assert cuda.groups_on_device(torch.bfloat16) == (capability[0] == 9)
    assert not cuda.groups_on_device(torch.float32) and not CPU.groups_on_device(torch.bfloat16)


def test_quantized_layers_on_cuda_take_the_kernel_layout_without_the_cpu_kernels(two_gpus, monkeypatch):
    """CUDA's Triton kernel reads specserve's kernel layout only: the layers built for it take that layout
    even where the CPU kernels are not built (which the CPU's layers then do without)."""
    monkeypatch.setattr(kernels, "ops", lambda: None)
    config = EngineConfig(model="m", device="cuda", quantization="int4")
    w = quantize_int4(torch.randn(32, 64), 32)
    assert Int4Linear(w, use_kernel=config.platform.quantized_layout).on_kernel
    assert not Int4Linear(w, use_kernel=CPU.quantized_layout).on_kernel


def test_auto_falls_back_to_the_cpu_for_what_runs_there_only(two_gpus):
    config = EngineConfig(model="m", quantization="int8", tensor_parallel_size=3)
    assert config.platform is CPU
    assert config.device_reason == (
        "auto: tensor parallelism over cuda:0 to cuda:2 (torch sees 2 GPU(s)) run on the CPU only"
    )


def test_tensor_parallel_ranks_exchange_tensors_over_nccl_on_cuda_and_gloo_on_the_cpu():
    assert CPU.collective_backend == "gloo"
    assert Platform(torch.device("cuda", 0), "fla").collective_backend == "nccl"


def test_each_tensor_parallel_rank_has_a_gpu_of_its_own_from_the_device_asked_for(two_gpus):
    cuda1 = Platform(torch.device("cuda", 1), "fla")
    assert [cuda1.of_rank(r).device for r in range(3)] == [torch.device("cuda", i) for i in (1, 2, 3)]
    assert cuda1.of_rank(2).delta_rule == "fla" and CPU.of_rank(3) is CPU  # the CPU's cores are shared
    config = EngineConfig(model="m", device="cuda", tensor_parallel_size=2)
    assert config.platform.device == torch.device("cuda", 0)
    with pytest.raises(SpecserveError, match=r"over cuda:1 to cuda:2 \(torch sees 2 GPU\(s\)\) do\(es\) not"):
        EngineConfig(model="m", device="cuda:1", tensor_parallel_size=2)
    with pytest.raises(SpecserveError, match=r"over cuda:0 to cuda:3 \(torch sees 2"):
        EngineConfig(model="m", device="cuda", tensor_parallel_size=4)


def test_with_a_launcher_a_node_needs_gpus_for_its_own_ranks_only(two_gpus, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun: 2 nodes of 2 ranks each
    assert EngineConfig(model="m", device="cuda", tensor_parallel_size=4).platform.is_cuda
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert Platform(torch.device("cuda", 0), "fla").of_rank(local_rank(3)).device == torch.device("cuda", 1)


def test_the_caches_budget_is_measured_on_a_gpu_and_given_on_the_cpu(two_gpus):
    from specserve.worker.device_memory import cache_budget_bytes

    assert EngineConfig(model="m", device="cpu").kv_cache_bytes == 2 * 2**30  # the CPU's default
    assert EngineConfig(model="m", device="cuda").kv_cache_bytes is None  # measured after loading
    assert EngineConfig(model="m", device="cuda", kv_cache_memory="1GiB").kv_cache_bytes == 2**30
    for bad in (0, 1.5, True, "0.9"):
        with pytest.raises(SpecserveError, match="gpu_memory_utilization must be in"):
            EngineConfig(model="m", gpu_memory_utilization=bad)
    # 80 GB at 0.9 leaves 72; 16 of weights and 6 of activations come first
    assert cache_budget_bytes(80 * 10**9, 0.9, 16 * 10**9, 6 * 10**9) == 50 * 10**9
    assert cache_budget_bytes(20 * 10**9, 0.9, 16 * 10**9, 6 * 10**9) == 0


def test_the_cpu_keeps_its_own_dtype_choice(no_gpu, monkeypatch):
    monkeypatch.setenv("SPECSERVE_AUTO_DTYPE", "float32")
    config = EngineConfig(model="m", quantization="int4")
    assert config.platform is CPU and config.dtype == "float32"


def test_the_device_flag_reaches_the_engine():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args(["--device", "cuda:1"]))["device"] == "cuda:1"
    assert engine_kwargs(parser.parse_args([]))["device"] == "auto"


def test_host_device_transfers():
    a, b = torch.arange(6).view(2, 3), torch.tensor([7])
    assert all(x is y for x, y in zip(to_device(torch.device("cpu"), a, b), (a, b)))
    moved = to_device(torch.device("meta"), a, b)  # one copy, viewed back into the shapes
    assert [m.device.type for m in moved] == ["meta"] * 2 and [m.shape for m in moved] == [a.shape, b.shape]
    assert to_host(a, None) == [a, None]


def _meta_attention(q, cache, meta, scale, sliding_window=None, logit_softcap=None):
    assert q.device == cache.k.device == meta.device == meta.tables.device == meta.slot_mapping.device
    return q.new_empty(q.shape[0], q.shape[1], cache.v.shape[-1])


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "gemma3", "gemma4"])
def test_a_forward_keeps_every_tensor_on_the_models_device(tiny_model_dir, arch):
    """The model on torch's meta device (shapes, no data): any tensor the runner or a layer builds on the host
    and mixes into the computation raises, as it would beside a GPU model. Attention is a stand-in here
    (the CPU plan reads its metadata on the host; on CUDA the Triton kernel is installed)."""
    model, _, _ = load_model(str(tiny_model_dir(arch)))
    model.to("meta")
    for module in model.modules():
        if hasattr(module, "attention_backend"):
            module.attention_backend = _meta_attention
    runner = ModelRunner(model, num_blocks=8, block_size=16, dtype=torch.float32)
    assert runner.device.type == "meta" and all(c.k.device.type == "meta" for c in runner.kv_caches)
    pieces = [PieceInput([1, 2, 3], 0, [0]), PieceInput([4, 5], 17, [1, 2])]
    out = runner.forward(pieces, logit_rows=[2, 4])
    assert out.logits.device.type == "meta" and tuple(out.logits.shape) == (2, model.config.vocab_size)


@pytest.mark.parametrize("static", [False, True], ids=["plain", "static_buffers"])
def test_a_dspark_draft_forward_keeps_every_tensor_on_the_drafters_device(tiny_model_dir, static):
    """The DSpark drafter's backbone forward (context rows from the target, the paged draft cache, the
    block queries) with its model, caches and the target's features on the meta device; plain, and
    through the static buffers of CUDA graphs (run eagerly)."""
    import dataclasses

    from specserve.spec_decode.drafters.dspark import DSparkDrafter
    from tests.test_dspark import B, bound, fake_target, make_drafter_model, sequence

    targets = {"qwen3": load_model(str(tiny_model_dir("qwen3")))[:2]}
    model = make_drafter_model(targets).to("meta")
    for module in model.modules():
        if hasattr(module, "attention_backend"):
            module.attention_backend = _meta_attention
    meta = Platform(torch.device("meta"), "torch")
    drafter = DSparkDrafter(model, dataclasses.replace(fake_target(B), platform=meta))
    if static:
        drafter.graph_config = GraphConfig(max_tokens=16, max_pieces=4, max_blocks=8, capture=False)
    drafter = bound(drafter, B)
    assert all(c.k.device.type == "meta" for c in drafter.caches)
    seqs = [sequence("a", list(range(3, 12))), sequence("b", list(range(5, 10)))]
    for seq in seqs:
        drafter.observe(seq, 0, torch.empty(seq.num_tokens - 1, drafter.feature_width, device="meta"))
    h = drafter._backbone(seqs)
    assert h.device.type == "meta" and tuple(h.shape[:2]) == (2, B)
    if static:  # 2 blocks of B rows, 8 + 4 context rows
        assert set(drafter.graphs._inputs) == {(2 * B, 16)}


def test_the_gpu_benchmark_runs_anywhere(tmp_path, capsys):
    """`python -m specserve.bench.gpu` on a tiny shape on the CPU: every figure it reports on a GPU."""
    from specserve.bench.gpu import KS, main

    argv = ["--device", "cpu", "--shape", "tiny", "--dtype", "float32", "--context", "40", "--repeats", "1"]
    argv += ["--concurrency", "1,2", "--input-len", "16", "--output-len", "12", "--copy-bytes", "100000"]
    # A draft of the target's shape gets the target's random weights (one seed): every draft is accepted.
    argv += ["--draft-shape", "tiny", "--spec-k", "3"]
    main([*argv, "--new-tokens", "3", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "gpu-bench.json").read_text())
    assert list(result["runs"]) == ["eager"]  # the CPU captures no graphs
    run = result["runs"]["eager"]
    assert set(map(int, run["verify_ratio"])) == set(KS) and run["verify_ratio"]["1"] == 1.0
    assert run["decode_tokens_per_s"] > 0 and 0 < run["roofline_share"]
    # (transformers' per-token time is the difference of two generate timings: at tiny shapes on a loaded
    # CPU it can come out of the noise with either sign; only that the anchor is measured is checked here)
    assert "transformers_tokens_per_s" in result and "vs_transformers" in run
    by_weights = result["quantized"]["by_weights"]
    assert list(by_weights) == ["float32", "int4", "int8"]
    for figures in by_weights.values():
        assert figures["decode_tokens_per_s"] > 0 and figures["roofline_share"] > 0
        assert figures["verify_ratio_8"] > 0
    assert (tmp_path / "verify-cost.png").stat().st_size > 0
    assert (tmp_path / "pareto.png").stat().st_size > 0
    spec = result["speculative"]
    assert spec["mode"] == "eager" and spec["k"] == 3 and not spec["skipped"]
    draft, ngram = spec["configs"]["specserve draft_model k=3"], spec["configs"]["specserve ngram k=3"]
    for served, accepted in ((run["serving"], None), (draft, 1.0), (ngram, None)):
        assert set(served) == {"1", "2"}
        for c, figures in served.items():
            assert figures["output_tokens"] == int(c) * 12  # every request got exactly what it asked for
            assert figures["output_tokens_per_s"] > 0 and figures["user_tokens_per_s"] > 0
            if served is not run["serving"]:
                assert figures["draft_tokens"] > 0 and 0 <= figures["acceptance_rate"] <= 1
                assert 1 <= figures["tokens_per_round"] <= 4
            if accepted is not None:
                assert figures["acceptance_rate"] == accepted and figures["tokens_per_round"] > 1
    # The n-gram drafter finds its matches in the repeating prompts, and some are accepted.
    assert max(figures["acceptance_rate"] for figures in ngram.values()) > 0
    out = capsys.readouterr().out
    assert "T(k)/T(1)" in out and "drafts accepted" in out and "random weights" in out and "int4:" in out
    with pytest.raises(SystemExit):
        main([*argv, "--draft-shape", "qwen3-0.6b"])  # another vocabulary: refused before anything runs
    assert "another vocabulary" in capsys.readouterr().err


@pytest.mark.parametrize("killed_at", [2, 4], ids=["plain serving", "speculation"])
def test_a_killed_gpu_benchmark_keeps_what_it_measured(tmp_path, monkeypatch, killed_at):
    """gpu-bench.json is written after each measured phase: a run stopped in its `killed_at`-th serving run
    (the second plain one, or the second speculative one) leaves the figures measured before it."""
    from specserve.bench import gpu

    real, calls = gpu.serve, []

    def serve(*args, **kwargs):
        calls.append(None)
        if len(calls) == killed_at:
            raise KeyboardInterrupt  # what a timeout's signal ends it with, as far as the file can tell
        return real(*args, **kwargs)

    monkeypatch.setattr(gpu, "serve", serve)
    argv = ["--device", "cpu", "--shape", "tiny", "--dtype", "float32", "--context", "40", "--repeats", "1"]
    argv += ["--concurrency", "1,2", "--spec-concurrency", "1", "--input-len", "16", "--output-len", "4"]
    argv += ["--copy-bytes", "100000", "--draft-shape", "tiny", "--new-tokens", "3", "--out", str(tmp_path)]
    with pytest.raises(KeyboardInterrupt):
        gpu.main(argv)
    assert [p.name for p in tmp_path.iterdir()] == ["gpu-bench.json"]  # whole, no partial file beside it
    result = json.loads((tmp_path / "gpu-bench.json").read_text())
    run = result["runs"]["eager"]
    assert run["decode_tokens_per_s"] > 0 and len(run["verify_ratio"]) == len(gpu.KS)
    if killed_at == 2:
        assert list(run["serving"]) == ["1"] and "transformers_tokens_per_s" not in result
        assert "speculative" not in result
    else:
        assert list(run["serving"]) == ["1", "2"] and "vs_transformers" in run
        served = [by for by in result["speculative"]["configs"].values() if by]
        assert len(served) == 1 and list(served[0]) == ["1"]


def test_the_gpu_benchmark_starts_no_speculative_run_past_its_budget():
    """Past `--budget-s` every speculative run left is listed as skipped, none is started (no engine is
    built from the model directories, which do not exist)."""
    from specserve.bench.gpu import speculation

    args = argparse.Namespace(spec_k=2, spec_concurrency=[8, 1], draft_shape="tiny")
    spec = speculation("no-model", "no-draft", args, "graphs", False, deadline=time.monotonic() - 1)
    assert spec["configs"] == {"specserve ngram k=2": {}, "specserve draft_model k=2": {}}
    assert spec["skipped"] == [
        f"specserve {method} k=2 at {c}" for c in (1, 8) for method in ("ngram", "draft_model")
    ]
