"""GGUF files of Gemma 4 text models (llama.cpp's `gemma4`).

The files here are written from tiny transformers Gemma 4 models the way llama.cpp's converter writes them:
tensor names from the gguf package's own name map, norms as they are (Gemma 4's scale by w), the layer
scalar as `layer_output_scale`, the router's scale and per-expert scale as `ffn_gate_inp.scale` and
`ffn_down_exps.scale`, the experts' fused gate/up as they are; the sliding pattern, the KV-shared layers,
the per-layer input size, the head dims and KV heads of both layer kinds and the double-wide MLPs' widths as
metadata; the global layers' proportional RoPE as a `rope_freqs` tensor (1 on rotated pairs, 1e30 on the
others). llama.cpp (where installed) runs those files and must agree with transformers, which pins the
writer to llama.cpp's own reading of the format; specserve must then read them back into the checkpoint
transformers started from."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from specserve import LLM, SamplingParams
from specserve.layers import kernels
from specserve.layers.moe import Experts
from specserve.layers.quant import QuantizedLinear
from tests.gguf_files import (
    PROMPT,
    add_tensor,
    assert_llama_cpp_reads_as,
    assert_quantized_loading_is_quantizing_the_conversion,
    checkpoint,
    finish,
    transformers_greedy,
)
from tests.tiny_models import VOCAB, randomized

S, F = "sliding_attention", "full_attention"
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    layer_types=[S, F, S, F],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,
    sliding_window=4,
    # none of them transformers' defaults, so that the conversion must read each off the file
    rope_parameters={
        S: {"rope_type": "default", "rope_theta": 20000.0},
        F: {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 500000.0},
    },
    rms_norm_eps=1e-5,
    hidden_size_per_layer_input=0,
    final_logit_softcapping=30.0,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
CONFIGS = {
    # E2B / E4B-like: per-layer inputs, the last two layers reading the KV of earlier ones (one of each
    # kind) with double-wide MLPs, V projections on every layer that has K. The last layers with KV of their
    # own are a sliding then a global one, as llama.cpp's reuse takes them (it reads the sliding KV from
    # the last layer but one, the global from the last; transformers, the last of each kind).
    "dense": dict(
        num_hidden_layers=6,
        layer_types=[S, S, S, F, S, F],
        num_kv_shared_layers=2,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=VOCAB,
        use_double_wide_mlp=True,
    ),
    # 26B-A4B-like: experts beside the MLP, global layers with their own KV heads and V = K
    "moe": dict(
        attention_k_eq_v=True,
        num_global_key_value_heads=1,
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=32,
    ),
}


def _reference(name: str):
    """The tiny Gemma 4 of `name`: its norms' scales about 1 (Gemma 4's scale by w: about 0 they would
    shrink the signal until the logits hardly depend on the weights), its layer scalars random too (a buffer,
    not a parameter)."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    torch.manual_seed(0)
    model = randomized(Gemma4ForCausalLM(Gemma4TextConfig(**{**BASE, **CONFIGS[name]})))
    model.generation_config.eos_token_id = None  # random models hit eos by chance
    with torch.no_grad():
        for key, p in model.named_parameters():
            if key.endswith("norm.weight"):
                p.add_(1.0)
        for layer in model.model.layers:
            layer.layer_scalar.uniform_(0.5, 1.5)
    return model


