"""DeepSpec drafter configurations (DSpark / DFlash / EAGLE-3): config.json parsed, validated and created.

A DeepSpec drafter config is the target's own config (its backbone dimensions) with the draft fields on top:
`architectures` (`Qwen3DSparkModel` / `Gemma4DSparkModel` / `Qwen3Eagle3Model` / `Gemma4Eagle3Model`),
`num_hidden_layers` (draft layers), `target_layer_ids`; DSpark adds `block_size`, `mask_token_id`,
`num_anchors`, `markov_rank` (+ `markov_head_type`), `enable_confidence_head` (+
`confidence_head_with_markov`); DFlash checkpoints are the DSpark classes with rank 0 and no confidence head;
EAGLE-3 adds `ttt_length`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import ClassVar

import transformers

from specserve.config import SpecserveError
from specserve.spec_decode.deepspec.heads import MARKOV_HEAD_TYPES

# Targets whose drafter takes each layout. Qwen2/2.5 targets get the Qwen3 drafter (q/k norms, no biases):
# DeepSpec has no Qwen2 class, and the layout is the target-independent part of the drafter. So do the
# hybrid Qwen3.5 / Qwen3-Next targets, whose drafter is a plain Qwen3 backbone of the target's widths.
HYBRID_TARGETS = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
FAMILY_OF_TARGET = {
    "qwen2": "qwen3",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3",
    "gemma4_text": "gemma4",
    **dict.fromkeys(HYBRID_TARGETS, "qwen3"),
}
# What a Qwen3 drafter takes from a hybrid target; the rest (linear attention, output gates, partial and
# multimodal RoPE, MoE) belongs to the target's own layers.
_HYBRID_INHERITED = (
    "vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
    "max_position_embeddings", "hidden_act", "bos_token_id", "eos_token_id", "pad_token_id", "dtype",
)  # fmt: skip
_HF_CONFIG = {"qwen3": transformers.Qwen3Config, "gemma4": transformers.Gemma4TextConfig}
# Target fields the drafter does not inherit: everything MoE, sliding windows and Gemma 4 extras that only
# the target's own layers use.
_NOT_INHERITED = (
    "num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step", "mlp_only_layers",
    "norm_topk_prob", "router_aux_loss_coef", "output_router_logits", "enable_moe_block", "top_k_experts",
    "num_kv_shared_layers", "hidden_size_per_layer_input", "vocab_size_per_layer_input",
    "use_double_wide_mlp", "sliding_window", "use_sliding_window", "max_window_layers",
    "per_layer_config",  # transformers' per-layer view of the target's layer types; drafts are all global
)  # fmt: skip
NUM_ANCHORS = 512  # DeepSpec's training default (`num_anchors`), written when training did not say


@dataclass
class DrafterConfig:
    """What every DeepSpec drafter has: a backbone layout and the target layers it reads."""

    family: str  # "qwen3" or "gemma4": which backbone layout
    backbone: transformers.PretrainedConfig  # dimensions of the draft layers (a Qwen3 / Gemma 4 text config)
    target_layer_ids: list[int]  # DeepSpec's convention: id l is the output of target layer l
    # The checkpoint's format (`spec_decode/formats`). DeepSpec drafters serve targets of their own family;
    # the other formats' Qwen3-style drafters serve any target of their widths.
    source: str = "DeepSpec"
    qk_norm: bool = True  # RMSNorm on each head's q and k (Llama-style draft layers have none)
    draft_vocab_size: int | None = None  # a pruned draft vocabulary (`d2t` / `t2d`), else the target's
    # A Qwen3-style drafter of a Gemma target that embeds with the target's own (scaled) embedding.
    embed_scale: float | None = None
    # z-lab's DFlash2 logits: softcapped (final_logit_softcapping), then times output_multiplier.
    logit_softcap: float | None = None
    logit_scale: float = 1.0

    ARCHITECTURES: ClassVar[dict[str, str]] = {}  # architectures[0] -> family
    REQUIRED: ClassVar[tuple[str, ...]] = ("target_layer_ids",)

    @property
    def num_layers(self) -> int:
        return self.backbone.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.backbone.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.backbone.vocab_size

    @property
    def architecture(self) -> str:
        return {v: k for k, v in self.ARCHITECTURES.items()}[self.family]

    @property
    def output_vocab_size(self) -> int:
        """Rows of the drafter's LM head: its pruned vocabulary, or the target's."""
        return self.draft_vocab_size or self.vocab_size

    def token_scaling(self) -> tuple[float | None, float | None]:
        """(embedding scale, logit softcap): Gemma drafters scale as Gemma does (sqrt(H), the backbone's
        softcap); a Qwen3-style drafter only by `embed_scale`."""
        if self.family == "gemma4":
            return self.hidden_size**0.5, getattr(self.backbone, "final_logit_softcapping", None)
        return self.embed_scale, self.logit_softcap

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json"):
        arch = (raw.get("architectures") or [None])[0]
        if arch not in cls.ARCHITECTURES:
            raise SpecserveError(
                f"{source}: architectures[0] is {arch!r}; expected one of {', '.join(cls.ARCHITECTURES)}"
            )
        missing = [k for k in cls.REQUIRED if k not in raw]
        if missing:
            raise SpecserveError(f"{source} is missing {', '.join(missing)}")
        family = cls.ARCHITECTURES[arch]
        fields = {
            k: v for k, v in raw.items() if k not in ("architectures", "model_type", "per_layer_config")
        }
        config = cls(
            family=family,
            backbone=_HF_CONFIG[family](**fields),
            target_layer_ids=list(raw["target_layer_ids"]),
            **cls._own_fields(raw),
        )
        config.validate(source)
        return config

    @classmethod
    def _own_fields(cls, raw: dict) -> dict:
        return {}

    def validate(self, source: str = "config.json") -> None:
        vocab = self.draft_vocab_size
        _check(
            vocab is None or (isinstance(vocab, int) and 1 <= vocab <= self.vocab_size),
            source,
            f"draft_vocab_size {vocab!r} is not in [1, vocab_size={self.vocab_size}]",
        )
        ids = self.target_layer_ids
        ok = bool(ids) and all(isinstance(i, int) for i in ids) and all(a < b for a, b in zip(ids, ids[1:]))
        _check(
            ok, source, f"target_layer_ids must be a non-empty, strictly increasing list of ints, got {ids!r}"
        )
        _check(self.num_layers >= 1, source, f"num_hidden_layers {self.num_layers!r}")
        width = self.backbone.intermediate_size
        _check(width >= 1, source, f"intermediate_size {width!r}: a draft layer's MLP needs a width >= 1")

    def check_target(self, target_config, source: str = "drafter") -> None:
        """Errors naming the key when the drafter does not fit the target model."""
        expected = FAMILY_OF_TARGET.get(target_config.model_type)
        if expected is None or (self.source == "DeepSpec" and expected != self.family):
            raise SpecserveError(
                f"{source}: a {self.source} {self.architecture} drafter cannot serve a "
                f"{target_config.model_type!r} target"
            )
        num_target_layers = target_config.num_hidden_layers
        pairs = (
            ("hidden_size", self.hidden_size, target_config.hidden_size),
            ("vocab_size", self.vocab_size, target_config.vocab_size),
        )
        for key, mine, theirs in pairs:
            if mine != theirs:
                raise SpecserveError(f"{source}: {key} is {mine}, the target's is {theirs}")
        declared = getattr(self.backbone, "num_target_layers", None)
        if declared is not None and declared != num_target_layers:
            raise SpecserveError(
                f"{source}: num_target_layers is {declared}, the target has {num_target_layers} layers"
            )
        # The last layer's output is not what a DeepSpec target cache stores (HF reports it post-norm).
        bad = [i for i in self.target_layer_ids if not -1 <= i <= num_target_layers - 2]
        if bad:
            raise SpecserveError(
                f"{source}: target_layer_ids {bad} out of range: each must be -1 (the embedding) or a "
                f"layer in [0, {num_target_layers - 2}] (the final layer {num_target_layers - 1} is excluded)"
            )

    def to_dict(self) -> dict:
        """config.json contents, in DeepSpec's layout."""
        out = self.backbone.to_dict()
        out.update(
            architectures=[self.architecture],
            num_hidden_layers=self.num_layers,
            layer_types=["full_attention"] * self.num_layers,
            tie_word_embeddings=False,
            target_layer_ids=list(self.target_layer_ids),
        )
        if self.family == "gemma4":  # DeepSpec's transformers reads the global geometry from these keys
            out.pop("per_layer_config", None)
            out.update(global_attention_fields(self.backbone))
            # Our draft layers have neither per-layer inputs nor MoE blocks; DeepSpec asserts both are off
            # (without the key, transformers defaults the per-layer input width to 256).
            out.update(hidden_size_per_layer_input=0, enable_moe_block=False)
        return out


