"""GGUF files of the hybrid Qwen3.5 / Qwen3.6 and Qwen3-Next targets (llama.cpp's `qwen35`, `qwen35moe`,
`qwen3next`).

The files here are written from tiny transformers models the way llama.cpp's converter writes them (its
tensor names from the gguf package's own name map; A_log as -exp(A_log), norms as w + 1, the conv kernel
squeezed, experts stacked; Qwen3.5's value heads tiled and its multi-token-prediction layer as an appended
`nextn` block; Qwen3-Next's fused in_proj_qkvz split into attn_qkv and attn_gate, its in_proj_ba kept).
Where llama.cpp is installed (`pip install -e '.[bench]'`) it runs those files and must agree with
transformers, which pins the writer to llama.cpp's own reading of the format; specserve must then read
them back into the checkpoint transformers started from."""

from __future__ import annotations

import re

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from specserve import LLM, SamplingParams
from specserve.models.loader import resolve_model
from tests.gguf_files import (
    PROMPT,
    add_tensor,
    assert_llama_cpp_reads_as,
    assert_quantized_loading_is_quantizing_the_conversion,
    checkpoint,
    finish,
    transformers_greedy,
)
from tests.test_loader import CHAT_TEMPLATE, _bytes_to_unicode
from tests.tiny_models import build_reference

ARCHS = {"qwen3_5": "qwen35", "qwen3_5_moe": "qwen35moe", "qwen3_next": "qwen3next"}
MTP_ARCHS = ("qwen3_5", "qwen3_5_moe")  # Qwen3-Next's converter drops the MTP layer


def _tiled(x: np.ndarray, axis: int, key_heads: int, per_key: int, head_dim: int, start: int = 0):
    """The converter's value-head order: grouped by key head -> tiled over the key heads."""
    head, values = np.split(x, [start], axis=axis)
    shape = list(values.shape)
    grouped = values.reshape(shape[:axis] + [key_heads, per_key, head_dim] + shape[axis + 1 :])
    return np.concatenate([head, np.swapaxes(grouped, axis, axis + 1).reshape(shape)], axis=axis)


def _reference(arch: str, **overrides):
    """The tiny model of `arch` that llama.cpp can run: its qwen3next routes every layer (no dense
    `mlp_only_layers`, which the format cannot say)."""
    return build_reference(arch, **({"mlp_only_layers": []} if arch == "qwen3_next" else {}), **overrides)