def _rope_freqs(config) -> np.ndarray:
    """The converter's factors for the global layers' proportional RoPE: 1 on the rotated frequency pairs,
    1e30 (no rotation) on the others."""
    full = config.rope_parameters[F]
    head_dim = config.per_layer_config[config.layer_types.index(F)].head_dim
    rotated = int(head_dim * full["partial_rotary_factor"] / 2)
    return np.array([1.0] * rotated + [1e30] * (head_dim // 2 - rotated), dtype=np.float32)


def _write_metadata(w: gguf.GGUFWriter, config) -> None:
    layers, types = config.num_hidden_layers, config.layer_types
    views = [config.per_layer_config[i] for i in range(layers)]
    full, swa = views[types.index(F)], views[types.index(S)]
    first_shared = layers - config.num_kv_shared_layers
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(layers)
    w.add_head_count(config.num_attention_heads)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(config.rope_parameters[F]["rope_theta"])
    w.add_rope_freq_base_swa(config.rope_parameters[S]["rope_theta"])
    w.add_sliding_window(config.sliding_window)
    if config.final_logit_softcapping:
        w.add_final_logit_softcapping(config.final_logit_softcapping)
    w.add_shared_kv_layers(config.num_kv_shared_layers)
    w.add_embedding_length_per_layer_input(config.hidden_size_per_layer_input or 0)
    w.add_sliding_window_pattern([t == S for t in types])
    w.add_key_length(full.head_dim)
    w.add_value_length(full.head_dim)
    w.add_key_length_swa(swa.head_dim)
    w.add_value_length_swa(swa.head_dim)
    w.add_rope_dimension_count(full.head_dim)
    w.add_rope_dimension_count_swa(swa.head_dim)
    width = config.intermediate_size
    if config.use_double_wide_mlp:
        w.add_feed_forward_length([width * (2 if i >= first_shared else 1) for i in range(layers)])
    else:
        w.add_feed_forward_length(width)
    if config.attention_k_eq_v:  # the converter's per-layer array where the config names global KV heads
        w.add_head_count_kv([v.num_key_value_heads for v in views])
    else:
        w.add_head_count_kv(swa.num_key_value_heads)
    if config.enable_moe_block:
        w.add_expert_count(config.num_experts)
        w.add_expert_used_count(config.top_k_experts)
        w.add_expert_feed_forward_length(config.moe_intermediate_size)


# checkpoint names the converter maps by hand (the name map has no entry), by their leaf in a layer
_BY_HAND = {"router.scale": "ffn_gate_inp.scale", "router.per_expert_scale": "ffn_down_exps.scale"}


# A vocabulary as the converter writes Gemma 4's: its control tokens, the tool answer's start marked
# user-defined, sentencepiece pieces with merges, unused slots up to the model's size.
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<|turn>", "<turn|>", "<|tool_response>"]
PIECES = ["\u2581", *"abcdefghijklmnopqrstuvwxyz\n", "th", "the", "\u2581c", "at"]
MERGES = ["t h", "th e", "\u2581 c", "a t"]
TOKENS = SPECIALS + PIECES + [f"<unused{i}>" for i in range(VOCAB - len(SPECIALS) - len(PIECES))]
TOKEN_TYPES = [3, 3, 3, 2, 3, 3, 4] + [1] * len(PIECES) + [5] * (VOCAB - len(SPECIALS) - len(PIECES))
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|turn>{{ m.role }}\n{{ m.content }}<turn|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)


def _write_vocabulary(w: gguf.GGUFWriter) -> None:
    w.add_tokenizer_model("gemma4")
    w.add_token_list(TOKENS)
    w.add_token_scores([0.0] * len(TOKENS))
    w.add_token_types(TOKEN_TYPES)
    w.add_token_merges(MERGES)
    w.add_pad_token_id(0)
    w.add_eos_token_id(1)
    w.add_bos_token_id(2)
    w.add_unk_token_id(3)
    w.add_add_space_prefix(False)
    w.add_add_bos_token(True)
    w.add_chat_template(CHAT_TEMPLATE)


def write_like_llama_cpp(
    model, path, quantized: QT | None = None, vocabulary: bool = False, rope_freqs: np.ndarray | None = None
) -> None:
    """`model` (a transformers Gemma4ForCausalLM) as llama.cpp's converter writes it: F32 tensors, or the
    matrices in `quantized` blocks; the vocabulary above, or none; `rope_freqs` for the factors."""
    config = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, config.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), "gemma4")
    _write_metadata(w, config)
    w.add_vocab_size(config.vocab_size)
    if vocabulary:
        _write_vocabulary(w)
    else:
        w.add_tokenizer_model("no_vocab")
    for name, x in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        prefix, _, leaf = name.partition(".layers.")
        layer, _, leaf = leaf.partition(".")
        if leaf in _BY_HAND:
            name = f"blk.{layer}.{_BY_HAND[leaf]}"
        else:  # parameters without a `.weight` (layer_scalar, the experts) get one, as the converter adds it
            base = name.removesuffix(".weight")
            name = f"{names.get_name(base)}.weight"
        matrix = x.dim() >= 2 and "norm" not in name
        add_tensor(w, name, x.float().numpy(), quantized, matrix)
    w.add_tensor("rope_freqs.weight", _rope_freqs(config) if rope_freqs is None else rope_freqs)
    finish(w)


