"""Prefix caching: the block manager's chains, sharing and eviction; outputs with caching equal to an
engine without it, request by request, plain and under every kind of drafter; cached blocks never written;
what users see (num_cached_tokens, usage, metrics)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.core.block_manager import BlockManager
from specserve.core.cache_groups import PrefixStates
from specserve.layers.attention import KVCache
from specserve.spec_decode.drafters.hidden_states import ContextGroup, ContextState
from specserve.worker.model_runner import kv_bytes_per_block, state_bytes_per_slot
from tests.server_harness import MODEL_NAME, make_client, running_server, wait_until
from tests.test_speculative import greedy_bigram_bias, repetitive_prompts
from tests.tiny_models import VOCAB, save_tiny_chat_model, save_tiny_drafter, save_tiny_model, save_tiny_mtp

BLOCK = 4


def owner() -> SimpleNamespace:
    return SimpleNamespace(block_table=[], prefix_ids=[])


def computed(bm: BlockManager, tokens: list[int]) -> SimpleNamespace:
    """An owner that computed and committed `tokens`."""
    seq = owner()
    bm.grow(seq, len(tokens))
    bm.commit(seq, len(tokens), lambda: tokens)
    return seq


# ---- the block manager ----------------------------------------------------------------------------------
def test_full_committed_blocks_are_found_by_their_token_chain():
    bm = BlockManager(8, BLOCK, enable_prefix_caching=True)
    tokens = list(range(10, 20))
    a = computed(bm, tokens)
    assert bm.num_cached_blocks == 2  # the partial third block is not cached
    assert bm.match(tokens, len(tokens) - 1) == a.block_table[:2]
    assert bm.match(tokens, 7) == a.block_table[:1]  # at most max_tokens
    assert bm.match(tokens[:4] + [0, 0, 0, 0], 8) == a.block_table[:1]
    assert bm.match([0] + tokens[1:], 9) == []
    # a block's key is its whole prefix: the same tokens after another first block are another block
    assert bm.match([0, 0, 0, 0] + tokens[4:8], 8) == []
    assert BlockManager(8, BLOCK).match(tokens, 9) == []  # off


def test_only_committed_tokens_are_cached():
    bm = BlockManager(8, BLOCK, enable_prefix_caching=True)
    seq, tokens = owner(), list(range(12))
    bm.grow(seq, 12)
    bm.commit(seq, 7, lambda: tokens)  # say, 7 verified and 5 drafts in flight
    assert bm.match(tokens, 11) == seq.block_table[:1]
    bm.shrink(seq, 7)  # drafts rejected: a length change that keeps the cached block
    assert bm.match(tokens, 11) == seq.block_table[:1] and len(seq.block_table) == 2


def test_shared_blocks_are_held_by_reference_and_evicted_tail_first_when_unowned():
    bm = BlockManager(4, BLOCK, enable_prefix_caching=True)
    tokens = list(range(8))
    a = computed(bm, tokens)
    table, b = list(a.block_table), owner()
    hit = bm.match(tokens, 7)
    assert bm.can_admit(hit, 8)
    bm.attach(b, hit)
    assert b.block_table == table[:1] and bm.ref_counts[hit[0]] == 2
    bm.free(a)
    assert bm.ref_counts[hit[0]] == 1 and bm.num_free_blocks == 3  # a's second block: cached, unowned
    bm.free(b)
    assert bm.num_free_blocks == 4 and bm.num_used_blocks == 0 and bm.num_cached_blocks == 2
    assert bm.match(tokens, 8) == table
    c = owner()
    bm.grow(c, 8)  # the two empty blocks first
    assert bm.num_cached_blocks == 2
    bm.grow(c, 12)  # then the least recently freed cached block: the chain's tail went first
    assert bm.match(tokens, 8) == table[:1] and bm.num_cached_blocks == 1
    assert not bm.can_admit(bm.match(tokens, 8), 8)  # the head is unowned: taking it costs a free block
    assert bm.can_admit(bm.match(tokens, 8), 4)


def test_a_block_computed_twice_continues_the_chain_and_stays_private():
    bm = BlockManager(8, BLOCK, enable_prefix_caching=True)
    tokens = list(range(12))
    a, b = computed(bm, tokens[:4]), computed(bm, tokens[:4])
    assert bm.num_cached_blocks == 1 and a.prefix_ids == b.prefix_ids
    bm.grow(b, 12)
    bm.commit(b, 12, lambda: tokens)  # b's next blocks chain on a's first block
    assert bm.match(tokens, 12) == [a.block_table[0], *b.block_table[1:3]]
    bm.free(b)
    assert b.block_table == [] and bm.num_free_blocks == 7  # its private twin went back to the free list


def test_a_context_that_reads_the_next_token_shares_a_hit_but_its_last_row():
    """EAGLE-3 / MTP: a block's last row reads the token after the block. A hit takes the cached blocks and a
    private copy of the last one (same rows), whose last row is pending again from the feature kept with the
    block, to be recomputed with the request's own next token."""
    group = ContextGroup(BlockManager(8, 2, enable_prefix_caching=True), ContextState, True)
    group.reads_next_token = True
    group.caches = [KVCache(torch.randn(8, 2, 1, 4), torch.randn(8, 2, 1, 4))]
    group.last_features = torch.zeros(8, 3)
    a = group.open("a")
    group.blocks.grow(a, 4)
    rows = torch.arange(4)  # a's context rows 0..3 written, with their target features
    group.keep_last_features(
        [a.block_table], torch.zeros(4, dtype=torch.long), rows, torch.arange(12.0).view(4, 3)
    )
    group.roll_back(a, 4, lambda: [1, 2, 3, 4, 5])
    assert len(group.hit([1, 2, 3, 4, 9], 4)) == 2  # keyed by the blocks' own tokens: the next may differ
    group.attach("b", [1, 2, 3, 4, 9], 4)
    b = group.entries["b"]
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]  # the last, copied
    for cache in group.caches:
        assert torch.equal(cache.k[b.block_table[1]], cache.k[a.block_table[1]])
    assert b.num_cached == 3 and b.num_pending == 1  # row 3 again, from the feature kept with its block
    assert torch.equal(b.pending[0], torch.tensor([[9.0, 10.0, 11.0]]))
    assert group.blocks.ref_counts[a.block_table[1]] == 1  # the shared block is a's alone again