def _split_qkvz(x: np.ndarray, key_heads: int, key_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Qwen3-Next's in_proj_qkvz rows [per key head: q, k, v..., z...] -> ([all q, all k, all v], all z)."""
    hidden = x.shape[-1]
    groups = x.reshape(key_heads, -1, hidden)
    value = (groups.shape[1] - 2 * key_dim) // 2
    q, k, v, z = np.split(groups, np.cumsum([key_dim, key_dim, value]), axis=1)
    return np.concatenate([t.reshape(-1, hidden) for t in (q, k, v)]), z.reshape(-1, hidden)


def _llama_cpp_tensors(config, state: dict[str, np.ndarray]):
    """(HF name, llama.cpp's tensor) pairs: each tensor as the converter transforms it, unnamed yet."""
    key_heads, value_heads = config.linear_num_key_heads, config.linear_num_value_heads
    per_key, value_dim = value_heads // key_heads, config.linear_value_head_dim
    qk = 2 * key_heads * config.linear_key_head_dim
    tile = per_key > 1 and config.model_type != "qwen3_next"  # Qwen3.5's converter only

    def tiled(x, axis=0, head_dim=value_dim, start=0):
        return _tiled(x, axis, key_heads, per_key, head_dim, start) if tile else x

    experts: dict[str, list[np.ndarray]] = {}
    for name, x in state.items():
        if m := re.match(r"(.*\.mlp\.experts)\.(\d+)\.(\w+)\.weight$", name):  # the converter stacks them
            experts.setdefault(f"{m.group(1)}.{m.group(3)}.weight", {})[int(m.group(2))] = x
            continue
        leaf = name.rpartition(".linear_attn.")[2]
        if leaf == "in_proj_qkvz.weight":
            qkv, z = _split_qkvz(x, key_heads, config.linear_key_head_dim)
            yield name.replace("qkvz", "qkv"), qkv
            yield name.replace("qkvz", "z"), z
            continue
        if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            x = x + np.float32(1)
        if leaf == "in_proj_qkv.weight":
            x = tiled(x, start=qk)
        elif leaf == "in_proj_z.weight":
            x = tiled(x)
        elif leaf in ("in_proj_a.weight", "in_proj_b.weight", "dt_bias", "A_log"):
            x = tiled(x, head_dim=1)
        elif leaf == "conv1d.weight":
            x = tiled(x[:, 0], start=qk)
        elif leaf == "out_proj.weight":
            x = tiled(x, axis=1)
        if leaf == "A_log":
            x = -np.exp(x)
        elif leaf == "dt_bias":
            name = name.replace("dt_bias", "dt_proj.bias")
        if name.endswith("experts.gate_up_proj"):
            gate, up = np.split(x, 2, axis=1)
            yield name.replace("gate_up_proj", "gate_proj.weight"), gate
            yield name.replace("gate_up_proj", "up_proj.weight"), up
        elif name.endswith("experts.down_proj"):
            yield name + ".weight", x
        else:
            yield name, x
    for name, stack in experts.items():
        yield name, np.stack([stack[e] for e in range(len(stack))])


MTP_TOP = {
    "fc": "eh_proj",
    "pre_fc_norm_embedding": "enorm",
    "pre_fc_norm_hidden": "hnorm",
    "norm": "shared_head_norm",
}


def write_like_llama_cpp(
    model,
    path,
    quantized: QT | None = None,
    mtp: dict[str, torch.Tensor] | None = None,
    tokens: list[str] | None = None,
) -> None:
    """`model` (a transformers Qwen3.5 / Qwen3.5-MoE / Qwen3-Next) as llama.cpp's converter writes it: F32
    tensors, or the matrices in `quantized` blocks; `mtp` (the checkpoint's `mtp.*` tensors) as a last
    `nextn` block; a byte-level BPE vocabulary of `tokens` (the last three control tokens), or none."""
    config = model.config
    arch = ARCHS[config.model_type.removesuffix("_text")]
    layers = config.num_hidden_layers
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], layers + 1)
    w = gguf.GGUFWriter(str(path), arch)
    head_dim = config.head_dim
    rope = config.rope_parameters
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(layers + (1 if mtp else 0))
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_rope_dimension_count(int(head_dim * rope["partial_rotary_factor"]))
    if "mrope_section" in rope:
        w.add_rope_dimension_sections([*rope["mrope_section"], 0])
    w.add_ssm_conv_kernel(config.linear_conv_kernel_dim)
    w.add_ssm_state_size(config.linear_key_head_dim)
    w.add_ssm_group_count(config.linear_num_key_heads)
    w.add_ssm_time_step_rank(config.linear_num_value_heads)
    w.add_ssm_inner_size(config.linear_value_head_dim * config.linear_num_value_heads)
    w.add_full_attention_interval(config.layer_types.index("full_attention") + 1)
    if arch != "qwen35moe":
        w.add_feed_forward_length(config.intermediate_size)
    if arch != "qwen35":
        w.add_expert_count(config.num_experts)
        w.add_expert_used_count(config.num_experts_per_tok)
        w.add_expert_feed_forward_length(config.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if mtp:
        w.add_nextn_predict_layers(1)
    w.add_vocab_size(config.vocab_size)
    if tokens is None:
        w.add_tokenizer_model("no_vocab")
    else:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen35")
        w.add_token_list(tokens)
        w.add_token_types([1] * (len(tokens) - 3) + [3] * 3)
        w.add_token_merges(["Ġ t", "h e"])
        w.add_eos_token_id(len(tokens) - 1)
        w.add_chat_template(CHAT_TEMPLATE)

    state = {k: v.float().numpy() for k, v in model.state_dict().items()}
    for k, v in (mtp or {}).items():  # the MTP layer: block `layers`, its own four tensors under `nextn`
        top = k.split(".")[1]
        if top in MTP_TOP:
            state[f"blk.{layers}.nextn.{MTP_TOP[top]}.weight"] = v.float().numpy()
        else:
            state[k.replace("mtp.layers.0.", f"model.layers.{layers}.")] = v.float().numpy()
    for name, x in _llama_cpp_tensors(config, state):
        if not name.startswith("blk."):  # the name map's, as the converter looks it up
            base, _, kind = name.rpartition(".")
            name = names.get_name(name) if kind == "A_log" else f"{names.get_name(base)}.{kind}"
        matrix = x.ndim >= 2 and "norm" not in name and "conv1d" not in name
        add_tensor(w, name, x, quantized, matrix)
    finish(w)


@pytest.mark.parametrize("arch", ARCHS)
def test_llama_cpp_reads_the_written_file_as_transformers(arch, tmp_path):
    """The writer above writes llama.cpp's format: llama.cpp's logits on its file are transformers'."""
    model = _reference(arch)
    path = tmp_path / f"{arch}.gguf"
    write_like_llama_cpp(model, path)
    assert_llama_cpp_reads_as(model, path)


def _fused_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Qwen3.5-MoE's checkpoint form of per-expert tensors: gate_up_proj and down_proj of all experts."""
    out, experts = {}, {}
    for name, x in state.items():
        if m := re.match(r"(.*\.mlp\.experts)\.(\d+)\.(\w+)_proj\.weight$", name):
            experts.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = x
        else:
            out[name] = x
    for prefix, proj in experts.items():
        gate, up, down = ([p[e] for e in range(len(p))] for p in (proj["gate"], proj["up"], proj["down"]))
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat(pair) for pair in zip(gate, up)])
        out[f"{prefix}.down_proj"] = torch.stack(down)
    return out