@pytest.mark.parametrize("name", CONFIGS)
def test_llama_cpp_reads_the_written_file_as_transformers(name, tmp_path):
    """The writer above writes llama.cpp's format: llama.cpp's logits on its file are transformers', over a
    prompt twice as long as the sliding window (within 0.5% of the largest: llama.cpp rounds to 0.2% here;
    the global layers' RoPE turning every pair instead is 1.5% off and more)."""
    model = _reference(name)
    path = tmp_path / f"{name}.gguf"
    write_like_llama_cpp(model, path)
    assert_llama_cpp_reads_as(model, path, rtol=5e-3)


def _config_view(config) -> dict:
    """What a Gemma 4 config says about the model, layer by layer where layers differ."""
    fields = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "layer_types",
        "sliding_window",
        "rope_parameters",
        "final_logit_softcapping",
        "num_kv_shared_layers",
        "use_double_wide_mlp",
        "attention_k_eq_v",
        "hidden_size_per_layer_input",
        "vocab_size_per_layer_input",
        "enable_moe_block",
        "num_experts",
        "top_k_experts",
        "moe_intermediate_size",
        "tie_word_embeddings",
        "architectures",
        "rms_norm_eps",
    )
    view = {field: getattr(config, field) for field in fields}
    if not config.hidden_size_per_layer_input:  # a size of nothing (not in the file)
        del view["vocab_size_per_layer_input"]
    layers = [config.per_layer_config[i] for i in range(config.num_hidden_layers)]
    view["per_layer"] = [(layer.head_dim, layer.num_key_value_heads) for layer in layers]
    return view