def test_the_feature_kept_with_a_block_is_the_one_of_its_own_last_row():
    """One forward writes context rows of two requests (EAGLE-3's first forward of a round): each row that
    ends a block leaves its feature with that block of its own request's table."""
    group = ContextGroup(BlockManager(8, 2, enable_prefix_caching=True), ContextState, True)
    group.last_features = torch.zeros(8, 3)
    a, b = group.open("a"), group.open("b")
    group.blocks.grow(a, 4)
    group.blocks.grow(b, 3)
    owners, positions = torch.tensor([0, 0, 0, 1, 1, 1]), torch.tensor([1, 2, 3, 0, 1, 2])
    features = torch.arange(18.0).view(6, 3)
    group.keep_last_features([a.block_table, b.block_table], owners, positions, features)
    kept = {a.block_table[0]: 0, a.block_table[1]: 2, b.block_table[0]: 4}  # block -> the row ending it
    for block in range(8):
        expected = features[kept[block]] if block in kept else torch.zeros(3)
        assert torch.equal(group.last_features[block], expected)


# ---- the engine -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def target_dir(tiny_model_dir):
    return str(tiny_model_dir("qwen3"))


@pytest.fixture(scope="module")
def spec_configs(target_dir, tiny_model_dir, tmp_path_factory):
    bias = greedy_bigram_bias(target_dir)
    dspark = save_tiny_drafter(target_dir, tmp_path_factory.mktemp("dspark"), std=0.2, markov_bias=bias)
    eagle3 = save_tiny_drafter(target_dir, tmp_path_factory.mktemp("eagle3"), std=0.2, eagle3=True)
    return {
        "plain": None,
        "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
        "draft_model": {
            "method": "draft_model",
            "model": str(tiny_model_dir("qwen2")),
            "num_speculative_tokens": 3,
        },
        "dspark": {"method": "dspark", "model": str(dspark)},
        "eagle3": {"method": "eagle3", "model": str(eagle3), "num_speculative_tokens": 3},
    }


def conversation(seed: int = 5) -> list[list[int]]:
    """A, B, A, A continued (A + a reply + a new turn), B: shared prefixes of every kind."""
    g = torch.Generator().manual_seed(seed)
    system = repetitive_prompts(1, seed=seed)[0] * 2
    a = system + torch.randint(3, VOCAB, (9,), generator=g).tolist()
    b = system[:21] + torch.randint(3, VOCAB, (30,), generator=g).tolist()
    continued = a + torch.randint(3, VOCAB, (23,), generator=g).tolist()
    return [a, b, a, continued, b]