def _saved_reference(arch: str, directory):
    """The tiny model saved as its checkpoint (with an MTP layer where the arch's GGUF keeps one), read back
    by transformers, and the checkpoint's `mtp.*` tensors."""
    from transformers import AutoModelForCausalLM

    from tests.tiny_models import save_tiny_mtp

    model = _reference(arch)
    model.generation_config.eos_token_id = None  # random models hit eos by chance
    model.save_pretrained(directory)
    if arch in MTP_ARCHS:
        save_tiny_mtp(directory)
    mtp = {k: v for k, v in checkpoint(directory).items() if k.startswith("mtp.")}
    return AutoModelForCausalLM.from_pretrained(directory).eval(), mtp


@pytest.mark.parametrize("arch", ARCHS)
def test_the_conversion_is_the_checkpoint(arch, tmp_path, specserve_cache):
    """Read back, the file is the checkpoint transformers started from: its config, every tensor under its
    checkpoint name and in its checkpoint form (A_log through log(-(-exp)), norms through (w + 1) - 1: within
    float32 rounding; Qwen3-Next's in_proj_qkvz rebuilt from attn_qkv and attn_gate, its experts one by one;
    Qwen3.5-MoE's fused), its logits in transformers, and the multi-token-prediction layer where the file
    has one."""
    from transformers import AutoModelForCausalLM

    model, mtp = _saved_reference(arch, tmp_path / "hf")
    path = tmp_path / f"{arch}.gguf"
    write_like_llama_cpp(model, path, mtp=mtp)

    converted = resolve_model(str(path), need_weights=True)
    config = AutoModelForCausalLM.from_pretrained(converted).config
    assert type(config) is type(model.config)
    assert config.architectures == model.config.architectures
    fields = (
        "layer_types",
        "linear_num_key_heads",
        "linear_key_head_dim",
        "linear_num_value_heads",
        "linear_value_head_dim",
        "linear_conv_kernel_dim",
        "head_dim",
        "intermediate_size",
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "norm_topk_prob",
        "mlp_only_layers",
        "decoder_sparse_step",
    )
    for field in fields:
        assert getattr(config, field, None) == getattr(model.config, field, None), field
    assert config.rope_parameters == {**model.config.rope_parameters, "rope_type": "default"}
    assert getattr(config, "mtp_num_hidden_layers", 0) == (1 if mtp else 0)
    # the hubs' forms: Qwen3-Next's experts one by one (as saved here), Qwen3.5-MoE's fused (as in memory)
    saved = {k: v for k, v in checkpoint(tmp_path / "hf").items() if not k.startswith("mtp.")}
    expected = {**(saved if arch == "qwen3_next" else model.state_dict()), **_fused_experts(mtp)}
    got = checkpoint(converted)
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value.float(), rtol=1e-6, atol=1e-6, msg=name)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        reference = model(ids).logits
        converted_logits = AutoModelForCausalLM.from_pretrained(converted).eval()(ids).logits
    torch.testing.assert_close(converted_logits, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "qwen3_next"])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_loading_takes_the_blocks_in_the_checkpoint_order(arch, mode, tmp_path, specserve_cache):
    """Q8_0 matrices: rows put in the model's order move whole blocks (int8 keeps the file's codes: Qwen3.5's
    tiled value heads; Qwen3-Next's attn_qkv, attn_gate and the b and a rows of ssm_ba), Qwen3.5's output
    projection's columns cross blocks and are requantized; every layer is the one quantizing the fp32
    conversion (the checkpoint's form, split by the model) gives, and the engine generates from the file."""
    path = tmp_path / "q8.gguf"
    # Qwen3-Next's 32 value heads, halved: in_proj_b and in_proj_a quantized (the kernel packs 16 rows)
    wide = {"linear_num_value_heads": 16} if arch == "qwen3_next" else {}
    write_like_llama_cpp(_reference(arch, **wide), path, quantized=QT.Q8_0)
    requantized = {"out_proj"} if arch == "qwen3_5_moe" else set()
    _, _, checked = assert_quantized_loading_is_quantizing_the_conversion(path, mode, requantized)
    assert {"in_proj_qkv", "in_proj_z", "out_proj", "q_proj", "down_proj"} <= checked
    assert not wide or {"in_proj_b", "in_proj_a"} <= checked


