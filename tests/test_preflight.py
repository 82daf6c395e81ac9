"""Mistakes decidable from config.json, a GGUF header and the arguments fail before any weight is read.

The models here have a config.json and a weights file of junk: any read of a weight would fail with a
safetensors error, so a test that sees the check's own message knows no weight was read. The 1.5B-shaped
one would take ~6 GB to load; the CLI's errors on it stay under 1 GB."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
import torch
import transformers

from specserve import LLM, preflight
from specserve.cli import main
from specserve.config import EngineConfig, SpecserveError, SpeculativeConfig
from specserve.models.gguf import build_hf_config
from specserve.models.gguf_header import GGUFHeader
from specserve.models.registry import model_skeleton
from specserve.preflight import check_before_loading, host_memory_bytes, weight_bytes
from tests.test_loader import write_tiny_gguf

pytestmark = pytest.mark.kernel_agnostic

QWEN_1_5B = dict(
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=32768,
)
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=512,
)


def unloadable(
    directory: Path, config: transformers.PretrainedConfig, vocab: list[str] | None = None
) -> Path:
    """config.json, a weights file no reader accepts, and (with `vocab`) a tokenizer.json naming it."""
    config.save_pretrained(directory)
    (directory / "model.safetensors").write_bytes(b"not a safetensors file")
    if vocab is not None:
        model = {"type": "BPE", "vocab": {t: i for i, t in enumerate(vocab)}, "merges": []}
        (directory / "tokenizer.json").write_text(json.dumps({"model": model, "added_tokens": []}))
    return directory


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> Path:
    return unloadable(tmp_path_factory.mktemp("big"), transformers.Qwen2Config(**QWEN_1_5B))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    vocab = [f"t{i}" for i in range(256)]
    return unloadable(tmp_path_factory.mktemp("tiny"), transformers.Qwen2Config(**TINY), vocab)


def test_junk_weights_would_fail_a_load(tiny):
    with pytest.raises(Exception) as info:
        LLM(model=str(tiny), kv_cache_memory="16MiB")  # every check passes: the load reads the junk
    assert "safetensor" in type(info.value).__name__.lower()


def test_max_model_len_past_the_context(big):
    with pytest.raises(SpecserveError, match="max_model_len 100000 exceeds the model's context length 32768"):
        LLM(model=str(big), max_model_len=100000)


def test_kv_budget_below_max_model_len(big):
    # fp32 KV of the 1.5B: 28 layers x 2 x 2 heads x 128 x 4 bytes = 56 KiB a token
    with pytest.raises(
        SpecserveError, match=r"kv_cache_memory='1MiB' holds 16 tokens, fewer than max_model_len"
    ):
        LLM(model=str(big), kv_cache_memory="1MiB", dtype="float32")
    check_before_loading(
        EngineConfig(model=str(big), kv_cache_memory="512MiB", max_model_len=8192, dtype="fp32")
    )


def test_unknown_draft_model(big):
    spec = {"method": "draft_model", "model": "qwen2.5-coder-05b"}
    with pytest.raises(SpecserveError, match="unknown model 'qwen2.5-coder-05b'"):
        LLM(model=str(big), speculative_config=spec)
    spec = {"method": "draft_model", "model": "./no/such/dir"}
    with pytest.raises(SpecserveError, match="does not exist"):
        LLM(model=str(big), speculative_config=spec)


def test_draft_model_vocabulary_and_tokenizer(tiny, tmp_path):
    other_size = unloadable(tmp_path / "a", transformers.Qwen2Config(**{**TINY, "vocab_size": 320}))
    spec = SpeculativeConfig(method="draft_model", model=str(other_size))
    with pytest.raises(SpecserveError, match="vocabulary size 320, the target has 256"):
        check_before_loading(EngineConfig(model=str(tiny), kv_cache_memory="16MiB"), spec)
    vocab = [f"t{i}" for i in range(256)]
    vocab[7] = "seven"
    other_tokens = unloadable(tmp_path / "b", transformers.Qwen2Config(**TINY), vocab)
    spec = SpeculativeConfig(method="draft_model", model=str(other_tokens))
    with pytest.raises(SpecserveError, match="different tokenizer vocabulary .* id 7: 'seven' against 't7'"):
        check_before_loading(EngineConfig(model=str(tiny), kv_cache_memory="16MiB"), spec)
    same = unloadable(tmp_path / "c", transformers.Qwen2Config(**TINY), [f"t{i}" for i in range(256)])
    check_before_loading(
        EngineConfig(model=str(tiny), kv_cache_memory="16MiB"),
        SpeculativeConfig(method="draft_model", model=str(same)),
    )


def test_tensor_parallel_against_head_counts(tiny):
    with pytest.raises(SpecserveError, match="not divisible by tensor_parallel_size=3"):
        check_before_loading(EngineConfig(model=str(tiny), kv_cache_memory="16MiB", tensor_parallel_size=3))


def test_quantization_against_the_architecture(tmp_path):
    # no output width a multiple of 16 (heads of 6, an MLP of 40, 250 tokens): the kernels take no layer
    odd = dict(TINY, hidden_size=24, intermediate_size=40, head_dim=6, vocab_size=250)
    model = unloadable(tmp_path / "odd", transformers.Qwen3Config(**odd))
    with pytest.raises(SpecserveError, match="quantization 'int4' applies to no linear layer"):
        check_before_loading(EngineConfig(model=str(model), kv_cache_memory="16MiB", quantization="int4"))


def test_mtp_needs_a_hybrid_target(tiny):
    with pytest.raises(SpecserveError, match="method 'mtp' drafts with the multi-token-prediction layer"):
        check_before_loading(
            EngineConfig(model=str(tiny), kv_cache_memory="16MiB"), SpeculativeConfig(method="mtp")
        )


def test_unsupported_architecture(tmp_path):
    model = unloadable(tmp_path / "llama", transformers.LlamaConfig(**TINY))
    with pytest.raises(SpecserveError, match="model_type 'llama' is not supported"):
        check_before_loading(EngineConfig(model=str(model), kv_cache_memory="16MiB"))


# ---- GGUF: the header alone, before any conversion -----------------------------------------------------


@pytest.mark.parametrize("arch", ["qwen2", "gemma3", "qwen3moe"])
def test_gguf_header_gives_the_readers_config(tmp_path, arch):
    path = tmp_path / f"{arch}.gguf"
    write_tiny_gguf(path, arch, tokenizer=True)
    reader = gguf.GGUFReader(str(path))
    header = GGUFHeader(path)
    assert build_hf_config(header).to_dict() == build_hf_config(reader).to_dict()
    assert header.get("tokenizer.ggml.tokens") == reader.fields["tokenizer.ggml.tokens"].contents()
    assert [(t.name, list(t.shape)) for t in header.tensors] == [
        (t.name, [int(d) for d in t.shape]) for t in reader.tensors
    ]
    # the same file cut into chunks (as local models ship), read across them
    data = path.read_bytes()
    cuts = [0, 100, 1000, len(data) // 2, len(data)]
    parts = []
    for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
        parts.append(tmp_path / f"part{i}.bin")
        parts[-1].write_bytes(data[a:b])
    assert build_hf_config(GGUFHeader(parts)).to_dict() == build_hf_config(reader).to_dict()


def test_gguf_header_refuses_junk(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 8)
    with pytest.raises(SpecserveError):
        GGUFHeader(junk)
    (tmp_path / "text.gguf").write_text("hello, not a model at all")
    with pytest.raises(SpecserveError, match="not a GGUF file"):
        GGUFHeader(tmp_path / "text.gguf")


def test_gguf_checked_before_conversion(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "qwen2")
    with pytest.raises(SpecserveError, match="max_model_len 1000 exceeds the model's context length 256"):
        LLM(model=str(path), max_model_len=1000)
    assert not (tmp_path / "cache" / "converted").exists()  # nothing was converted


# ---- the CLI: the acceptance's errors, in a process of its own, under 1 GB -------------------------------

# The peak of this process's own address space (VmHWM starts afresh at exec; getrusage's maxrss counts the
# parent's pages the child was forked with: a pytest process of 1.4 GB made every child look that large).
PROBE = """
import contextlib, io, json, re, sys
from specserve.cli import main
err = io.StringIO()
with contextlib.redirect_stderr(err):
    code = main(sys.argv[1:])
