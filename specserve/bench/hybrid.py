"""What speculation costs on a hybrid target: random weights at Qwen3.5-0.8B's real shapes against a dense
Qwen3 of the same widths, depth and vocabulary (random weights time like trained ones).

Per model, at a cached context: batch-1 decode (one forward of one token, logits included), the
verification forward T(q) of q = 1..8 tokens (checkpointed, as the engine runs it) as T(q) / T(1), and on
the hybrid the rollback of a rejected round: the replay of the accepted prefix that specserve does, against
the per-position states a forward could keep instead (vLLM's way: k + 1 state copies per linear layer
and round, and one copy to commit). Rounds interleave the models; medians.

    OMP_WAIT_POLICY=PASSIVE python -m specserve.bench.hybrid [--context 256] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers

from specserve.layers.gated_deltanet import RecurrentState
from specserve.layers.linear import pack_linears
from specserve.models.registry import build_model
from specserve.worker.model_runner import ModelRunner, PieceInput

BLOCK = 16
QS = range(1, 9)

# Qwen3.5-0.8B's text config (24 layers, [linear x 3, full] x 6), and a dense Qwen3 of the same sizes.
SHAPES = dict(
    vocab_size=248320,
    hidden_size=1024,
    intermediate_size=3584,
    num_hidden_layers=24,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=256,
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)


def hybrid_config() -> transformers.PretrainedConfig:
    return transformers.Qwen3_5TextConfig(
        **SHAPES,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    )


def dense_config() -> transformers.PretrainedConfig:
    return transformers.Qwen3Config(**SHAPES, rope_parameters={"rope_type": "default", "rope_theta": 1e7})


class Timed:
    """One model with `context` tokens cached for one sequence (state slot 0)."""

    def __init__(self, config, context: int):
        model = build_model(config)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.02)
        pack_linears(model)
        self.model = model.eval()
        blocks = -(-(context + max(QS) + 1) // BLOCK)
        self.runner = ModelRunner(model, blocks, BLOCK, torch.float32, num_state_slots=1)
        self.table = list(range(blocks))
        self.context = context
        self.runner.forward([self.piece(list(range(100, 100 + context)), 0)], [context - 1])

    def piece(self, tokens: list[int], start: int, checkpoint: bool = False) -> PieceInput:
        return PieceInput(tokens, start, self.table, state_slot=0, checkpoint=checkpoint)

    def forward_s(self, q: int) -> tuple[float, object]:
        """Seconds of a forward over q new tokens after the context (logits at every row); its output."""
        piece = self.piece([7] * q, self.context, checkpoint=self.model.has_recurrent_state and q > 1)
        start = time.perf_counter()
        out = self.runner.forward([piece], range(q))
        return time.perf_counter() - start, out

    def rollback_s(self, keep: int) -> float:
        """Seconds of rolling the last forward's piece back to its first `keep` tokens."""
        start = time.perf_counter()
        self.runner.commit_states({0: keep})
        return time.perf_counter() - start

    def state_copies_s(self, copies: int) -> float:
        """What keeping per-position states costs: `copies` copies of slot 0's state in every linear layer."""
        states = [c for c in self.runner.kv_caches if isinstance(c, RecurrentState)]
        start = time.perf_counter()
        for state in states:
            for _ in range(copies):
                state.ssm[0].clone()
                state.conv[0].clone()
        return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    models = {"hybrid (Qwen3.5-0.8B shapes)": Timed(hybrid_config(), args.context)}
    models["dense Qwen3, same sizes"] = Timed(dense_config(), args.context)
    times: dict[str, dict[int, list[float]]] = {name: {q: [] for q in QS} for name in models}
    replay: dict[int, list[float]] = {3: [], 7: []}
    copies: dict[int, list[float]] = {3: [], 7: []}
    hybrid = next(iter(models.values()))
    for _ in range(args.repeats):
        for name, timed in models.items():
            for q in QS:
                times[name][q].append(timed.forward_s(q)[0])
        for k in replay:
            hybrid.forward_s(k + 1)
            # a rejection at the middle draft: the anchor and k // 2 accepted drafts are kept
            replay[k].append(hybrid.rollback_s(1 + k // 2))
            copies[k].append(hybrid.state_copies_s(k + 2))
    med = {name: {q: statistics.median(ts) for q, ts in by_q.items()} for name, by_q in times.items()}
    print(f"context {args.context}, fp32, {torch.get_num_threads()} threads, medians of {args.repeats}")
    print(f"{'model':<30} {'decode tok/s':>12} " + " ".join(f"{'T' + str(q) + '/T1':>7}" for q in QS[1:]))
    for name, by_q in med.items():
        ratios = " ".join(f"{by_q[q] / by_q[1]:>7.2f}" for q in QS[1:])
        print(f"{name:<30} {1 / by_q[1]:>12.2f} {ratios}")
    (h, d) = med.values()
    print(f"T(8)/T(1) hybrid / dense: {(h[8] / h[1]) / (d[8] / d[1]):.2f} (goal <= 1.2)")
    for k in replay:
        round_s = h[k + 1]
        r, c = statistics.median(replay[k]), statistics.median(copies[k])
        print(
            f"k = {k}: verify round {round_s * 1e3:.1f} ms; replay rollback {r * 1e3:.2f} ms "
            f"({100 * r / round_s:.1f}% of the round); per-position states {c * 1e3:.2f} ms "
            f"({100 * c / round_s:.1f}%)"
        )


if __name__ == "__main__":
    main()
