"""A GGUF's tensors in checkpoint terms: which HF checkpoint tensor each one is (`plan_tensors`), what
llama.cpp's converter did to it and how that is undone (`undo_conversion`), dequantized a block of rows at a
time (`iter_converted`), and the tensors the fp32 checkpoint holds (`checkpoint_tensors`). `models/gguf.py`
writes the conversion from these, `models/gguf_quantized.py` reads linear weights' blocks by them.

GGUF conventions that matter here (llama.cpp's converter; checked against transformers' GGUF loading):
- ggml shapes are innermost-first: `ReaderTensor.shape` is [in, out] for a Linear, and the dequantized
  numpy array comes out [out, in], already HF's order. Quantized `.data` is raw bytes [rows, row_bytes].
- Qwen2/Qwen3/Qwen3-MoE: no Q/K row permutation (only llama.cpp's LlamaModel permutes); biases are F32.
- Gemma 3: every `*norm.weight` (block norms, q/k norms, final norm) is stored as `w + 1`, because HF's
  Gemma3RMSNorm multiplies by `1 + w` and llama.cpp's by `w`. We subtract 1 again (in float32, exactly
  as transformers does, so (w + 1) - 1 may differ from w in the last bit: the file only has w + 1).
- Gemma 3: the sliding-window pattern (5 local : 1 global) and the local RoPE base (10,000) are not in
  the file; llama.cpp hard-codes both, so do we. The window size itself is (`attention.sliding_window`).
- Gemma 4 (`gemma4`, llama.cpp's Gemma4Model; checked against llama.cpp itself by tests/test_gguf_gemma4.py):
  norms stored as they are (its norms scale by w); the layer scalar as `layer_output_scale`, the router's
  scale and per-expert scale as `ffn_gate_inp.scale` and `ffn_down_exps.scale`, the experts stacked and
  their gate/up fused as in the checkpoint (`ffn_gate_up_exps`); the KV-shared layers have no K/V tensors,
  the global layers of V = K no `attn_v`. `rope_freqs` is no checkpoint tensor: the global layers' RoPE,
  read into the config.
- Tied embeddings: llama.cpp writes `output.weight` only when the model has its own LM head. The two
  Qwen2.5-Coder files here DO carry `output.weight` although the HF originals are tied: it was quantized
  differently from `token_embd` (Q8_0 vs Q5_0, Q6_K vs Q4_K), so the two differ after dequantization and
  the converted model is untied (as transformers also loads it). Gemma 3 270M has none: tied.
- MoE experts are stacked into one [n_expert, ...] tensor per projection (Gemma 4's gate and up fused in
  one); we plan them per expert, as the model holds them, so that quantized loading takes each expert's
  blocks; Qwen3.5-MoE's and Gemma 4's checkpoints stack them again (`checkpoint_tensors`).
- Qwen3.5 / Qwen3.6 (`qwen35`, `qwen35moe`; llama.cpp's `_LinearAttentionVReorderBase`, checked against
  llama.cpp itself by tests/test_gguf_hybrid.py): norms stored as w + 1 as Gemma's (not the linear
  attention's gated `ssm_norm`); `A_log` stored as `ssm_a` = -exp(A_log) and `dt_bias` as `ssm_dt.bias`;
  the conv kernel squeezed to [channels, kernel]; where there are more value heads than key heads, the
  value heads are stored tiled over the key heads (`VHeadOrder`): rows of in_proj_qkv's v part, in_proj_z,
  in_proj_a/b, the conv's v channels, A_log and dt_bias; columns of out_proj. The multi-token-prediction
  layer is a last block (`nextn_predict_layers`), its own tensors under `nextn.`.
- Qwen3-Next (`qwen3next`, llama.cpp's Qwen3NextModel; tests/test_gguf_hybrid.py too): as Qwen3.5 but no
  value heads tiled and no MTP layer (dropped); its checkpoints' fused in_proj_qkvz (per key-head group q,
  k, v..., z...) is stored as attn_qkv (all q, all k, all v) and attn_gate (all z), its in_proj_ba as it is
  (`ssm_ba`). The plan holds the model's projections (ssm_ba's b and a rows as in_proj_b, in_proj_a); the
  fp32 checkpoint fuses them again, as row ranges (`_qwen3_next_layouts`), for transformers.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from specserve.config import SpecserveError

# llama.cpp stores these architectures' RMSNorm weights as w + 1 (their checkpoints scale by 1 + w, its norm
# by w); the gated norm of the linear-attention output (`ssm_norm`) scales by w and is stored as it is.
_PLUS_ONE_NORMS = ("gemma3", "qwen3next", "qwen35", "qwen35moe")
HYBRID_ARCHS = ("qwen3next", "qwen35", "qwen35moe")
# Qwen3.5's converter (not Qwen3-Next's) stores the value heads tiled over the key heads (`VHeadOrder`).
_V_HEADS_TILED = ("qwen35", "qwen35moe")


class Meta:
    """Typed access to GGUF key/values (`ReaderField.contents()` parses on demand)."""

    def __init__(self, reader):
        self.fields = reader.fields
        self.arch: str = self.get("general.architecture")

    def get(self, key: str, default: Any = None) -> Any:
        field = self.fields.get(key)
        return default if field is None else field.contents()

    def arch_key(self, key: str, default: Any = None) -> Any:
        return self.get(f"{self.arch}.{key}", default)

    def require(self, key: str) -> Any:
        value = self.arch_key(key)
        if value is None:
            raise SpecserveError(f"GGUF file lacks metadata key {self.arch}.{key}")
        return value


_TOP_LEVEL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    # Gemma 4's per-layer inputs
    "per_layer_token_embd": "model.embed_tokens_per_layer",
    "per_layer_model_proj": "model.per_layer_model_projection",
    "per_layer_proj_norm": "model.per_layer_projection_norm",
}
_LAYER_COMMON = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_QWEN35 = {
    **_LAYER_COMMON,
    "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
}
_QWEN35_MOE = {
    **_QWEN35,
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# Gemma 3 has four norms per block; llama.cpp's names shift by one relative to HF's.
_GEMMA3 = {
    **_LAYER_COMMON,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_LAYER_BY_ARCH = {
    "qwen2": {**_LAYER_COMMON, "ffn_norm": "post_attention_layernorm"},
    "qwen3": {**_LAYER_COMMON, "ffn_norm": "post_attention_layernorm"},
    "qwen3moe": {**_LAYER_COMMON, "ffn_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.gate"},
    "gemma3": _GEMMA3,
    # and the per-layer inputs' and the MoE block's (its router's scales are parameters: `_PARAMETERS`)
    "gemma4": {
        **_GEMMA3,
        "inp_gate": "per_layer_input_gate",
        "proj": "per_layer_projection",
        "post_norm": "post_per_layer_input_norm",
        "ffn_gate_inp": "router.proj",
        "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
        "post_ffw_norm_1": "post_feedforward_layernorm_1",
        "post_ffw_norm_2": "post_feedforward_layernorm_2",
    },
    "qwen35": _QWEN35,
    "qwen35moe": _QWEN35_MOE,
    "qwen3next": _QWEN35_MOE,  # and `ssm_ba`, fused (`_qwen3_next_layouts`)
}
# Block tensors that are parameters of their own (no `.weight` of a module), by (name, kind) in the block.
_HYBRID_PARAMETERS = {("ssm_a", None): "linear_attn.A_log", ("ssm_dt", "bias"): "linear_attn.dt_bias"}
_PARAMETERS = {
    **dict.fromkeys(HYBRID_ARCHS, _HYBRID_PARAMETERS),
    "gemma4": {
        ("layer_output_scale", "weight"): "layer_scalar",
        ("ffn_gate_inp.scale", None): "router.scale",
        ("ffn_down_exps.scale", None): "router.per_expert_scale",
    },
}
# Tensors the converter derives from the config; `build_hf_config` reads them back into it.
_CONFIG_TENSORS = {"gemma4": ("rope_freqs.weight",)}
# The multi-token-prediction blocks llama.cpp appends (Qwen3.5): their own tensors, by the checkpoint's names.
_MTP = {
    "nextn.eh_proj": "mtp.fc",
    "nextn.enorm": "mtp.pre_fc_norm_embedding",
    "nextn.hnorm": "mtp.pre_fc_norm_hidden",
    "nextn.shared_head_norm": "mtp.norm",
}
# A MoE block's stacked expert tensors, planned one per expert (each expert's rows: whole quantized blocks).
_EXPERT_LEAVES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_FUSED_EXPERT_LEAF = "ffn_gate_up_exps"  # Gemma 4's: each expert's gate rows, then its up rows
_EXPERTS_IN_LAYER = {"gemma4": "experts"}  # beside the MLP; others' are the MLP's (`mlp.experts`)
# Architectures whose checkpoints hold a layer's experts as two stacked tensors (`checkpoint_tensors`).
_STACKED_EXPERTS = ("qwen35moe", "gemma4")
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_0-9.]+?)(?:\.(weight|bias))?$")
_TOP_RE = re.compile(r"^([a-z_]+)\.(weight|bias)$")


@dataclass(frozen=True)
class VHeadOrder:
    """llama.cpp's converter stores the value heads of a linear-attention layer tiled over the key heads
    ([k0v0, k1v0, ..., k0v1, k1v1, ...]) where the checkpoint groups them by key head ([k0v0, k0v1, ...,
    k1v0, ...]), whenever there are more value heads than key heads. This is that order along `axis` (0:
    rows, which quantized blocks follow exactly; 1: columns), after the first `start` elements (q and k)."""

    axis: int
    start: int
    key_heads: int
    per_key: int
    head_dim: int

    def index(self, length: int) -> np.ndarray:
        """For each of the checkpoint's `length` elements along `axis`, its position in the file."""
        tiled = np.arange(self.key_heads * self.per_key * self.head_dim)
        grouped = self.start + tiled.reshape(self.per_key, self.key_heads, self.head_dim).transpose(1, 0, 2)
        return np.concatenate(
            [np.arange(self.start), grouped.reshape(-1), np.arange(self.start + tiled.size, length)]
        )