def _check(ok: bool, source: str, message: str) -> None:
    if not ok:
        raise SpecserveError(f"{source}: {message}")


@dataclass
class DSparkConfig(DrafterConfig):
    """DSpark: `block_size` slots per block (the anchor included: B slots give B drafts), the mask token
    of the non-anchor slots, and optional sequential heads. DFlash: rank 0 and no confidence head."""

    block_size: int = 7
    mask_token_id: int = 0
    num_anchors: int = NUM_ANCHORS  # blocks per training sequence; DeepSpec's model requires it
    markov_rank: int = 0
    markov_head_type: str | None = None
    confidence_head: bool = False
    confidence_with_markov: bool = False
    # DeepSpec's convention: slot i of a block at anchor a predicts the token at a+i+1 (B drafts). False:
    # z-lab's 1+N infill, slot 0 holds the anchor and slot i >= 1 predicts the token at a+i (B-1 drafts).
    sample_from_anchor: bool = True
    # DFlash2: taps of the convolutions around each sublayer (0: none), channels per dynamic kernel, and
    # the candidate selector's rank (0: none) and candidates per slot.
    conv_kernel_size: int = 0
    conv_group_size: int = 16
    selector_rank: int = 0
    selector_top_k: int = 16

    ARCHITECTURES: ClassVar[dict[str, str]] = {"Qwen3DSparkModel": "qwen3", "Gemma4DSparkModel": "gemma4"}
    REQUIRED: ClassVar[tuple[str, ...]] = (
        "block_size", "mask_token_id", "target_layer_ids", "markov_rank", "enable_confidence_head",
    )  # fmt: skip

    def __post_init__(self) -> None:
        if isinstance(self.markov_head_type, str):  # DeepSpec lower-cases it; we keep (and write) that form
            self.markov_head_type = self.markov_head_type.lower()

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> DSparkConfig:
        missing = []
        if raw.get("markov_rank") and "markov_head_type" not in raw:
            missing.append("markov_head_type")
        if raw.get("enable_confidence_head") and "confidence_head_with_markov" not in raw:
            missing.append("confidence_head_with_markov")
        if missing and (raw.get("architectures") or [None])[0] in cls.ARCHITECTURES:
            raise SpecserveError(f"{source} is missing {', '.join(missing)}")
        return super().from_dict(raw, source)

    @classmethod
    def _own_fields(cls, raw: dict) -> dict:
        rank = raw["markov_rank"]
        return dict(
            block_size=raw["block_size"],
            mask_token_id=raw["mask_token_id"],
            num_anchors=raw.get("num_anchors", NUM_ANCHORS),  # older specserve checkpoints lack it
            markov_rank=rank,
            markov_head_type=raw.get("markov_head_type") if rank else None,
            confidence_head=bool(raw["enable_confidence_head"]),
            confidence_with_markov=bool(raw.get("confidence_head_with_markov")) and bool(rank),
        )

    @property
    def first_draft_slot(self) -> int:
        """The block slot whose output is the first draft."""
        return 0 if self.sample_from_anchor else 1

    @property
    def max_drafts(self) -> int:
        return self.block_size - self.first_draft_slot

    def validate(self, source: str = "config.json") -> None:
        super().validate(source)
        _check(
            isinstance(self.block_size, int) and self.block_size >= 1 + self.first_draft_slot,
            source,
            f"block_size {self.block_size!r}: a block of B slots drafts B - {self.first_draft_slot} tokens, "
            f"so B must be at least {1 + self.first_draft_slot}",
        )
        _check(
            isinstance(self.mask_token_id, int) and 0 <= self.mask_token_id < self.vocab_size,
            source,
            f"mask_token_id {self.mask_token_id!r} is not in [0, vocab_size={self.vocab_size})",
        )
        _check(
            isinstance(self.num_anchors, int) and self.num_anchors >= 1,
            source,
            f"num_anchors {self.num_anchors!r}",
        )
        _check(
            isinstance(self.markov_rank, int) and self.markov_rank >= 0,
            source,
            f"markov_rank {self.markov_rank!r}",
        )
        if self.conv_kernel_size:
            _check(
                isinstance(self.conv_kernel_size, int) and 1 <= self.conv_kernel_size <= self.block_size,
                source,
                f"conv_kernel_size {self.conv_kernel_size!r} is not in [1, block_size={self.block_size}]",
            )
            _check(
                isinstance(self.conv_group_size, int)
                and self.conv_group_size >= 1
                and self.hidden_size % self.conv_group_size == 0,
                source,
                f"conv_group_size {self.conv_group_size!r} does not divide hidden_size {self.hidden_size}",
            )
        if self.selector_rank:
            _check(
                isinstance(self.selector_top_k, int) and 1 <= self.selector_top_k <= self.vocab_size,
                source,
                f"selector_top_k {self.selector_top_k!r} is not in [1, vocab_size={self.vocab_size}]",
            )
            _check(
                self.draft_vocab_size is None,
                source,
                "a DFlash2 candidate selector needs the full vocabulary (no draft_vocab_size of its own)",
            )
        if self.markov_rank:
            _check(
                self.markov_head_type in MARKOV_HEAD_TYPES,
                source,
                f"markov_head_type {self.markov_head_type!r} is not one of {', '.join(MARKOV_HEAD_TYPES)}",
            )

    def to_dict(self) -> dict:
        out = super().to_dict()
        out.update(
            block_size=self.block_size,
            mask_token_id=self.mask_token_id,
            num_anchors=self.num_anchors,
            markov_rank=self.markov_rank,
            enable_confidence_head=self.confidence_head,
        )
        out.pop("markov_head_type", None)
        out.pop("confidence_head_with_markov", None)
        if self.markov_rank:
            out["markov_head_type"] = self.markov_head_type
        if self.confidence_head:
            out["confidence_head_with_markov"] = self.confidence_with_markov
        return out