@pytest.mark.parametrize("name", CONFIGS)
def test_the_conversion_is_the_checkpoint(name, tmp_path, specserve_cache):
    """Read back, the file is the checkpoint transformers saved: its config (layer kinds, each layer's head
    dim and KV heads, the proportional RoPE's rotated fraction from rope_freqs, KV sharing, double-wide MLPs,
    V = K, per-layer inputs, the experts), the same from the header alone (preflight's reading), every tensor
    under its checkpoint name, exactly (F32, nothing transformed), and its logits in transformers."""
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM

    from specserve.models.gguf import build_hf_config
    from specserve.models.gguf_header import GGUFHeader
    from specserve.models.loader import resolve_model

    model = _reference(name)
    model.save_pretrained(tmp_path / "hf")
    path = tmp_path / f"{name}.gguf"
    write_like_llama_cpp(model, path)

    converted = resolve_model(str(path), need_weights=True)
    reread = AutoModelForCausalLM.from_pretrained(converted).eval()
    assert type(reread.config) is type(model.config)
    assert _config_view(reread.config) == _config_view(model.config)
    assert build_hf_config(GGUFHeader(path)).to_dict() == build_hf_config(GGUFReader(str(path))).to_dict()
    expected, got = checkpoint(tmp_path / "hf"), checkpoint(converted)
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        assert torch.equal(got[key], value), key
    with torch.no_grad():
        ids = torch.tensor([PROMPT])
        torch.testing.assert_close(reread(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_loading_takes_the_files_blocks(name, mode, tmp_path, specserve_cache):
    """Q8_0 matrices (the per-layer inputs' and the experts' among them): int8 keeps the file's codes, int4
    requantizes them; every quantized layer is the one quantizing the fp32 conversion gives (each expert's
    gate and up from its rows of the file's fused gate|up tensor; then stacked for grouped calls), the
    per-layer embedding (no linear layer) is the conversion's tensor, and the engine generates from the
    file."""
    path = tmp_path / "q8.gguf"
    write_like_llama_cpp(_reference(name), path, quantized=QT.Q8_0)
    from_gguf, dense, checked = assert_quantized_loading_is_quantizing_the_conversion(path, mode, {"lm_head"})
    assert {"q_proj", "o_proj", "down_proj"} <= checked
    assert name != "dense" or "per_layer_model_projection" in checked
    experts = [m for m in from_gguf.modules() if isinstance(m, Experts)]
    assert len(experts) == (from_gguf.config.num_hidden_layers if name == "moe" else 0)
    for layer in experts:  # grouped calls on specserve's kernels
        assert all(isinstance(e.gate_proj, QuantizedLinear) for e in layer)
        assert (layer.stacks is not None) == (kernels.ops() is not None)
    rest = {key: p for key, p in dense.named_parameters() if "embed_tokens_per_layer" in key}
    assert name != "dense" or rest
    for key, value in from_gguf.named_parameters():
        if key in rest:
            assert torch.equal(value, rest.pop(key)), key
    assert not rest


@pytest.mark.parametrize("name", CONFIGS)
def test_the_engine_serves_the_file_as_transformers(name, tmp_path, specserve_cache):
    """Greedy on the file (through its fp32 conversion) is transformers' greedy on the model: KV-shared layers
    reading the right caches, the sliding window, per-layer inputs, the experts."""
    model = _reference(name)
    path = tmp_path / f"{name}.gguf"
    write_like_llama_cpp(model, path)
    prompts = [[5, 17, 3, 42], [8, 99, 1, 64, 12, 7]]
    llm = LLM(str(path), max_model_len=64, kv_cache_memory="16MiB")
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == transformers_greedy(model, prompts, 10)


def test_the_tokenizer_comes_from_the_file(tmp_path, specserve_cache):
    """transformers builds Gemma 4's tokenizer from the file (pieces and merges, no BOS of its own: the chat
    template writes it); the conversion keeps it with the template, the engine stops at the end of a turn and
    at the tool answer's start (user-defined in the file) as llama.cpp does, and answers chat."""
    path = tmp_path / "chat.gguf"
    write_like_llama_cpp(_reference("dense"), path, vocabulary=True)
    llm = LLM(str(path), max_model_len=64, kv_cache_memory="16MiB")
    tokenizer = llm.tokenizer
    assert tokenizer("the cat").input_ids == [TOKENS.index(t) for t in ("the", "\u2581c", "at")]
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert {1, TOKENS.index("<turn|>"), TOKENS.index("<|tool_response>")} <= set(llm.engine.eos_token_ids)
    messages = [{"role": "user", "content": "hi"}]
    out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert out[0].prompt_token_ids == tokenizer.encode("<bos><|turn>user\nhi<turn|>\n<|turn>model\n")
    assert out[0].prompt_token_ids[:2] == [2, TOKENS.index("<|turn>")]
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize(
    ("factors", "error"),
    [
        (np.ones(16, np.float32), None),  # every pair turned: a fraction of 1
        (np.array([1.0] * 4 + [1e30] * 4, np.float32), "not proportional RoPE's factors .* 16 in all"),
        (np.array([1.0, 1e30] * 8, np.float32), "not proportional RoPE's factors"),
    ],
)
def test_the_global_layers_rope_comes_from_rope_freqs(factors, error, tmp_path, specserve_cache):
    """The rotated fraction is read off rope_freqs (not assumed); factors that are not proportional RoPE's
    are a clear error, before anything is converted."""
    from specserve.config import SpecserveError
    from specserve.models.loader import load_hf_config, resolve_model

    path = tmp_path / "rope.gguf"
    write_like_llama_cpp(_reference("moe"), path, rope_freqs=factors)
    if error is None:
        config = load_hf_config(resolve_model(str(path), need_weights=False))
        assert config.rope_parameters[F]["partial_rotary_factor"] == 1.0
        return
    with pytest.raises(SpecserveError, match=error):
        resolve_model(str(path), need_weights=False)
    assert not any((specserve_cache / "converted").glob("*/config.json"))
