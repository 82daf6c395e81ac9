"""Mixture-of-experts decode on this CPU: a model of a released MoE's layer shapes (fewer layers, and the
vocabulary scaled with them so that the head's share of a token's reads stays the real model's), random int4
weights made in the kernel's layout (no checkpoint, no fp32 copy), timed with the routed experts in grouped
kernel calls and with the loop over experts, round by round in turn on the same weights; and llama.cpp
(llama-cpp-python, `pip install 'specserve[bench]'`) on a GGUF of the same shapes with random Q4_K weights
(written here with the `gguf` package, routers F32), timed in the same rounds. `--model`:
- `qwen3-30b-a3b` (the default): hidden 2048, 128 experts of width 768, top 8, 32 query / 4 KV heads of 128.
- `qwen3.6-35b-a3b`: the hybrid (Qwen3.5 / 3.6 MoE): three Gated DeltaNet layers (16 key / 32 value heads
  of 128) to one gated full-attention layer (16 query / 2 KV heads of 256), 256 experts of width 512, top 8,
  and a shared expert of 512; `--layers` a multiple of 4. llama.cpp cannot cut its recurrent state back,
  so its context is evaluated again (untimed) before each of its timed forwards.

    python -m specserve.bench.moe [--model M] [--layers 8] [--context 64] [--rounds 5] [--out F] [--no-llama]

Per mode: T(q), one model forward over q new tokens after `--context` cached ones with logits for all q
rows (as verification needs; for the hybrid, keeping what a rollback needs), for q = 1..9 and 16; T(1) is a
batch-1 decode step (the engine's scheduling and sampling excluded), and T(q)/T(1) the cost of verifying
q - 1 drafts. The read roofline: the weight bytes a forward reads (attention and head int4, routers fp32,
and the int4 weights of the experts its rows are routed to: top-k for one row, more distinct ones for q
rows) over the read bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import torch
import transformers
from torch import nn

from specserve.bench.quant import LlamaCpp, read_bandwidth_gb_s, weight_bytes_per_token
from specserve.layers import kernels
from specserve.layers.moe import Experts
from specserve.layers.quant import (
    DEFAULT_GROUP_SIZE,
    GROUPS_PER_SUPER,
    N_MULTIPLE,
    Int4Linear,
    fuse_projections,
    quantizable_linears,
    replace_module,
)
from specserve.models.prepare import place
from specserve.models.registry import model_skeleton
from specserve.platform import CPU
from specserve.worker.model_runner import ModelRunner, PieceInput


@dataclass(frozen=True)
class Shape:
    """A released model's layer shapes (its config.json, less its layer count and vocabulary)."""

    config_class: type
    fields: dict
    layers: int
    vocab: int


SHAPES = {
    "qwen3-30b-a3b": Shape(
        transformers.Qwen3MoeConfig,
        dict(
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_experts=128,
            num_experts_per_tok=8,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
            norm_topk_prob=True,
            max_position_embeddings=4096,
        ),
        layers=48,
        vocab=151936,
    ),
    # hybrid: three Gated DeltaNet layers to one gated full-attention layer, a shared expert beside the routed
    "qwen3.6-35b-a3b": Shape(
        transformers.Qwen3_5MoeTextConfig,
        dict(
            hidden_size=2048,
            moe_intermediate_size=512,
            shared_expert_intermediate_size=512,
            num_experts=256,
            num_experts_per_tok=8,
            num_attention_heads=16,
            num_key_value_heads=2,
            head_dim=256,
            linear_num_key_heads=16,
            linear_num_value_heads=32,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
            rms_norm_eps=1e-6,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10_000_000.0,
                "partial_rotary_factor": 0.25,
                "mrope_section": [11, 11, 10],
                "mrope_interleaved": True,
            },
            max_position_embeddings=4096,
        ),
        layers=40,
        vocab=248320,
    ),
}
FULL_ATTENTION_INTERVAL = 4  # Qwen3.6's: every fourth layer is full attention
Q_VALUES = [*range(1, 10), 16]
BLOCK = 16
MODES = ("grouped", "loop")


def is_hybrid(config_class: type) -> bool:
    """Gated DeltaNet layers beside the full-attention ones (llama.cpp's qwen35moe, not qwen3moe)."""
    return issubclass(config_class, transformers.Qwen3_5MoeTextConfig)


