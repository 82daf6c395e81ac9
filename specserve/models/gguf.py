"""GGUF -> HF-format directory (config.json + tokenizer, fp32 safetensors on first need), cached.

The engine only loads HF-format directories (fast: mmap'd safetensors). A GGUF file is turned into one
here: the config is rebuilt from the GGUF metadata and the tokenizer built once by transformers from the
GGUF (`convert_gguf`). The fp32 weights come later, when a load first needs them (`ensure_fp32_weights`):
every tensor is dequantized with `gguf.quants.dequantize`, renamed to its HF checkpoint name and
un-transformed where llama.cpp's `convert_hf_to_gguf.py` transformed it, then streamed into fp32
safetensors. A quantized load reads the GGUF itself (below) and never needs them: a Q4_K_M file of a 30B
mixture of experts (18 GB) would otherwise first become 120 GB of fp32 on disk.

GGUF conventions that matter here (llama.cpp's converter; checked against transformers' GGUF loading):
- ggml shapes are innermost-first: `ReaderTensor.shape` is [in, out] for a Linear, and the dequantized
  numpy array comes out [out, in], already HF's order. Quantized `.data` is raw bytes [rows, row_bytes].
- Qwen2/Qwen3/Qwen3-MoE: no Q/K row permutation (only llama.cpp's LlamaModel permutes); biases are F32.
- Gemma 3: every `*norm.weight` (block norms, q/k norms, final norm) is stored as `w + 1`, because HF's
  Gemma3RMSNorm multiplies by `1 + w` and llama.cpp's by `w`. We subtract 1 again (in float32, exactly
  as transformers does, so (w + 1) - 1 may differ from w in the last bit: the file only has w + 1).
- Gemma 3: the sliding-window pattern (5 local : 1 global) and the local RoPE base (10,000) are not in
  the file; llama.cpp hard-codes both, so do we. The window size itself is (`attention.sliding_window`).
- Tied embeddings: llama.cpp writes `output.weight` only when the model has its own LM head. The two
  Qwen2.5-Coder files here DO carry `output.weight` although the HF originals are tied: it was quantized
  differently from `token_embd` (Q8_0 vs Q5_0, Q6_K vs Q4_K), so the two differ after dequantization and
  the converted model is untied (as transformers also loads it). Gemma 3 270M has none: tied.
- Qwen3-MoE experts are stacked into one [n_expert, ...] tensor per projection; we split them back into
  HF's per-expert checkpoint names (Qwen3.5-MoE's checkpoints fuse them again: `checkpoint_tensors`).
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
- Parsing a GGUF with `GGUFReader` costs 7-11 s here (it walks the 150k-260k token strings), so a
  conversion parses once; cached directories are found without opening the GGUF at all.

Quantized loading (`load_quantized`, used when the engine is asked for int8/int4) reads the linear
weights from the GGUF itself rather than from the fp32 conversion: Q8_0 blocks become int8 (their codes
and scales) and Q4_K blocks int4 (group 32, their own codes and two-level scales, exactly: the kernel's
int4 format is Q4_K's) without an fp32 copy of the tensor; other types (Q4_0 among them) are dequantized
in memory, one tensor at a time, and requantized. Rows put back in order (or picked: Qwen3-Next's ssm_ba)
move whole blocks (exact); columns put back (Qwen3.5's out_proj) cross them, so that weight is requantized.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specserve.cache_dir import cache_root, file_lock
from specserve.config import SpecserveError
from specserve.layers.quant import (
    Int4Linear,
    Int4Weights,
    Int8Linear,
    QuantizedLinear,
    quantizable_linears,
    quantize_row_blocks,
    replace_module,
)

# Bump when the conversion output changes, so stale caches are rebuilt rather than trusted.
CONVERTER_VERSION = 1
MARKER_FILE = "specserve_conversion.json"
DEFAULT_MAX_SHARD_BYTES = 2 << 30

SUPPORTED_ARCHS = ("gemma3", "qwen2", "qwen3", "qwen3moe", "qwen3next", "qwen35", "qwen35moe")
# llama.cpp stores these architectures' RMSNorm weights as w + 1 (their checkpoints scale by 1 + w, its norm
# by w); the gated norm of the linear-attention output (`ssm_norm`) scales by w and is stored as it is.
_PLUS_ONE_NORMS = ("gemma3", "qwen3next", "qwen35", "qwen35moe")
_HYBRID_ARCHS = ("qwen3next", "qwen35", "qwen35moe")
# Qwen3.5's converter (not Qwen3-Next's) stores the value heads tiled over the key heads (`VHeadOrder`).
_V_HEADS_TILED = ("qwen35", "qwen35moe")

# Control tokens llama.cpp also treats as end-of-generation (it matches them by text).
_EOG_TEXTS = ("<|im_end|>", "<|endoftext|>", "<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|end|>")


def converted_dir(key: str) -> Path:
    return cache_root() / "converted" / key


def _marker(path: Path) -> dict | None:
    """The conversion's record, or None where `path` is no finished conversion of this converter version."""
    marker = path / MARKER_FILE
    if not marker.is_file() or not (path / "config.json").is_file():
        return None
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    return info if info.get("converter_version") == CONVERTER_VERSION else None


