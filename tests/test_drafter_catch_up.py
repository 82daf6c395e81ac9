"""A hidden-state drafter's catch-up (HiddenStateDrafter.catch_up): a round whose pending context rows (a new
request's whole prompt, or features collected over steps without a round) exceed what one forward may hold
(`max_forward_rows`, what `activation_bytes` measures) writes the excess beforehand in forwards of at most
that many rows. On the CPU the kernels are batch-invariant, so a drafter with a limit of a few rows drafts
bitwise as one without: the same drafts, q rows, confidences and draft cache, through static buffers too."""

from __future__ import annotations

import inspect
from dataclasses import replace

import pytest
import torch

from specserve import SamplingParams
from specserve.core.cache_coordinator import DrafterCaches
from specserve.core.sequence import Sequence
from specserve.models.loader import load_model
from specserve.models.prepare import prepare_model
from specserve.spec_decode.drafters.draft_model import DraftModelDrafter
from specserve.spec_decode.drafters.dspark import DSparkDrafter
from specserve.spec_decode.drafters.eagle3 import Eagle3Drafter
from specserve.worker.cuda_graphs import GraphConfig
from tests.test_dspark import fake_target, make_drafter_model, make_eagle3_model, targets  # noqa: F401
from tests.tiny_models import VOCAB

pytestmark = pytest.mark.kernel_agnostic

BLOCK = 4
LIMIT = 4  # rows a chunked drafter's forward may hold: a few, against prompts of up to 30
LENGTH = 40
# Rounds: request -> its anchor. The first feeds two whole prompts (47 rows), the second a new one (25)
# beside a few rows of the others; request 1 skips a round (its features accumulate), request 3 is short
# and is proposed for again without a new row.
ROUNDS = [
    {0: 30, 1: 17},
    {0: 33, 1: 19, 2: 25},
    {0: 34, 2: 28},
    {0: 38, 1: 27, 2: 30, 3: 9},
    {3: 9, 1: 39},  # request 3 again without new rows, beside more than a forward's
]
STATIC = GraphConfig(max_tokens=16, max_pieces=4, max_blocks=16, capture=False)


def bound_drafter(model, drafter_type, max_rows: int, graphs=None, **kwargs):
    """A drafter whose engine steps hold `max_rows` tokens, its caches bound, and the rows of every forward
    it runs recorded in `drafter.rows`: (query rows, K/V-only rows)."""
    drafter = drafter_type(model, replace(fake_target(BLOCK), max_num_batched_tokens=max_rows), **kwargs)
    drafter.graph_config = graphs
    drafter.bind_caches(DrafterCaches.standalone(drafter.cache_spec(BLOCK), 64, BLOCK, max_num_seqs=4))
    drafter.rows = []
    for name in ("run_forward", "eager_forward"):  # (run_forward's eager path is recorded twice)
        real = getattr(drafter, name)

        def forward(*args, real=real, **kwargs):
            call = inspect.signature(real).bind(*args, **kwargs)
            call.apply_defaults()
            token_ids, kv_only = call.arguments["token_ids"], call.arguments["kv_only"]
            drafter.rows.append((sum(map(len, token_ids)), len(kv_only[0])))
            return real(*args, **kwargs)

        setattr(drafter, name, forward)
    return drafter


def same_rounds(model, drafter_type, graphs=None, **kwargs):
    """The rounds through a drafter without a limit and one with LIMIT (through `graphs`): bitwise the same
    proposals and draft caches. Returns the chunked drafter."""
    prepare_model(model, None)
    plain = bound_drafter(model, drafter_type, 2048, **kwargs)
    chunked = bound_drafter(model, drafter_type, LIMIT, graphs, **kwargs)
    assert chunked.max_forward_rows == LIMIT
    g = torch.Generator().manual_seed(0)
    tokens = [torch.randint(3, VOCAB - 1, (LENGTH,), generator=g).tolist() for _ in range(4)]
    features = [torch.randn(LENGTH, plain.feature_width, generator=g) for _ in range(4)]
    fed = [0] * 4
    params = SamplingParams(temperature=1.0, max_tokens=64, ignore_eos=True)
    for anchors in ROUNDS:
        seqs, fresh = [], []
        for r, a in anchors.items():
            fresh.append(a > fed[r])
            seq = Sequence(f"r{r}", tokens[r][:1], params, 64, output_token_ids=tokens[r][1 : a + 1])
            for drafter in (plain, chunked):  # in pieces of 5 rows, as a prompt's prefill chunks hand them
                for start in range(fed[r], a, 5):
                    drafter.observe(seq, start, features[r][start : min(start + 5, a)])
            fed[r] = a
            seqs.append(seq)
        proposals = zip(plain.propose(seqs, 3), chunked.propose(seqs, 3), fresh, strict=True)
        for p, c, new_rows in proposals:
            # (EAGLE-3 drafts from a request's newest row: none without one)
            assert c.token_ids == p.token_ids and (len(p.token_ids) == 3 or not new_rows)
            if p.token_ids:
                assert torch.equal(c.probs, p.probs)
                assert torch.equal(c.confidences, p.confidences)
    for a, b in zip(plain.caches, chunked.caches, strict=True):
        assert torch.equal(a.k, b.k[: a.k.shape[0]]) and torch.equal(a.v, b.v[: a.v.shape[0]])
    if plain.reads_next_token:  # the features kept with the full blocks
        assert torch.equal(plain.group.last_features, chunked.group.last_features)
    assert len(chunked.rows) > len(plain.rows)  # it did chunk
    return chunked


