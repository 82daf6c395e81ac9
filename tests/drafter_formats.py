"""Tiny random drafter checkpoints in the published formats, written as each format's tooling writes them:
config.json with the format's own keys (speculators: a diff-only `transformer_layer_config`, the
`speculators_config` block; z-lab: a Qwen3 config with `dflash_config`; Model-Optimizer: the same plus its
DSpark head fields) and model.safetensors under the format's tensor names (speculators: no `embed_tokens`,
`d2t` / `t2d` for a pruned vocabulary; z-lab: no embedding or LM head; Model-Optimizer: top-level
`markov_w1` / `markov_w2` / `gate_proj` / `joint_proj` / `confidence_proj`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

from specserve.models.loader import load_model
from specserve.spec_decode.deepspec.checkpoint import build_draft_model, init_draft_weights
from specserve.spec_decode.formats import parse_checkpoint_config


def layer_fields(target_config, num_layers: int = 1, llama: bool = False) -> dict:
    """The draft layers' config as speculators serializes it (to_diff_dict: non-default fields only)."""
    cls = transformers.LlamaConfig if llama else transformers.Qwen3Config
    config = cls(
        vocab_size=target_config.vocab_size,
        hidden_size=target_config.hidden_size,
        intermediate_size=96,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    return config.to_diff_dict()


def speculators_config(target_config, kind: str, *, tokens: int, llama: bool = False, **fields) -> dict:
    """A speculators config.json of `kind` (eagle3 / dflash / dspark) for a target; `fields` override."""
    arch = {
        "eagle3": "Eagle3Speculator",
        "dflash": "DFlashSpeculator",
        "dspark": "DSparkSpeculator",
        "dflash2": "DFlash2DraftModel",
    }[kind]
    n = target_config.num_hidden_layers
    raw = {
        "architectures": [arch],
        "speculators_model_type": kind,
        "speculators_version": "0.9.0",
        "transformer_layer_config": layer_fields(target_config, 1, llama),
        "draft_vocab_size": target_config.vocab_size,
        "target_hidden_size": None,
        "speculators_config": {
            "algorithm": kind,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": tokens}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": "tiny/target", "architectures": ["Qwen3ForCausalLM"]},
        },
    }
    if kind == "eagle3":
        raw |= {"eagle_aux_hidden_state_layer_ids": [1, n - 1], "norm_before_residual": False}
        raw |= {"norm_before_fc": False, "fc_norm": False, "norm_output": False, "embed_requires_grad": False}
    else:
        raw |= {
            "block_size": 4,
            "aux_hidden_state_layer_ids": [1, n - 1],
            "mask_token_id": target_config.vocab_size - 1,
            "sliding_window_non_causal": False,
            "sample_from_anchor": kind == "dspark",
        }
    if kind == "dflash2":
        raw |= {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 6}
        raw["sliding_window_non_causal"] = True
    if kind == "dspark":
        raw |= {
            "markov_rank": 8,
            "markov_head_type": "vanilla",
            "enable_confidence_head": True,
            "confidence_head_with_markov": True,
        }
    return raw | fields


def zlab_config(
    target_config, *, modelopt: dict | None = None, dflash2: dict | None = None, **fields
) -> dict:
    """z-lab's DFlash config.json (Model-Optimizer's DSpark export when `modelopt` has its head fields;
    DFlash2 when `dflash2` has its fields)."""
    config = transformers.Qwen3Config(**layer_fields(target_config))
    raw = config.to_dict() | {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": 4,
        "num_target_layers": target_config.num_hidden_layers,
        "dflash_config": {"mask_token_id": target_config.vocab_size - 1, "target_layer_ids": [0, 1]},
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    }
    if modelopt is not None:
        raw["dflash_config"] |= {"projector_type": "dspark", "shift_label": True} | modelopt
    if dflash2 is not None:
        raw["architectures"] = ["DFlash2DraftModel"]
        raw["dflash_config"] |= {"block_size": raw["block_size"]} | dflash2
    return raw | fields


def write_drafter(
    target_dir: Path | str,
    directory: Path,
    raw: dict,
    *,
    seed: int = 0,
    std: float = 0.2,
    drop: tuple[str, ...] = (),
    kept_ids: list[int] | None = None,
    head_scale: float | None = None,
) -> Path:
    """Random weights for the drafter `raw` describes, saved under the format's tensor names without the
    `drop`ped ones. `kept_ids`: the target ids of a pruned draft vocabulary (d2t / t2d, LM head rows);
    `head_scale`: an LM head of its own, the target's times that factor (flatter drafts)."""
    target, target_config, _ = load_model(str(target_dir))
    checkpoint = parse_checkpoint_config(raw, target_config)
    model = build_draft_model(checkpoint.config)
    init_draft_weights(model, target, seed=seed, std=std)
    state = {name: t.detach().clone().contiguous() for name, t in model.state_dict().items()}
    if kept_ids is not None:
        kept = torch.tensor(sorted(kept_ids))
        state["d2t"] = kept - torch.arange(len(kept))
        state["t2d"] = torch.zeros(target_config.vocab_size, dtype=torch.bool).index_fill_(0, kept, True)
        state["lm_head.weight"] = target.output_layer().weight[kept].detach().clone()
    if head_scale is not None:
        state["lm_head.weight"] = state["lm_head.weight"] * head_scale
    inverse = {checkpoint.rename(name) or name: name for name in _format_names(state, raw)}
    tensors = {inverse.get(name, name): t for name, t in state.items() if name not in drop}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(raw, indent=2))
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def _format_names(state: dict, raw: dict) -> list[str]:
    """The checkpoint names that map onto `state`'s keys (Model-Optimizer's heads sit at the top level)."""
    modelopt = raw.get("dflash_config", {}).get("projector_type") == "dspark"
    if not modelopt:
        return list(state)
    names = []
    for name in state:
        if name.startswith("markov_head."):
            names.append(name.removeprefix("markov_head."))
        elif name.startswith("confidence_head.proj."):
            names.append("confidence_proj." + name.removeprefix("confidence_head.proj."))
        else:
            names.append(name)
    return names
