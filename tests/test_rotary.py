"""RoPE inverse frequencies per layer type: pinned to the formulas, and to the installed transformers.

The formulas are written out here (float64) so that a change of transformers' initialisers cannot move
both sides at once; the cross-check against transformers' own rotary modules covers every rope_type we
support, on whichever release is installed (`make test-transformers-min` runs the lowest one allowed).
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from transformers import (
    Gemma3TextConfig,
    Gemma4TextConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from specserve.layers.rotary import RotaryEmbedding, inverse_frequencies
from specserve.models.gemma import plan_layers

S, F = "sliding_attention", "full_attention"
SMALL = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def gemma4_config() -> Gemma4TextConfig:
    return Gemma4TextConfig(
        **SMALL,
        global_head_dim=32,
        num_hidden_layers=4,
        layer_types=[S, F, S, F],
        hidden_size_per_layer_input=0,
    )


def gemma3_config() -> Gemma3TextConfig:
    rope = {
        F: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        S: {"rope_type": "default", "rope_theta": 1e4},
    }
    return Gemma3TextConfig(**SMALL, num_hidden_layers=3, layer_types=[S, S, F], rope_parameters=rope)


def ours_per_layer_type(config, gemma4: bool) -> dict[str, tuple[torch.Tensor, float]]:
    """What our Gemma layers use: each layer type's head dim and config view, from plan_layers."""
    plans = {p.layer_type: p for p in plan_layers(config, gemma4=gemma4)}
    return {t: inverse_frequencies(p.rope_config, p.head_dim, t) for t, p in plans.items()}


def powers(theta: float, count: int, d: int) -> torch.Tensor:
    """theta^(-2j/d) for j < count."""
    return torch.tensor([theta ** (-2 * j / d) for j in range(count)], dtype=torch.float64)


def assert_freqs(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0.0)


def test_gemma4_frequencies_per_layer_type():
    # Sliding layers: default RoPE over head_dim 16. Full attention: proportional RoPE whose exponent's
    # denominator is global_head_dim 32; int(0.25 * 32 / 2) = 4 frequencies rotate, the other 12 are 0.
    freqs = ours_per_layer_type(gemma4_config(), gemma4=True)
    assert_freqs(freqs[S][0], powers(1e4, 8, 16))
    assert_freqs(freqs[F][0], torch.cat((powers(1e6, 4, 32), torch.zeros(12, dtype=torch.float64))))
    assert freqs[S][1] == freqs[F][1] == 1.0


def test_gemma3_frequencies_per_layer_type():
    freqs = ours_per_layer_type(gemma3_config(), gemma4=False)
    assert_freqs(freqs[S][0], powers(1e4, 8, 16))
    assert_freqs(freqs[F][0], powers(1e6, 8, 16) / 8.0)  # linear scaling: positions / factor


def test_proportional_rope_rotates_pairs_half_a_head_apart():
    """Channel j pairs with j + d/2 over the whole head; channels of zero frequency are left as they are."""
    inv_freq, _ = ours_per_layer_type(gemma4_config(), gemma4=True)[F]
    rope = RotaryEmbedding(inv_freq)
    pos = torch.tensor([7])
    for j in (0, 3, 4, 15):
        x = torch.zeros(1, 1, 32)
        x[..., j] = 1.0
        (y,) = rope(pos, x)
        angle = 7 * inv_freq[j].item()
        want = torch.zeros(32)
        want[j], want[j + 16] = math.cos(angle), math.sin(angle)
        torch.testing.assert_close(y[0, 0], want)


# Every rope_type we support, in the configs of the supported families.
HF_CASES = {
    "qwen2_default": lambda: Qwen2Config(**SMALL),
    "qwen2_yarn": lambda: Qwen2Config(
        **SMALL,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 1e6,
            "factor": 4.0,
            "original_max_position_embeddings": 128,
        },
    ),
    "qwen3_yarn_mscale": lambda: Qwen3Config(
        **SMALL,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 1e6,
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
            "beta_fast": 16,
        },
    ),
    "qwen3_moe_default": lambda: Qwen3MoeConfig(**SMALL),
    "gemma3": gemma3_config,
    "gemma4": gemma4_config,
}


def hf_rotary(config):
    """transformers' own rotary module of that model family (it resolves per-layer head dims itself)."""
    prefix = {"qwen2": "Qwen2", "qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe"}
    kind = config.model_type.removesuffix("_text")
    module = importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
    name = prefix.get(kind, kind.capitalize() + ("Text" if kind == "gemma4" else ""))
    return getattr(module, f"{name}RotaryEmbedding")(config)


@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_frequencies_match_installed_transformers(case):
    config = HF_CASES[case]()
    hf = hf_rotary(config)
    if config.model_type.startswith("gemma"):
        ours = ours_per_layer_type(config, gemma4=config.model_type == "gemma4_text")
        want = {t: (getattr(hf, f"{t}_inv_freq"), getattr(hf, f"{t}_attention_scaling")) for t in ours}
    else:
        ours = {None: inverse_frequencies(config, config.head_dim)}
        want = {None: (hf.inv_freq, hf.attention_scaling)}
    for layer_type, (inv_freq, scaling) in ours.items():
        torch.testing.assert_close(inv_freq, want[layer_type][0].float(), rtol=1e-6, atol=0.0)
        assert scaling == pytest.approx(want[layer_type][1], rel=1e-12), layer_type
    if case.startswith("qwen") and "yarn" in case:
        assert ours[None][1] != 1.0  # yarn's attention factor is exercised, not just defaulted


def test_unsupported_rope_types_are_refused():
    config = Qwen2Config(**SMALL, rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0})
    with pytest.raises(NotImplementedError, match="dynamic"):
        inverse_frequencies(config, 16)
    config.rope_parameters = {"rope_type": "axial", "rope_theta": 1e4}
    with pytest.raises(NotImplementedError, match="axial"):
        inverse_frequencies(config, 16)
