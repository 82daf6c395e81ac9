"""The compiled Gated DeltaNet recurrence (specserve/layers/kernels/delta_rule.cpp): against the recurrence in
fp64, every ISA path bitwise equal to the scalar one, batch invariance (a token's output and state are the
same whatever the other pieces and however many tokens follow), and a rollback bitwise equal to the state
the forward held. Skipped where the kernels are not built; the layers then run the torch recurrence
(tests/test_hybrid.py runs the layer both ways)."""

from __future__ import annotations

import pytest
import torch

from specserve.layers import kernels
from specserve.layers.gated_deltanet import l2norm, recurrent_delta_rule, repeat_heads

ops = kernels.load_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="specserve's kernels are not built here")
ISAS = [0, 1, 2][: ops.best_isa() + 1] if ops is not None else []  # scalar, AVX2, AVX-512
# (heads, key heads, d_k, d_v): Qwen3.5's 16 x 128 x 128; fewer key heads; columns past whole vectors/tiles
SHAPES = [(16, 16, 128, 128), (4, 2, 16, 16), (3, 1, 24, 40), (2, 2, 8, 100)]


def inputs(shape, lengths: list[int], seed: int, slots: int = 6):
    heads, key_heads, dk, dv = shape
    gen = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    return dict(
        q=l2norm(torch.randn(n, key_heads, dk, generator=gen)) * dk**-0.5,
        k=l2norm(torch.randn(n, key_heads, dk, generator=gen)),
        v=torch.randn(n, heads, dv, generator=gen),
        decay=torch.rand(n, heads, generator=gen).mul(0.5).add(0.5),
        beta=torch.rand(n, heads, generator=gen),
        state0=torch.randn(len(lengths), heads, dk, dv, generator=gen),
        pool=torch.full((slots, heads, dk, dv), float("nan")),
    )


def run(x, lengths: list[int], slots: list[int], isa: int = -1, pieces: list[int] | None = None):
    """The pieces (all by default, rows back to back in order) through the kernel: (out, deltas, pool)."""
    pieces = list(range(len(lengths))) if pieces is None else pieces
    starts = [sum(lengths[:p]) for p in range(len(lengths))]
    pool, out, deltas = x["pool"].clone(), torch.zeros_like(x["v"]), torch.zeros_like(x["v"])
    ops.delta_rule_recurrent(
        x["state0"], pool, torch.tensor(pieces), torch.tensor([slots[p] for p in pieces]),
        [starts[p] for p in pieces], [lengths[p] for p in pieces],
        x["q"], x["k"], x["v"], x["decay"], x["beta"], out, deltas, isa,
    )  # fmt: skip
    return out, deltas, pool


def reference(x, lengths: list[int], dtype=torch.float64):
    """recurrent_delta_rule (torch ops) per piece in `dtype`: (out [N, heads, d_v], states [P, ...])."""
    heads = x["v"].shape[1]
    outs, states, at = [], [], 0
    for p, n in enumerate(lengths):
        rows = slice(at, at + n)
        q, k = (repeat_heads(x[name][rows], heads)[None].to(dtype) for name in ("q", "k"))
        v, decay, beta = (x[name][rows][None].to(dtype) for name in ("v", "decay", "beta"))
        s, o, _ = recurrent_delta_rule(
            x["state0"][p : p + 1].to(dtype), q, k, v, decay, beta, torch.ones(1, n, dtype=torch.bool)
        )
        outs.append(o[0])
        states.append(s[0])
        at += n
    return torch.cat(outs), torch.stack(states)


@pytest.mark.parametrize("shape", SHAPES)
def test_recurrence_against_fp64(shape):
    lengths, slots = [8, 1, 5], [4, 0, 2]
    x = inputs(shape, lengths, seed=1)
    out, _, pool = run(x, lengths, slots)
    want_out, want_states = reference(x, lengths)
    # fp32 through d_k-long sums: the torch recurrence in fp32 is as far from fp64
    got32, states32 = reference(x, lengths, torch.float32)
    tol = 4 * max((got32 - want_out).abs().max().item(), (states32 - want_states).abs().max().item(), 1e-6)
    assert (out.double() - want_out).abs().max().item() <= tol
    assert (pool[slots].double() - want_states).abs().max().item() <= tol
    untouched = [s for s in range(len(x["pool"])) if s not in slots]
    assert pool[untouched].isnan().all()


@pytest.mark.parametrize("shape", SHAPES)
def test_every_isa_path_equals_the_scalar_one_bitwise(shape):
    lengths, slots = [8, 3], [1, 5]
    x = inputs(shape, lengths, seed=2)
    scalar = run(x, lengths, slots, isa=0)
    for isa in [*ISAS, -1]:
        for got, want in zip(run(x, lengths, slots, isa=isa), scalar, strict=True):
            assert torch.equal(got.nan_to_num(), want.nan_to_num()), f"path {isa}"


