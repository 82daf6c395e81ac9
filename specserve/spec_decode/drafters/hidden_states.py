"""Shared machinery of drafters conditioned on the target's hidden states (DSpark, DFlash, EAGLE-3, MTP):
per-request context rows handed over by the engine, a paged draft KV cache rolled back by length, and
their forward run through static buffers and CUDA graphs where the engine captures them (drafters/graphs.py),
eagerly otherwise."""

from __future__ import annotations

import logging
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from specserve.config import SpecserveError, SpeculativeConfig
from specserve.core.batch import catch_up_chunks, row_offsets
from specserve.core.cache_coordinator import DrafterCaches, DrafterCacheSpec
from specserve.core.cache_groups import PagedEntry, PagedGroup, PagedSpec
from specserve.core.sequence import Sequence
from specserve.layers.attention import KVCache
from specserve.layers.metadata import ForwardMetadata, padded_block_tables, slot_mapping
from specserve.layers.transfer import to_device
from specserve.models.prepare import prepare_model
from specserve.spec_decode.context import TargetContext
from specserve.spec_decode.deepspec.checkpoint import load_draft_checkpoint
from specserve.spec_decode.deepspec.dspark import PagedDraftBatch, attention_geometry
from specserve.spec_decode.drafters.base import Drafter
from specserve.spec_decode.drafters.graphs import DraftGraphs, DraftInputs, draft_graph_config
from specserve.worker.device_memory import GRAPH_POOL_FORWARDS, peak_bytes

logger = logging.getLogger(__name__)


@dataclass
class ContextState(PagedEntry):
    """One request's draft context: rows [0, num_cached) are in the draft cache, then `pending` rows."""

    pending: list[torch.Tensor] = field(default_factory=list)
    num_pending: int = 0

    @property
    def num_rows(self) -> int:
        return self.num_cached + self.num_pending

    def take_pending(self, num_rows: int | None = None) -> list[torch.Tensor]:
        """The first `num_rows` pending rows (all of them by default), no longer pending."""
        if num_rows is None or num_rows == self.num_pending:
            rows, self.pending, self.num_pending = self.pending, [], 0
            return rows
        rows, left = [], num_rows
        while left:
            head = self.pending.pop(0)
            rows.append(head[:left])
            if head.shape[0] > left:
                self.pending.insert(0, head[left:])
            left -= rows[-1].shape[0]
        self.num_pending -= num_rows
        return rows


def context_rows(starts: Seq[int], lens: Seq[int]) -> tuple[list[int], list[int]]:
    """The owner (request index) and position of each context row: `lens[r]` rows from `starts[r]`."""
    owners = [r for r, n in enumerate(lens) for _ in range(n)]
    return owners, [p for s, n in zip(starts, lens) for p in range(s, s + n)]


def concat_rows(rows: list[torch.Tensor], width: int, like: torch.Tensor) -> torch.Tensor:
    """[sum of rows, width] in `like`'s dtype and device; empty when a request was proposed for again
    without new rows (it had not been scheduled since its last proposal)."""
    return torch.cat(rows).to(like.dtype) if rows else like.new_zeros(0, width)


@dataclass(frozen=True)
class DrafterLayout:
    """What a hidden-state drafter reads and keeps: the target layers it reads (their outputs are
    concatenated: `feature_width` wide) and its paged cache, `num_layers` x [.., num_kv_heads, head_dim]."""

    capture_layers: tuple[int, ...]
    feature_width: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of_checkpoint(cls, model) -> DrafterLayout:
        """A DeepSpec-format drafter's (its config says)."""
        config, geo = model.config, attention_geometry(model.config)
        return cls(
            tuple(config.target_layer_ids),
            model.fc.in_features,
            config.num_layers,
            geo.num_kv_heads,
            geo.head_dim,
        )