@dataclass
class Eagle3Config(DrafterConfig):
    """EAGLE-3 as DeepSpec trains it: one decoder layer over [embedding; projected features], drafting
    autoregressively; `ttt_length` is its training-time test depth (the default number of drafts)."""

    ttt_length: int = 7
    norm_before_residual: bool = False  # speculators: the layer's residual is hidden_norm(hidden)

    ARCHITECTURES: ClassVar[dict[str, str]] = {"Qwen3Eagle3Model": "qwen3", "Gemma4Eagle3Model": "gemma4"}

    @classmethod
    def _own_fields(cls, raw: dict) -> dict:
        return dict(ttt_length=raw.get("ttt_length", 7))

    def validate(self, source: str = "config.json") -> None:
        super().validate(source)
        _check(self.num_layers == 1, source, f"an EAGLE-3 drafter has 1 layer, not {self.num_layers}")
        _check(
            isinstance(self.ttt_length, int) and self.ttt_length >= 1,
            source,
            f"ttt_length {self.ttt_length!r}",
        )

    def to_dict(self) -> dict:
        return super().to_dict() | dict(
            ttt_length=self.ttt_length, draft_num_hidden_layers=1, step_loss_decay=0.8
        )


DRAFTER_CONFIGS = {arch: cls for cls in (DSparkConfig, Eagle3Config) for arch in cls.ARCHITECTURES}


