"""Model resolution and loading: local dirs, GGUF conversion, PyPI-shipped local models, hub errors.

Fast tier: tiny random models and tiny GGUF files written here. Slow tier (`-m slow`): the three real local
models, converted into the shared cache and compared tensor by tensor with transformers' own GGUF loading.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from specserve import LLM, SamplingParams
from specserve.config import SpecserveError
from specserve.local_port import free_local_port
from specserve.models import gguf as sgguf
from specserve.models import local_models
from specserve.models.loader import (
    iter_checkpoint_tensors,
    load_hf_config,
    load_tokenizer,
    resolve_model,
)

# ----------------------------------------------------------------------------------------------- fixtures


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("SPECSERVE_CACHE", str(root))
    return root


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A tiny random Qwen2 saved by transformers in several shards (no tokenizer files)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(config)
    out = tmp_path_factory.mktemp("tiny_qwen")
    model.save_pretrained(out, max_shard_size="4KB")
    return out, {k: v.clone() for k, v in model.state_dict().items()}


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character table (byte-level BPE vocabularies start with these 256)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs, strict=True))]


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)
H, LAYERS, HEADS, KV_HEADS, FFN = 32, 2, 4, 2, 64


EXPERTS, EXPERT_FFN = 4, 32


def gguf_writer(path, arch: str, layers: int, hidden: int, ffn: int, heads: int, kv_heads: int):
    """A GGUFWriter with the hyperparameters every tiny test model shares."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1_000_000.0)
    return w