def _v_head_orders(meta: Meta) -> dict[str, VHeadOrder]:
    """The reordered tensors of a Qwen3.5 linear-attention layer, by their name in the block."""
    key_heads, value_heads = meta.arch_key("ssm.group_count"), meta.arch_key("ssm.time_step_rank")
    if meta.arch not in _V_HEADS_TILED or key_heads == value_heads:
        return {}
    key_heads, per_key = int(key_heads), int(value_heads) // int(key_heads)
    qk = 2 * key_heads * int(meta.require("ssm.state_size"))
    value_dim = int(meta.require("ssm.inner_size")) // int(value_heads)
    order = lambda axis, start, head_dim: VHeadOrder(axis, start, key_heads, per_key, head_dim)
    per_head = order(0, 0, 1)
    return {
        "attn_qkv": order(0, qk, value_dim),
        "ssm_conv1d": order(0, qk, value_dim),
        "attn_gate": order(0, 0, value_dim),
        "ssm_beta": per_head,
        "ssm_alpha": per_head,
        "ssm_a": per_head,
        "ssm_dt": per_head,
        "ssm_out": order(1, 0, value_dim),
    }


# A fused checkpoint tensor's rows in order: row ranges (projection, start, stop) of the model's projections.
Layout = list[tuple[str, int, int]]


