"""The speculators format (vllm-project/speculators; RedHatAI's published drafters).

config.json: `speculators_model_type`, the draft layers' config in `transformer_layer_config` (diff-only:
fields equal to its class's defaults are left out), `speculators_config` (algorithm, proposal methods with
their speculative token count, verifier), and per algorithm:
- eagle3: `eagle_aux_hidden_state_layer_ids`, `draft_vocab_size`, `norm_before_residual`, `norm_before_fc`,
  `fc_norm`, `norm_output`; the layer is a Llama layer (no q/k norms) or a Qwen3 one, after its model_type.
- dflash / dspark: `aux_hidden_state_layer_ids`, `block_size`, `mask_token_id`, `draft_vocab_size`,
  `sample_from_anchor` (false: slot 0 carries the anchor; DSpark's default true), `sliding_window_non_causal`;
  dspark adds `markov_rank`, `markov_head_type`, `enable_confidence_head`, `confidence_head_with_markov`;
  dflash2 adds `conv_kernel_size`, `conv_group_size`, `selector_rank`, `selector_top_k` (its blocks default
  to non-causal sliding-window layers).
  Their layers are Qwen3 layers whatever `transformer_layer_config.model_type` says.
Layer ids are vLLM's capture ids: id k is the input of target layer k, i.e. the output of layer k - 1.
Tensors are ours by name (`layers.*`, `fc`, `norm`, `hidden_norm`, `lm_head`, `markov_head.*`,
`confidence_head.proj`); `embed_tokens` is often left out and `lm_head` may be (full vocabulary only):
the target's are used. A pruned vocabulary carries `d2t` (target id = draft id + d2t) and `t2d`.
"""

from __future__ import annotations

from specserve.config import SpecserveError
from specserve.spec_decode.deepspec.config import DSparkConfig, Eagle3Config
from specserve.spec_decode.formats import (
    SHARED_WITH_TARGET,
    DrafterCheckpoint,
    check_attention_layout,
    field,
    layer_config,
    qwen3_backbone,
)

SUPPORTED = ("eagle3", "dflash", "dspark", "dflash2")
NOT_YET = {"peagle": "parallel EAGLE", "mtp": "a standalone MTP layer"}
# DFlash2's fields and speculators' defaults for them.
DFLASH2_DEFAULTS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}
# Flags of the EAGLE-3 layer specserve's EAGLE-3 drafter does not implement; each must be false.
_EAGLE3_UNSUPPORTED = ("norm_before_fc", "fc_norm", "norm_output")
_SKIPPED = ("verifier_lm_head.weight", "verifier_norm.weight")  # the trainer's copies; never saved normally


def _rename(name: str) -> str | None:
    return None if name in _SKIPPED or name.endswith("rotary_emb.inv_freq") else name


def parse_speculators(raw: dict, target_config, source: str) -> DrafterCheckpoint:
    kind = raw["speculators_model_type"]
    if kind in NOT_YET:
        raise SpecserveError(
            f"{source}: speculators_model_type {kind!r} ({NOT_YET[kind]}) is not supported; supported: "
            f"{', '.join(SUPPORTED)}"
        )
    if kind not in SUPPORTED:
        raise SpecserveError(
            f"{source}: unknown speculators_model_type {kind!r}; supported: {', '.join(SUPPORTED)}"
        )
    fields = field(raw, "transformer_layer_config", source)
    if not isinstance(fields, dict):
        raise SpecserveError(f"{source}: transformer_layer_config must be an object")
    layer = layer_config(fields, source, "transformer_layer_config.")
    backbone = qwen3_backbone(layer, source, "transformer_layer_config.")
    target_hidden = raw.get("target_hidden_size")
    if target_hidden is not None and target_hidden != backbone.hidden_size:
        raise SpecserveError(
            f"{source}: target_hidden_size {target_hidden} differs from the draft layers' hidden_size "
            f"{backbone.hidden_size}; specserve's drafters share the target's width"
        )
    vocab = raw.get("draft_vocab_size")
    common = dict(
        backbone=backbone,
        source="speculators",
        draft_vocab_size=vocab if vocab is not None and vocab != backbone.vocab_size else None,
    )
    if kind == "eagle3":
        config = _eagle3(raw, layer, target_config, source, common)
    else:
        config = _block_drafter(raw, layer, kind, source, common)
    config.validate(source)
    optional = SHARED_WITH_TARGET if config.draft_vocab_size is None else ("embed_tokens.weight",)
    return DrafterCheckpoint(config, rename=_rename, optional=optional)


