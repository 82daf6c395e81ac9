"""Tests for the batched token sampler: exact masks, penalties, statistics, seeded determinism, logprobs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from specserve.config import SamplingParams
from specserve.layers.sampler import (
    SamplingBatch,
    draw_exponential,
    draw_uniform,
    make_generator,
    processed_logprobs,
    sample,
    target_probs,
)

pytestmark = pytest.mark.kernel_agnostic


def _batch(params, vocab, prompts=None, outputs=None, generators=None, generator=None):
    m = len(params)
    return SamplingBatch.build(
        params,
        prompts if prompts is not None else [[] for _ in range(m)],
        outputs if outputs is not None else [[] for _ in range(m)],
        vocab,
        generators,
        generator=generator,
    )


def _logits_from_probs(probs):
    return torch.tensor([math.log(p) for p in probs], dtype=torch.float32)


def _support(probs_row: torch.Tensor) -> list[int]:
    return torch.nonzero(probs_row > 0).flatten().tolist()


P4 = [0.5, 0.3, 0.15, 0.05]


# ---------------------------------------------------------------- greedy and temperature


def test_greedy_is_argmax_lowest_id_on_ties():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [0.0, -1.0, 2.0, 2.0]])
    batch = _batch([SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, top_k=2)], 4)
    assert batch.all_greedy
    assert sample(logits, batch).token_ids.tolist() == [1, 2]
    probs = target_probs(logits, batch)
    assert probs.tolist() == [[0, 1, 0, 0], [0, 0, 1, 0]]


def test_greedy_rows_in_mixed_batch_stay_argmax():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    params = [
        SamplingParams(temperature=0.0, top_p=0.3, min_p=0.2) if i % 2 else SamplingParams() for i in range(6)
    ]
    out = sample(logits, _batch(params, 50))
    assert out.token_ids[1::2].tolist() == logits[1::2].argmax(-1).tolist()


def test_temperature_scales_distribution():
    torch.manual_seed(1)
    logits = torch.randn(3, 20)
    params = [SamplingParams(temperature=t) for t in (0.5, 1.0, 2.0)] + [SamplingParams(temperature=0.0)]
    logits = torch.cat([logits, logits[:1]])
    batch = _batch(params, 20)
    lp = processed_logprobs(logits, batch)
    for i, t in enumerate((0.5, 1.0, 2.0)):
        torch.testing.assert_close(lp[i], torch.log_softmax(logits[i] / t, -1))
    torch.testing.assert_close(lp[3], torch.log_softmax(logits[3], -1))  # greedy: temperature 1
    ent = [-(lp[i].exp() * lp[i]).sum().item() for i in range(3)]
    assert ent[0] < ent[1] < ent[2]
    probs = target_probs(logits, batch)
    torch.testing.assert_close(probs[:3], lp[:3].exp())
    assert probs[3].tolist() == torch.nn.functional.one_hot(logits[3].argmax(), 20).float().tolist()


# ---------------------------------------------------------------- truncation masks


def test_top_k_masks_exactly_and_keeps_ties():
    logits = torch.tensor([[3.0, 2.0, 2.0, 1.0, 0.0]] * 4)
    params = [SamplingParams(top_k=k) for k in (1, 2, 5, 100)]
    probs = target_probs(logits, _batch(params, 5))
    assert _support(probs[0]) == [0]
    assert _support(probs[1]) == [0, 1, 2]  # tie at the 2nd value: both kept (as HF / vLLM)
    assert _support(probs[2]) == [0, 1, 2, 3, 4]
    assert _support(probs[3]) == [0, 1, 2, 3, 4]  # top_k >= V is off
    kept = torch.tensor([3.0, 2.0, 2.0])
    torch.testing.assert_close(probs[1, :3], torch.softmax(kept, -1))


@pytest.mark.parametrize("force_sort", [False, True])
def test_top_p_masks_exactly(force_sort):
    logits = _logits_from_probs(P4).repeat(5, 1)
    params = [SamplingParams(top_p=p) for p in (0.4, 0.6, 0.85, 0.97, 1.0)]
    if force_sort:  # a batch-mate with a large top_k changes the code path, not the result
        logits = torch.cat([logits, logits[:1]])
        params.append(SamplingParams(top_k=3))
    probs = target_probs(logits, _batch(params, 4))
    assert _support(probs[0]) == [0]
    assert _support(probs[1]) == [0, 1]
    assert _support(probs[2]) == [0, 1, 2]
    assert _support(probs[3]) == [0, 1, 2, 3]
    assert _support(probs[4]) == [0, 1, 2, 3]
    torch.testing.assert_close(probs[1, :2], torch.tensor([0.5, 0.3]) / 0.8)


def test_top_p_keeps_ties_at_the_cut():
    logits = _logits_from_probs([0.4, 0.2, 0.2, 0.2])
    probs = target_probs(logits[None], _batch([SamplingParams(top_p=0.5)], 4))
    assert _support(probs[0]) == [0, 1, 2, 3]


@pytest.mark.parametrize("other_row", [None, SamplingParams(top_p=0.9)])
def test_top_p_applies_to_top_k_renormalised_distribution(other_row):
    # top_k=2 renormalises to [0.625, 0.375]; top_p=0.6 then keeps one token (without top-k it keeps two)
    logits = _logits_from_probs(P4)[None]
    params = [SamplingParams(top_k=2, top_p=0.6)]
    if other_row is not None:  # a top-p row without top-k forces the full-sort path
        params.append(other_row)
        logits = logits.repeat(2, 1)
    batch = _batch(params, 4)
    assert batch.top_p_within_top_k == (other_row is None)
    assert _support(target_probs(logits, batch)[0]) == [0]


@pytest.mark.parametrize("other_row", [None, SamplingParams(top_p=0.9)])
def test_top_k_ties_spilling_past_subset_keep_exact_masses(other_row):
    # top_k=2 keeps 5 tokens (4 tied at the 2nd value); top-p must see all of their mass
    logits = torch.tensor([[2.0, 1.0, 1.0, 1.0, 1.0, 0.0]])
    params = [SamplingParams(top_k=2, top_p=0.5)]
    if other_row is not None:
        params.append(other_row)
        logits = logits.repeat(2, 1)
    probs = target_probs(logits, _batch(params, 6))
    # renormalised over 5 tokens: e^2/(e^2+4e) ~ 0.405 < 0.5, so the cut falls in the tie group: keep all 5
    assert _support(probs[0]) == [0, 1, 2, 3, 4]
    torch.testing.assert_close(probs[0, :5], torch.softmax(logits[0, :5], -1))


@pytest.mark.parametrize("force_sort", [False, True])
def test_top_p_near_one_never_undoes_top_k(force_sort):
    # rounding can leave the top-k mass just below a top_p of 1 - 2**-24; the top-k cut must survive
    top_p = float(np.nextafter(np.float32(1), np.float32(0)))
    params = [SamplingParams(top_k=8, top_p=top_p)] + ([SamplingParams(top_p=0.5)] if force_sort else [])
    for seed in range(40):
        logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(seed)).repeat(len(params), 1)
        assert (target_probs(logits, _batch(params, 64))[0] > 0).sum() == 8


def _ref_top_p_support(logits: torch.Tensor, top_p: float) -> list[int]:
    """float64 reference: smallest descending prefix reaching top_p, ties at the cut kept."""
    x = logits.double()
    vals = x.sort(descending=True).values
    probs = torch.softmax(vals, 0)
    n_keep = int(((probs.cumsum(0) - probs) < top_p).sum())
    return torch.nonzero(x >= vals[n_keep - 1]).flatten().tolist()


@pytest.mark.parametrize("scale", [4.0, 0.05])  # peaked: topk() candidates suffice; flat: full-sort fallback
def test_top_p_large_vocab_matches_reference(scale):
    vocab = 6000
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(2)) * scale
    params = [SamplingParams(top_p=p) for p in (0.5, 0.9, 1.0)]
    probs = target_probs(logits, _batch(params, vocab))
    for i, p in enumerate((0.5, 0.9, 1.0)):
        support = _support(probs[i])
        assert support == _ref_top_p_support(logits[i], p)
        torch.testing.assert_close(probs[i, support], torch.softmax(logits[i, support], 0))
    if scale < 1:
        assert len(_support(probs[1])) > 1024  # the cut lies past the candidates


def test_min_p_masks_relative_to_max_after_temperature():
    logits = _logits_from_probs(P4).repeat(3, 1)
    params = [
        SamplingParams(min_p=0.2),
        SamplingParams(min_p=0.5),
        SamplingParams(min_p=0.2, temperature=0.5),
    ]
    probs = target_probs(logits, _batch(params, 4))
    assert _support(probs[0]) == [0, 1, 2]  # p >= 0.1
    assert _support(probs[1]) == [0, 1]  # p >= 0.25
    # at T=0.5 probs ~ p^2: [0.25, 0.09, 0.0225, 0.0025] / Z; cut at 0.2 * 0.25 = 0.05 keeps 2
    assert _support(probs[2]) == [0, 1]


def test_all_masks_together_and_no_mutation():
    logits = _logits_from_probs(P4)[None].to(torch.bfloat16)
    before = logits.clone()
    params = [SamplingParams(top_k=3, top_p=0.9, min_p=0.35, repetition_penalty=1.3, temperature=0.8)]
    batch = _batch(params, 4, prompts=[[3]], outputs=[[3]])
    processed_logprobs(logits, batch)
    sample(logits, batch)
    assert torch.equal(logits, before)


# ---------------------------------------------------------------- penalties


def test_penalties_hand_made():
    logits = torch.tensor([[1.0, 2.0, -2.0, 4.0, 0.5]] * 2)
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(temperature=0.0),
    ]
    prompts = [[1, 2], [1, 2]]
    outputs = [[2, 3, 3], [2, 3, 3]]
    batch = _batch(params, 5, prompts, outputs)
    lp = processed_logprobs(logits, batch)
    # rep on prompt+output {1,2,3}: 2->1, -2->-4, 4->2; then output counts {2:1, 3:2}
    expected = torch.tensor([1.0, 1.0, -4.0 - 0.25 - 0.5, 2.0 - 0.5 - 0.5, 0.5])
    torch.testing.assert_close(lp[0], torch.log_softmax(expected, -1))
    torch.testing.assert_close(lp[1], torch.log_softmax(logits[1], -1))  # no penalties: untouched
    assert sample(logits, batch).token_ids.tolist() == [0, 3]  # ties (1.0, 1.0) -> lowest id


def test_a_vanishing_repetition_penalty_keeps_logits_finite():
    """5e-324 is > 0 as the client's float but 0 in fp32: the boosted logits stay finite, and top-k and
    top-p beside them still give a proper distribution (an inf there made the row's softmax NaN)."""
    logits = torch.tensor([[1.0, 2.0, -2.0, 4.0, 0.5]])
    params = [SamplingParams(temperature=1.0, top_k=3, top_p=0.9, repetition_penalty=5e-324)]
    batch = _batch(params, 5, [[1, 2]], [[]], generator=torch.Generator().manual_seed(0))
    lp = processed_logprobs(logits, batch)
    assert not lp.isnan().any()
    assert sample(logits, batch).token_ids.tolist() == [1]  # the boosted positive logit


def test_a_vanishing_repetition_penalty_leaves_masked_tokens_masked():
    """A grammar's mask (-inf) on tokens the penalty applies to stays -inf under a penalty of 0 in fp32
    (-inf x 0 was NaN, and greedy picked the masked token: "token broke the request's output
    constraint", found by the schemathesis load test with json_object)."""
    logits = torch.tensor([[float("-inf"), 2.0, float("-inf"), -1.0, float("-inf")]])
    params = [SamplingParams(temperature=0.0, top_k=1, repetition_penalty=5e-324)]
    batch = _batch(params, 5, [[0, 2, 3]], [[4]], generator=torch.Generator().manual_seed(0))
    lp = processed_logprobs(logits, batch)
    assert not lp.isnan().any() and lp[0, [0, 2, 4]].isneginf().all()
    assert sample(logits, batch).token_ids.tolist() == [1]


def test_presence_and_frequency_ignore_prompt_tokens():
    logits = torch.zeros(1, 4)
    params = [SamplingParams(temperature=0.0, presence_penalty=1.0, frequency_penalty=1.0)]
    lp = processed_logprobs(logits, _batch(params, 4, [[0, 0, 1]], [[2]]))
    torch.testing.assert_close(lp[0], torch.log_softmax(torch.tensor([0.0, 0.0, -2.0, 0.0]), -1))


def test_penalty_rows_for_speculative_verification():
    # one entry per ROW: row j of a request sees the first j drafts as emitted output
    p = SamplingParams(temperature=0.0, presence_penalty=1.0)
    drafts = [3, 1]
    outputs = [[0] + drafts[:j] for j in range(3)]
    batch = _batch([p] * 3, 5, [[4]] * 3, outputs)
    lp = processed_logprobs(torch.zeros(3, 5), batch)
    shifted = lp - lp.max(dim=-1, keepdim=True).values
    assert shifted.round().tolist() == [[-1, 0, 0, 0, 0], [-1, 0, 0, -1, 0], [-1, -1, 0, -1, 0]]


# ---------------------------------------------------------------- statistics


def _chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    keep = probs > 0
    assert counts[~keep].sum() == 0, "sampled a token outside the support"
    expected = probs[keep] / probs[keep].sum() * counts.sum()
    return float(chisquare(counts[keep], expected).pvalue)


def test_samples_match_target_probs_chi_square():
    vocab, n = 40, 20_000
    gen = torch.Generator().manual_seed(1234)
    logits = torch.randn(vocab, generator=gen) * 1.5
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9)
    batch = _batch([params] * n, vocab, generator=torch.Generator().manual_seed(7))
    out = sample(logits.expand(n, vocab), batch)
    counts = np.bincount(out.token_ids.numpy(), minlength=vocab)
    probs = target_probs(logits[None], _batch([params], vocab))[0].double().numpy()
    support = (probs > 0).sum()
    assert 3 < support < 20  # top-p really cut inside the top-k set
    assert probs[probs > 0].min() * n > 20  # chi-square validity
    assert _chi2_pvalue(counts, probs) > 1e-3
    # power: the same counts must reject nearby wrong distributions
    for wrong in (
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9),
        SamplingParams(temperature=0.7, top_k=20),
    ):
        wrong_probs = target_probs(logits[None], _batch([wrong], vocab))[0].double().numpy()
        support_ok = counts[wrong_probs == 0].sum() == 0
        assert not support_ok or _chi2_pvalue(counts, wrong_probs) < 1e-6


