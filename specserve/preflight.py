"""Checks made before any weight is read: everything that config.json, a GGUF header and the arguments
decide. A mistake then fails in seconds and a few hundred MB, not after minutes of loading (and of
converting, for a GGUF not converted yet).

What is checked: the model reference (local name, path, .gguf, hub id) and its architecture; tensor
parallelism against the head counts; `max_model_len` against the model's context; the KV budget against
`max_model_len` (the engine's own plan for the target's caches, on the model built on the meta device);
quantization against the architecture (some linear layer must take it); on the CPU, the weights as loaded
(quantized or not) and the cache budget against the machine's memory (RAM and swap, or a cgroup's limit):
a model that cannot fit at all is refused, not killed by the kernel minutes into its load; the drafter: a
draft model's name, vocabulary and tokenizer against the target's, a drafter checkpoint's presence, MTP's
target and weights, the draft length a hybrid target can verify.

`LLMEngine.from_args` runs these checks before it builds the engine (so `LLM`, the server and the
benchmarks), and the CLI before it imports the engine. A hub model that is not cached yet is checked once
downloaded (its config is part of the download).
"""

from __future__ import annotations

import json
from pathlib import Path

from specserve.config import EngineConfig, SpecserveError, SpeculativeConfig
from specserve.models.generation_config import DEFAULT_MAX_MODEL_LEN, context_length
from specserve.models.loader import ModelFiles, load_hf_config, locate_model
from specserve.models.registry import model_skeleton, text_config_of


def model_config(files: ModelFiles, revision: str | None = None):
    """The transformers config of a located model, read from config.json or the GGUF header; None for a
    hub model whose config is not cached."""
    if files.directory is not None:
        return load_hf_config(files.directory)
    if files.gguf_parts:
        from specserve.models.gguf import build_hf_config
        from specserve.models.gguf_header import GGUFHeader

        return build_hf_config(GGUFHeader(files.gguf_parts))
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(files.hub_id, "config.json", revision=revision)
    return load_hf_config(Path(cached).parent) if isinstance(cached, str) else None


def vocabulary(files: ModelFiles) -> dict[int, str] | None:
    """Token id -> token text from the tokenizer files without building the tokenizer (tokenizer.json's
    vocabulary and added tokens, or the GGUF's token list); None where neither is there."""
    if files.gguf_parts:
        from specserve.models.gguf_header import GGUFHeader

        tokens = GGUFHeader(files.gguf_parts).get("tokenizer.ggml.tokens")
        return dict(enumerate(tokens)) if tokens else None
    path = files.directory / "tokenizer.json" if files.directory is not None else None
    if path is None or not path.is_file():
        return None
    data = json.loads(path.read_text())
    vocab = {i: token for token, i in (data.get("model", {}).get("vocab") or {}).items()}
    vocab.update({added["id"]: added["content"] for added in data.get("added_tokens", [])})
    return vocab


def _skeleton(text_config, what: str):
    try:
        return model_skeleton(text_config)
    except ValueError as exc:  # an unsupported model_type
        raise SpecserveError(f"{what}: {exc}") from None


def check_before_loading(config: EngineConfig, speculative_config: SpeculativeConfig | None = None) -> None:
    """Raise SpecserveError on anything about `config` and `speculative_config` decidable without weights."""
    from specserve.core.cache_coordinator import plan_cache_memory
    from specserve.models.sharding import shard_config
    from specserve.worker.model_runner import cache_layout

    target_files = locate_model(config.model, need_weights=config.load_format != "dummy")
    hf_config = model_config(target_files, config.revision)
    if hf_config is None:  # a hub model not downloaded yet: the engine checks it after the download
        _check_drafter(speculative_config, None, None, None, config)
        return
    text = text_config_of(hf_config)
    max_model_len = effective_max_model_len(config, text)
    skeleton = _skeleton(shard_config(text, config.tensor_parallel_size), config.model)
    # The target's share of the budget alone (a drafter's needs are known once it is loaded; a GPU's
    # budget once the weights are on it).
    if config.kv_cache_bytes is not None:
        plan_cache_memory(
            cache_layout(skeleton, config.block_size, config.torch_dtype),
            config.kv_cache_bytes,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_model_len=max_model_len,
            enable_prefix_caching=config.enable_prefix_caching,
            budget_text=f"kv_cache_memory={config.kv_cache_memory!r}",
        )
    _check_quantization(skeleton, config.quantization, config.model)
    if not config.platform.is_cuda:
        _check_host_memory(skeleton, config)
    _check_drafter(speculative_config, target_files, text, skeleton, config)