peak = int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read())[1]) * 1024
print(json.dumps({"code": code, "err": err.getvalue(), "peak": peak}))
"""


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max-model-len", "100000"], "exceeds the model's context length 32768"),
        (["--kv-cache-memory", "1MiB", "--dtype", "float32"], "holds 16 tokens, fewer than max_model_len"),
        (
            ["--speculative-config", '{"method": "draft_model", "model": "qwen2.5-coder-05b"}'],
            "unknown model 'qwen2.5-coder-05b'",
        ),
    ],
    ids=["max-model-len", "kv-budget", "draft-name"],
)
def test_cli_errors_before_loading_under_1_gb(big, flags, message):
    argv = ["generate", "--model", str(big), *flags, "hello"]
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=300)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["code"] == 2 and message in result["err"]
    assert result["peak"] < 2**30, f"peak RSS {result['peak'] / 2**20:.0f} MiB"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--port", "70000"], "port must be in 0..65535, got 70000"),
        (["--host", "192.0.2.1"], "cannot serve on 192.0.2.1:8000: Cannot assign requested address"),
        (["--tokenizer-workers", "0"], "tokenizer_workers must be >= 1, got 0"),
        (["--max-waiting-requests", "-1"], "max_waiting must be >= 0, got -1"),
        (["--shutdown-timeout", "-1"], "drain_timeout_s must be >= 0, got -1.0"),
        (["--max-request-body-bytes", "-5"], "max_request_body_bytes must be > 0, got -5"),
        (["--request-read-timeout", "0"], "request_read_timeout_s must be > 0, got 0.0"),
    ],
)
def test_serve_refuses_bad_server_flags_before_loading(tiny, flags, message, capsys):
    assert main(["serve", str(tiny), *flags]) == 2  # the junk weights: no load began
    assert message in capsys.readouterr().err


def test_serve_on_a_taken_port_fails_before_loading(tiny, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", str(tiny), "--port", str(port)]) == 2
    assert f"cannot serve on 127.0.0.1:{port}: Address already in use" in capsys.readouterr().err


@pytest.mark.parametrize("tied", [False, True])
def test_weight_bytes_are_the_loaded_parameters(tied):
    config = transformers.Qwen2Config(**TINY, tie_word_embeddings=tied)
    parameters = transformers.AutoModelForCausalLM.from_config(config).num_parameters()  # a tied one once
    skeleton = model_skeleton(config)
    assert weight_bytes(skeleton, None, torch.float32) == 4 * parameters
    assert weight_bytes(skeleton, None, torch.bfloat16) == 2 * parameters
    linears = sum(m.weight.numel() for m in skeleton.modules() if isinstance(m, torch.nn.Linear))
    # int8 quantizes every linear layer but the head (tied, the head is the embedding)
    body = linears - TINY["vocab_size"] * TINY["hidden_size"]
    int8 = weight_bytes(skeleton, "int8", torch.float32)
    assert int8 == int(4 * (parameters - body) + 8.5 / 8 * body)


def test_weights_that_cannot_fit_in_memory_are_refused(big, monkeypatch):
    """The 1.5B's fp32 weights (~6.6 GiB) on a machine of 4 GiB: refused before loading, naming int4's ~1.7
    GiB; int4 then passes the check, and on 1 GiB nothing fits."""
    monkeypatch.setattr(preflight, "host_memory_bytes", lambda: 4 * 2**30)
    fp32 = r"its weights take ~6\.\d GiB as loaded \(float32\), and the caches 0\.5 GiB"
    with pytest.raises(
        SpecserveError, match=fp32 + r".*\(4\.0 GiB of RAM and swap\); use --quantization int4"
    ):
        LLM(model=str(big), dtype="float32", kv_cache_memory="512MiB")
    check_before_loading(EngineConfig(model=str(big), quantization="int4", kv_cache_memory="512MiB"))
    monkeypatch.setattr(preflight, "host_memory_bytes", lambda: 2**30)
    with pytest.raises(SpecserveError, match=r"\(int4\).*; use a smaller model$"):
        check_before_loading(EngineConfig(model=str(big), quantization="int4", kv_cache_memory="512MiB"))


def test_host_memory_is_read():
    assert host_memory_bytes() > 2**30  # any machine that runs the suite
