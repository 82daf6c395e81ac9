"""GGUF files of the hybrid Qwen3.5 / Qwen3.6 targets (llama.cpp's `qwen35`, `qwen35moe`).

The files here are written from tiny transformers models the way llama.cpp's converter writes them (its
tensor names from the gguf package's own name map; value heads tiled, A_log as -exp(A_log), norms as w + 1,
the conv kernel squeezed, experts stacked, the multi-token-prediction layer as an appended `nextn` block).
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
from torch import nn

from specserve import LLM, SamplingParams
from specserve.layers.quant import Int4Linear, Int8Linear, quantize_model
from specserve.models.loader import load_model, resolve_model
from tests.test_loader import CHAT_TEMPLATE, _bytes_to_unicode
from tests.tiny_models import build_reference

ARCHS = {"qwen3_5": "qwen35", "qwen3_5_moe": "qwen35moe"}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _tiled(x: np.ndarray, axis: int, key_heads: int, per_key: int, head_dim: int, start: int = 0):
    """The converter's value-head order: grouped by key head -> tiled over the key heads."""
    head, values = np.split(x, [start], axis=axis)
    shape = list(values.shape)
    grouped = values.reshape(shape[:axis] + [key_heads, per_key, head_dim] + shape[axis + 1 :])
    return np.concatenate([head, np.swapaxes(grouped, axis, axis + 1).reshape(shape)], axis=axis)


def _llama_cpp_tensors(config, state: dict[str, np.ndarray]):
    """(HF name, llama.cpp's tensor) pairs: each tensor as the converter transforms it, unnamed yet."""
    key_heads, value_heads = config.linear_num_key_heads, config.linear_num_value_heads
    per_key, value_dim = value_heads // key_heads, config.linear_value_head_dim
    qk = 2 * key_heads * config.linear_key_head_dim

    def tiled(x, axis=0, head_dim=value_dim, start=0):
        return _tiled(x, axis, key_heads, per_key, head_dim, start) if per_key > 1 else x

    experts: dict[str, list[np.ndarray]] = {}
    for name, x in state.items():
        if m := re.match(r"(.*\.mlp\.experts)\.(\d+)\.(\w+)\.weight$", name):  # the converter stacks them
            experts.setdefault(f"{m.group(1)}.{m.group(3)}.weight", {})[int(m.group(2))] = x
            continue
        leaf = name.rpartition(".linear_attn.")[2]
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
    """`model` (a transformers Qwen3.5 / Qwen3.5-MoE) as llama.cpp's converter writes it: F32 tensors, or
    the matrices in `quantized` blocks; `mtp` (the checkpoint's `mtp.*` tensors) as a last `nextn` block;
    a byte-level BPE vocabulary of `tokens` (the last three control tokens), or none."""
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
    w.add_rope_dimension_sections([*rope["mrope_section"], 0])
    w.add_ssm_conv_kernel(config.linear_conv_kernel_dim)
    w.add_ssm_state_size(config.linear_key_head_dim)
    w.add_ssm_group_count(config.linear_num_key_heads)
    w.add_ssm_time_step_rank(config.linear_num_value_heads)
    w.add_ssm_inner_size(config.linear_value_head_dim * config.linear_num_value_heads)
    w.add_full_attention_interval(config.layer_types.index("full_attention") + 1)
    if arch == "qwen35":
        w.add_feed_forward_length(config.intermediate_size)
    else:
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
        x = np.ascontiguousarray(x, dtype=np.float32)
        matrix = x.ndim >= 2 and "norm" not in name and "conv1d" not in name
        if quantized is not None and matrix and x.shape[-1] % gguf.GGML_QUANT_SIZES[quantized][0] == 0:
            w.add_tensor(name, gguf.quants.quantize(x, quantized), raw_dtype=quantized)
        else:
            w.add_tensor(name, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_llama_cpp_reads_the_written_file_as_transformers(arch, tmp_path):
    """The writer above writes llama.cpp's format: llama.cpp's logits on its file are transformers'."""
    llama_cpp = pytest.importorskip("llama_cpp")
    model = build_reference(arch)
    path = tmp_path / f"{arch}.gguf"
    write_like_llama_cpp(model, path)
    ids = [5, 17, 3, 42, 8, 99, 1, 64]
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0].numpy()
    llm = llama_cpp.Llama(str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=2)
    llm.eval(ids)
    got = np.asarray(llm.scores[: len(ids)])
    np.testing.assert_allclose(got, expected, atol=2e-3 * np.abs(expected).max())


def _checkpoint(model_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(model_dir.glob("*.safetensors")) for k, v in load_file(f).items()}


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