def _write_marker(path: Path, info: dict) -> None:
    tmp = path / f".{MARKER_FILE}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(info, indent=2) + "\n")
    os.replace(tmp, path / MARKER_FILE)


def is_converted(path: Path) -> bool:
    """True for a finished conversion made by this converter version."""
    return _marker(path) is not None


def gguf_cache_key(gguf_path: Path) -> str:
    """`<stem>-<fingerprint>` from the size and the first and last MiB: cheap on every load (no full hash)."""
    size = gguf_path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(gguf_path, "rb") as fh:
        digest.update(fh.read(1 << 20))
        fh.seek(max(0, size - (1 << 20)))
        digest.update(fh.read(1 << 20))
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", gguf_path.stem)
    return f"{stem}-{digest.hexdigest()[:12]}"


def resolve_gguf(gguf_path: Path) -> Path:
    """The cached HF-format directory for a GGUF file, converting it on first use."""
    out = converted_dir(gguf_cache_key(gguf_path))
    if is_converted(out):
        return out
    return convert_gguf(gguf_path, out)


# --------------------------------------------------------------------------------------------- metadata


class _Meta:
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


def _f32(value: float) -> float:
    """A float32 from the file as the short decimal it was written from (9.99999997e-07 -> 1e-06)."""
    return float(f"{float(value):.7g}")


def _rope_parameters(meta: _Meta) -> dict[str, Any]:
    params: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": _f32(meta.arch_key("rope.freq_base", 10000.0)),
    }
    scaling = meta.arch_key("rope.scaling.type")
    if scaling and scaling != "none":
        params["rope_type"] = scaling
        params["factor"] = _f32(meta.arch_key("rope.scaling.factor", 1.0))
        original = meta.arch_key("rope.scaling.original_context_length")
        if original:
            params["original_max_position_embeddings"] = int(original)
    return params