class ContextGroup(PagedGroup[ContextState]):
    """A hidden-state drafter's context cache, a paged group of the engine's cache coordinator. With prefix
    caching the full blocks of context rows join its prefix cache, keyed by the tokens they hold; its rows
    come from the target's forward, so a target prefix hit goes only as far as this cache holds it too.

    A drafter whose row t also reads the token at t + 1 (EAGLE-3, MTP: `reads_next_token`) keeps with each
    block the target feature of the block's last row (`last_features`), since that row depends on the
    token after the block, which a request sharing the prefix may not share. A hit takes the cached
    blocks but a private copy of the last one, whose last row the request recomputes from that feature
    and its own next token: the drafter's hit is the target's, as a drafter that reads tokens only."""

    reads_next_token = False
    caches: list[KVCache]
    last_features: torch.Tensor | None = None  # [blocks, feature width] where reads_next_token

    def hit(self, token_ids: Seq[int], max_tokens: int) -> list[int]:
        blocks = super().hit(token_ids, max_tokens)
        if (
            blocks
            and self.reads_next_token
            and not self.blocks.can_admit(blocks, (len(blocks) + 1) * self.block_size)
        ):
            return blocks[:-1]  # no free block to copy the last one into
        return blocks

    def attach(self, request_id: str, token_ids: Seq[int], num_tokens: int) -> None:
        super().attach(request_id, token_ids, num_tokens)
        if num_tokens and self.reads_next_token:
            self._copy_last_block(self.entries[request_id])

    def keep_last_features(
        self,
        block_tables: Seq[Seq[int]],
        owners: torch.Tensor,
        positions: torch.Tensor,
        features: torch.Tensor,
    ) -> None:
        """Of context rows just written (the requests' block tables; each row's request and position, on the
        host; target features), keep the features of those that end a block, with the block. (Their blocks
        are looked up alone: the forward that writes the rows builds its own slots.)"""
        if self.last_features is None:
            return
        size = self.block_size
        ends = positions % size == size - 1
        if not ends.any():  # most rounds: nothing to send to the device
            return
        rows = ends.nonzero().flatten()
        blocks = [block_tables[r][p // size] for r, p in zip(owners[rows].tolist(), positions[rows].tolist())]
        blocks, rows = to_device(self.last_features.device, torch.tensor(blocks, dtype=torch.long), rows)
        self.last_features[blocks] = features[rows].to(self.last_features.dtype)

    def _copy_last_block(self, entry: ContextState) -> None:
        """The entry's last (shared) block replaced by a private copy whose last row is pending again, its
        feature the one kept with the block."""
        shared, spare = entry.block_table[-1], PagedEntry()
        self.blocks.grow(spare, 1)
        (copy,) = spare.block_table
        for cache in self.caches:
            cache.k[copy], cache.v[copy] = cache.k[shared], cache.v[shared]
        self.last_features[copy] = self.last_features[shared]
        self.blocks.shrink(entry, entry.num_cached - self.block_size)  # lets go of the shared block
        entry.block_table.append(copy)  # its reference passes from `spare` to the entry
        entry.num_cached -= 1
        entry.pending.append(self.last_features[copy][None].clone())
        entry.num_pending += 1


class HiddenStateDrafter(Drafter):
    """`observe` collects the target features of each position in order; a subclass's `propose` turns
    the pending rows into draft cache entries and drafts from them (`ContextGroup` holds them)."""

    reads_next_token = False  # a context row t reads the token at t + 1 too (EAGLE-3, MTP)
    causal = True  # a query row attends the keys up to its own position (False: all of its request's)
    drafts_from_newest_row = False  # a round's forward needs each request's newest context row (EAGLE-3, MTP)
    query_rows_per_request = 1  # a forward's query rows a request beside its context (DSpark: its block's)

    def __init__(self, model, target: TargetContext, layout: DrafterLayout, extra_tokens_per_request: int):
        self.model = model
        self.layout = layout
        self.capture_layers = layout.capture_layers
        self.feature_width = layout.feature_width
        self.vocab_size = target.vocab_size
        self.dtype = target.torch_dtype
        self.device = target.platform.device  # where the target's features arrive and the drafter runs
        self.generator = target.generator  # unseeded requests draw from the engine's generator
        self.extra_tokens_per_request = extra_tokens_per_request  # drafted rows beyond the context
        # The most context rows one forward takes (`catch_up` bounds a round's to it), and the rows of each
        # kind `activation_bytes` measures a forward of: the memory budget holds exactly that forward.
        self.max_forward_rows = target.max_num_batched_tokens
        # None: every forward eager (see draft_graph_config); set before `bind_caches`
        self.graph_config = draft_graph_config(target, model)
        self.graphs: DraftGraphs | None = None

    def cache_spec(self, block_size: int) -> DrafterCacheSpec:
        layout = self.layout
        elem = torch.empty((), dtype=self.dtype).element_size()
        per_block = layout.num_layers * 2 * block_size * layout.num_kv_heads * layout.head_dim * elem
        if self.reads_next_token:  # the last row's feature kept with each block
            per_block += self.feature_width * elem
        context = PagedSpec(
            per_block,
            self.extra_tokens_per_request,
            limits_prefix_hits=True,
            group_type=ContextGroup,
            entry_type=ContextState,
        )
        return DrafterCacheSpec(paged=(context,))

    def bind_caches(self, caches: DrafterCaches) -> None:
        (group,) = caches.paged
        self.group: ContextGroup = group
        self.blocks = group.blocks
        self.states = group.entries  # request id -> its context (the coordinator frees it with the request)
        num_blocks = group.blocks.num_blocks
        scratch = self.graph_config is not None  # graphs: a block for the padding rows
        self.caches = self._new_caches(num_blocks + scratch, group.block_size)
        if self.graph_config is not None:
            args = (self.caches, group.block_size, num_blocks, self.graph_config, self.causal)
            self.graphs = DraftGraphs(self.forward_rows, *args, self.row_widths())
        group.caches, group.reads_next_token = self.caches, self.reads_next_token
        if self.reads_next_token:
            group.last_features = self.caches[0].k.new_zeros(num_blocks, self.feature_width)

    def _new_caches(self, num_blocks: int, block_size: int) -> list[KVCache]:
        shape = (num_blocks, block_size, self.layout.num_kv_heads, self.layout.head_dim)
        on = {"dtype": self.dtype, "device": self.device}
        return [
            KVCache(torch.zeros(shape, **on), torch.zeros(shape, **on)) for _ in range(self.layout.num_layers)
        ]

    def activation_bytes(self, target: TargetContext) -> int:
        """Its forwards' (worker/device_memory.py): one of as many query rows as a target step holds (or a
        round of every request's own, where those are more: DSpark's blocks), after a step's K/V-only rows
        where it reads them (a DSpark round's context), and, where it replays graphs, their pool: of its
        largest bucket's forward (query and K/V-only rows)."""
        kv = self.row_widths()[1] > 0
        rows = self.max_forward_rows
        queries = max(rows, target.max_num_seqs * self.query_rows_per_request)
        total = self._probe_bytes(queries, rows * kv, target.block_size)
        if self.graph_config is not None:
            bucket = self.graph_config.largest_bucket
            total += GRAPH_POOL_FORWARDS * self._probe_bytes(bucket, bucket * kv, target.block_size)
        return total

    def _probe_bytes(self, num_query: int, num_kv: int, block_size: int) -> int:
        """The peak of an eager forward of one request's `num_query` query rows after `num_kv` K/V-only
        rows, on caches of its own."""
        query_width, kv_width = self.row_widths()
        on = {"dtype": self.dtype, "device": self.device}

        def setup() -> Callable[[], int]:
            caches = self._new_caches(-(-(num_kv + num_query) // block_size), block_size)
            table = list(range(caches[0].k.shape[0]))
            query_rows = torch.zeros(num_query, query_width, **on) if query_width else None
            kv_rows = torch.zeros(num_kv, kv_width, **on) if kv_width else None
            kv_only = ([0] * num_kv, list(range(num_kv)))

            @torch.inference_mode()
            def forward() -> int:
                self.eager_forward([table], caches, [[0] * num_query], [num_kv], kv_only, query_rows, kv_rows)
                return 0

            return forward

        return peak_bytes(self.device, setup)

    def catch_up(self, seqs: list[Sequence], states: list[ContextState]) -> None:
        """Bound a round's forward to `max_forward_rows` pending rows: a new request's prompt arrives whole
        (its chunks' features wait for its first round), and the memory budget holds no longer forward.
        The excess, each request's oldest rows first, is written to the draft cache beforehand
        (`write_context`), in forwards of at most that many rows; a drafter that drafts from a request's
        newest row keeps it for the round. Every request's blocks must already cover its pending rows."""
        pending = [st.num_pending for st in states]
        for chunk in catch_up_chunks(pending, self.drafts_from_newest_row, self.max_forward_rows):
            chunk_states = [states[r] for r, _ in chunk]
            lens = [n for _, n in chunk]
            rows = [f for st, n in zip(chunk_states, lens) for f in st.take_pending(n)]
            features = concat_rows(rows, self.feature_width, self.caches[0].k)
            self.write_context([seqs[r] for r, _ in chunk], chunk_states, lens, features)
            for st, n in zip(chunk_states, lens):
                st.num_cached += n

    def write_context(
        self, seqs: list[Sequence], states: list[ContextState], lens: list[int], features: torch.Tensor
    ) -> torch.Tensor | None:
        """Write `lens[r]` context rows of each request, from its `num_cached` on, into the draft cache
        (their target `features`, concatenated); a subclass may return what the forward gives."""
        raise NotImplementedError

    def forward_rows(self, inputs: DraftInputs, batch: PagedDraftBatch) -> torch.Tensor:
        """The network's paged forward (drafters/graphs.py's DraftForward): the query rows' outputs."""
        raise NotImplementedError

    def row_widths(self) -> tuple[int, int]:
        """Widths of the float rows `forward_rows` reads beside the query rows and the K/V-only rows."""
        raise NotImplementedError

    def run_forward(
        self,
        states: list[ContextState],
        token_ids: list[list[int]],
        starts: list[int],
        kv_only: tuple[list[int], list[int]] = ([], []),
        query_rows: torch.Tensor | None = None,
        kv_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`forward_rows` over each request's query rows (`token_ids` at consecutive positions from
        `starts`) after rows that only write K/V (their requests and positions): through static buffers
        where a bucket holds the step, else over a paged batch built for it. Every request's blocks must
        already cover its last position."""
        tables = [st.block_table for st in states]
        key = self.graphs.key_for(token_ids, len(kv_only[0]), tables) if self.graphs is not None else None
        if key is not None:
            return self.graphs.run(key, token_ids, starts, tables, kv_only, query_rows, kv_rows)
        return self.eager_forward(tables, self.caches, token_ids, starts, kv_only, query_rows, kv_rows)

    def eager_forward(
        self,
        block_tables: list[list[int]],
        caches: list[KVCache],
        token_ids: list[list[int]],
        starts: list[int],
        kv_only: tuple[list[int], list[int]],
        query_rows: torch.Tensor | None,
        kv_rows: torch.Tensor | None,
    ) -> torch.Tensor:
        """`run_forward` over a paged batch built for it, on `caches` (the drafter's, or a probe's)."""
        lens = [len(t) for t in token_ids]
        query_pos = torch.tensor([p for s, n in zip(starts, lens) for p in range(s, s + n)], dtype=torch.long)
        owners = torch.repeat_interleave(torch.arange(len(block_tables)), torch.tensor(lens))
        kv_owner = torch.cat([torch.tensor(kv_only[0], dtype=torch.long), owners])
        kv_pos = torch.cat([torch.tensor(kv_only[1], dtype=torch.long), query_pos])
        tokens = torch.tensor([t for ids in token_ids for t in ids], dtype=torch.long)
        batch, tokens = self.paged_batch(block_tables, caches, kv_owner, kv_pos, lens, query_pos, tokens)
        return self.forward_rows(DraftInputs(tokens, query_rows, kv_rows), batch)

    @staticmethod
    def load(spec: SpeculativeConfig, target: TargetContext, config_type: type):
        """The checkpoint's drafter, checked to be a `config_type` drafter, quantized if the config says so
        (its own layers only: modules it shares with the target are replaced, not changed) and placed on
        the target's platform."""
        model = load_draft_checkpoint(spec.model, target.model, target.model_config, dtype=target.torch_dtype)
        if not isinstance(model.config, config_type):
            raise SpecserveError(
                f"{spec.model}: a {model.config.architecture} drafter cannot run method {spec.method!r}"
            )
        return prepare_model(model, spec.quantization, platform=target.platform)

    # ---- context bookkeeping ------------------------------------------------------------------------
    def observe(self, seq: Sequence, start: int, features: torch.Tensor) -> None:
        state = self.states.get(seq.request_id)
        if state is None or start != state.num_rows:
            # Rows arrive in position order from 0; anything else means a restart (after preemption the
            # sequence is recomputed from position 0) or a state we cannot trust: begin again.
            self.group.free(seq.request_id)
            if start != 0:
                logger.warning(
                    "request %s: target features from position %d, expected 0", seq.request_id, start
                )
                return
            state = self.group.open(seq.request_id)
        state.pending.append(features)
        state.num_pending += features.shape[0]

    def ready(self, seqs: list[Sequence]) -> list[int]:
        """Indices of the sequences whose every position before the anchor has been handed over."""
        return [
            i
            for i, s in enumerate(seqs)
            if (state := self.states.get(s.request_id)) is not None and state.num_rows == s.num_tokens - 1
        ]

    def paged_batch(
        self,
        block_tables: list[list[int]],
        caches: list[KVCache],
        kv_owner: torch.Tensor,
        kv_pos: torch.Tensor,
        query_lens: list[int],
        query_pos: torch.Tensor,
        token_ids: torch.Tensor,
    ) -> tuple[PagedDraftBatch, torch.Tensor]:
        """Rows to write (owner request, position) and queries (per request, consecutive) of one forward
        over `caches`, and the queries' token ids; every request's blocks must already cover its last
        position. Built on the host, sent to the drafter's device in one copy."""
        block_size = caches[0].k.shape[1]
        owners = torch.repeat_interleave(torch.arange(len(block_tables)), torch.tensor(query_lens))
        last = torch.full((len(block_tables),), -1, dtype=torch.long)
        last = last.scatter_reduce(0, kv_owner, kv_pos, reduce="amax").scatter_reduce(
            0, owners, query_pos, reduce="amax"
        )
        meta = ForwardMetadata.build(
            query_start=row_offsets(query_lens),
            context_lens=(last + 1).tolist(),
            block_tables=block_tables,
            positions=query_pos,
            block_size=block_size,
            causal=self.causal,
        )
        kv_slots = slot_mapping(padded_block_tables(block_tables), kv_owner, kv_pos, block_size)
        meta, (kv_pos, kv_slots, token_ids) = meta.to(self.device, kv_pos, kv_slots, token_ids)
        return PagedDraftBatch(meta.positions, kv_pos, kv_slots, meta, caches), token_ids

    def roll_back(self, seqs: list[Sequence], states: list[ContextState], lengths: list[int]) -> None:
        """Keep the first `lengths[i]` rows of each request's draft cache (a length change): its context
        rows, which are final (full blocks of them join the prefix cache)."""
        for seq, state, n in zip(seqs, states, lengths):
            self.group.roll_back(state, n, lambda seq=seq: seq.all_token_ids)