def test_seeded_rows_sample_the_target_distribution():
    vocab, n = 12, 3000
    logits = torch.linspace(-1.0, 1.5, vocab)
    params = SamplingParams(temperature=1.2, min_p=0.1, seed=0)
    gens = [make_generator(i) for i in range(n)]
    out = sample(logits.expand(n, vocab), _batch([params] * n, vocab, generators=gens))
    counts = np.bincount(out.token_ids.numpy(), minlength=vocab)
    probs = target_probs(logits[None], _batch([params], vocab))[0].double().numpy()
    assert _chi2_pvalue(counts, probs) > 1e-3


# ---------------------------------------------------------------- seeds and batch invariance


def test_seeded_row_independent_of_batch_composition():
    vocab, steps = 1000, 6
    torch.manual_seed(3)
    target = torch.randn(steps, vocab) * 0.3  # flat-ish: tokens vary from step to step
    p = SamplingParams(temperature=1.0, top_k=500, seed=42)

    gen = make_generator(42)
    alone = [
        sample(target[s][None], _batch([p], vocab, generators=[gen])).token_ids.item() for s in range(steps)
    ]
    assert len(set(alone)) > 1

    others = [
        (SamplingParams(seed=1), make_generator(1)),
        (SamplingParams(temperature=0.5), None),
        (SamplingParams(temperature=0.0), None),
        (SamplingParams(top_p=0.8, presence_penalty=0.5), None),
        (SamplingParams(seed=43, top_k=3), make_generator(43)),
        (SamplingParams(min_p=0.05), None),
        (SamplingParams(temperature=0.0, seed=5), make_generator(5)),
    ]
    params = [o[0] for o in others[:3]] + [p] + [o[0] for o in others[3:]]
    gen = make_generator(42)
    gens = [o[1] for o in others[:3]] + [gen] + [o[1] for o in others[3:]]
    shared = torch.Generator().manual_seed(99)
    in_batch = []
    for s in range(steps):
        logits = torch.randn(8, vocab)
        logits[3] = target[s]
        batch = _batch(params, vocab, [[1, 2]] * 8, [[5]] * 8, generators=gens, generator=shared)
        in_batch.append(sample(logits, batch).token_ids[3].item())
    assert in_batch == alone