def effective_max_model_len(config: EngineConfig, text_config) -> int:
    """`config.max_model_len`, or the model's context capped at DEFAULT_MAX_MODEL_LEN; never past the
    context."""
    context = context_length(text_config)
    max_model_len = config.max_model_len or min(context, DEFAULT_MAX_MODEL_LEN)
    if max_model_len > context:
        raise SpecserveError(f"max_model_len {max_model_len} exceeds the model's context length {context}")
    return max_model_len


def _check_quantization(skeleton, mode: str | None, model: str) -> None:
    from specserve.layers.quant import quantizable_linears

    if mode is not None and not any(True for _ in quantizable_linears(skeleton, mode)):
        raise SpecserveError(
            f"quantization {mode!r} applies to no linear layer of {model} (the kernels take weights with "
            "16 | out_features and a group size dividing in_features); drop --quantization"
        )


# Bits a weight of a quantized layer holds at least (int4: Q4_K's 4.5; int8: Q8_0's 8.5): an estimate that
# errs low, so that only a model that cannot fit is refused.
_QUANTIZED_BITS = {"int4": 4.5, "int8": 8.5}


def weight_bytes(skeleton, quantization: str | None, dtype) -> int:
    """What `skeleton`'s weights take once loaded: its quantized layers' (`quantization`) at their bits, the
    other parameters in `dtype` (a tied one once)."""
    import torch

    from specserve.layers.quant import quantizable_linears

    quantized = set()
    if quantization is not None:
        for names in quantizable_linears(skeleton, quantization):
            quantized.add(id(skeleton.get_submodule(names[0]).weight))
    size, tied, total = torch.empty((), dtype=dtype).element_size(), skeleton.tied_parameter_names(), 0.0
    for name, p in skeleton.named_parameters():
        if name not in tied:
            total += p.numel() * (_QUANTIZED_BITS[quantization] / 8 if id(p) in quantized else size)
    return int(total)


def host_memory_bytes() -> int | None:
    """The most memory this process can have: RAM and swap (/proc/meminfo), or its cgroup's limit where
    lower; None where neither can be read."""
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
        fields = (line.split(":", 1) for line in lines if ":" in line)
        kib = {key: int(value.split()[0]) for key, value in fields}
        total = (kib["MemTotal"] + kib.get("SwapTotal", 0)) * 1024
    except (OSError, KeyError, ValueError):
        return None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        return total
    return min(total, int(limit)) if limit.isdigit() else total


def _check_host_memory(skeleton, config: EngineConfig) -> None:
    """Weights (every tensor-parallel rank's) and the cache budget that exceed all of the machine's memory."""
    import torch

    available = host_memory_bytes()
    if available is None:
        return
    ranks, dtype, mode = config.tensor_parallel_size, config.torch_dtype, config.quantization
    weights = weight_bytes(skeleton, mode, dtype) * ranks
    if weights + (config.kv_cache_bytes or 0) <= available:
        return
    gib, way_out = 2**30, "a smaller model"
    int4 = weight_bytes(skeleton, "int4", torch.float32) * ranks  # int4 computes in fp32
    if mode != "int4" and int4 < weights:
        way_out = f"--quantization int4 (~{int4 / gib:.1f} GiB), or {way_out}"
    raise SpecserveError(
        f"{config.model}: its weights take ~{weights / gib:.1f} GiB as loaded ({mode or config.dtype}), and "
        f"the caches {(config.kv_cache_bytes or 0) / gib:.1f} GiB: more than this machine's memory "
        f"({available / gib:.1f} GiB of RAM and swap); use {way_out}"
    )


