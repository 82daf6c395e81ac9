"""z-lab's DFlash and DFlash2 formats (z-lab/dflash) and NVIDIA Model-Optimizer's DSpark export of the same
layout.

config.json: a Qwen3 config of the draft layers with `architectures: ["DFlashDraftModel"]`, `block_size`
(at the top or inside `dflash_config`), `num_target_layers`, and `dflash_config {mask_token_id,
target_layer_ids}` (ids in DeepSpec's convention; without them, DFlash's rule over num_target_layers).
Blocks are 1+N infill: slot 0 holds the anchor, slot i >= 1 predicts the token at its own position, so a
block of B gives B-1 drafts. The checkpoint holds the draft layers, `fc`, `hidden_norm` and `norm` only:
embedding and LM head are the target's (z-lab embeds with the target's own module: Gemma's is scaled).

DFlash2 (`DFlash2DraftModel`) adds to `dflash_config`: `conv_kernel_size`, `conv_group_size`,
`selector_rank`, `selector_top_k`, and optionally `output_multiplier` and `final_logit_softcapping` (of the
unary logits, the target's LM head) and `input_embedding_scale`; tensors `layers.*.attention_conv.*`,
`layers.*.mlp_conv.*`, `candidate_selector.*`.

Model-Optimizer's DSpark adds to `dflash_config`: `projector_type: "dspark"`, `markov_rank`,
`markov_head_type`, `use_confidence_head`, `shift_label` (true: DSpark's anchor-first blocks, B drafts),
`use_swa` / `swa_window_size`, `causal`; and top-level tensors `markov_w1`, `markov_w2`, `gate_proj`,
`joint_proj`, `confidence_proj` (the confidence head reads [h; W1[prev]]).
"""

from __future__ import annotations

from specserve.config import SpecserveError
from specserve.spec_decode.deepspec.config import FAMILY_OF_TARGET, DSparkConfig
from specserve.spec_decode.formats import (
    SHARED_WITH_TARGET,
    DrafterCheckpoint,
    check_attention_layout,
    field,
    layer_config,
    qwen3_backbone,
)

_HEAD_TENSORS = ("markov_w1.", "markov_w2.", "gate_proj.", "joint_proj.")
PROJECTORS = ("dflash", "dspark", "dflash2")
_DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def dflash_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's default taps: round(1 + i (L - 4) / (n - 1)), or the middle layer for one draft layer."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def _rename_plain(name: str) -> str | None:
    return None if name.endswith("rotary_emb.inv_freq") else name


def _rename_modelopt(name: str) -> str | None:
    if name.startswith(_HEAD_TENSORS):
        return "markov_head." + name
    if name.startswith("confidence_proj."):
        return "confidence_head.proj." + name.removeprefix("confidence_proj.")
    return _rename_plain(name)


def parse_zlab(raw: dict, target_config, source: str) -> DrafterCheckpoint:
    arch = (raw.get("architectures") or [None])[0]
    if arch not in ("DFlashDraftModel", "DFlash2DraftModel"):
        raise SpecserveError(
            f"{source}: architectures[0] {arch!r} is not supported among z-lab-format drafters "
            "(supported: DFlashDraftModel, with or without Model-Optimizer's DSpark head; DFlash2DraftModel)"
        )
    dflash = field(raw, "dflash_config", source)
    if not isinstance(dflash, dict):
        raise SpecserveError(f"{source}: dflash_config must be an object")
    projector = dflash.get("projector_type", "dflash2" if arch == "DFlash2DraftModel" else "dflash")
    if (projector == "dflash2") != (arch == "DFlash2DraftModel") or projector not in PROJECTORS:
        raise SpecserveError(
            f"{source}: dflash_config.projector_type {projector!r} with architectures[0] {arch!r} is not "
            f"supported (DFlashDraftModel: dflash, dspark; DFlash2DraftModel: dflash2)"
        )
    if raw.get("model_type", "qwen3") != "qwen3":
        raise SpecserveError(
            f"{source}: model_type {raw.get('model_type')!r}: z-lab-format drafters run Qwen3 draft layers"
        )
    for key in ("attention_sink_bias", "causal"):
        if dflash.get(key):
            raise SpecserveError(f"{source}: dflash_config.{key} true is not supported")
    layer = layer_config(raw, source, "")
    # z-lab's own loop runs every layer without a causal mask, sliding ones included (see the docs).
    check_attention_layout(layer, True, source)
    backbone = qwen3_backbone(layer, source)
    block_size = raw.get("block_size", dflash.get("block_size"))
    if block_size is None:
        raise SpecserveError(f"{source} is missing block_size (top level or dflash_config.block_size)")
    ids = dflash.get("target_layer_ids")
    if ids is None:
        num_target_layers = field(raw, "num_target_layers", source)
        ids = dflash_layer_ids(num_target_layers, backbone.num_hidden_layers)
    declared = raw.get("num_target_layers")
    if declared is not None:
        backbone.num_target_layers = declared  # checked against the target by check_target
    gemma_target = FAMILY_OF_TARGET.get(target_config.model_type) == "gemma4"
    embed_scale = target_config.hidden_size**0.5 if gemma_target else None
    if dflash.get("input_embedding_scale") is not None:  # DFlash2: the unscaled embedding times this
        embed_scale = float(dflash["input_embedding_scale"])
    common = dict(
        family="qwen3",
        backbone=backbone,
        target_layer_ids=list(ids),
        block_size=block_size,
        mask_token_id=field(dflash, "mask_token_id", source, "dflash_config."),
        embed_scale=embed_scale,
    )
    if projector == "dflash":
        config = DSparkConfig(source="z-lab DFlash", sample_from_anchor=False, **common)
        rename = _rename_plain
    elif projector == "dflash2":
        softcap = dflash.get("final_logit_softcapping")
        config = DSparkConfig(
            source="z-lab DFlash2",
            sample_from_anchor=False,
            logit_scale=float(dflash.get("output_multiplier", 1.0)),
            logit_softcap=float(softcap) if softcap else None,
            **{key: field(dflash, key, source, "dflash_config.") for key in _DFLASH2_FIELDS},
            **common,
        )
        rename = _rename_plain
    else:
        rank = field(dflash, "markov_rank", source, "dflash_config.")
        confidence = bool(dflash.get("use_confidence_head", False))
        config = DSparkConfig(
            source="Model-Optimizer DSpark",
            sample_from_anchor=bool(dflash.get("shift_label", True)),
            markov_rank=rank,
            markov_head_type=str(dflash.get("markov_head_type", "vanilla")).lower(),
            confidence_head=confidence,
            confidence_with_markov=confidence,
            **common,
        )
        if not (isinstance(rank, int) and rank > 0):
            raise SpecserveError(f"{source}: dflash_config.markov_rank must be > 0 for DSpark, got {rank!r}")
        rename = _rename_modelopt
    config.validate(source)
    return DrafterCheckpoint(config, rename=rename, optional=SHARED_WITH_TARGET)
