"""Tiny random transformers models of every supported architecture, saved to disk once per session."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

VOCAB = 256


def _configs() -> dict[str, transformers.PretrainedConfig]:
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return {
        "qwen2": transformers.Qwen2Config(**common, tie_word_embeddings=True),
        "qwen3": transformers.Qwen3Config(**common),
        "qwen3_moe": transformers.Qwen3MoeConfig(
            **common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True
        ),
        "gemma3": transformers.Gemma3TextConfig(
            **common,
            sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        ),
        "gemma4": transformers.Gemma4TextConfig(
            **{**common, "num_hidden_layers": 4},
            global_head_dim=32,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            hidden_size_per_layer_input=0,
            final_logit_softcapping=30.0,
        ),
    }


ARCHS = list(_configs())


def _hybrid_configs() -> dict[str, transformers.PretrainedConfig]:
    """Qwen3.5 / Qwen3.5-MoE / Qwen3-Next text models: [linear, full, linear] layers, 2 key heads serving
    4 value heads in the linear layers (conv_dim 128), partial RoPE on a head dim of 32."""
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=3,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    # Multimodal RoPE sections (temporal, height, width) over the 4 rotated frequencies, as Qwen3.5 ships.
    mrope = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25, mrope_section=[2, 1, 1])
    moe = dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48
    )
    return {
        "qwen3_5": transformers.Qwen3_5TextConfig(
            **common, intermediate_size=96, rope_parameters={**mrope, "mrope_interleaved": True}
        ),
        "qwen3_5_moe": transformers.Qwen3_5MoeTextConfig(
            **common, **moe, rope_parameters={**mrope, "mrope_interleaved": True}
        ),
        # its shared expert as wide as a routed one, as in the real Qwen3-Next (stacked with them when
        # quantized); Qwen3.5-MoE's here is wider (kept apart)
        "qwen3_next": transformers.Qwen3NextConfig(
            **{**common, **moe, "shared_expert_intermediate_size": 32},
            intermediate_size=96,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        ),
    }


# Hybrid (linear-attention) architectures: build_reference / save_tiny_model take these names too.
HYBRID_ARCHS = list(_hybrid_configs())


def _model_class(arch: str):
    return {
        "qwen2": transformers.Qwen2ForCausalLM,
        "qwen3": transformers.Qwen3ForCausalLM,
        "qwen3_moe": transformers.Qwen3MoeForCausalLM,
        "gemma3": transformers.Gemma3ForCausalLM,
        "gemma4": transformers.Gemma4ForCausalLM,
        "qwen3_5": transformers.Qwen3_5ForCausalLM,
        "qwen3_5_moe": transformers.Qwen3_5MoeForCausalLM,
        "qwen3_next": transformers.Qwen3NextForCausalLM,
    }[arch]


def build_reference(arch: str, seed: int = 0, **overrides):
    """A transformers model with all parameters randomised (norm weights included), in eval mode;
    `overrides` change fields of the arch's tiny config."""
    torch.manual_seed(seed)
    config = _configs()[arch] if arch in ARCHS else _hybrid_configs()[arch]
    if overrides:
        config = type(config).from_dict({**config.to_dict(), **overrides})
    return randomized(_model_class(arch)(config))


def randomized(model):
    """`model` with all parameters randomised (norm weights included), in eval mode."""
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2 if p.dim() == 1 else 0.08)
    return model.eval()


def save_tiny_model(arch: str, directory: Path) -> Path:
    model = build_reference(arch)
    model.generation_config.eos_token_id = None  # random models hit eos by chance; tests pass ignore_eos
    model.save_pretrained(directory)
    return directory


def save_tiny_drafter(
    target_dir: Path,
    directory: Path,
    *,
    seed: int = 0,
    std: float = 0.02,
    head_scale: float | None = None,
    markov_bias: torch.Tensor | None = None,
    eagle3: bool = False,
    **config,
) -> Path:
    """A random DSpark/DFlash drafter for a saved tiny target, in DeepSpec's checkpoint format.

    `config` goes to `new_draft_config` (defaults here: 1 layer, B = 4, rank 8, vanilla head, confidence).
    `head_scale` gives the drafter its own LM head, the target's times that factor (flatter drafts);
    `markov_bias` [V, V] plants a vanilla Markov head whose bias after token p is markov_bias[p]
    (rank V, W1 = identity), e.g. a bigram table of the target, so that drafts are often right.
    `eagle3` makes an EAGLE-3 drafter instead (`config` then goes to `new_eagle3_config`).
    """
    from specserve.models.loader import load_model
    from specserve.spec_decode.deepspec.checkpoint import (
        build_draft_model,
        init_draft_weights,
        save_draft_checkpoint,
    )
    from specserve.spec_decode.deepspec.config import new_draft_config, new_eagle3_config

    target, target_config, _ = load_model(str(target_dir))
    vocab = target_config.vocab_size
    defaults = dict(num_layers=1, block_size=4, markov_rank=8, mask_token_id=vocab - 1)
    if markov_bias is not None:
        defaults["markov_rank"] = vocab
    if eagle3:
        draft_config = new_eagle3_config(target_config, **config)
    else:
        draft_config = new_draft_config(target_config, **{**defaults, **config})
    draft = build_draft_model(draft_config)
    init_draft_weights(draft, target, seed=seed, std=std)
    with torch.no_grad():
        if head_scale is not None:
            weight = draft.lm_head.weight * head_scale
            draft.lm_head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
            draft.lm_head.weight.copy_(weight)
        if markov_bias is not None:
            draft.markov_head.markov_w1.weight.copy_(torch.eye(vocab))
            draft.markov_head.markov_w2.weight.copy_(markov_bias.T)
    return save_draft_checkpoint(draft, directory)


SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]  # ids 0-4, as the configs say
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def save_byte_tokenizer(directory: Path) -> Path:
    """A byte-level tokenizer that fits the tiny vocabulary, with a chat template, saved into `directory`.

    Ids 0-4 are the special tokens; every other id is the byte of that value (bytes 0-4 cannot be
    written, which no test text needs), so any text encodes and every generated id decodes.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(len(SPECIAL_TOKENS), VOCAB)}
    vocab.update({token: i for i, token in enumerate(SPECIAL_TOKENS)})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    return directory


def save_tiny_chat_model(arch: str, directory: Path) -> Path:
    """A tiny random model with the byte tokenizer beside it: text prompts and chat work."""
    save_tiny_model(arch, directory)
    return save_byte_tokenizer(directory)


def save_tiny_mtp(target_dir: Path, seed: int = 0, output_scale: float | None = None) -> Path:
    """Random `mtp.*` tensors (a multi-token-prediction layer) for a saved tiny hybrid target, in a
    safetensors file of their own beside its weights, as released checkpoints carry them.
    `output_scale` sets the (zero-centred) final norm's scale: small values give flat drafts."""
    from safetensors.torch import save_file

    from specserve.models.loader import load_hf_config
    from specserve.models.qwen3_next import MultiTokenPredictor
    from specserve.models.registry import text_config_of

    torch.manual_seed(seed)
    predictor = MultiTokenPredictor(text_config_of(load_hf_config(Path(target_dir))))
    with torch.no_grad():
        for p in predictor.parameters():
            p.normal_(0.0, 0.2 if p.dim() == 1 else 0.08)
        if output_scale is not None:
            predictor.norm.weight.fill_(output_scale - 1.0)
    tensors = {f"mtp.{name}": t.contiguous() for name, t in predictor.state_dict().items()}
    save_file(tensors, str(Path(target_dir) / "mtp.safetensors"))
    return Path(target_dir)