@pytest.mark.parametrize("arch", ARCHS)
def test_the_conversion_is_the_checkpoint(arch, tmp_path, cache):
    """Read back, the file is the model transformers started from: its config, every tensor (A_log through
    log(-(-exp)), norms through (w + 1) - 1: within float32 rounding), its logits in transformers, and the
    multi-token-prediction layer under its checkpoint names."""
    from transformers import AutoModelForCausalLM

    from tests.tiny_models import save_tiny_model, save_tiny_mtp

    target = save_tiny_mtp(save_tiny_model(arch, tmp_path / "hf"))
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    mtp = {k: v for k, v in _checkpoint(target).items() if k.startswith("mtp.")}
    path = tmp_path / f"{arch}.gguf"
    write_like_llama_cpp(model, path, mtp=mtp)

    converted = resolve_model(str(path), need_weights=True)
    config = AutoModelForCausalLM.from_pretrained(converted).config
    fields = ("layer_types", "linear_num_value_heads", "linear_value_head_dim", "head_dim", "num_experts")
    for field in fields:
        assert getattr(config, field, None) == getattr(model.config, field, None), field
    assert config.rope_parameters == {**model.config.rope_parameters, "rope_type": "default"}
    assert config.mtp_num_hidden_layers == 1
    expected = {**model.state_dict(), **_fused_experts(mtp)}
    got = _checkpoint(converted)
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value.float(), rtol=1e-6, atol=1e-6, msg=name)
    ids = torch.tensor([[5, 17, 3, 42, 8, 99, 1, 64]])
    with torch.no_grad():
        reference = model(ids).logits
        converted_logits = AutoModelForCausalLM.from_pretrained(converted).eval()(ids).logits
    torch.testing.assert_close(converted_logits, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_loading_takes_the_blocks_in_the_checkpoint_order(mode, tmp_path, cache):
    """Q8_0 matrices, value heads tiled: rows put back move whole blocks (int8 keeps the file's codes), the
    output projection's columns cross blocks and are requantized; every layer is the one quantizing the
    fp32 conversion gives, and the engine generates from the file."""
    path = tmp_path / "q8.gguf"
    write_like_llama_cpp(build_reference("qwen3_5_moe"), path, quantized=QT.Q8_0)
    model_dir = resolve_model(str(path))
    from_gguf, _, _ = load_model(str(model_dir), quantization=mode)
    dense, _, _ = load_model(str(model_dir))
    fp32 = {name: m.weight.clone() for name, m in dense.named_modules() if isinstance(m, nn.Linear)}
    assert quantize_model(dense, mode) > 0
    layers = dict(from_gguf.named_modules())
    checked = set()
    for name, module in dense.named_modules():
        if isinstance(module, Int8Linear | Int4Linear) and not name.endswith((".coarse", ".residual")):
            layer = layers[name]
            assert type(layer) is type(module), name
            if mode == "int8" and not name.endswith("out_proj"):  # the file's codes, d rounded to bf16
                value = fp32[name]
                assert ((layer.weight - value).abs() <= 2**-8 * value.abs()).all(), name
            else:
                assert torch.equal(layer.weight, module.weight), name
            checked.add(name.rpartition(".")[2])
    assert {"in_proj_qkv", "in_proj_z", "out_proj", "q_proj", "down_proj"} <= checked
    llm = LLM(str(path), quantization=mode, max_model_len=64, kv_cache_memory="16MiB")
    out = llm.generate([[1, 5, 9, 2]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 6


@pytest.mark.parametrize("arch", ARCHS)
def test_the_engine_serves_the_file_and_drafts_with_its_mtp_layer(arch, tmp_path, cache):
    """Method 'mtp' drafts with the file's nextn block: read from the GGUF while no fp32 copy is written (a
    quantized load writes none), it is the checkpoint's mtp.*; greedy speculation equals plain greedy,
    quantized and in fp32, and plain greedy on the file is transformers' on the model."""
    from transformers import AutoModelForCausalLM

    from specserve.models.weight_files import iter_checkpoint_tensors
    from tests.tiny_models import save_tiny_model, save_tiny_mtp

    target = save_tiny_mtp(save_tiny_model(arch, tmp_path / "hf"))
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    mtp = {k: v for k, v in _checkpoint(target).items() if k.startswith("mtp.")}
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

    with torch.no_grad():
        expected = [
            model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=10, min_new_tokens=10)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]
    assert run() == expected
    assert run(speculative_config=spec) == expected


def test_the_tokenizer_comes_from_the_file(tmp_path, cache):
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