def write_tiny_gguf(
    path: Path,
    arch: str = "qwen2",
    *,
    tokenizer: bool = False,
    lm_head: bool = False,
    vocabless: bool = False,
) -> dict[str, np.ndarray]:
    """A tiny GGUF in llama.cpp's conventions; returns the HF tensors the conversion must produce.
    `vocabless`: a model without a vocabulary, as llama.cpp marks one (tokenizer model "no_vocab")."""
    rng = np.random.default_rng(0)
    head_dim = H // HEADS
    tokens = _bytes_to_unicode() + ["Ġt", "he", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = len(tokens)
    w = gguf_writer(path, arch, LAYERS, H, FFN, HEADS, KV_HEADS)
    if arch != "qwen2":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == "gemma3":
        w.add_sliding_window(16)
    if arch == "qwen3moe":
        w.add_expert_count(EXPERTS)
        w.add_expert_used_count(2)
        w.add_expert_feed_forward_length(EXPERT_FFN)
    if vocabless:
        w.add_tokenizer_model("no_vocab")
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list(tokens)
        w.add_token_types([1] * (vocab - 3) + [3, 3, 3])
        w.add_token_merges(["Ġ t", "h e"])
        w.add_bos_token_id(vocab - 3)
        w.add_eos_token_id(vocab - 1)
        w.add_pad_token_id(vocab - 3)
        w.add_chat_template(CHAT_TEMPLATE)

    expected: dict[str, np.ndarray] = {}

    def add(gguf_name: str, hf_name: str, shape: tuple[int, ...], qtype: QT = QT.F32, norm: bool = False):
        x = rng.standard_normal(shape).astype(np.float32)
        if hf_name.endswith(".experts"):  # stacked [n_expert, ...]: HF names one tensor per expert
            w.add_tensor(gguf_name, x)
            leaf = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
            proj = leaf[gguf_name.split(".")[2]]
            expected.update({f"{hf_name}.{e}.{proj}.weight": x[e] for e in range(EXPERTS)})
            return
        if norm and arch == "gemma3":
            # llama.cpp stores Gemma norms as w + 1; undoing it in float32 is what transformers does too
            w.add_tensor(gguf_name, x + 1)
            expected[hf_name] = (x + 1) - np.float32(1)
        elif qtype == QT.F32:
            w.add_tensor(gguf_name, x)
            expected[hf_name] = x
        else:
            q = gguf.quants.quantize(x, qtype)
            w.add_tensor(gguf_name, q, raw_dtype=qtype)
            expected[hf_name] = gguf.quants.dequantize(q, qtype).reshape(shape)

    add("token_embd.weight", "model.embed_tokens.weight", (vocab, H))
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        add(f"blk.{i}.attn_q.weight", f"{p}.self_attn.q_proj.weight", (H, H), QT.Q8_0)
        add(f"blk.{i}.attn_k.weight", f"{p}.self_attn.k_proj.weight", (KV_HEADS * head_dim, H))
        add(f"blk.{i}.attn_v.weight", f"{p}.self_attn.v_proj.weight", (KV_HEADS * head_dim, H))
        add(f"blk.{i}.attn_output.weight", f"{p}.self_attn.o_proj.weight", (H, H))
        if arch == "qwen3moe":
            add(f"blk.{i}.ffn_gate_inp.weight", f"{p}.mlp.gate.weight", (EXPERTS, H))
            add(f"blk.{i}.ffn_gate_exps.weight", f"{p}.mlp.experts", (EXPERTS, EXPERT_FFN, H))
            add(f"blk.{i}.ffn_up_exps.weight", f"{p}.mlp.experts", (EXPERTS, EXPERT_FFN, H))
            add(f"blk.{i}.ffn_down_exps.weight", f"{p}.mlp.experts", (EXPERTS, H, EXPERT_FFN))
        else:
            add(f"blk.{i}.ffn_gate.weight", f"{p}.mlp.gate_proj.weight", (FFN, H))
            add(f"blk.{i}.ffn_up.weight", f"{p}.mlp.up_proj.weight", (FFN, H), QT.Q8_0)
            add(f"blk.{i}.ffn_down.weight", f"{p}.mlp.down_proj.weight", (H, FFN))
        add(f"blk.{i}.attn_norm.weight", f"{p}.input_layernorm.weight", (H,), norm=True)
        if arch == "qwen2":
            add(f"blk.{i}.attn_q.bias", f"{p}.self_attn.q_proj.bias", (H,))
            add(f"blk.{i}.attn_k.bias", f"{p}.self_attn.k_proj.bias", (KV_HEADS * head_dim,))
            add(f"blk.{i}.attn_v.bias", f"{p}.self_attn.v_proj.bias", (KV_HEADS * head_dim,))
        if arch in ("qwen3", "qwen3moe"):
            add(f"blk.{i}.attn_q_norm.weight", f"{p}.self_attn.q_norm.weight", (head_dim,))
            add(f"blk.{i}.attn_k_norm.weight", f"{p}.self_attn.k_norm.weight", (head_dim,))
        if arch != "gemma3":
            add(f"blk.{i}.ffn_norm.weight", f"{p}.post_attention_layernorm.weight", (H,))
        else:
            add(f"blk.{i}.attn_q_norm.weight", f"{p}.self_attn.q_norm.weight", (head_dim,), norm=True)
            add(f"blk.{i}.attn_k_norm.weight", f"{p}.self_attn.k_norm.weight", (head_dim,), norm=True)
            add(
                f"blk.{i}.post_attention_norm.weight", f"{p}.post_attention_layernorm.weight", (H,), norm=True
            )
            add(f"blk.{i}.ffn_norm.weight", f"{p}.pre_feedforward_layernorm.weight", (H,), norm=True)
            add(f"blk.{i}.post_ffw_norm.weight", f"{p}.post_feedforward_layernorm.weight", (H,), norm=True)
    add("output_norm.weight", "model.norm.weight", (H,), norm=True)
    if lm_head:  # without output.weight llama.cpp's model ties the head to the embedding
        add("output.weight", "lm_head.weight", (vocab, H), QT.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


# ----------------------------------------------------------------------------------- local HF directories


def test_local_dir_resolves_as_is_and_iterates_every_shard(tiny_hf_dir):
    path, state = tiny_hf_dir
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) > 1
    assert resolve_model(str(path)) == path
    got = dict(iter_checkpoint_tensors(path))
    assert set(got) == set(state)
    for name, tensor in state.items():
        assert torch.equal(got[name], tensor), name
    assert load_hf_config(path).model_type == "qwen2"


def test_dir_without_tokenizer_gives_none(tiny_hf_dir):
    assert load_tokenizer(tiny_hf_dir[0]) is None


def test_dir_with_tokenizer_loads_it(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"<unk>": 0, "hi": 1}, unk_token="<unk>"))
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>").save_pretrained(tmp_path)
    assert load_tokenizer(tmp_path) is not None