@pytest.mark.parametrize("isa", [0, *ISAS])
def test_updating_the_slots_in_place_equals_starting_from_a_copy(isa):
    """state0 the pool itself, index the slots (the decode path: no copy of the states): bitwise the
    outputs, deltas and states of the same pieces started from a copy, the other slots untouched."""
    lengths, slots = [3, 1, 6], [4, 0, 2]
    x = inputs(SHAPES[0], lengths, seed=7)
    want = run(x, lengths, slots, isa=isa)
    pool = x["pool"].clone()
    pool[slots] = x["state0"]
    out, deltas = torch.zeros_like(x["v"]), torch.zeros_like(x["v"])
    index = torch.tensor(slots)
    starts = [sum(lengths[:p]) for p in range(len(lengths))]
    ops.delta_rule_recurrent(
        pool, pool, index, index, starts, lengths,
        x["q"], x["k"], x["v"], x["decay"], x["beta"], out, deltas, isa,
    )  # fmt: skip
    assert torch.equal(out, want[0]) and torch.equal(deltas, want[1])
    assert torch.equal(pool[slots], want[2][slots])
    untouched = [s for s in range(len(pool)) if s not in slots]
    assert pool[untouched].isnan().all()


@pytest.mark.parametrize("shape", SHAPES[:2])
def test_a_token_is_the_same_whatever_else_is_computed(shape):
    lengths, slots = [8, 2, 6], [3, 1, 0]
    x = inputs(shape, lengths, seed=3)
    out, deltas, pool = run(x, lengths, slots)
    # the middle piece alone
    alone_out, alone_deltas, alone_pool = run(x, lengths, slots, pieces=[1])
    assert torch.equal(alone_out[8:10], out[8:10]) and torch.equal(alone_deltas[8:10], deltas[8:10])
    assert torch.equal(alone_pool[1], pool[1])
    # the first piece one token at a time, each step from the state the last one left
    state = x["state0"][0:1].clone()
    for t in range(8):
        step = {name: x[name][t : t + 1] for name in ("q", "k", "v", "decay", "beta")}
        step.update(state0=state, pool=torch.zeros(1, *state.shape[1:]))
        step_out, step_deltas, state = run(step, [1], [0])
        assert torch.equal(step_out[0], out[t]) and torch.equal(step_deltas[0], deltas[t]), f"token {t}"
    assert torch.equal(state[0], pool[3])


@pytest.mark.parametrize("shape", SHAPES[:3])
def test_rollback_replays_the_forward_bitwise(shape):
    lengths, slots = [8, 5], [2, 4]
    x = inputs(shape, lengths, seed=4)
    _, deltas, _ = run(x, lengths, slots)
    t = max(lengths)
    rows = torch.tensor([[min(sum(lengths[:p]) + j, sum(lengths) - 1) for j in range(t)] for p in range(2)])
    k, decay, kept_deltas = x["k"][rows], x["decay"][rows], deltas[rows]
    for keep_a, keep_b in ((1, 5), (4, 2), (8, 1)):
        pool = x["pool"].clone()
        ops.delta_rule_replay(
            pool, torch.tensor(slots), x["state0"], k, decay, kept_deltas, [0, 1], [keep_a, keep_b]
        )
        for p, keep in enumerate((keep_a, keep_b)):
            at = sum(lengths[:p])
            prefix = {name: x[name][at : at + keep] for name in ("q", "k", "v", "decay", "beta")}
            prefix.update(state0=x["state0"][p : p + 1], pool=torch.zeros(1, *x["state0"].shape[1:]))
            assert torch.equal(pool[slots[p]], run(prefix, [keep], [0])[2][0]), (p, keep)
    pool = x["pool"].clone()
    ops.delta_rule_replay(pool, torch.tensor(slots), x["state0"], k, decay, kept_deltas, [1], [3])
    assert pool[slots[0]].isnan().all()  # a piece not named keeps its slot


def test_shape_and_range_checks():
    lengths = [3]
    x = inputs((4, 2, 16, 16), lengths, seed=5)
    with pytest.raises(RuntimeError, match="rows out of range"):
        run(x, [4], [0])
    with pytest.raises(RuntimeError, match="index or slot out of range"):
        run(x, lengths, [9])
    x["k"] = x["k"][:, :1].contiguous()
    with pytest.raises(RuntimeError, match="q, k"):
        run(x, lengths, [0])