def _special_ids(meta: _Meta) -> dict[str, Any]:
    ids = {
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    return {k: int(v) for k, v in ids.items() if v is not None}


def eos_token_ids(meta: _Meta) -> list[int]:
    """EOS plus the other end-of-generation control tokens (as llama.cpp and HF generation configs do)."""
    ids = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    out = [int(i) for i in ids if i is not None]
    tokens_field = meta.fields.get("tokenizer.ggml.tokens")
    types_field = meta.fields.get("tokenizer.ggml.token_type")
    if tokens_field is not None and types_field is not None:
        types = types_field.contents()
        for i, t in enumerate(types):
            if t == 3 and tokens_field.contents(i) in _EOG_TEXTS and i not in out:  # 3 = CONTROL
                out.append(i)
    return out


def _vocab_size(reader) -> int:
    for t in reader.tensors:
        if t.name == "token_embd.weight":
            return int(t.shape[1])
    raise SpecserveError("GGUF file has no token_embd.weight")


def build_hf_config(reader):
    """A transformers config for the model in `reader` (architecture names and model types as on the hub)."""
    meta = _Meta(reader)
    arch = meta.arch
    if arch not in SUPPORTED_ARCHS:
        raise SpecserveError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHS)}"
        )
    names = {t.name for t in reader.tensors}
    common: dict[str, Any] = {
        "vocab_size": _vocab_size(reader),
        "hidden_size": int(meta.require("embedding_length")),
        "num_hidden_layers": int(meta.require("block_count")),
        "num_attention_heads": int(meta.require("attention.head_count")),
        "num_key_value_heads": int(
            meta.arch_key("attention.head_count_kv") or meta.require("attention.head_count")
        ),
        "max_position_embeddings": int(meta.require("context_length")),
        "rms_norm_eps": _f32(meta.require("attention.layer_norm_rms_epsilon")),
        # llama.cpp writes the output projection only when it is not the embedding matrix.
        "tie_word_embeddings": "output.weight" not in names,
        "dtype": "float32",
        **_special_ids(meta),
    }
    if meta.arch_key("feed_forward_length") is not None:
        common["intermediate_size"] = int(meta.arch_key("feed_forward_length"))
    head_dim = meta.arch_key("attention.key_length")

    if arch == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(
            architectures=["Qwen2ForCausalLM"], rope_parameters=_rope_parameters(meta), **common
        )
    if arch == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(
            architectures=["Qwen3ForCausalLM"],
            rope_parameters=_rope_parameters(meta),
            head_dim=int(head_dim or common["hidden_size"] // common["num_attention_heads"]),
            **common,
        )
    if arch == "qwen3moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            architectures=["Qwen3MoeForCausalLM"],
            rope_parameters=_rope_parameters(meta),
            head_dim=int(head_dim or common["hidden_size"] // common["num_attention_heads"]),
            num_experts=int(meta.require("expert_count")),
            num_experts_per_tok=int(meta.require("expert_used_count")),
            moe_intermediate_size=int(meta.require("expert_feed_forward_length")),
            # llama.cpp renormalises the top-k router weights for qwen3moe (transformers' GGUF loader agrees).
            norm_topk_prob=True,
            **common,
        )
    if arch in _HYBRID_ARCHS:
        return _qwen35_config(meta, common, head_dim)
    # gemma3
    from transformers import Gemma3TextConfig

    head_dim = int(head_dim or 256)
    layers = common["num_hidden_layers"]
    # llama.cpp: f_attention_scale = 1/sqrt(n_embd/n_head) for the 27B, 1/sqrt(head_dim) otherwise.
    scalar = common["hidden_size"] // common["num_attention_heads"] if layers == 62 else head_dim
    return Gemma3TextConfig(
        architectures=["Gemma3ForCausalLM"],
        head_dim=head_dim,
        query_pre_attn_scalar=scalar,
        sliding_window=int(meta.arch_key("attention.sliding_window") or 4096),
        # Not stored in GGUF; llama.cpp hard-codes the 5:1 pattern and the 10k local base.
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)],
        rope_parameters={
            "full_attention": _rope_parameters(meta),
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        final_logit_softcapping=meta.arch_key("final_logit_softcapping"),
        attn_logit_softcapping=meta.arch_key("attn_logit_softcapping"),
        **common,
    )


def _qwen35_config(meta: _Meta, common: dict[str, Any], head_dim):
    """Qwen3.5 / Qwen3.6 (dense and MoE) and Qwen3-Next. llama.cpp appends the multi-token-prediction layers
    to the blocks (`nextn_predict_layers` of them, last; Qwen3-Next's converter drops them), keeps one
    full-attention layer in `full_attention_interval`, and stores the linear attention's shape under its
    `ssm.*` keys: the group count is the key heads, the time-step rank the value heads, the state size the
    key head dim, the inner size all value dims."""
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig

    mtp_layers = int(meta.arch_key("nextn_predict_layers") or 0)
    layers = common["num_hidden_layers"] - mtp_layers
    interval = int(meta.require("full_attention_interval"))
    head_dim = int(head_dim or common["hidden_size"] // common["num_attention_heads"])
    value_heads = int(meta.require("ssm.time_step_rank"))
    rope = _rope_parameters(meta)
    rope["partial_rotary_factor"] = int(meta.arch_key("rope.dimension_count") or head_dim) / head_dim
    sections = [int(s) for s in meta.arch_key("rope.dimension_sections") or []]
    if any(sections):  # multimodal RoPE: on text positions every section turns alike, as plain RoPE
        rope.update(mrope_section=sections[:3], mrope_interleaved=True)
    fields = {
        **common,
        "num_hidden_layers": layers,
        "layer_types": [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)
        ],
        "head_dim": head_dim,
        "rope_parameters": rope,
        "linear_conv_kernel_dim": int(meta.require("ssm.conv_kernel")),
        "linear_key_head_dim": int(meta.require("ssm.state_size")),
        "linear_num_key_heads": int(meta.require("ssm.group_count")),
        "linear_num_value_heads": value_heads,
        "linear_value_head_dim": int(meta.require("ssm.inner_size")) // value_heads,
        "mtp_num_hidden_layers": mtp_layers,
    }
    if meta.arch == "qwen35":
        return Qwen3_5TextConfig(architectures=["Qwen3_5ForCausalLM"], **fields)
    moe = {
        "num_experts": int(meta.require("expert_count")),
        "num_experts_per_tok": int(meta.require("expert_used_count")),
        "moe_intermediate_size": int(meta.require("expert_feed_forward_length")),
        "shared_expert_intermediate_size": int(meta.require("expert_shared_feed_forward_length")),
    }
    if meta.arch == "qwen35moe":
        return Qwen3_5MoeTextConfig(architectures=["Qwen3_5MoeForCausalLM"], **moe, **fields)
    # not a Qwen3-Next field (its checkpoints' MTP layer is not in the file)
    del fields["mtp_num_hidden_layers"]
    # llama.cpp's qwen3next routes every layer (no dense `mlp_only_layers`) and renormalises the top k.
    return Qwen3NextConfig(
        architectures=["Qwen3NextForCausalLM"], norm_topk_prob=True, mlp_only_layers=[], **moe, **fields
    )