def _qwen3_next_layouts(meta: Meta) -> dict[str, Layout]:
    """Qwen3-Next's checkpoints fuse the linear attention's input projections per key-head group:
    in_proj_qkvz [q, k, v..., z...] and in_proj_ba [b..., a...]. llama.cpp's converter splits the first
    into attn_qkv (all q, all k, all v: the model's in_proj_qkv) and attn_gate (all z: in_proj_z) and keeps
    the second (`ssm_ba`); no other architecture has any."""
    if meta.arch != "qwen3next":
        return {}
    groups, dk = int(meta.require("ssm.group_count")), int(meta.require("ssm.state_size"))
    per_group = int(meta.require("ssm.time_step_rank")) // groups
    dv = int(meta.require("ssm.inner_size")) // groups
    v = 2 * groups * dk
    qkvz = [
        part
        for g in range(groups)
        for part in (
            ("in_proj_qkv", g * dk, (g + 1) * dk),
            ("in_proj_qkv", (groups + g) * dk, (groups + g + 1) * dk),
            ("in_proj_qkv", v + g * dv, v + (g + 1) * dv),
            ("in_proj_z", g * dv, (g + 1) * dv),
        )
    ]
    ba = [
        (proj, g * per_group, (g + 1) * per_group)
        for g in range(groups)
        for proj in ("in_proj_b", "in_proj_a")
    ]
    return {"in_proj_qkvz": qkvz, "in_proj_ba": ba}