def test_same_seed_same_token_and_shared_generator_reproducible():
    logits = torch.randn(4, 300)
    p = [SamplingParams(seed=7)] * 4
    a = sample(logits, _batch(p, 300, generators=[make_generator(7) for _ in range(4)])).token_ids
    b = sample(logits, _batch(p, 300, generators=[make_generator(7) for _ in range(4)])).token_ids
    assert torch.equal(a, b)
    u = [SamplingParams()] * 4
    c = sample(logits, _batch(u, 300, generator=torch.Generator().manual_seed(3))).token_ids
    d = sample(logits, _batch(u, 300, generator=torch.Generator().manual_seed(3))).token_ids
    assert torch.equal(c, d)


def test_draw_helpers_route_generators():
    params = [SamplingParams(seed=5), SamplingParams(), SamplingParams(temperature=0.0), SamplingParams()]
    shared = torch.Generator().manual_seed(11)
    batch = _batch(params, 10, generators=[make_generator(5), None, None, None], generator=shared)
    u = draw_uniform(batch, 6)
    assert torch.equal(u[0], torch.empty(6).uniform_(generator=make_generator(5)))
    assert torch.equal(u[[1, 3]], torch.empty(2, 6).uniform_(generator=torch.Generator().manual_seed(11)))
    assert u[2].tolist() == [0.0] * 6  # greedy rows draw nothing
    e = draw_exponential(batch, 6)
    assert (e > 0).all() and e[2].tolist() == [1.0] * 6


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_raw_model_logprobs():
    torch.manual_seed(5)
    logits = (torch.randn(5, 64) * 2).to(torch.bfloat16)
    params = [
        SamplingParams(temperature=0.6, top_k=10, repetition_penalty=1.5),
        SamplingParams(temperature=0.0),
        SamplingParams(top_p=0.5, frequency_penalty=1.0),
        SamplingParams(temperature=1.7, min_p=0.1),
        SamplingParams(temperature=0.0, presence_penalty=2.0),
    ]
    batch = _batch(params, 64, [[1, 2, 3]] * 5, [[4, 4]] * 5)
    out = sample(logits, batch, num_logprobs=3)
    raw = torch.log_softmax(logits.float(), -1)
    torch.testing.assert_close(out.logprobs, raw.gather(1, out.token_ids[:, None]).squeeze(1))
    top = raw.topk(3, -1)
    ids, values = out.top_logprobs
    torch.testing.assert_close(values, top.values)
    assert torch.equal(ids, top.indices)
    assert values.dtype == torch.float32 and out.logprobs.shape == (5,)
    assert sample(logits, batch, num_logprobs=0).top_logprobs is None
    assert sample(logits, batch).logprobs is None