def serve_one_by_one(llm: LLM, requests: list[list[int]], params: list[SamplingParams]):
    return [llm.generate([r], p)[0] for r, p in zip(requests, params)]


def sampling(n: int, temperature: float) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=temperature, max_tokens=24, ignore_eos=True, seed=7 + i) for i in range(n)
    ]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("method", ["plain", "ngram", "draft_model", "dspark", "eagle3"])
def test_outputs_with_caching_equal_outputs_without(method, temperature, spec_configs, target_dir):
    spec = spec_configs[method]
    requests, params = conversation(), sampling(5, temperature)
    engines = {
        on: LLM(
            target_dir, max_model_len=256, block_size=BLOCK, enable_prefix_caching=on, speculative_config=spec
        )
        for on in (True, False)
    }
    cached, uncached = (serve_one_by_one(engines[on], requests, params) for on in (True, False))
    assert [o.outputs[0].token_ids for o in cached] == [o.outputs[0].token_ids for o in uncached]
    hits = [o.num_cached_tokens for o in cached]
    a, b, _, continued, _ = requests
    assert hits[0] == 0 and hits[1] == 20  # B shares A's first 21 tokens: 5 whole blocks
    assert hits[2] == (len(a) - 1) // BLOCK * BLOCK  # all of A but its last token's block
    assert hits[3] >= len(a) // BLOCK * BLOCK  # A's prompt and part of its reply
    assert hits[4] == (len(b) - 1) // BLOCK * BLOCK
    assert all(o.num_cached_tokens == 0 for o in uncached)
    for llm in engines.values():
        assert llm.engine.block_manager.num_used_blocks == 0
    if spec is not None:
        assert engines[True].engine.spec_stats.num_drafts > 0


def test_cached_blocks_are_never_written(target_dir):
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    llm = LLM(target_dir, max_model_len=256, block_size=BLOCK, speculative_config=spec)
    a, _, _, continued, _ = conversation()
    llm.generate([a], sampling(1, 0.0)[0])
    bm, caches = llm.engine.block_manager, llm.engine.runner.kv_caches
    shared = bm.match(a, len(a))

    def checksum() -> list[torch.Tensor]:
        return [torch.cat([c.k[shared].flatten(), c.v[shared].flatten()]).clone() for c in caches]

    before = checksum()
    # Speculative rounds of several requests sharing those blocks, at once and one after another.
    llm.generate([a, continued, a + [5, 6, 7]], sampling(3, 0.0))
    llm.generate([continued], sampling(1, 0.8)[0])
    assert llm.engine.spec_stats.num_drafts > 0
    assert all(torch.equal(x, y) for x, y in zip(before, checksum()))