def _rows_in(layout: Layout, proj: str) -> tuple[int, ...]:
    """The rows of the fused tensor that hold `proj`, in `proj`'s order."""
    out, at = [], 0
    for name, start, stop in layout:
        if name == proj:
            out.extend(range(at, at + stop - start))
        at += stop - start
    return tuple(out)


@dataclass(frozen=True)
class PlannedTensor:
    """One HF checkpoint tensor and where it comes from in the GGUF."""

    hf_name: str
    shape: tuple[int, ...]
    source: int  # index into reader.tensors
    expert: int | None = None  # slice of a stacked [n_expert, ...] tensor
    offset: float = 0.0  # subtracted after dequantization (norms stored as w + 1)
    v_heads: VHeadOrder | None = None  # value heads stored tiled (Qwen3.5)
    negated_exp: bool = False  # stored as -exp(x) (Qwen3.5's A_log)
    rows: tuple[int, ...] | None = None  # only these rows of the source (in the checkpoint's order)

    def row_index(self, length: int) -> np.ndarray | None:
        """For each row, its row in the stored source of `length` rows; None where they are the same. Whole
        rows move, so quantized blocks follow exactly."""
        index = self.v_heads.index(length) if self.v_heads is not None and self.v_heads.axis == 0 else None
        if self.rows is not None:
            index = np.asarray(self.rows) if index is None else index[list(self.rows)]
        return index


def _row_range(p: PlannedTensor, start: int, stop: int) -> PlannedTensor:
    """Rows [start, stop) of a planned tensor, planned as a tensor of their own (a part of a fused one)."""
    rows = (range(p.shape[0]) if p.rows is None else p.rows)[start:stop]
    return replace(p, shape=(stop - start, *p.shape[1:]), rows=tuple(rows))


def plan_tensors(reader) -> list[PlannedTensor]:
    """HF name, shape and source of every output tensor; raises on a GGUF tensor we do not know."""
    meta = Meta(reader)
    arch = meta.arch
    layer_map = _LAYER_BY_ARCH[arch]
    mtp_from = int(meta.require("block_count")) - int(meta.arch_key("nextn_predict_layers") or 0)
    v_heads = _v_head_orders(meta)
    layouts = _qwen3_next_layouts(meta)
    plan: list[PlannedTensor] = []

    def unknown(name: str) -> SpecserveError:
        return SpecserveError(f"GGUF tensor {name!r} has no HF counterpart for architecture {arch!r}")

    for idx, t in enumerate(reader.tensors):
        if t.name in _CONFIG_TENSORS.get(arch, ()):
            continue
        shape = tuple(int(d) for d in reversed(list(t.shape)))  # GGUFReader's array or GGUFHeader's list
        plus_one = t.name.endswith("norm.weight") and not t.name.endswith("ssm_norm.weight")
        offset = 1.0 if arch in _PLUS_ONE_NORMS and plus_one else 0.0
        if m := _BLOCK_RE.match(t.name):
            layer, leaf, kind = int(m.group(1)), m.group(2), m.group(3)
            prefix = f"model.layers.{layer}" if layer < mtp_from else f"mtp.layers.{layer - mtp_from}"
            planned = dict(source=idx, offset=offset, v_heads=v_heads.get(leaf))
            if param := _PARAMETERS.get(arch, {}).get((leaf, kind)):
                plan.append(PlannedTensor(f"{prefix}.{param}", shape, **planned, negated_exp=leaf == "ssm_a"))
            elif (leaf in _EXPERT_LEAVES or leaf == _FUSED_EXPERT_LEAF) and "ffn_gate_inp" in layer_map:
                experts = f"{prefix}.{_EXPERTS_IN_LAYER.get(arch, 'mlp.experts')}"
                plan.extend(_planned_experts(experts, leaf, kind, shape, idx))
            elif leaf in _MTP and layer >= mtp_from:
                plan.append(PlannedTensor(f"{_MTP[leaf]}.{kind}", shape, **planned))
            elif leaf == "ssm_ba" and layouts:  # kept fused: the model's in_proj_b and in_proj_a are its rows
                for proj in ("in_proj_b", "in_proj_a"):
                    rows = _rows_in(layouts["in_proj_ba"], proj)
                    name = f"{prefix}.linear_attn.{proj}.{kind}"
                    plan.append(PlannedTensor(name, (len(rows), *shape[1:]), **planned, rows=rows))
            elif leaf in layer_map and kind is not None:
                if leaf == "ssm_conv1d":  # the converter squeezed [channels, 1, kernel]
                    shape = (shape[0], 1, shape[1])
                plan.append(PlannedTensor(f"{prefix}.{layer_map[leaf]}.{kind}", shape, **planned))
            else:
                raise unknown(t.name)
        elif (m := _TOP_RE.match(t.name)) and m.group(1) in _TOP_LEVEL:
            plan.append(PlannedTensor(f"{_TOP_LEVEL[m.group(1)]}.{m.group(2)}", shape, idx, offset=offset))
        else:
            raise unknown(t.name)
    return plan