def parse_drafter_config(raw: dict, source: str = "config.json") -> DrafterConfig:
    """Dispatch on architectures[0] (DSpark/DFlash or EAGLE-3)."""
    arch = (raw.get("architectures") or [None])[0]
    if arch not in DRAFTER_CONFIGS:
        raise SpecserveError(
            f"{source}: architectures[0] is {arch!r}; DeepSpec drafters: {', '.join(DRAFTER_CONFIGS)}"
        )
    return DRAFTER_CONFIGS[arch].from_dict(raw, source)


def global_attention_fields(gemma_config) -> dict:
    """A Gemma 4 config's full-attention geometry as the flat keys of a pre-`per_layer_config` config."""
    from specserve.models.gemma import plan_layers

    plan = next(p for p in plan_layers(gemma_config, gemma4=True) if p.layer_type == "full_attention")
    return {
        "global_head_dim": plan.head_dim,
        "attention_k_eq_v": plan.k_eq_v,
        "num_global_key_value_heads": plan.num_kv_heads if plan.k_eq_v else None,
    }


def default_target_layer_ids(num_target_layers: int, count: int = 5) -> list[int]:
    """DFlash's rule, round(1 + i (L - 4) / (n - 1)), clipped to layers a drafter may read; deduplicated."""
    count = max(1, min(count, num_target_layers - 1))
    if count == 1:
        return [max(0, num_target_layers - 2) // 2]
    last = num_target_layers - 2
    ids = (round(1 + i * (num_target_layers - 4) / (count - 1)) for i in range(count))
    return sorted({min(max(i, 0), last) for i in ids})


def default_mask_token(tokenizer, vocab_size: int) -> int:
    """The first embedding row past the tokenizer's ids (Qwen pads its vocabulary), as DeepSpec picks.

    A tokenizer converted from a GGUF file covers those rows with llama.cpp's padding tokens `[PAD<id>]`:
    the first of them is the same row."""
    if tokenizer is not None:
        if len(tokenizer) < vocab_size:
            return len(tokenizer)
        padding = [i for token, i in tokenizer.get_vocab().items() if token == f"[PAD{i}]"]
        if padding:
            return min(padding)
    raise SpecserveError("no unused embedding row to use as the mask token: give mask_token_id")


def draft_backbone(
    target_config, num_layers: int, intermediate_size: int | None = None
) -> tuple[str, transformers.PretrainedConfig]:
    """(family, backbone config) of a new drafter: the target's dimensions (its MLP width unless
    `intermediate_size`), `num_layers` global layers."""
    family = FAMILY_OF_TARGET.get(target_config.model_type)
    if family is None:
        raise SpecserveError(
            f"no DeepSpec drafter layout for target model_type {target_config.model_type!r}; supported: "
            f"{', '.join(FAMILY_OF_TARGET)}"
        )
    fields = copy.deepcopy(target_config.to_dict())
    if target_config.model_type in HYBRID_TARGETS:
        fields = {key: fields[key] for key in _HYBRID_INHERITED if key in fields}
        # Full RoPE at the target's base: DeepSpec's Qwen3 rotary ignores a partial factor.
        fields["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": target_config.rope_parameters["rope_theta"],
        }
        dense = getattr(target_config, "intermediate_size", None)  # MoE targets: the shared expert's width
        fields["intermediate_size"] = dense or target_config.shared_expert_intermediate_size
    for key in (*_NOT_INHERITED, "architectures", "model_type", "layer_types", "num_hidden_layers"):
        fields.pop(key, None)
    if family == "gemma4":
        fields.update(global_attention_fields(target_config), hidden_size_per_layer_input=0)
    fields.update(
        num_hidden_layers=num_layers,
        layer_types=["full_attention"] * num_layers,
        num_target_layers=target_config.num_hidden_layers,
        tie_word_embeddings=False,
        attention_bias=False,
    )
    if intermediate_size is not None:
        fields["intermediate_size"] = intermediate_size
    return family, _HF_CONFIG[family](**fields)


def new_draft_config(
    target_config,
    *,
    num_layers: int = 1,
    block_size: int = 7,
    target_layer_ids: list[int] | None = None,
    mask_token_id: int | None = None,
    markov_rank: int = 256,
    markov_head_type: str = "vanilla",
    confidence_head: bool = True,
    confidence_with_markov: bool = True,
    intermediate_size: int | None = None,
    num_anchors: int = NUM_ANCHORS,
) -> DSparkConfig:
    """A fresh DSpark config for a target (training starts here). DFlash: rank 0, no confidence head.
    `intermediate_size`: the draft layers' MLP width (default: the target's); `num_anchors`: blocks per
    training sequence, recorded for DeepSpec."""
    if mask_token_id is None:
        raise SpecserveError(
            "mask_token_id is needed: an id whose embedding is never a real token (Qwen: the first unused "
            "padded row, e.g. 151669 for Qwen3; Gemma 4: 4)"
        )
    family, backbone = draft_backbone(target_config, num_layers, intermediate_size)
    config = DSparkConfig(
        family=family,
        backbone=backbone,
        target_layer_ids=target_layer_ids or default_target_layer_ids(target_config.num_hidden_layers),
        block_size=block_size,
        mask_token_id=mask_token_id,
        num_anchors=num_anchors,
        markov_rank=markov_rank,
        markov_head_type=markov_head_type if markov_rank else None,
        confidence_head=confidence_head,
        confidence_with_markov=confidence_with_markov and confidence_head and markov_rank > 0,
    )
    config.validate("new drafter")
    config.check_target(target_config, "new drafter")
    return config


def new_eagle3_config(
    target_config, *, target_layer_ids: list[int] | None = None, ttt_length: int = 7
) -> Eagle3Config:
    """A fresh EAGLE-3 config for a target (one layer; DeepSpec reads 5 target layers)."""
    family, backbone = draft_backbone(target_config, 1)
    config = Eagle3Config(
        family=family,
        backbone=backbone,
        target_layer_ids=target_layer_ids or default_target_layer_ids(target_config.num_hidden_layers),
        ttt_length=ttt_length,
    )
    config.validate("new drafter")
    config.check_target(target_config, "new drafter")
    return config