# ---------------------------------------------------------------- property test


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    vocab=st.integers(2, 24),
    temperature=st.sampled_from([0.0, 0.3, 1.0, 2.5]),
    top_k=st.one_of(st.just(-1), st.integers(1, 30)),
    top_p=st.one_of(st.just(1.0), st.floats(0.05, 1.0)),
    min_p=st.one_of(st.just(0.0), st.floats(0.0, 0.9)),
    force_sort=st.booleans(),
)
def test_processed_probs_valid_and_truncated(data, vocab, temperature, top_k, top_p, min_p, force_sort):
    values = data.draw(st.lists(st.integers(-8, 8), min_size=vocab, max_size=vocab))
    logits = torch.tensor(values, dtype=torch.float32) / 2  # coarse grid: many ties
    p = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    params, rows = [p], logits[None]
    if force_sort:
        params, rows = [p, SamplingParams(top_p=0.7)], logits.expand(2, vocab)
    probs = torch.exp(processed_logprobs(rows, _batch(params, vocab)))[0].double()
    assert torch.isfinite(probs).all() and (probs >= 0).all()
    assert abs(probs.sum().item() - 1) < 1e-5

    x = (logits / (temperature if temperature >= 1e-5 else 1.0)).double()
    kept = probs > 0
    assert kept[x.argmax()]
    lo = x[kept].min()
    assert torch.equal(kept, x >= lo)  # support is exactly a top set (ties kept together)
    if 0 < top_k < vocab:
        assert (x[kept] >= x.sort(descending=True).values[top_k - 1]).all()
        q = torch.softmax(torch.where(x >= x.sort(descending=True).values[top_k - 1], x, -math.inf), 0)
    else:
        q = torch.softmax(x, 0)
    # top-p minimality: the tokens strictly above the last kept value did not already reach top_p
    assert q[x > lo].sum() < top_p + 1e-5
    if min_p == 0.0:
        assert q[kept].sum() >= top_p - 1e-5  # top-p sufficiency
    else:
        pm = torch.softmax(x, 0)
        assert (pm[kept] >= min_p * pm.max() * (1 - 1e-5)).all()