def _planned_experts(
    experts: str, leaf: str, kind: str, shape: tuple[int, ...], source: int
) -> Iterator[PlannedTensor]:
    """Each expert's tensors of a stacked [n_expert, ...] GGUF tensor; a fused gate|up one gives each
    expert's gate and up projections as row ranges of its part."""
    width = shape[1] // 2
    for e in range(shape[0]):
        if leaf != _FUSED_EXPERT_LEAF:
            yield PlannedTensor(f"{experts}.{e}.{_EXPERT_LEAVES[leaf]}.{kind}", shape[1:], source, expert=e)
            continue
        for proj, rows in (("gate_proj", range(width)), ("up_proj", range(width, 2 * width))):
            name = f"{experts}.{e}.{proj}.{kind}"
            yield PlannedTensor(name, (width, *shape[2:]), source, expert=e, rows=tuple(rows))


def undo_conversion(p: PlannedTensor, arr: np.ndarray) -> np.ndarray:
    """The checkpoint's tensor from its dequantized GGUF form: what llama.cpp's converter did, undone."""
    if (rows := p.row_index(arr.shape[0])) is not None:
        arr = arr[rows]
    if p.v_heads is not None and p.v_heads.axis == 1:
        arr = np.take(arr, p.v_heads.index(arr.shape[1]), axis=1)
    if p.offset:
        arr = arr - np.float32(p.offset)
    if p.negated_exp:
        arr = np.log(-arr)
    return np.ascontiguousarray(arr, dtype=np.float32).reshape(p.shape)


@dataclass(frozen=True)
class CheckpointTensor:
    """A tensor of the written checkpoint: one planned tensor, or several (or row ranges of them, planned as
    tensors of their own: `_row_range`) written one after another."""

    name: str
    shape: tuple[int, ...]
    parts: tuple[PlannedTensor, ...]

    @property
    def nbytes(self) -> int:
        return 4 * math.prod(self.shape)


