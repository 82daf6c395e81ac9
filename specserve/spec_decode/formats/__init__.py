"""Drafter checkpoint formats: which one a config.json is, and how it maps onto specserve's drafters.

Read from config.json alone, before any weight: DeepSpec's (`architectures` Qwen3DSparkModel, ...), the
speculators format (`speculators_model_type`), z-lab's DFlash (`DFlashDraftModel` + `dflash_config`) and
NVIDIA Model-Optimizer's DSpark export (the z-lab layout with `dflash_config.projector_type: "dspark"`) and
DFlash2 (`DFlash2DraftModel`, or speculators' `dflash2`).
Each becomes a `DrafterConfig` in DeepSpec's conventions (target layer ids: id l is the output of target
layer l) plus the format's tensor names and whether the checkpoint may leave out the target's embedding
and LM head.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from specserve.config import SpecserveError
from specserve.spec_decode.deepspec.config import DRAFTER_CONFIGS, DrafterConfig, parse_drafter_config

SHARED_WITH_TARGET = ("embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class DrafterCheckpoint:
    """A parsed drafter config.json: the drafter it builds and how its tensors are named."""

    config: DrafterConfig
    rename: Callable[[str], str | None] = lambda name: name  # checkpoint name -> ours; None: not ours
    # Tensors the checkpoint may leave out: the target's own are used (speculators and z-lab drafters).
    optional: tuple[str, ...] = ()


def parse_checkpoint_config(raw: dict, target_config, source: str = "config.json") -> DrafterCheckpoint:
    """The drafter a config.json describes, in whichever format it is; a clear error naming the field
    when it is none of them or asks for something specserve does not run."""
    if not isinstance(raw, dict):
        raise SpecserveError(f"{source}: a drafter config must be a JSON object")
    if "speculators_model_type" in raw:
        from specserve.spec_decode.formats.speculators import parse_speculators

        return parse_speculators(raw, target_config, source)
    arch = (raw.get("architectures") or [None])[0]
    if arch in DRAFTER_CONFIGS:
        return DrafterCheckpoint(parse_drafter_config(raw, source))
    if "dflash_config" in raw or arch in ("DFlashDraftModel", "DFlash2DraftModel"):
        from specserve.spec_decode.formats.zlab import parse_zlab

        return parse_zlab(raw, target_config, source)
    raise SpecserveError(
        f"{source}: not a drafter checkpoint specserve knows: architectures[0] is {arch!r} and there is no "
        "speculators_model_type or dflash_config. Formats: DeepSpec "
        f"({', '.join(DRAFTER_CONFIGS)}), speculators (speculators_model_type), z-lab DFlash and "
        "Model-Optimizer DSpark (DFlashDraftModel with dflash_config)"
    )


def field(raw: dict, key: str, source: str, where: str = ""):
    """raw[key], or an error naming the missing field."""
    if key not in raw or raw[key] is None:
        raise SpecserveError(f"{source} is missing {where}{key}")
    return raw[key]


def layer_config(fields: dict, source: str, where: str):
    """A transformers config of the draft layers from a (possibly diff-only) dict, the class picked by its
    `model_type` as speculators does (Qwen3 without one)."""
    import transformers

    fields = {k: v for k, v in fields.items() if k != "architectures"}
    model_type = fields.pop("model_type", "qwen3")
    try:
        return transformers.AutoConfig.for_model(model_type, **fields)
    except (ValueError, KeyError, TypeError) as exc:
        raise SpecserveError(f"{source}: {where}model_type {model_type!r}: {exc}") from None


def qwen3_backbone(layer, source: str, where: str = ""):
    """The Qwen3 layout specserve's draft layers take, with the dimensions of `layer` (any decoder config:
    DFlash drafters are Qwen3 layers whatever model_type their config names)."""
    import transformers

    if getattr(layer, "mlp_bias", False):
        raise SpecserveError(f"{source}: {where}mlp_bias true is not supported (draft MLPs have no bias)")
    rope = dict(getattr(layer, "rope_parameters", None) or {})
    if "full_attention" in rope or "sliding_attention" in rope:  # per-layer-type RoPE: speculators takes this
        rope = dict(rope.get("sliding_attention") or rope["full_attention"])
    if "rope_theta" not in rope:
        rope["rope_theta"] = getattr(layer, "rope_theta", 10000.0)
    return transformers.Qwen3Config(
        vocab_size=layer.vocab_size,
        hidden_size=layer.hidden_size,
        intermediate_size=layer.intermediate_size,
        num_hidden_layers=layer.num_hidden_layers,
        num_attention_heads=layer.num_attention_heads,
        num_key_value_heads=getattr(layer, "num_key_value_heads", None) or layer.num_attention_heads,
        head_dim=getattr(layer, "head_dim", None) or layer.hidden_size // layer.num_attention_heads,
        rms_norm_eps=layer.rms_norm_eps,
        attention_bias=bool(getattr(layer, "attention_bias", False)),
        hidden_act=getattr(layer, "hidden_act", "silu"),
        max_position_embeddings=getattr(layer, "max_position_embeddings", 32768),
        rope_parameters=rope,
    )


def check_attention_layout(layer, non_causal_sliding: bool, source: str, where: str = "") -> None:
    """Draft blocks attend without a causal mask in every layer; a sliding-window layer trained with a
    causal block cannot run that way."""
    types = list(getattr(layer, "layer_types", None) or [])
    if "sliding_attention" in types and not non_causal_sliding:
        raise SpecserveError(
            f"{source}: {where}layer_types has sliding_attention layers whose blocks are causal "
            "(sliding_window_non_causal false); specserve runs draft blocks non-causally only"
        )