@pytest.mark.parametrize(
    ("model", "needle"),
    [
        ("qwen2.5-coder-7b", "qwen2.5-coder-0.5b"),  # unknown short name: lists the known ones
        ("/no/such/dir/model.gguf", "does not exist"),
        ("not a model", "accepted"),
    ],
)
def test_bad_references_say_what_is_accepted(model, needle):
    with pytest.raises(SpecserveError, match="accepted") as err:
        resolve_model(model)
    assert needle in str(err.value)
    assert "hub id" in str(err.value)


def test_dir_without_config_or_weights(tmp_path):
    with pytest.raises(SpecserveError, match="no config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SpecserveError, match="no \\*.safetensors"):
        resolve_model(str(tmp_path))
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(SpecserveError, match="safetensors"):
        resolve_model(str(tmp_path))
    other = tmp_path / "weights.txt"
    other.write_text("x")
    with pytest.raises(SpecserveError, match="not a .gguf"):
        resolve_model(str(other))


# ---------------------------------------------------------------------------------------------------- hub


def test_hub_offline_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    with pytest.raises(SpecserveError, match="offline") as err:
        resolve_model("some-org/some-model", cache_dir=tmp_path)
    assert time.perf_counter() - start < 5
    assert "local path" in str(err.value)


def test_hub_unreachable_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_local_port()}")
    start = time.perf_counter()
    with pytest.raises(SpecserveError, match="unreachable") as err:
        resolve_model("some-org/some-model", cache_dir=tmp_path)
    assert time.perf_counter() - start < 10
    assert "local path" in str(err.value)


# --------------------------------------------------------------------------------------------------- GGUF


def _assert_converted(out: Path, expected: dict[str, np.ndarray]) -> None:
    got = dict(iter_checkpoint_tensors(out))
    assert set(got) == set(expected)
    for name, ref in expected.items():
        assert got[name].dtype == torch.float32
        assert tuple(got[name].shape) == ref.shape, name
        np.testing.assert_array_equal(got[name].numpy(), ref, err_msg=name)


def test_tiny_qwen2_gguf_converts_to_hf_names_and_values(tmp_path, cache):
    src = tmp_path / "tiny-qwen2.gguf"
    expected = write_tiny_gguf(src, "qwen2")
    out = resolve_model(str(src))
    assert out.parent == cache / "converted"
    _assert_converted(out, expected)
    config = load_hf_config(out)
    assert config.model_type == "qwen2" and config.architectures == ["Qwen2ForCausalLM"]
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (H, LAYERS, FFN)
    assert (config.num_attention_heads, config.num_key_value_heads) == (HEADS, KV_HEADS)
    assert config.tie_word_embeddings is True  # no output.weight in the file
    assert config.rope_parameters["rope_theta"] == 1e6 and config.rms_norm_eps == 1e-6
    assert load_tokenizer(out) is None
    # cached: the second resolve is a lookup, the same directory, and nothing temporary is left behind
    start = time.perf_counter()
    assert resolve_model(str(src)) == out
    assert time.perf_counter() - start < 1
    assert [p.name for p in out.parent.iterdir() if not p.name.endswith(".lock")] == [out.name]
    # a directory with exactly one .gguf resolves to the same conversion
    assert resolve_model(str(tmp_path)) == out