@pytest.mark.parametrize("graphs", [None, STATIC], ids=["eager", "static"])
@pytest.mark.parametrize(
    "config", [{}, {"markov_rank": 0, "confidence_head": False}], ids=["dspark", "dflash"]
)
def test_dspark_context_rows_in_chunks_draft_bitwise_the_same(targets, config, graphs):  # noqa: F811
    """The context rows are K/V-only: every forward writes at most LIMIT of them (a round's block rows, 4
    per request, are its query rows)."""
    drafter = same_rounds(make_drafter_model(targets, **config), DSparkDrafter, graphs)
    assert max(kv for _, kv in drafter.rows) == LIMIT
    assert max(query for query, _ in drafter.rows) <= BLOCK * 4
    if graphs is not None:
        assert drafter.graphs._inputs  # the rounds' forwards went through the static buffers


@pytest.mark.parametrize("graphs", [None, STATIC], ids=["eager", "static"])
def test_eagle3_context_rows_in_chunks_draft_bitwise_the_same(targets, graphs):  # noqa: F811
    """The context rows are query rows: every forward holds at most LIMIT, each request's newest one in
    the round's forward (it drafts d1); the kept last-row features of full blocks are the same too."""
    drafter = same_rounds(make_eagle3_model(targets), Eagle3Drafter, graphs, max_num_tokens=3)
    assert max(query for query, _ in drafter.rows) == LIMIT
    assert all(kv == 0 for _, kv in drafter.rows)
    if graphs is not None:
        assert drafter.graphs._inputs


@pytest.mark.parametrize("max_rows, dspark_queries", [(7, 16), (40, 40)])
def test_activation_probe_measures_the_bounded_forward(targets, max_rows, dspark_queries):  # noqa: F811
    """`activation_bytes` probes a forward of `max_forward_rows` rows of each kind the drafter reads: query
    rows, and K/V-only rows where it has them (DSpark's context); DSpark's query rows are at least a
    round's blocks, 4 rows for each of fake_target's 4 requests."""
    drafters = {
        DSparkDrafter(make_drafter_model(targets), fake_target(BLOCK)): (dspark_queries, max_rows),
        Eagle3Drafter(make_eagle3_model(targets), fake_target(BLOCK), 3): (max_rows, 0),
    }
    for drafter, probed in drafters.items():
        probes = []
        drafter.max_forward_rows = max_rows
        drafter._probe_bytes = lambda query, kv, block_size, probes=probes: probes.append((query, kv)) or 0
        drafter.activation_bytes(fake_target(BLOCK))
        assert probes == [probed]


@pytest.mark.parametrize(
    "arch, graphs", [("qwen2", None), ("qwen2", STATIC), ("qwen3_5", None)]
)  # attention only, eager and through static buffers; a hybrid's committed state
def test_draft_model_feeds_a_long_backlog_in_chunks_drafting_bitwise_the_same(tiny_model_dir, arch, graphs):
    """A draft model's round first feeds every token its cache has not seen (a new request's whole prompt):
    beyond `max_forward_tokens`, the oldest go in forwards of their own beforehand, into the committed
    state, and the round's forward keeps each request's newest token. Drafts and q rows bitwise as without
    a limit; no forward feeds more than LIMIT tokens but for the rows a round needs (one per request)."""
    model = load_model(str(tiny_model_dir(arch)))[0]
    drafters, fed_per_forward = [], []
    for limit, graph_config in ((2048, None), (LIMIT, graphs)):
        drafter = DraftModelDrafter(model, replace(fake_target(BLOCK), max_num_batched_tokens=limit))
        drafter.graph_config = graph_config
        drafter.bind_caches(DrafterCaches.standalone(drafter.cache_spec(BLOCK), 64, BLOCK, max_num_seqs=4))
        fed, real = [], drafter.runner.forward
        drafter.runner.forward = lambda pieces, rows, *a, fed=fed, real=real: (
            fed.append(sum(len(p.token_ids) for p in pieces)) or real(pieces, rows, *a)
        )
        drafters.append(drafter)
        fed_per_forward.append(fed)
    g = torch.Generator().manual_seed(0)
    tokens = [torch.randint(3, VOCAB - 1, (LENGTH,), generator=g).tolist() for _ in range(4)]
    params = SamplingParams(temperature=1.0, max_tokens=64, ignore_eos=True)
    for anchors in ROUNDS:
        seqs = [
            Sequence(f"r{r}", tokens[r][:1], params, 64, output_token_ids=tokens[r][1 : a + 1])
            for r, a in anchors.items()
        ]
        plain, chunked = (drafter.propose(seqs, 3) for drafter in drafters)
        for p, c in zip(plain, chunked, strict=True):
            assert c.token_ids == p.token_ids and len(p.token_ids) == 3
            assert torch.equal(c.probs, p.probs)
    assert max(fed_per_forward[0]) > LIMIT  # without a limit a prompt goes whole
    assert max(fed_per_forward[1]) <= max(LIMIT, len(ROUNDS[-1]))
    if graphs is not None:
        assert drafters[1].runner.graphs._inputs  # the short forwards went through the static buffers