def _check_drafter(
    spec: SpeculativeConfig | None,
    target_files: ModelFiles | None,
    target_text,
    target_skeleton,
    config: EngineConfig,
) -> None:
    if spec is None:
        return
    if spec.method == "draft_model":
        _check_draft_model(spec, target_files, target_text, config.load_format)
    elif spec.model is not None:  # a drafter checkpoint (or a Gemma 4 assistant, under method 'mtp')
        locate_model(spec.model)  # a path that is not there, or a name that is nothing, fails here
    if target_text is None:
        return
    from specserve.models.qwen3_next import HybridQwenForCausalLM

    if spec.method == "mtp" and spec.model is None:  # the target's own layer
        _check_mtp(target_files, isinstance(target_skeleton, HybridQwenForCausalLM), config.model)
    if target_skeleton.has_recurrent_state and spec.num_speculative_tokens is not None:
        from specserve.layers.gated_deltanet import RECURRENT_MAX_LEN

        if spec.num_speculative_tokens + 1 > RECURRENT_MAX_LEN:
            raise SpecserveError(
                f"num_speculative_tokens={spec.num_speculative_tokens}: a hybrid target verifies at most "
                f"{RECURRENT_MAX_LEN - 1} drafts a round exactly"
            )


def _check_draft_model(
    spec: SpeculativeConfig, target_files: ModelFiles | None, target_text, load_format: str
) -> None:
    draft_files = locate_model(spec.model, need_weights=load_format != "dummy")
    draft_config = model_config(draft_files)
    if draft_config is None or target_text is None:
        return
    draft_text = text_config_of(draft_config)
    skeleton = _skeleton(draft_text, f"draft model {spec.model}")
    _check_quantization(skeleton, spec.quantization, f"draft model {spec.model}")
    if draft_text.vocab_size != target_text.vocab_size:
        raise SpecserveError(
            f"draft model {spec.model!r} has vocabulary size {draft_text.vocab_size}, the target has "
            f"{target_text.vocab_size}: a draft model must share the target's tokenizer"
        )
    # Both vocabularies read the same way (tokenizer files, or GGUF token lists): every id both name must
    # be the same token. (Read differently, the engine compares the loaded tokenizers.)
    if bool(draft_files.gguf_parts) == bool(target_files.gguf_parts):
        draft_vocab, target_vocab = vocabulary(draft_files), vocabulary(target_files)
        if draft_vocab and target_vocab:
            both = draft_vocab.keys() & target_vocab.keys()
            differ = [i for i in both if draft_vocab[i] != target_vocab[i]]
            if differ:
                i = min(differ)
                raise SpecserveError(
                    f"draft model {spec.model!r} has a different tokenizer vocabulary than the target "
                    f"({len(differ)} ids differ; id {i}: {draft_vocab[i]!r} against {target_vocab[i]!r})"
                )


def _check_mtp(target_files: ModelFiles, hybrid: bool, model: str) -> None:
    from specserve.models.qwen3_next import no_mtp_layer

    if not hybrid:
        raise SpecserveError(
            "method 'mtp' drafts with the multi-token-prediction layer of a Qwen3-Next / Qwen3.5 checkpoint; "
            f"{model} is not one"
        )
    names = _checkpoint_tensor_names(target_files)
    if names is not None and not any(name.startswith("mtp.") for name in names):
        raise SpecserveError(no_mtp_layer(model))


def _checkpoint_tensor_names(files: ModelFiles) -> list[str] | None:
    """Tensor names from the safetensors index or the files' headers (no tensor is read); a GGUF's (or a
    conversion's without its fp32 weights) are the checkpoint's names it converts to."""
    from specserve.models import gguf
    from specserve.models.gguf_header import GGUFHeader
    from specserve.models.gguf_tensors import plan_tensors

    source = files.gguf_parts or (files.directory and gguf.unwritten_weights_source(files.directory))
    if source:
        return [p.hf_name for p in plan_tensors(GGUFHeader(source))]
    if files.directory is None:
        return None
    index = files.directory / "model.safetensors.index.json"
    if index.is_file():
        return list(json.loads(index.read_text())["weight_map"])
    from safetensors import safe_open

    names = []
    for path in sorted(files.directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as fh:
            names += list(fh.keys())  # noqa: SIM118 (not a mapping)
    return names