def test_gguf_without_a_vocabulary_serves_token_ids(tmp_path, cache):
    """llama.cpp's "no_vocab" tokenizer (a model of token ids; transformers builds no tokenizer of it)."""
    src = tmp_path / "vocabless.gguf"
    write_tiny_gguf(src, "qwen3moe", vocabless=True)
    llm = LLM(str(src), quantization="int4", max_model_len=64, kv_cache_memory="4MiB")
    assert llm.tokenizer is None
    out = llm.generate([[1, 5, 9]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


def test_tiny_gemma3_gguf_norms_are_unshifted(tmp_path, cache):
    src = tmp_path / "tiny-gemma3.gguf"
    expected = write_tiny_gguf(src, "gemma3")
    out = resolve_model(str(src))
    _assert_converted(out, expected)
    config = load_hf_config(out)
    assert config.model_type == "gemma3_text" and config.head_dim == H // HEADS
    assert config.sliding_window == 16 and config.layer_types[:2] == ["sliding_attention"] * 2
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0


@pytest.mark.parametrize("arch", ["qwen3", "qwen3moe"])
def test_tiny_qwen3_gguf_with_lm_head(tmp_path, cache, arch):
    src = tmp_path / f"tiny-{arch}.gguf"
    expected = write_tiny_gguf(src, arch, lm_head=True)
    out = resolve_model(str(src))
    _assert_converted(out, expected)
    config = load_hf_config(out)
    assert config.tie_word_embeddings is False and config.head_dim == H // HEADS
    if arch == "qwen3moe":
        assert (config.model_type, config.num_experts, config.num_experts_per_tok) == (
            "qwen3_moe",
            EXPERTS,
            2,
        )
        assert config.moe_intermediate_size == EXPERT_FFN and config.norm_topk_prob is True
        assert "model.layers.1.mlp.experts.3.down_proj.weight" in expected
    else:
        assert config.model_type == "qwen3"


def test_gguf_conversion_shards_and_tokenizer(tmp_path, cache):
    src = tmp_path / "tok.gguf"
    expected = write_tiny_gguf(src, "qwen2", tokenizer=True)
    out = sgguf.convert_gguf(src, cache / "sharded", progress=lambda _: None)
    assert not list(out.glob("*.safetensors"))  # written when a load first needs them
    sgguf.ensure_fp32_weights(out, max_shard_bytes=8 << 10)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    _assert_converted(out, expected)
    gen = json.loads((out / "generation_config.json").read_text())
    tokens = len(_bytes_to_unicode()) + 5
    assert gen["eos_token_id"] == [tokens - 1, tokens - 3]  # eos, then <|endoftext|> (also end-of-generation)
    tok = load_tokenizer(out)
    assert tok is not None and tok.chat_template == CHAT_TEMPLATE
    assert tok.decode(tok("the tea").input_ids) == "the tea"


def test_interrupted_conversion_leaves_nothing_behind(tmp_path, cache, monkeypatch):
    src = tmp_path / "tiny.gguf"
    expected = write_tiny_gguf(src, "qwen2", tokenizer=True)

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(sgguf, "write_tokenizer", boom)  # dies after the config was written
    with pytest.raises(KeyboardInterrupt):
        resolve_model(str(src))
    assert [p.name for p in (cache / "converted").iterdir() if not p.name.endswith(".lock")] == []
    monkeypatch.undo()
    monkeypatch.setenv("SPECSERVE_CACHE", str(cache))
    _assert_converted(resolve_model(str(src)), expected)


def test_quantized_gguf_load_writes_no_fp32_copy(tmp_path, cache):
    """A GGUF loaded quantized is read from the file: its conversion holds no fp32 weights (a 30B MoE's would
    be 120 GB) until a load needs them, then they are written once."""
    from specserve.models.loader import load_model

    src = tmp_path / "tiny.gguf"
    expected = write_tiny_gguf(src, "qwen2")
    out = sgguf.converted_dir(sgguf.gguf_cache_key(src))
    for mode in ("int4", "int8"):
        load_model(str(src), quantization=mode)
        assert sgguf.is_converted(out) and not list(out.glob("*.safetensors"))
    dense, _, _ = load_model(str(src))  # fp32: the weights are written now, and then kept
    _assert_converted(out, expected)
    assert torch.equal(
        dense.get_parameter("model.embed_tokens.weight"),
        torch.from_numpy(expected["model.embed_tokens.weight"]),
    )
    written = {p.name: p.stat().st_mtime_ns for p in out.glob("*.safetensors")}
    load_model(str(src))
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.safetensors")} == written


def test_fp32_weights_of_a_gguf_that_is_gone(tmp_path, cache, monkeypatch):
    """Weights written later need the GGUF still there: a clear error where it went; an interrupted write
    leaves the conversion without weights, and the next load writes them."""
    src = tmp_path / "tiny.gguf"
    expected = write_tiny_gguf(src, "qwen2")
    out = resolve_model(str(src), need_weights=False)

    def boom(reader, plan, out_dir, *args, **kwargs):
        (out_dir / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(sgguf, "write_weights", boom)
    with pytest.raises(KeyboardInterrupt):
        resolve_model(str(src))
    assert not list(out.glob("*.safetensors")) and not list(out.glob(".weights.tmp-*"))
    monkeypatch.undo()
    monkeypatch.setenv("SPECSERVE_CACHE", str(cache))
    moved = src.rename(tmp_path / "elsewhere.gguf")
    with pytest.raises(SpecserveError, match="needs its fp32 weights from .*tiny.gguf, which is gone"):
        resolve_model(str(out))
    moved.rename(src)
    _assert_converted(resolve_model(str(out)), expected)


def test_unsupported_gguf_architecture(tmp_path, cache):
    src = tmp_path / "llama.gguf"
    w = gguf.GGUFWriter(str(src), "llama")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(SpecserveError, match="'llama' is not supported; supported: gemma3, gemma4, qwen2"):
        resolve_model(str(src))
    assert not any((cache / "converted").glob("*/config.json"))


def test_junk_gguf_is_a_clear_error(tmp_path, cache):
    src = tmp_path / "junk.gguf"
    src.write_bytes(b"not a gguf at all" * 100)
    with pytest.raises(SpecserveError, match="not a readable GGUF"):
        resolve_model(str(src))


# ------------------------------------------------------------------------------------------- local models


def test_chunk_assembly_checks_sha_and_deletes_bad_file(tmp_path):
    chunks = []
    for i, data in enumerate([b"abc" * 1000, b"def" * 777]):
        chunks.append(tmp_path / f"part{i}")
        chunks[-1].write_bytes(data)
    dest = tmp_path / "out" / "model.gguf"
    with pytest.raises(SpecserveError, match="sha256"):
        local_models.assemble_chunks(chunks, dest, sha256="0" * 64)
    assert not dest.exists() and list(dest.parent.iterdir()) == []
    import hashlib

    good = hashlib.sha256(b"abc" * 1000 + b"def" * 777).hexdigest()
    assert local_models.assemble_chunks(chunks, dest, sha256=good, size=3000 + 3 * 777) == dest
    assert dest.read_bytes() == b"abc" * 1000 + b"def" * 777
    with pytest.raises(SpecserveError, match="add up to"):
        local_models.assemble_chunks(chunks, tmp_path / "x.gguf", sha256=good, size=1)


def test_missing_packages_suggest_the_extra(cache, monkeypatch):
    fake = local_models.LocalModel("fake-model", "x", ("specserve_no_such_pkg_1",), "*.bin", 1, "0" * 64)
    monkeypatch.setitem(local_models.LOCAL_MODELS, "fake-model", fake)
    with pytest.raises(SpecserveError, match=r"pip install 'specserve\[local-models\]'"):
        resolve_model("fake-model")
    assert not (cache / "gguf").exists() or not any((cache / "gguf").glob("*.gguf"))


@pytest.mark.slow  # needs the local-models extra (`make install-models`)
@pytest.mark.parametrize("name", sorted(local_models.LOCAL_MODELS))
def test_local_model_chunks_are_installed(name):
    model = local_models.LOCAL_MODELS[name]
    paths = local_models.chunk_paths(model)
    assert len(paths) == len(model.packages)
    assert sum(p.stat().st_size for p in paths) == model.size


def test_cache_root_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    assert local_models.cache_root() == tmp_path
    monkeypatch.delenv("SPECSERVE_CACHE")
    assert local_models.cache_root() == Path.home() / ".cache" / "specserve"


# ------------------------------------------------------------------------------- slow: real local models

LOCAL_SHAPES = {  # hidden, layers, heads, kv heads, vocab, tied
    "qwen2.5-coder-0.5b": (896, 24, 14, 2, 151936, False),
    "qwen2.5-coder-1.5b": (1536, 28, 12, 2, 151936, False),
    "gemma-3-270m": (640, 18, 4, 1, 262144, True),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LOCAL_SHAPES))
def test_local_model_resolves_then_reloads_fast(name):
    resolve_model(name)  # assembles + converts into the shared cache on first use (minutes)
    start = time.perf_counter()
    path = resolve_model(name)
    config = load_hf_config(path)
    tokenizer = load_tokenizer(path)
    assert time.perf_counter() - start < 10
    hidden, layers, heads, kv, vocab, tied = LOCAL_SHAPES[name]
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (
        hidden,
        layers,
        heads,
    )
    assert (config.num_key_value_heads, config.vocab_size, config.tie_word_embeddings) == (kv, vocab, tied)
    assert tokenizer is not None
    if name.startswith("qwen"):
        assert tokenizer.eos_token == "<|im_end|>" and "<|im_start|>" in tokenizer.chat_template
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
        assert "<|im_start|>user\nhi<|im_end|>" in text
    else:
        assert tokenizer.chat_template is None and tokenizer("hi").input_ids[0] == tokenizer.bos_token_id


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LOCAL_SHAPES))
def test_conversion_equals_transformers_gguf_loading(name):
    """Every tensor equals transformers' own GGUF loading (max-abs-diff 0); configs and tokenizers agree.

    `from_pretrained(dir, gguf_file=...)` needs `accelerate` (not a dependency); for these architectures it
    gets its state dict from `load_gguf_checkpoint(..., model_to_load=model)`, which we call directly on a
    meta-device model: the same tensors, without materialising a second fp32 copy of the model.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = resolve_model(name)
    src = local_models.local_gguf_path(name)
    if not src.is_file():
        src = local_models.ensure_gguf(name)
    ref_config = AutoConfig.from_pretrained(str(src.parent), gguf_file=src.name)
    config = load_hf_config(path)
    for key in (
        "model_type",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "vocab_size",
        "max_position_embeddings",
        "tie_word_embeddings",
        "head_dim",
        "sliding_window",
        "eos_token_id",
        "bos_token_id",
    ):
        if hasattr(ref_config, key):
            assert getattr(config, key) == getattr(ref_config, key), key
    assert config.rms_norm_eps == pytest.approx(ref_config.rms_norm_eps, rel=1e-6)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(ref_config)
    ref_state = load_gguf_checkpoint(str(src), return_tensors=True, model_to_load=skeleton)["tensors"]
    ours = dict(iter_checkpoint_tensors(path))
    assert set(ours) == set(ref_state)
    worst = 0.0
    for key, tensor in ref_state.items():
        assert ours[key].shape == tensor.shape and tensor.dtype == torch.float32, key
        worst = max(worst, (ours[key] - tensor).abs().max().item())
    assert worst == 0.0
    del ref_state, ours
    ref_tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    tok = load_tokenizer(path)
    text = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # ünïcödé 中文 <|im_end|>"
    assert tok(text).input_ids == ref_tok(text).input_ids
    assert tok.chat_template == ref_tok.chat_template


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LOCAL_SHAPES))
def test_load_model_end_to_end(name):
    pytest.importorskip("specserve.models.qwen" if name.startswith("qwen") else "specserve.models.gemma")
    from specserve.models.loader import load_model

    model, config, tokenizer = load_model(name)
    assert tokenizer is not None
    params = dict(model.named_parameters())
    embed = next(v for k, v in params.items() if "embed" in k)
    assert embed.dtype == torch.float32 and embed.shape[0] == config.vocab_size
    ckpt = dict(iter_checkpoint_tensors(resolve_model(name)))
    assert torch.equal(embed, ckpt["model.embed_tokens.weight"])


def test_dummy_weights_need_only_the_config(tmp_path, tiny_model_dir):
    """load_format "dummy" (vLLM's, for benchmarks of real shapes): config.json alone, random weights."""
    shutil.copy(tiny_model_dir("qwen3") / "config.json", tmp_path / "config.json")
    with pytest.raises(SpecserveError, match=r"config.json but no \*.safetensors"):
        LLM(str(tmp_path))
    llm = LLM(str(tmp_path), load_format="dummy", max_model_len=64)
    weights = torch.cat([p.detach().flatten() for p in llm.engine.model.parameters()])
    assert abs(weights.std().item() - 0.02) < 0.002 and abs(weights.mean().item()) < 0.002
    out = llm.generate([[3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    # A draft model's weights are random too: one seed, so a draft of the target's own config is the
    # target, and greedy speculation accepts every draft and decodes what plain greedy does.
    draft = {"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 3}
    with pytest.raises(SpecserveError, match=r"config.json but no \*.safetensors"):
        LLM(str(tmp_path), max_model_len=64, speculative_config=draft)
    spec = LLM(str(tmp_path), load_format="dummy", max_model_len=64, speculative_config=draft)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    plain = llm.generate([[3, 4, 5]], params)[0].outputs[0].token_ids
    assert spec.generate([[3, 4, 5]], params)[0].outputs[0].token_ids == plain
    stats = spec.engine.spec_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
    with pytest.raises(SpecserveError, match="load_format must be one of auto, dummy"):
        LLM(str(tmp_path), load_format="random")


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe", "gemma4", "qwen3_5_moe"])
@pytest.mark.parametrize("mode", ["int4", "int8"])
@pytest.mark.parametrize("load_format", ["auto", "dummy"])
def test_a_quantized_load_never_holds_the_dense_weights(arch, mode, load_format, monkeypatch, tmp_path):
    """From safetensors (or random, `load_format="dummy"`), every layer that quantizing replaces is quantized
    as its weight is read or made (its dense weight never written: a 30B MoE's fp32 weights would be
    114 GB), biases (qwen2), fused experts (Qwen3.5 MoE, Gemma 4) and a tied head (left to the tie)
    included; the model is the fp32 load quantized, bit for bit, to the logits."""
    from specserve.layers.quant import QuantizingLoad, quantizable_weights, quantize_model
    from specserve.models.loader import load_model
    from tests.paged_harness import PagedHarness
    from tests.tiny_models import save_tiny_model

    path = str(save_tiny_model(arch, tmp_path))
    replaced = []
    quantize = QuantizingLoad.__call__

    def recorded(self, model, name, weight, dtype):
        took = quantize(self, model, name, weight, dtype)
        replaced.extend([name] * took)
        return took

    monkeypatch.setattr(QuantizingLoad, "__call__", recorded)
    quantized, _, _ = load_model(path, quantization=mode, load_format=load_format)
    dense, _, _ = load_model(path, load_format=load_format)
    tied = {"lm_head.weight"} if dense.config.tie_word_embeddings else set()
    expected = set(quantizable_weights(dense, mode)) - tied
    assert sorted(replaced) == sorted(expected) and expected
    assert quantize_model(dense, mode) > 0
    layers = dict(quantized.named_modules())
    for name, module in dense.named_modules():
        if hasattr(module, "group_size"):  # a quantized layer
            assert type(layers[name]) is type(module), name
            assert torch.equal(layers[name].weight, module.weight), name
    ids = [1, 5, 9, 2, 7]
    assert torch.equal(*(PagedHarness(m).step([(0, ids)])[0][0] for m in (quantized, dense)))