def test_the_engine_serves_a_qwen3_next_file_as_transformers(tmp_path, specserve_cache):
    """Greedy on a qwen3next file (through its fp32 conversion: in_proj_qkvz and in_proj_ba rebuilt, split
    again by the model) is transformers' greedy on the model."""
    model = _reference("qwen3_next")
    model.generation_config.eos_token_id = None  # random models hit eos by chance
    path = tmp_path / "qwen3_next.gguf"
    write_like_llama_cpp(model, path)
    prompts = [[5, 17, 3, 42], [8, 99, 1, 64, 12, 7]]
    llm = LLM(str(path), max_model_len=64, kv_cache_memory="16MiB")
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == transformers_greedy(model, prompts, 10)


@pytest.mark.parametrize("arch", MTP_ARCHS)
def test_the_engine_serves_the_file_and_drafts_with_its_mtp_layer(arch, tmp_path, specserve_cache):
    """Method 'mtp' drafts with the file's nextn block: read from the GGUF while no fp32 copy is written (a
    quantized load writes none), it is the checkpoint's mtp.*; greedy speculation equals plain greedy,
    quantized and in fp32, and plain greedy on the file is transformers' on the model."""
    from transformers import AutoModelForCausalLM

    from specserve.models.weight_files import iter_checkpoint_tensors
    from tests.tiny_models import save_tiny_model, save_tiny_mtp

    target = save_tiny_mtp(save_tiny_model(arch, tmp_path / "hf"))
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    mtp = {k: v for k, v in checkpoint(target).items() if k.startswith("mtp.")}
    path = tmp_path / f"{arch}.gguf"
    write_like_llama_cpp(model, path, mtp=mtp)
    prompts = [[5, 17, 3, 42], [8, 99, 1, 64, 12, 7]]
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    spec = {"method": "mtp", "num_speculative_tokens": 2}

    def run(quantization=None, **kwargs) -> list[list[int]]:
        llm = LLM(str(path), max_model_len=64, kv_cache_memory="16MiB", quantization=quantization, **kwargs)
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        if kwargs:
            assert llm.engine.spec_stats.num_drafts > 0
        return outs

    converted = resolve_model(str(path), need_weights=False)
    from_gguf = dict(iter_checkpoint_tensors(converted, prefix="mtp."))
    assert sorted(from_gguf) == sorted(mtp)
    for name, value in mtp.items():
        torch.testing.assert_close(from_gguf[name], value, rtol=1e-6, atol=1e-6, msg=name)
    assert run("int8", speculative_config=spec) == run("int8")
    assert not list(converted.glob("*.safetensors"))  # read from the GGUF, not from an fp32 copy

    expected = transformers_greedy(model, prompts, 10)
    assert run() == expected
    assert run(speculative_config=spec) == expected


def test_the_tokenizer_comes_from_the_file(tmp_path, specserve_cache):
    """transformers builds no model from a qwen35 GGUF, but its tokenizer from the token lists (Qwen3.5's
    pre-tokenizer, named by `tokenizer.ggml.pre`): the conversion keeps it, with the chat template, and the
    engine answers text and chat."""
    tokens = _bytes_to_unicode() + ["Ġt", "he", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    path = tmp_path / "chat.gguf"
    write_like_llama_cpp(build_reference("qwen3_5", vocab_size=len(tokens)), path, tokens=tokens)
    llm = LLM(str(path), max_model_len=64, kv_cache_memory="16MiB")
    tokenizer = llm.tokenizer
    assert tokenizer("the cat").input_ids == [116, 257, 32, 99, 97, 116]  # "t", "he" merged, " cat" bytes
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert len(tokens) - 1 in llm.engine.eos_token_ids
    messages = [{"role": "user", "content": "hi"}]
    out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert out[0].prompt_token_ids == tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n")
    assert len(out[0].outputs[0].token_ids) == 4


def test_a_tokenizer_transformers_cannot_build_is_a_clear_error(tmp_path, specserve_cache, monkeypatch):
    """transformers before 5.25 builds no tokenizer from a qwen35 GGUF (a ValueError): one clear line, and
    no conversion left behind."""
    import transformers

    from specserve.config import SpecserveError

    def too_old(*args, **kwargs):
        raise ValueError("GGUF model with architecture qwen35 is not supported yet.")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", too_old)
    tokens = _bytes_to_unicode() + ["Ġt", "he", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    path = tmp_path / "chat.gguf"
    write_like_llama_cpp(build_reference("qwen3_5", vocab_size=len(tokens)), path, tokens=tokens)
    with pytest.raises(SpecserveError, match=r"chat.gguf: transformers .* cannot build its tokenizer .*-U"):
        resolve_model(str(path), need_weights=False)
    assert not any(p.name.startswith("chat") for p in (specserve_cache / "converted").iterdir())