def test_eviction_under_a_tight_kv_budget_keeps_outputs_exact(target_dir):
    requests = conversation() + repetitive_prompts(6, seed=11) + conversation()
    params = sampling(len(requests), 0.0)
    tight = LLM(target_dir, max_model_len=128, block_size=BLOCK, kv_cache_memory="96KiB", max_num_seqs=2)
    roomy = LLM(target_dir, max_model_len=128, block_size=BLOCK, enable_prefix_caching=False)
    blocks = tight.engine.block_manager.num_blocks
    assert blocks < sum(len(r) + 24 for r in requests) // BLOCK  # the cache cannot keep everything
    got = tight.generate(requests, params)
    want = serve_one_by_one(roomy, requests, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert tight.engine.block_manager.num_used_blocks == 0
    assert tight.engine.block_manager.num_cached_blocks <= blocks


def test_preemption_and_abort_release_shared_blocks(target_dir):
    requests = conversation() * 2
    params = sampling(len(requests), 0.0)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    # 3 layers x 2 (k, v) x 2 kv heads x 16 dims x 4 bytes = 768 bytes a token: 200 tokens of cache
    tight = LLM(
        target_dir, max_model_len=128, block_size=BLOCK, kv_cache_memory=200 * 768, speculative_config=spec
    )
    plain = LLM(target_dir, max_model_len=128, block_size=BLOCK, enable_prefix_caching=False)
    outs = tight.generate(requests, params)
    assert [o.outputs[0].token_ids for o in outs] == [
        o.outputs[0].token_ids for o in plain.generate(requests, params)
    ]
    assert sum(o.metrics.num_preemptions for o in outs) > 0 and tight.engine.caches.prefix_hits > 0
    engine, bm = tight.engine, tight.engine.block_manager
    assert bm.num_used_blocks == 0
    # Aborting requests that hold shared blocks gives their references back, mid-prefill or mid-decode.
    ids = [engine.add_request(r, p) for r, p in zip(requests[:3], params)]
    engine.step()
    engine.abort(ids[0])
    engine.step()
    for request_id in ids[1:]:
        engine.abort(request_id)
    assert bm.num_used_blocks == 0 and all(c == 0 for c in bm.ref_counts)
    assert tight.generate([requests[0]], params[0])[0].num_cached_tokens > 0


def test_many_requests_sharing_a_system_prompt_at_once(target_dir):
    system = repetitive_prompts(1, seed=2)[0] * 3
    g = torch.Generator().manual_seed(3)
    requests = [system + torch.randint(3, VOCAB, (int(n),), generator=g).tolist() for n in range(2, 12)]
    params = sampling(len(requests), 0.0)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    cached = LLM(target_dir, max_model_len=256, block_size=BLOCK, max_num_seqs=4, speculative_config=spec)
    plain = LLM(target_dir, max_model_len=256, block_size=BLOCK, enable_prefix_caching=False)
    got = cached.generate(requests, params)
    assert [o.outputs[0].token_ids for o in got] == [
        o.outputs[0].token_ids for o in plain.generate(requests, params)
    ]
    # the first four are admitted together (nothing cached yet); the later ones start from their blocks
    assert [o.num_cached_tokens for o in got[:4]] == [0] * 4
    assert all(o.num_cached_tokens == len(system) // BLOCK * BLOCK for o in got[4:])
    assert cached.engine.caches.prefix_hits == sum(o.num_cached_tokens for o in got)


def test_state_checkpoints_are_kept_at_intervals_and_reused_least_recently_used_last():
    states = PrefixStates(range(10, 12), interval=8, block_size=4)
    assert states.slot_for(101, 1) is None  # 4 tokens: not at an interval
    assert states.slot_for(102, 2) == 10 and states.slot_for(102, 2) is None  # kept once
    assert states.slot_for(104, 4) == 11
    assert states.usable([101, 102, 103, 104, 105]) == 4  # the longest kept prefix within the hit
    assert states.usable([101, 102, 103]) == 2 and states.usable([101, 999]) == 0
    assert states.take(102) == 10  # used: now the most recent
    assert states.slot_for(106, 2) == 11  # full: the least recently used (104's) slot is reused
    assert states.usable([101, 102, 103, 104]) == 2


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    return str(save_tiny_mtp(save_tiny_model("qwen3_5", tmp_path_factory.mktemp("qwen3_5"))))


def hybrid_engines(hybrid_dir, speculative_config) -> dict[bool, LLM]:
    """The hybrid target with prefix caching (True) and without (False)."""
    return {
        on: LLM(
            hybrid_dir,
            max_model_len=256,
            block_size=BLOCK,
            state_checkpoint_interval=4 * BLOCK,
            enable_prefix_caching=on,
            speculative_config=speculative_config,
        )
        for on in (True, False)
    }


@pytest.mark.parametrize("method", ["plain", "ngram", "draft_model", "dspark", "mtp"])
def test_hybrid_outputs_with_caching_equal_outputs_without(method, hybrid_dir, tiny_model_dir, tmp_path):
    spec = {
        "plain": lambda: None,
        "ngram": lambda: {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
        "draft_model": lambda: {
            "method": "draft_model",
            "model": str(tiny_model_dir("qwen3")),
            "num_speculative_tokens": 3,
        },
        "dspark": lambda: {
            "method": "dspark",
            "model": str(save_tiny_drafter(hybrid_dir, tmp_path / "d", std=0.2)),
        },
        "mtp": lambda: {"method": "mtp", "num_speculative_tokens": 2},
    }[method]()
    requests, params = conversation(), sampling(5, 0.0)
    engines = hybrid_engines(hybrid_dir, spec)
    cached, uncached = (serve_one_by_one(engines[on], requests, params) for on in (True, False))
    assert [o.outputs[0].token_ids for o in cached] == [o.outputs[0].token_ids for o in uncached]
    hits = [o.num_cached_tokens for o in cached]
    interval = 4 * BLOCK
    assert hits[0] == 0 and hits[1] == 16  # B shares 21 tokens with A: the state is kept at 16
    assert hits[2] == (len(requests[0]) - 1) // interval * interval
    assert hits[3] >= hits[2] and hits[4] == (len(requests[1]) - 1) // interval * interval
    assert engines[True].engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("method", ["ngram", "eagle3", "mtp"])
def test_drafters_that_read_the_next_token_hit_a_prefix_ending_at_a_block_whole(method, hybrid_dir, tmp_path):
    """A shared prefix that ends at a block (and an interval, where the state is kept), then different
    tokens: EAGLE-3 and MTP, whose context row t reads token t + 1, hit it whole as ngram does (they hit one
    block less before: the last block's last row was keyed by the token after the block), with outputs equal
    to an engine without caching."""
    spec = {
        "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
        "eagle3": {
            "method": "eagle3",
            "model": str(save_tiny_drafter(hybrid_dir, tmp_path / "e", std=0.2, eagle3=True, ttt_length=3)),
        },
        "mtp": {"method": "mtp", "num_speculative_tokens": 2},
    }[method]
    prefix = repetitive_prompts(1, seed=11)[0] * 4
    prefix = prefix[: len(prefix) // 16 * 16]
    requests = [prefix + [5, 6, 7], prefix + [8, 9], prefix + [10]]
    params = sampling(3, 0.0)
    engines = hybrid_engines(hybrid_dir, spec)
    cached, uncached = (serve_one_by_one(engines[on], requests, params) for on in (True, False))
    assert [o.outputs[0].token_ids for o in cached] == [o.outputs[0].token_ids for o in uncached]
    assert [o.num_cached_tokens for o in cached] == [0, len(prefix), len(prefix)]
    assert engines[True].engine.block_manager.num_used_blocks == 0


def test_a_hybrid_target_without_room_for_state_checkpoints_caches_nothing(tiny_model_dir):
    model_dir = str(tiny_model_dir("qwen3_5"))
    model = LLM(model_dir, max_model_len=64).engine.model
    per_slot, per_block = (
        state_bytes_per_slot(model, torch.float32),
        kv_bytes_per_block(model, 16, torch.float32),
    )
    # two running sequences' states and the KV of one full-length sequence: less than a quarter spare
    memory = 2 * per_slot + 5 * per_block
    assert memory - 2 * per_slot < 4 * per_slot
    llm = LLM(model_dir, max_model_len=64, max_num_seqs=2, kv_cache_memory=memory)
    assert not llm.engine.block_manager.enable_prefix_caching and llm.engine.caches.states.checkpoints is None
    outs = llm.generate(conversation()[:2], SamplingParams(temperature=0.0, max_tokens=8))
    assert all(o.num_cached_tokens == 0 for o in outs)


# ---- what users see -------------------------------------------------------------------------------------
def test_usage_and_metrics_report_cached_tokens(tmp_path):
    model_dir = save_tiny_chat_model("qwen3", tmp_path / "chat")
    messages = [
        {"role": "system", "content": "You are a careful assistant. " * 8},
        {"role": "user", "content": "Hi"},
    ]
    with running_server(model_dir, max_model_len=512) as srv:
        client = make_client(srv.url)
        ask = dict(model=MODEL_NAME, messages=messages, max_tokens=4, temperature=0.0)
        first, second = client.chat.completions.create(**ask), client.chat.completions.create(**ask)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert 0 < cached < second.usage.prompt_tokens
        assert first.choices[0].message.content == second.choices[0].message.content
        expected = {
            ("specserve:prefix_cache_queries_total", ()): 2 * first.usage.prompt_tokens,
            ("specserve:prefix_cache_hits_total", ()): cached,
        }
        wait_until(lambda: {k: srv.metrics().get(k) for k in expected} == expected, what="metrics to settle")


@pytest.mark.parametrize("command", [["generate", "hi"], ["serve", "some-model"]])
def test_the_cli_switches_prefix_caching(command):
    from specserve.cli import build_parser
    from specserve.cli_args import engine_kwargs

    parser = build_parser()
    assert engine_kwargs(parser.parse_args(command))["enable_prefix_caching"] is True
    off = engine_kwargs(
        parser.parse_args([*command, "--no-enable-prefix-caching", "--state-checkpoint-interval", "64"])
    )
    assert off["enable_prefix_caching"] is False and off["state_checkpoint_interval"] == 64


def test_bad_prefix_caching_settings_are_clear_errors():
    from specserve.config import EngineConfig, SpecserveError

    with pytest.raises(SpecserveError, match="multiple of block_size \\(16\\), got 40"):
        EngineConfig(model="m", state_checkpoint_interval=40)
    with pytest.raises(SpecserveError, match="enable_prefix_caching must be true or false"):
        EngineConfig(model="m", enable_prefix_caching="yes")