def shaped_config(layers: int, model: str = "qwen3-30b-a3b") -> transformers.PretrainedConfig:
    shape = SHAPES[model]
    vocab = shape.vocab * layers // shape.layers // N_MULTIPLE * N_MULTIPLE
    fields = dict(shape.fields, num_hidden_layers=layers, vocab_size=vocab)
    if is_hybrid(shape.config_class):
        interval = FULL_ATTENTION_INTERVAL
        if layers % interval:
            raise SystemExit(f"{model} keeps one full-attention layer in {interval}: --layers 4, 8...")
        pattern = ["linear_attention"] * (interval - 1) + ["full_attention"]
        fields["layer_types"] = pattern * (layers // interval)
    return shape.config_class(**fields)


def random_int4(n: int, k: int, generator: torch.Generator) -> Int4Linear:
    """An int4 layer [n, k] with random codes and sub-scales, made in the kernel's layout; each group's
    minimum is minus 7.5 steps, so the weights are centred on zero (with positive ones, every layer would add
    one common direction to all tokens, and all tokens would be routed to the same experts)."""
    tiles, groups = n // N_MULTIPLE, k // DEFAULT_GROUP_SIZE
    supers = -(-groups // GROUPS_PER_SUPER)
    sub_scales = torch.randint(1, 256, (tiles, groups, 16), dtype=torch.uint8, generator=generator)
    sub_mins = (-(sub_scales.float() * 127 / 255).round()).to(torch.int8).view(torch.uint8)
    d = torch.rand(tiles, supers, 16, generator=generator) * 5e-6 + 1e-6
    buffers = {
        "packed": torch.randint(0, 256, (tiles, k // 8, 64), dtype=torch.uint8, generator=generator),
        "scales": torch.cat([sub_scales, sub_mins], dim=-1),
        "supers": torch.cat([d, d * 7.5 * 255 / 127], dim=-1).half(),  # d, dmin
    }
    return Int4Linear.from_kernel_buffers(buffers, k, DEFAULT_GROUP_SIZE, None)


def build(config: transformers.PretrainedConfig, seed: int = 0) -> nn.Module:
    """The shaped model, int4 where the int4 mode quantizes (the routers fp32), fused, experts stacked and
    placed as a loaded model is."""
    model = model_skeleton(config)
    g = torch.Generator().manual_seed(seed)
    for names in list(quantizable_linears(model, "int4")):
        meta = model.get_submodule(names[0])
        replace_module(model, names, random_int4(meta.out_features, meta.in_features, g))
    for module in model.modules():  # what is left on the meta device: embedding, norms, routers
        for name, p in list(module._parameters.items()):
            if p is not None and p.is_meta:
                value = torch.randn(p.shape, generator=g)
                value = 1 + 0.1 * value if p.dim() == 1 else value * p.shape[-1] ** -0.5  # norms ~ 1
                module._parameters[name] = nn.Parameter(value, requires_grad=False)
    fuse_projections(model)
    return place(model.eval(), CPU)


# llama.cpp's Q4_K: 256 weights a block in d, dmin (fp16), 12 bytes of 6-bit scales, 128 bytes of codes
Q4_K_BLOCK, Q4_K_BYTES = 256, 144


def random_q4_k(rows: tuple[int, ...], cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random Q4_K blocks for a [*rows, cols] weight, as bytes: random codes; sub-blocks 0-3 with scale and
    minimum 16, 4-7 with 1 and 1 (the 6-bit packing of bytes 16 / 0x11), dmin = 7.5 d, so every sub-block is
    centred on zero as `random_int4`'s groups are."""
    blocks = rng.integers(0, 256, (*rows, cols // Q4_K_BLOCK, Q4_K_BYTES), dtype=np.uint8)
    d = (rng.random((*rows, cols // Q4_K_BLOCK)) * 5e-4 + 1e-4).astype(np.float16)
    blocks[..., 0:2] = d[..., None].view(np.uint8)
    blocks[..., 2:4] = (d * np.float16(7.5))[..., None].view(np.uint8)
    blocks[..., 4:12], blocks[..., 12:16] = 16, 0x11
    return blocks.reshape(*rows, -1)


def write_gguf(config: transformers.PretrainedConfig, path: str, seed: int = 0) -> None:
    """A GGUF of `config`'s shapes with random weights for llama.cpp (qwen3moe, or qwen35moe for the hybrid):
    Q4_K matrices (routers and the shared expert's gate F32), F32 norms and linear-attention parameters, no
    tokenizer (token ids go in as they are)."""
    import gguf

    rng = np.random.default_rng(seed)
    hidden, experts, width = config.hidden_size, config.num_experts, config.moe_intermediate_size
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    hybrid = is_hybrid(type(config))
    writer = gguf.GGUFWriter(path, "qwen35moe" if hybrid else "qwen3moe")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(hidden)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_expert_feed_forward_length(width)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_expert_count(experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_vocab_size(config.vocab_size)
    writer.add_tokenizer_model("no_vocab")
    if hybrid:
        rotated = int(head_dim * config.rope_parameters["partial_rotary_factor"])
        writer.add_rope_dimension_count(rotated)
        writer.add_rope_dimension_sections([*config.rope_parameters["mrope_section"], 0])
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
        writer.add_full_attention_interval(FULL_ATTENTION_INTERVAL)
        writer.add_ssm_conv_kernel(config.linear_conv_kernel_dim)
        writer.add_ssm_state_size(config.linear_key_head_dim)
        writer.add_ssm_group_count(config.linear_num_key_heads)
        writer.add_ssm_time_step_rank(config.linear_num_value_heads)
        writer.add_ssm_inner_size(config.linear_num_value_heads * config.linear_value_head_dim)
    else:
        writer.add_feed_forward_length(config.intermediate_size)

    def q4_k(name: str, *shape: int) -> None:
        blocks = random_q4_k(shape[:-1], shape[-1], rng)
        writer.add_tensor(name, blocks, raw_dtype=gguf.GGMLQuantizationType.Q4_K)

    def f32(name: str, value: np.ndarray) -> None:
        writer.add_tensor(name, value.astype(np.float32))

    def norm(name: str, size: int) -> None:
        f32(name, 1 + 0.1 * rng.standard_normal(size))

    q4_k("token_embd.weight", config.vocab_size, hidden)
    q4_k("output.weight", config.vocab_size, hidden)
    norm("output_norm.weight", hidden)
    for i in range(config.num_hidden_layers):
        block = f"blk.{i}"
        norm(f"{block}.attn_norm.weight", hidden)
        norm(f"{block}.{'post_attention_norm' if hybrid else 'ffn_norm'}.weight", hidden)
        if hybrid and config.layer_types[i] == "linear_attention":
            key_dim = config.linear_num_key_heads * config.linear_key_head_dim
            value_heads = config.linear_num_value_heads
            value_dim = value_heads * config.linear_value_head_dim
            q4_k(f"{block}.attn_qkv.weight", 2 * key_dim + value_dim, hidden)
            q4_k(f"{block}.attn_gate.weight", value_dim, hidden)
            q4_k(f"{block}.ssm_beta.weight", value_heads, hidden)
            q4_k(f"{block}.ssm_alpha.weight", value_heads, hidden)
            conv = (2 * key_dim + value_dim, config.linear_conv_kernel_dim)
            f32(f"{block}.ssm_conv1d.weight", rng.standard_normal(conv) * 0.5)
            f32(f"{block}.ssm_a", -np.exp(1 + 0.1 * rng.standard_normal(value_heads)))
            f32(f"{block}.ssm_dt.bias", 1 + 0.1 * rng.standard_normal(value_heads))
            norm(f"{block}.ssm_norm.weight", config.linear_value_head_dim)
            q4_k(f"{block}.ssm_out.weight", hidden, value_dim)
        else:
            gated = 2 if hybrid else 1  # the hybrid's query rows carry its output gate's
            q4_k(f"{block}.attn_q.weight", gated * heads * head_dim, hidden)
            q4_k(f"{block}.attn_k.weight", kv_heads * head_dim, hidden)
            q4_k(f"{block}.attn_v.weight", kv_heads * head_dim, hidden)
            q4_k(f"{block}.attn_output.weight", hidden, heads * head_dim)
            norm(f"{block}.attn_q_norm.weight", head_dim)
            norm(f"{block}.attn_k_norm.weight", head_dim)
        f32(f"{block}.ffn_gate_inp.weight", rng.standard_normal((experts, hidden)) * hidden**-0.5)
        q4_k(f"{block}.ffn_gate_exps.weight", experts, width, hidden)
        q4_k(f"{block}.ffn_up_exps.weight", experts, width, hidden)
        q4_k(f"{block}.ffn_down_exps.weight", experts, hidden, width)
        if hybrid:
            shared = config.shared_expert_intermediate_size
            f32(f"{block}.ffn_gate_inp_shexp.weight", rng.standard_normal((1, hidden)) * hidden**-0.5)
            q4_k(f"{block}.ffn_gate_shexp.weight", shared, hidden)
            q4_k(f"{block}.ffn_up_shexp.weight", shared, hidden)
            q4_k(f"{block}.ffn_down_shexp.weight", hidden, shared)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()


def experts_of(model: nn.Module) -> list[Experts]:
    return [m for m in model.modules() if isinstance(m, Experts)]


def expert_bytes(model: nn.Module) -> tuple[int, int]:
    """(weight bytes of every linear layer but the routed experts, bytes of one routed expert)."""
    total, one = weight_bytes_per_token(model), 0
    for experts in experts_of(model):
        for expert in experts:
            one = sum(b.numel() * b.element_size() for layer in expert.children() for b in layer.buffers())
            total -= one
    return total, one


def routed_experts(model: nn.Module, timer: Timer, q: int) -> int:
    """How many (layer, expert) pairs a forward over q tokens routes rows to: the experts it reads."""
    seen = []
    hooks = [
        experts.register_forward_hook(lambda m, inputs, out: seen.append(len(inputs[2].unique())))
        for experts in experts_of(model)
    ]
    try:
        timer.seconds(q)
    finally:
        for hook in hooks:
            hook.remove()
    return sum(seen)


class Timer:
    """One runner over the model with `context` tokens cached; T(q) for the tokens after them."""

    def __init__(self, model: nn.Module, context: int, vocab: int):
        blocks = -(-(context + max(Q_VALUES)) // BLOCK)
        self.runner = ModelRunner(model, blocks, BLOCK, torch.float32, num_state_slots=1)
        self.table = list(range(blocks))
        self.context = context
        self.state_slot = 0 if model.has_recurrent_state else None  # the hybrid's recurrent state
        g = torch.Generator().manual_seed(1)
        self.tokens = torch.randint(0, vocab, (context + max(Q_VALUES),), generator=g).tolist()
        prompt = PieceInput(self.tokens[:context], 0, self.table, state_slot=self.state_slot)
        self.runner.forward([prompt], [context - 1])

    def seconds(self, q: int) -> float:
        """One forward over q tokens; q > 1 is a verification block, which keeps what rolling the recurrent
        state back needs (the state moves on every call: no figure depends on its values)."""
        tokens = self.tokens[self.context : self.context + q]
        piece = PieceInput(tokens, self.context, self.table, state_slot=self.state_slot, checkpoint=q > 1)
        start = time.perf_counter()
        self.runner.forward([piece], list(range(q)))
        return time.perf_counter() - start


def use_mode(model: nn.Module, stacks: list, mode: str) -> None:
    """grouped: the experts' stacked calls; loop: each expert on its own (the same weights: views)."""
    for experts, stacked in zip(experts_of(model), stacks, strict=True):
        experts.stacks = stacked if mode == "grouped" else None


def llama_cpp(config: transformers.PretrainedConfig, directory: str, timer: Timer):
    """llama.cpp on a GGUF of the same shapes (random Q4_K weights), the same context cached; None, said
    why, without llama-cpp-python."""
    if importlib.util.find_spec("llama_cpp") is None:
        print("llama.cpp skipped: llama-cpp-python is not installed (pip install 'specserve[bench]')")
        return None
    started, path = time.perf_counter(), f"{directory}/shaped.gguf"
    write_gguf(config, path)
    llama = LlamaCpp(path, torch.get_num_threads(), n_ctx=timer.context + max(Q_VALUES) + 16)
    llama.prepare(timer.tokens[: timer.context])
    seconds = time.perf_counter() - started
    print(f"llama.cpp: a Q4_K GGUF of the same shapes, written and loaded in {seconds:.0f} s")
    return llama


def run(args: argparse.Namespace) -> dict:
    if kernels.ops() is None:
        raise SystemExit("specserve's kernels are not available here: nothing to group")
    started = time.perf_counter()
    config = shaped_config(args.layers, args.model)
    model = build(config)
    stacks = [experts.stacks for experts in experts_of(model)]
    assert all(s is not None for s in stacks), "the experts were not stacked"
    print(f"built {args.layers} layers in {time.perf_counter() - started:.0f} s", flush=True)
    timer = Timer(model, args.context, config.vocab_size)
    with tempfile.TemporaryDirectory() as directory:
        llama = llama_cpp(config, directory, timer) if args.llama else None
        engines = [*MODES, *(["llama.cpp"] if llama else [])]

        def seconds(engine: str, q: int) -> float:
            if engine == "llama.cpp":
                if timer.state_slot is not None:  # it cannot cut a recurrent state back: the context again
                    llama.prepare(timer.tokens[: timer.context])
                return llama.forward_seconds(timer.context, timer.tokens[timer.context : timer.context + q])
            use_mode(model, stacks, engine)
            return timer.seconds(q)

        times: dict[str, dict[int, list[float]]] = {e: {q: [] for q in Q_VALUES} for e in engines}
        for engine in engines:  # warm-up
            for q in Q_VALUES:
                seconds(engine, q)
        for r in range(args.rounds):
            # every other round in reverse: no engine always runs right after the same one (an engine's
            # threads keep spinning for a while after its forward, slowing the next one's start)
            order = engines if r % 2 == 0 else engines[::-1]
            for q in Q_VALUES:
                for engine in order:
                    times[engine][q].append(seconds(engine, q))
            t1 = ", ".join(f"{e} {times[e][1][-1] * 1e3:.1f} ms" for e in engines)
            print(f"  round {r + 1}: T(1) {t1}", flush=True)
        if llama:
            llama.llm.close()  # before its GGUF goes
    use_mode(model, stacks, "grouped")
    ms = {e: {q: statistics.median(t) * 1e3 for q, t in per_q.items()} for e, per_q in times.items()}
    bandwidth = read_bandwidth_gb_s()
    dense_bytes, per_expert = expert_bytes(model)
    read_bytes = {q: dense_bytes + routed_experts(model, timer, q) * per_expert for q in Q_VALUES}
    step_bytes = read_bytes[1]
    result = {
        "model": args.model,
        "machine": platform.processor() or platform.machine(),
        "isa": kernels.isa_name(),
        "threads": torch.get_num_threads(),
        "layers": args.layers,
        "vocab": config.vocab_size,
        "context": args.context,
        "rounds": args.rounds,
        "read_bandwidth_gb_s": bandwidth,
        "active_weight_bytes": step_bytes,
        "roofline_tokens_per_s": bandwidth * 1e9 / step_bytes,
        "read_bytes": read_bytes,
        "t_ms": ms,
    }
    print(f"\nread bandwidth {bandwidth:.1f} GB/s; a batch-1 step reads {step_bytes / 1e6:.0f} MB of weights")
    print(f"roofline {result['roofline_tokens_per_s']:.1f} tokens/s")
    # the roofline of q rows: the bytes of the experts they route to (more distinct ones as q grows)
    print(
        "q   "
        + "".join(f"{e + ' T(q) ms':>20}{'T(q)/T(1)':>11}" for e in engines)
        + f"{'loop/grouped':>14}{'reads MB':>10}{'roofline ms':>13}"
    )
    for q in Q_VALUES:
        cells = "".join(f"{ms[e][q]:20.1f}{ms[e][q] / ms[e][1]:11.2f}" for e in engines)
        roof = read_bytes[q] / bandwidth / 1e6
        print(f"{q:<4}{cells}{ms['loop'][q] / ms['grouped'][q]:14.2f}{read_bytes[q] / 1e6:10.0f}{roof:13.1f}")
    for engine in engines:
        rate = 1e3 / ms[engine][1]
        share = rate / result["roofline_tokens_per_s"]  # llama.cpp's Q4_K reads 4.5 bits a weight, ours ~4.6
        line = f"{engine}: batch-1 step {rate:.1f} tokens/s = {share:.0%} of the roofline"
        if "llama.cpp" in ms and engine != "llama.cpp":
            line += f", {ms['llama.cpp'][1] / ms[engine][1]:.2f}x llama.cpp"
        print(line)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(SHAPES), default="qwen3-30b-a3b", help="whose layer shapes")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--context", type=int, default=64, help="cached tokens before the q timed ones")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", help="write the results here (JSON)")
    parser.add_argument("--no-llama", dest="llama", action="store_false", help="skip llama.cpp")
    torch.manual_seed(0)
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