_EXPERT_RE = re.compile(r"^(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def checkpoint_tensors(plan: list[PlannedTensor], meta: Meta) -> list[CheckpointTensor]:
    """The tensors the checkpoint holds, in plan order. Qwen3.5-MoE's and Gemma 4's hold each layer's
    routed experts as two: gate_up_proj [experts, 2 x width, hidden] (each expert's gate rows, then its up
    rows) and down_proj [experts, hidden, width]; transformers reads no other form of them. Qwen3-Next's
    hold its fused projections (`_qwen3_next_layouts`)."""
    if meta.arch == "qwen3next":
        return _fused_projections(plan, _qwen3_next_layouts(meta))
    if meta.arch not in _STACKED_EXPERTS:
        return [CheckpointTensor(p.hf_name, p.shape, (p,)) for p in plan]
    experts: dict[str, dict[str, list[PlannedTensor]]] = {}
    order: list[CheckpointTensor | str] = []
    for p in plan:
        if m := _EXPERT_RE.match(p.hf_name):
            if m.group(1) not in experts:
                order.append(m.group(1))
            experts.setdefault(m.group(1), {}).setdefault(m.group(3), []).append(p)
        else:
            order.append(CheckpointTensor(p.hf_name, p.shape, (p,)))
    out: list[CheckpointTensor] = []
    for item in order:
        if isinstance(item, CheckpointTensor):
            out.append(item)
            continue
        gate, up, down = (experts[item][proj] for proj in ("gate", "up", "down"))
        (width, hidden), n = gate[0].shape, len(gate)
        pairs = tuple(p for e in range(n) for p in (gate[e], up[e]))
        out.append(CheckpointTensor(f"{item}.gate_up_proj", (n, 2 * width, hidden), pairs))
        out.append(CheckpointTensor(f"{item}.down_proj", (n, hidden, width), tuple(down)))
    return out


def _fused_projections(plan: list[PlannedTensor], layouts: dict[str, Layout]) -> list[CheckpointTensor]:
    """Each fused linear-attention projection from row ranges of the planned ones (in the place of its first
    part); the other planned tensors as they are."""
    by_name = {p.hf_name: p for p in plan}
    fused_at = {layout[0][0]: fused for fused, layout in layouts.items()}
    fused_parts = {proj for layout in layouts.values() for proj, _, _ in layout}
    out: list[CheckpointTensor] = []
    for p in plan:
        prefix, _, leaf = p.hf_name.rpartition("linear_attn.")
        proj, _, kind = leaf.partition(".")
        if proj not in fused_parts:
            out.append(CheckpointTensor(p.hf_name, p.shape, (p,)))
        elif fused := fused_at.get(proj):
            parts = tuple(
                _row_range(by_name[f"{prefix}linear_attn.{part}.{kind}"], start, stop)
                for part, start, stop in layouts[fused]
            )
            shape = (sum(part.shape[0] for part in parts), *p.shape[1:])
            out.append(CheckpointTensor(f"{prefix}linear_attn.{fused}.{kind}", shape, parts))
    return out


DEQUANTIZE_ROWS = 4096  # rows dequantized at once: gguf's numpy dequantizers hold a few temporaries


def dequantize_tensor(tensor) -> np.ndarray:
    """A GGUF tensor as float32 in HF (row-major, outermost-first) shape, in an array of its own (no view of
    the file), dequantized a block of rows at a time so that the temporaries stay small."""
    shape = tuple(int(d) for d in reversed(list(tensor.shape)))
    # torch's allocator: aligned as a parameter of its own would be, so that loading can adopt it
    out = torch.empty(math.prod(shape[:-1]), shape[-1]).numpy()
    start = 0
    for block in dequantized_row_blocks(tensor.data, tensor.ggml_type):
        out[start : start + len(block)] = block
        start += len(block)
    return out.reshape(shape)


def dequantized_row_blocks(raw: np.ndarray, ggml_type) -> Iterator[np.ndarray]:
    """A GGUF tensor's (or an expert's) rows as float32 [rows, columns] blocks of DEQUANTIZE_ROWS each."""
    from gguf.quants import dequantize

    rows = raw.reshape(-1, raw.shape[-1]) if raw.ndim > 1 else raw[None]
    for start in range(0, rows.shape[0], DEQUANTIZE_ROWS):
        block = rows[start : start + DEQUANTIZE_ROWS]
        yield np.array(dequantize(block, ggml_type), dtype=np.float32).reshape(len(block), -1)  # a copy


def iter_converted(reader, plan: list[PlannedTensor]) -> Iterator[tuple[PlannedTensor, np.ndarray]]:
    """Dequantized, un-transformed arrays in plan order. The last two source tensors stay dequantized, so
    that a plan alternating between two (a fused checkpoint tensor's parts) dequantizes each once."""
    cached: dict[int, np.ndarray] = {}
    for p in plan:
        if p.source not in cached:
            if len(cached) == 2:
                del cached[next(iter(cached))]
            cached[p.source] = dequantize_tensor(reader.tensors[p.source])
        arr = cached[p.source]
        yield p, undo_conversion(p, arr if p.expert is None else arr[p.expert])