def _capture_ids_to_layer_ids(ids, key: str, source: str) -> list[int]:
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise SpecserveError(f"{source}: {key} must be a list of layer ids, got {ids!r}")
    return [i - 1 for i in ids]


def _eagle3(raw: dict, layer, target_config, source: str, common: dict) -> Eagle3Config:
    if layer.model_type not in ("llama", "qwen3"):
        raise SpecserveError(
            f"{source}: transformer_layer_config.model_type {layer.model_type!r}: speculators' EAGLE-3 "
            "layers are 'llama' or 'qwen3'"
        )
    if layer.num_hidden_layers != 1:
        raise SpecserveError(
            f"{source}: transformer_layer_config.num_hidden_layers is {layer.num_hidden_layers}; specserve's "
            "EAGLE-3 drafter runs one layer"
        )
    for key in _EAGLE3_UNSUPPORTED:
        if raw.get(key):
            raise SpecserveError(f"{source}: {key} true is not supported by specserve's EAGLE-3 drafter")
    ids = raw.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:  # vLLM's default capture ids for EAGLE-3
        n = target_config.num_hidden_layers
        ids = [2, n // 2, n - 3]
    return Eagle3Config(
        family="qwen3",
        target_layer_ids=_capture_ids_to_layer_ids(ids, "eagle_aux_hidden_state_layer_ids", source),
        qk_norm=layer.model_type == "qwen3",
        ttt_length=_speculative_tokens(raw, source) or 3,
        norm_before_residual=bool(raw.get("norm_before_residual", False)),
        **common,
    )


def _block_drafter(raw: dict, layer, kind: str, source: str, common: dict) -> DSparkConfig:
    dflash2 = kind == "dflash2"
    check_attention_layout(
        layer, bool(raw.get("sliding_window_non_causal", dflash2)), source, "transformer_layer_config."
    )
    dspark = kind == "dspark"
    rank = raw.get("markov_rank", 256) if dspark else 0
    confidence = bool(raw.get("enable_confidence_head", True)) if dspark else False
    with_markov = bool(raw.get("confidence_head_with_markov", True))
    config = DSparkConfig(
        family="qwen3",
        target_layer_ids=_capture_ids_to_layer_ids(
            field(raw, "aux_hidden_state_layer_ids", source), "aux_hidden_state_layer_ids", source
        ),
        block_size=raw.get("block_size", 8),
        mask_token_id=field(raw, "mask_token_id", source),
        markov_rank=rank,
        markov_head_type=raw.get("markov_head_type", "vanilla") if rank else None,
        confidence_head=confidence,
        confidence_with_markov=confidence and bool(rank) and with_markov,
        sample_from_anchor=bool(raw.get("sample_from_anchor", dspark)),
        **({key: raw.get(key, default) for key, default in DFLASH2_DEFAULTS.items()} if dflash2 else {}),
        **common,
    )
    if confidence and not rank and with_markov:
        raise SpecserveError(f"{source}: confidence_head_with_markov true needs markov_rank > 0")
    return config


def _speculative_tokens(raw: dict, source: str) -> int | None:
    """The default proposal method's speculative token count (speculators_config)."""
    spec = raw.get("speculators_config") or {}
    methods = spec.get("proposal_methods") or []
    default = spec.get("default_proposal_method")
    for method in methods:
        if isinstance(method, dict) and method.get("proposal_type", default) == default:
            tokens = method.get("speculative_tokens")
            if tokens is not None and not (isinstance(tokens, int) and tokens >= 1):
                raise SpecserveError(
                    f"{source}: speculators_config.proposal_methods speculative_tokens {tokens!r}"
                )
            return tokens
    return None