# ---------------------------------------------------------------------------------------------- tensors

_TOP_LEVEL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
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
_LAYER_BY_ARCH = {
    "qwen2": {**_LAYER_COMMON, "ffn_norm": "post_attention_layernorm"},
    "qwen3": {**_LAYER_COMMON, "ffn_norm": "post_attention_layernorm"},
    "qwen3moe": {**_LAYER_COMMON, "ffn_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.gate"},
    # Gemma 3 has four norms per block; llama.cpp's names shift by one relative to HF's.
    "gemma3": {
        **_LAYER_COMMON,
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
    "qwen35": _QWEN35,
    "qwen35moe": _QWEN35_MOE,
    "qwen3next": _QWEN35_MOE,  # and `ssm_ba`, fused (`_qwen3_next_layouts`)
}
# Block tensors that are parameters of their own (no `.weight` of a module), by (name, kind) in the block.
_PARAMETERS = {("ssm_a", None): "linear_attn.A_log", ("ssm_dt", "bias"): "linear_attn.dt_bias"}
# The multi-token-prediction blocks llama.cpp appends (Qwen3.5): their own tensors, by the checkpoint's names.
_MTP = {
    "nextn.eh_proj": "mtp.fc",
    "nextn.enorm": "mtp.pre_fc_norm_embedding",
    "nextn.hnorm": "mtp.pre_fc_norm_hidden",
    "nextn.shared_head_norm": "mtp.norm",
}
_EXPERT_LEAVES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
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


def _v_head_orders(meta: _Meta) -> dict[str, VHeadOrder]:
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


def _qwen3_next_layouts(meta: _Meta) -> dict[str, Layout]:
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
    meta = _Meta(reader)
    arch = meta.arch
    layer_map = _LAYER_BY_ARCH[arch]
    mtp_from = int(meta.require("block_count")) - int(meta.arch_key("nextn_predict_layers") or 0)
    v_heads = _v_head_orders(meta)
    layouts = _qwen3_next_layouts(meta)
    plan: list[PlannedTensor] = []

    def unknown(name: str) -> SpecserveError:
        return SpecserveError(f"GGUF tensor {name!r} has no HF counterpart for architecture {arch!r}")

    for idx, t in enumerate(reader.tensors):
        shape = tuple(int(d) for d in reversed(list(t.shape)))  # GGUFReader's array or GGUFHeader's list
        plus_one = t.name.endswith("norm.weight") and not t.name.endswith("ssm_norm.weight")
        offset = 1.0 if arch in _PLUS_ONE_NORMS and plus_one else 0.0
        if m := _BLOCK_RE.match(t.name):
            layer, leaf, kind = int(m.group(1)), m.group(2), m.group(3)
            prefix = f"model.layers.{layer}" if layer < mtp_from else f"mtp.layers.{layer - mtp_from}"
            planned = dict(source=idx, offset=offset, v_heads=v_heads.get(leaf))
            if leaf in _EXPERT_LEAVES and "ffn_gate_inp" in layer_map:
                for e in range(shape[0]):
                    name = f"{prefix}.mlp.experts.{e}.{_EXPERT_LEAVES[leaf]}.{kind}"
                    plan.append(PlannedTensor(name, shape[1:], idx, expert=e))
            elif leaf in _MTP and layer >= mtp_from:
                plan.append(PlannedTensor(f"{_MTP[leaf]}.{kind}", shape, **planned))
            elif leaf == "ssm_ba" and layouts:  # kept fused: the model's in_proj_b and in_proj_a are its rows
                for proj in ("in_proj_b", "in_proj_a"):
                    rows = _rows_in(layouts["in_proj_ba"], proj)
                    name = f"{prefix}.linear_attn.{proj}.{kind}"
                    plan.append(PlannedTensor(name, (len(rows), *shape[1:]), **planned, rows=rows))
            elif arch in _HYBRID_ARCHS and (param := _PARAMETERS.get((leaf, kind))):
                plan.append(PlannedTensor(f"{prefix}.{param}", shape, **planned, negated_exp=leaf == "ssm_a"))
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


_EXPERT_RE = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def checkpoint_tensors(plan: list[PlannedTensor], meta: _Meta) -> list[CheckpointTensor]:
    """The tensors the checkpoint holds, in plan order. Qwen3.5-MoE's hold each layer's routed experts as
    two: gate_up_proj [experts, 2 x width, hidden] (each expert's gate rows, then its up rows) and
    down_proj [experts, hidden, width]; transformers reads no other form of them. Qwen3-Next's hold its
    fused projections (`_qwen3_next_layouts`)."""
    if meta.arch == "qwen3next":
        return _fused_projections(plan, _qwen3_next_layouts(meta))
    if meta.arch != "qwen35moe":
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
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    # torch's allocator: aligned as a parameter of its own would be, so that loading can adopt it
    out = torch.empty(math.prod(shape[:-1]), shape[-1]).numpy()
    start = 0
    for block in dequantized_row_blocks(tensor.data, tensor.tensor_type):
        out[start : start + len(block)] = block
        start += len(block)
    return out.reshape(shape)


def dequantized_row_blocks(raw: np.ndarray, tensor_type) -> Iterator[np.ndarray]:
    """A GGUF tensor's (or an expert's) rows as float32 [rows, columns] blocks of DEQUANTIZE_ROWS each."""
    from gguf.quants import dequantize

    rows = raw.reshape(-1, raw.shape[-1]) if raw.ndim > 1 else raw[None]
    for start in range(0, rows.shape[0], DEQUANTIZE_ROWS):
        block = rows[start : start + DEQUANTIZE_ROWS]
        yield np.array(dequantize(block, tensor_type), dtype=np.float32).reshape(len(block), -1)  # a copy


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


def _write_safetensors(
    path: Path, tensors: list[CheckpointTensor], arrays: Iterator[np.ndarray], on_bytes
) -> None:
    """Stream float32 tensors into a safetensors file: header from the planned shapes, then the bytes of
    each tensor's parts in order.

    Writing the header first lets us hold one tensor at a time instead of a whole shard in memory.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as fh:
        fh.write(len(blob).to_bytes(8, "little"))
        fh.write(blob)
        for part in (p for t in tensors for p in t.parts):
            arr = next(arrays)
            if arr.shape != part.shape:
                raise SpecserveError(f"{part.hf_name}: dequantized shape {arr.shape}, planned {part.shape}")
            arr.tofile(fh)
            on_bytes(arr.nbytes)


def _shard(tensors: list[CheckpointTensor], max_bytes: int) -> list[list[CheckpointTensor]]:
    shards: list[list[CheckpointTensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def write_weights(reader, plan: list[PlannedTensor], out_dir: Path, max_shard_bytes: int, desc: str) -> None:
    """fp32 safetensors (one file, or shards + model.safetensors.index.json as transformers writes them)."""
    from tqdm.auto import tqdm

    tensors = checkpoint_tensors(plan, _Meta(reader))
    shards = _shard(tensors, max_shard_bytes)
    total = sum(t.nbytes for t in tensors)
    arrays = (arr for _, arr in iter_converted(reader, [p for t in tensors for p in t.parts]))
    weight_map: dict[str, str] = {}
    with tqdm(total=total, unit="B", unit_scale=True, desc=desc) as bar:
        for i, items in enumerate(shards):
            fname = (
                "model.safetensors"
                if len(shards) == 1
                else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            )
            _write_safetensors(out_dir / fname, items, arrays, bar.update)
            weight_map.update({t.name: fname for t in items})
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


# -------------------------------------------------------------------------------------------- tokenizer


def write_tokenizer(gguf_path: Path, meta: _Meta, out_dir: Path, say: Callable[[str], None]) -> bool:
    """Build the tokenizer from the GGUF with transformers (slow: seconds per 100k tokens) and save it;
    whether the file has one."""
    if meta.get("tokenizer.ggml.model") in (None, "no_vocab"):  # llama.cpp's models without a vocabulary
        return False
    from transformers import AutoTokenizer

    say("building the tokenizer from the GGUF (slow, once)")
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    template = meta.get("tokenizer.chat_template")
    if template:
        tok.chat_template = template  # keep the GGUF's template verbatim
    tok.save_pretrained(str(out_dir))
    return True


# ------------------------------------------------------------------------------------------- conversion


def convert_gguf(
    gguf_path: Path,
    out_dir: Path,
    *,
    tokenizer: bool = True,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Convert `gguf_path` into `out_dir` (a HF-format directory without weights: `ensure_fp32_weights`
    writes them when a load needs them), atomically. Returns `out_dir`.

    Written into a temporary sibling directory and renamed into place at the end; a lock file keeps two
    processes from converting the same output at once (the second one then finds the finished directory).
    """
    from gguf import GGUFReader

    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    if not gguf_path.is_file():
        raise SpecserveError(f"GGUF file not found: {gguf_path}")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    say = progress or (lambda msg: print(f"[specserve] {msg}", flush=True))
    with file_lock(out_dir.parent / f".{out_dir.name}.lock"):
        if is_converted(out_dir):
            return out_dir
        for stale in out_dir.parent.glob(f".{out_dir.name}.tmp-*"):  # left by a killed run (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        start = time.perf_counter()
        say(f"converting {gguf_path.name} to {out_dir} (once; later loads reuse it)")
        try:
            reader = GGUFReader(str(gguf_path))
        except Exception as exc:  # the gguf package raises bare ValueError/struct errors on junk
            raise SpecserveError(f"{gguf_path} is not a readable GGUF file: {exc}") from exc
        meta = _Meta(reader)
        config = build_hf_config(reader)
        plan = plan_tensors(reader)
        tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            config.save_pretrained(str(tmp))
            eos = eos_token_ids(meta)
            gen: dict[str, Any] = dict(_special_ids(meta))
            if eos:
                gen["eos_token_id"] = eos if len(eos) > 1 else eos[0]
            (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
            has_tokenizer = False
            if tokenizer:
                has_tokenizer = write_tokenizer(gguf_path, meta, tmp, say)
            marker = {
                "converter_version": CONVERTER_VERSION,
                "source": str(gguf_path.resolve()),
                "source_bytes": gguf_path.stat().st_size,
                "architecture": meta.arch,
                "tensors": len(plan),
                "tokenizer": has_tokenizer,
                "seconds": round(time.perf_counter() - start, 1),
                "fp32_weights": False,
            }
            _write_marker(tmp, marker)
            if out_dir.exists():  # an incomplete or outdated conversion: replace it
                shutil.rmtree(out_dir)
            os.rename(tmp, out_dir)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        say(f"converted {gguf_path.name} in {time.perf_counter() - start:.0f} s")
    return out_dir


def _source_of_weights(model_dir: Path, info: dict) -> Path:
    source = gguf_source(model_dir)
    if source is None:
        raise SpecserveError(
            f"{model_dir} needs its fp32 weights from {info['source']}, which is gone or has changed "
            f"since it was converted: put the file back, or delete {model_dir} and load the GGUF again"
        )
    return source


def unwritten_weights_source(model_dir: Path) -> Path | None:
    """The GGUF to read a conversion's tensors from while its fp32 weights are not written (a quantized
    load never writes them); None for any other directory."""
    info = _marker(Path(model_dir))
    if info is None or info.get("fp32_weights", True):
        return None
    return _source_of_weights(Path(model_dir), info)


def iter_gguf_tensors(gguf_path: Path, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint tensors whose names start with `prefix`, read from the GGUF: dequantized, in fp32, the
    converter's transforms undone; stacked experts come one per expert (as `load_weights` takes them)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    plan = [p for p in plan_tensors(reader) if p.hf_name.startswith(prefix)]
    for p, arr in iter_converted(reader, plan):
        yield p.hf_name, torch.from_numpy(arr)


def ensure_fp32_weights(model_dir: Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
    """Write a GGUF conversion's fp32 safetensors if it has none yet (a load that reads fp32 weights, or
    transformers', needs them); any other directory is left as it is."""
    info = _marker(model_dir)
    if info is None or info.get("fp32_weights", True):  # conversions before this field wrote them at once
        return
    from gguf import GGUFReader

    with file_lock(model_dir.parent / f".{model_dir.name}.lock"):
        info = _marker(model_dir)
        if info.get("fp32_weights", True):  # another process wrote them meanwhile
            return
        for stale in model_dir.glob(".weights.tmp-*"):  # left by a killed run (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        source = _source_of_weights(model_dir, info)
        start = time.perf_counter()
        print(
            f"[specserve] writing the fp32 weights of {source.name} (once; later loads reuse them)",
            flush=True,
        )
        reader = GGUFReader(str(source))
        plan = plan_tensors(reader)
        tmp = model_dir / f".weights.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:  # written aside, moved in, recorded last: a killed run leaves files the next one replaces
            write_weights(reader, plan, tmp, max_shard_bytes, desc=f"dequantizing {source.name}")
            for stale in [*model_dir.glob("*.safetensors"), *model_dir.glob("model.safetensors.index.json")]:
                stale.unlink()
            for path in tmp.iterdir():
                os.replace(path, model_dir / path.name)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        _write_marker(model_dir, {**info, "fp32_weights": True})
        print(f"[specserve] wrote them in {time.perf_counter() - start:.0f} s", flush=True)


# ------------------------------------------------------------------------------------- quantized loading
# Block layouts (ggml's ggml-common.h; the tests check them against gguf.quants' own dequantization):
#   Q8_0: 32 weights in 34 bytes: fp16 d, 32 int8 codes; w = d * q.
#   Q4_K: 256 weights in 144 bytes: fp16 d, fp16 dmin, 12 bytes of eight 6-bit (scale, min) pairs, then 4
#         chunks of 32 bytes, chunk c holding sub-block 2c in its low nibbles and 2c + 1 in its high ones;
#         w = d * scale_j * q - dmin * min_j for sub-block j (32 weights).


def _fp16(raw: np.ndarray) -> np.ndarray:
    """[..., 2] bytes -> [...] float32."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def decode_q8_0(data: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 rows [N, row bytes] -> (q int8 [N, K], scales float32 [N, K / 32]) with w = q * scale."""
    blocks = data.reshape(data.shape[0], -1, 34)
    q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(data.shape[0], -1)
    return torch.from_numpy(q), torch.from_numpy(_fp16(blocks[..., :2]))


def _q4_k_scales_and_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 scale bytes of each Q4_K block -> 8 six-bit scales and 8 six-bit mins."""
    low, high, extra = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([low & 0x3F, (extra & 0x0F) | ((low >> 6) << 4)], axis=-1)
    mins = np.concatenate([high & 0x3F, (extra >> 4) | ((high >> 6) << 4)], axis=-1)
    return scales.astype(np.uint8), mins.astype(np.uint8)


def decode_q4_k(data: np.ndarray) -> Int4Weights:
    """Q4_K rows -> the same weight as `Int4Weights` (group 32, super-blocks of 8 groups): Q4_K's min is
    subtracted, -dmin * m, so the sub-minimums are the negated six-bit mins."""
    rows = data.shape[0]
    blocks = data.reshape(rows, -1, 144)
    d, dmin = _fp16(blocks[..., 0:2]), _fp16(blocks[..., 2:4])
    sub_scales, sub_mins = _q4_k_scales_and_mins(blocks[..., 4:16])
    chunks = blocks[..., 16:].reshape(rows, -1, 4, 1, 32)
    q = np.concatenate([chunks & 0x0F, chunks >> 4], axis=-2).reshape(rows, -1)
    return Int4Weights(
        torch.from_numpy(q),
        torch.from_numpy(d),
        torch.from_numpy(dmin),
        torch.from_numpy(sub_scales.reshape(rows, -1)),
        torch.from_numpy(-sub_mins.reshape(rows, -1).astype(np.int8)),
    )


def quantized_linear_from_gguf(
    tensor, plan: PlannedTensor, mode: str, bias, use_kernel: bool | None = None
) -> QuantizedLinear:
    """The quantized layer for one GGUF linear weight: from its blocks (rows put in order) when the format
    maps onto the mode and no column moves, else dequantized and requantized a block of rows at a time."""
    kind = tensor.tensor_type.name
    raw = tensor.data if plan.expert is None else tensor.data[plan.expert]
    if (rows := plan.row_index(raw.shape[0])) is not None:  # whole rows move: the blocks stay as they are
        raw = raw[rows]
    columns = None
    if plan.v_heads is not None and plan.v_heads.axis == 1:  # columns move across blocks: requantized
        columns = plan.v_heads.index(plan.shape[1])
    if columns is None and mode == "int8" and kind == "Q8_0":
        return Int8Linear(*decode_q8_0(raw), bias, use_kernel)
    if columns is None and mode == "int4" and kind == "Q4_K":
        return Int4Linear(decode_q4_k(raw), bias, use_kernel)
    blocks = (
        torch.from_numpy(block if columns is None else block[:, columns])
        for block in dequantized_row_blocks(raw, tensor.tensor_type)
    )
    return quantize_row_blocks(blocks, plan.shape, bias, mode, use_kernel=use_kernel)


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF file a converted directory was made from, if it is still there at its recorded size."""
    if not is_converted(Path(model_dir)):
        return None
    info = json.loads((Path(model_dir) / MARKER_FILE).read_text())
    source = Path(info.get("source", ""))
    if source.is_file() and source.stat().st_size == info.get("source_bytes"):
        return source
    return None


def load_quantized(
    gguf_path: Path, model, mode: str, use_kernel: bool | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Replace every quantizable linear layer of `model` (built, not yet loaded) by its quantized version
    read from the GGUF (`use_kernel`: the layers', as `quantize_model`'s), and return the remaining
    tensors, dequantized, for `model.load_weights`.

    A replaced layer's fp32 weight is never written, so (allocated uninitialised) it never takes memory.
    Layers the file does not hold (a head tied to the embedding) are left for `quantize_model`."""
    from gguf import GGUFReader
    from tqdm.auto import tqdm

    reader = GGUFReader(str(gguf_path))
    plan = plan_tensors(reader)
    targets = {f"{n}.weight": names for names in quantizable_linears(model, mode) for n in names}
    rest = []
    # slow where blocks are requantized (Q6_K, Q5_0: numpy); the result is cached (models/prepare.py)
    for p in tqdm(plan, desc=f"{mode} weights from {gguf_path.name}", unit="tensor", leave=False):
        names = targets.get(p.hf_name)
        if names is None:
            if model.checkpoint_name_map(p.hf_name) is not None:  # not the tensors it skips (`mtp.*`)
                rest.append(p)
            continue
        bias = model.get_submodule(names[0]).bias
        layer = quantized_linear_from_gguf(reader.tensors[p.source], p, mode, bias, use_kernel)
        replace_module(model, names, layer)
        release_pages(reader)
    return _as_tensors(reader, iter_converted(reader, rest))


def _as_tensors(
    reader, arrays: Iterator[tuple[PlannedTensor, np.ndarray]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The arrays as tensors for `load_weights`, which adopts those it can: an F32 tensor straight from the
    read-only memory map is copied."""
    for p, arr in arrays:
        yield p.hf_name, torch.from_numpy(arr if arr.flags.writeable else arr.copy())
        release_pages(reader)


def release_pages(reader) -> None:
    """Take the file's pages read so far out of this process's resident memory (the page cache keeps them,
    so a later read costs a minor fault): a memory map's pages count as the process's own until it is
    unmapped, which would add the whole file to the peak of a load."""
    mapped = getattr(reader.data, "_mmap", None)
    if mapped is not None and hasattr(mmap, "MADV_DONTNEED"):
        mapped.madvise(mmap.MADV_DONTNEED)
