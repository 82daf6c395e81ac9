"""GGUF -> HF-format directory (config.json + tokenizer, fp32 safetensors on first need), cached.

The engine only loads HF-format directories (fast: mmap'd safetensors). A GGUF file is turned into one
here: the config is rebuilt from the GGUF metadata and the tokenizer built once by transformers from the
GGUF (`convert_gguf`). The fp32 weights come later, when a load first needs them (`ensure_fp32_weights`):
every tensor is dequantized with `gguf.quants.dequantize`, renamed to its HF checkpoint name and
un-transformed where llama.cpp's `convert_hf_to_gguf.py` transformed it, then streamed into fp32
safetensors. A quantized load reads the GGUF itself (below) and never needs them: a Q4_K_M file of a 30B
mixture of experts (18 GB) would otherwise first become 120 GB of fp32 on disk.

The GGUF's tensors in checkpoint terms (names; llama.cpp's transforms, undone) are `models/gguf_tensors.py`'s;
quantized loading, which reads the file's blocks, is `models/gguf_quantized.py`'s. The file is read through
`models/gguf_header.py`'s lazy reader (no walk over the 150k-260k token strings, which costs `GGUFReader`
7-11 s here; transformers still makes one, building the tokenizer); cached directories are found without
opening the GGUF at all.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specserve.cache_dir import cache_root, file_lock
from specserve.config import SpecserveError
from specserve.models.gguf_header import GGUFHeader
from specserve.models.gguf_tensors import (
    HYBRID_ARCHS,
    CheckpointTensor,
    Meta,
    PlannedTensor,
    checkpoint_tensors,
    iter_converted,
    plan_tensors,
)

# Bump when the conversion output changes, so stale caches are rebuilt rather than trusted.
CONVERTER_VERSION = 1
MARKER_FILE = "specserve_conversion.json"
DEFAULT_MAX_SHARD_BYTES = 2 << 30

SUPPORTED_ARCHS = ("gemma3", "gemma4", "qwen2", "qwen3", "qwen3moe", "qwen3next", "qwen35", "qwen35moe")

# Tokens llama.cpp also treats as end-of-generation (it matches them by text): Gemma 4's end of turn, and its
# tool call's end (the tool answers next), which the converter marks user-defined rather than control.
_EOG_TEXTS = (
    "<|im_end|>",
    "<|endoftext|>",
    "<end_of_turn>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<turn|>",
    "<|tool_response>",
)
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type


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


def _f32(value: float) -> float:
    """A float32 from the file as the short decimal it was written from (9.99999997e-07 -> 1e-06)."""
    return float(f"{float(value):.7g}")


def _rope_parameters(meta: Meta) -> dict[str, Any]:
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


def _special_ids(meta: Meta) -> dict[str, Any]:
    ids = {
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    return {k: int(v) for k, v in ids.items() if v is not None}


def eos_token_ids(meta: Meta) -> list[int]:
    """EOS plus the other end-of-generation control tokens (as llama.cpp and HF generation configs do)."""
    ids = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    out = [int(i) for i in ids if i is not None]
    tokens_field = meta.fields.get("tokenizer.ggml.tokens")
    types_field = meta.fields.get("tokenizer.ggml.token_type")
    if tokens_field is not None and types_field is not None:
        marked = [i for i, t in enumerate(types_field.contents()) if t in (_CONTROL, _USER_DEFINED)]
        tokens = tokens_field.contents() if marked else []  # a lazy reader walks the whole array per read
        out += [i for i in marked if tokens[i] in _EOG_TEXTS and i not in out]
    return out


def _vocab_size(reader) -> int:
    for t in reader.tensors:
        if t.name == "token_embd.weight":
            return int(t.shape[1])
    raise SpecserveError("GGUF file has no token_embd.weight")


def build_hf_config(reader):
    """A transformers config for the model in `reader` (architecture names and model types as on the hub)."""
    meta = Meta(reader)
    arch = meta.arch
    if arch not in SUPPORTED_ARCHS:
        raise SpecserveError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHS)}"
        )
    names = {t.name for t in reader.tensors}
    layers = int(meta.require("block_count"))
    heads = int(meta.require("attention.head_count"))
    common: dict[str, Any] = {
        "vocab_size": _vocab_size(reader),
        "hidden_size": int(meta.require("embedding_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": _layer_values(meta, "attention.head_count_kv", layers, heads)[0],
        "max_position_embeddings": int(meta.require("context_length")),
        "rms_norm_eps": _f32(meta.require("attention.layer_norm_rms_epsilon")),
        # llama.cpp writes the output projection only when it is not the embedding matrix.
        "tie_word_embeddings": "output.weight" not in names,
        "dtype": "float32",
        **_special_ids(meta),
    }
    if meta.arch_key("feed_forward_length") is not None:
        common["intermediate_size"] = _layer_values(meta, "feed_forward_length", layers)[0]
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
    if arch in HYBRID_ARCHS:
        return _qwen35_config(meta, common, head_dim)
    if arch == "gemma4":
        return _gemma4_config(meta, common, reader)
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


def _layer_values(meta: Meta, key: str, layers: int, default: int | None = None) -> list[int]:
    """A key's value for each layer: llama.cpp writes an array where layers differ (Gemma 4's KV heads and
    MLP widths), one value where they do not."""
    value = meta.arch_key(key, default)
    if value is None:
        meta.require(key)
    values = [int(v) for v in value] if isinstance(value, list) else [int(value)] * layers
    if len(values) != layers:
        raise SpecserveError(f"GGUF metadata {meta.arch}.{key} has {len(values)} values for {layers} layers")
    return values


def _one_per_kind(values: list[int], kinds: list[str], what: str) -> dict[str, int]:
    """The value each kind of layer shares (the config has one per kind)."""
    out: dict[str, int] = {}
    for value, kind in zip(values, kinds):
        if out.setdefault(kind, value) != value:
            raise SpecserveError(f"GGUF file: its {kind} layers differ in {what}, which is not supported")
    return out


def _rotated_fraction(reader, head_dim: int) -> float:
    """The fraction of a global layer's head that RoPE turns. llama.cpp's converter stores Gemma 4's
    proportional RoPE as full-width RoPE whose frequencies are divided by `rope_freqs`: 1 for the pairs it
    turns, 1e30 (a standstill) for the rest."""
    tensor = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if tensor is None:
        raise SpecserveError("GGUF file lacks rope_freqs.weight (the global layers' RoPE)")
    if int(tensor.tensor_type) != 0:  # F32, as the converter writes every 1-D tensor
        raise SpecserveError(f"GGUF tensor rope_freqs.weight is of type {int(tensor.tensor_type)}, not F32")
    factors = np.asarray(tensor.data, dtype=np.float32).reshape(-1)
    turned = int(np.sum(factors == 1.0))
    if len(factors) != head_dim // 2 or not (factors[turned:] >= 1e29).all():
        raise SpecserveError(
            "GGUF tensor rope_freqs.weight is not proportional RoPE's factors (1 on the first pairs, 1e30 on "
            f"the rest, {head_dim // 2} in all)"
        )
    return 2 * turned / head_dim


def _gemma4_config(meta: Meta, common: dict[str, Any], reader):
    """Gemma 4 (E2B, E4B, 26B-A4B, 31B), as llama.cpp's converter writes it: the layer kinds as a sliding
    pattern, the global layers' head dim and KV heads as the plain keys and the sliding ones' as `_swa` keys
    or per-layer arrays, the last `shared_kv_layers` layers reading earlier layers' KV (no K/V of their own),
    their double-wide MLPs as per-layer widths. A global layer without V projection takes V from K."""
    from transformers import Gemma4TextConfig

    layers = common["num_hidden_layers"]
    pattern = meta.require("attention.sliding_window_pattern")
    if not isinstance(pattern, list) or len(pattern) != layers:
        raise SpecserveError(
            "GGUF metadata gemma4.attention.sliding_window_pattern: one flag per layer expected"
        )
    kinds = ["sliding_attention" if swa else "full_attention" for swa in pattern]
    head_dims = {
        "full_attention": int(meta.require("attention.key_length")),
        "sliding_attention": int(meta.require("attention.key_length_swa")),
    }
    if meta.arch_key("rope.scaling.type", "none") != "none":
        raise SpecserveError("GGUF file: RoPE scaling on Gemma 4 is not supported")
    for kind, dims in (("full_attention", ""), ("sliding_attention", "_swa")):
        if int(meta.arch_key(f"rope.dimension_count{dims}") or head_dims[kind]) != head_dims[kind]:
            raise SpecserveError(f"GGUF file: RoPE on part of the {kind} layers' heads is not supported")
    kv_heads = _one_per_kind(
        _layer_values(meta, "attention.head_count_kv", layers, common["num_attention_heads"]),
        kinds,
        "KV heads",
    )
    shared = int(meta.arch_key("attention.shared_kv_layers") or 0)
    widths = _layer_values(meta, "feed_forward_length", layers)
    width = widths[0]
    double_wide = widths != [width] * layers
    if double_wide and widths != [width * (1 if i < layers - shared else 2) for i in range(layers)]:
        raise SpecserveError("GGUF file: MLP widths other than double-wide in the KV-shared layers")
    names = {t.name for t in reader.tensors}
    has_v = {
        f"blk.{i}.attn_v.weight" in names for i in range(layers - shared) if kinds[i] == "full_attention"
    }
    if len(has_v) > 1:
        raise SpecserveError("GGUF file: some of its global layers have a V projection and some do not")
    per_layer = {"hidden_size_per_layer_input": int(meta.arch_key("embedding_length_per_layer_input") or 0)}
    for t in reader.tensors:
        if t.name == "per_layer_token_embd.weight":
            per_layer["vocab_size_per_layer_input"] = int(t.shape[-1])
    experts = int(meta.arch_key("expert_count") or 0)
    moe: dict[str, Any] = {"enable_moe_block": experts > 0}
    if experts:
        moe.update(
            num_experts=experts,
            top_k_experts=int(meta.require("expert_used_count")),
            moe_intermediate_size=int(meta.require("expert_feed_forward_length")),
        )
    full = {"head_dim": head_dims["full_attention"], "num_key_value_heads": kv_heads.get("full_attention")}
    return Gemma4TextConfig(
        architectures=["Gemma4ForCausalLM"],
        **{
            **common,
            "intermediate_size": width,
            "num_key_value_heads": kv_heads.get("sliding_attention", common["num_key_value_heads"]),
        },
        head_dim=head_dims["sliding_attention"],
        layer_types=kinds,
        per_layer_config={i: full for i, kind in enumerate(kinds) if kind == "full_attention"},
        sliding_window=int(meta.require("attention.sliding_window")),
        rope_parameters={
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": _rotated_fraction(reader, head_dims["full_attention"]),
                "rope_theta": _f32(meta.require("rope.freq_base")),
            },
            "sliding_attention": {
                "rope_type": "default",
                "rope_theta": _f32(meta.arch_key("rope.freq_base_swa", 10000.0)),
            },
        },
        final_logit_softcapping=meta.arch_key("final_logit_softcapping"),
        num_kv_shared_layers=shared,
        use_double_wide_mlp=double_wide,
        attention_k_eq_v=has_v == {False},
        **per_layer,
        **moe,
    )


def _qwen35_config(meta: Meta, common: dict[str, Any], head_dim):
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

    tensors = checkpoint_tensors(plan, Meta(reader))
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


# AutoTokenizer builds the model's config from the file only to pick the tokenizer's class, and transformers
# cannot build Gemma 4's (its per-layer KV heads and MLP widths fail the config's checks): the class, named.
_TOKENIZER_CLASSES = {"gemma4": "GemmaTokenizer"}


def write_tokenizer(gguf_path: Path, meta: Meta, out_dir: Path, say: Callable[[str], None]) -> bool:
    """Build the tokenizer from the GGUF with transformers (slow: seconds per 100k tokens) and save it;
    whether the file has one."""
    if meta.get("tokenizer.ggml.model") in (None, "no_vocab"):  # llama.cpp's models without a vocabulary
        return False
    import transformers

    say("building the tokenizer from the GGUF (slow, once)")
    tokenizer_class = getattr(transformers, _TOKENIZER_CLASSES.get(meta.arch, "AutoTokenizer"))
    try:
        tok = tokenizer_class.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except ValueError as exc:  # an older transformers knows no tokenizer of the architecture (qwen35 < 5.25)
        raise SpecserveError(
            f"{gguf_path.name}: transformers {transformers.__version__} cannot build its tokenizer ({exc}); "
            "a newer one can: pip install -U transformers"
        ) from None
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
            reader = GGUFHeader(gguf_path)
        except Exception as exc:  # struct errors on a header cut short, as well as ours
            raise SpecserveError(f"{gguf_path} is not a readable GGUF file: {exc}") from exc
        meta = Meta(reader)
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
    reader = GGUFHeader(gguf_path)
    plan = [p for p in plan_tensors(reader) if p.hf_name.startswith(prefix)]
    for p, arr in iter_converted(reader, plan):
        yield p.hf_name, torch.from_numpy(arr)


def ensure_fp32_weights(model_dir: Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
    """Write a GGUF conversion's fp32 safetensors if it has none yet (a load that reads fp32 weights, or
    transformers', needs them); any other directory is left as it is."""
    info = _marker(model_dir)
    if info is None or info.get("fp32_weights", True):  # conversions before this field wrote them at once
        return
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
        reader = GGUFHeader(source)
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


# ---------------------------------------------------------------------------------------------- sources


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF file a converted directory was made from, if it is still there at its recorded size."""
    if not is_converted(Path(model_dir)):
        return None
    info = json.loads((Path(model_dir) / MARKER_FILE).read_text())
    source = Path(info.get("source", ""))
    if source.is_file() and source.stat().st_size == info.get("source_bytes"):
        return source
    return None
