"""The engine: requests in, one scheduled model step at a time, request updates out.

A step, stage by stage (docs/architecture.md draws it):
propose (spec_decode/speculator.py) -> schedule (scheduler.py) -> forward (worker/model_runner.py) ->
sample and verify (sampling.py), and prompt logprobs where asked -> output (output_processor.py) ->
commit (scheduler.py) -> the drafter learns from the step (speculator.py).
"""

from __future__ import annotations

import gc
import itertools
import time

import torch

from specserve.config import EngineConfig, SamplingParams, SpecserveError, SpeculativeConfig
from specserve.core.batch import ScheduledPiece, StepLayout
from specserve.core.block_manager import BlockManager, PrefixStates, SlotPool
from specserve.core.sequence import Sequence
from specserve.core.spec_stats import SpecStats
from specserve.engine.input_processor import InputProcessor, PromptType
from specserve.engine.output_processor import OutputProcessor
from specserve.engine.outputs import RequestOutput
from specserve.engine.sampling import StepSampler, logprob_steps
from specserve.engine.scheduler import Scheduler
from specserve.models.generation_config import eos_token_ids
from specserve.models.loader import load_model, resolve_model
from specserve.models.registry import text_config_of
from specserve.parallel.executor import TensorParallelExecutor
from specserve.preflight import check_before_loading, effective_max_model_len
from specserve.spec_decode.context import TargetContext
from specserve.spec_decode.speculator import Speculator
from specserve.structured.grammar import GrammarCompiler, RequestGrammar
from specserve.worker.model_runner import ModelRunner, PieceInput, kv_cache_blocks, state_checkpoint_slots

__all__ = ["LLMEngine", "PromptType"]


def _freeze_import_heap() -> None:
    """Leave the objects that exist before the first engine (torch's, transformers', ~400k) out of Python's
    garbage collections, once per process. They live as long as the process anyway, yet every full
    collection walked them all: serving thousands of short requests, collections took ~20% of the engine's
    time in pauses of 0.1-0.3 s. The engines' own objects stay collectable."""
    if not gc.get_freeze_count():
        gc.collect()
        gc.freeze()


class LLMEngine:
    def __init__(
        self, config: EngineConfig, speculative_config: SpeculativeConfig | dict | str | None = None
    ):
        _freeze_import_heap()
        self.config = config
        spec_config = SpeculativeConfig.from_value(speculative_config)  # a typo fails before loading
        check_before_loading(config, spec_config)  # so does anything config.json and the arguments decide
        self.model_dir = resolve_model(config.model, revision=config.revision)
        # Tensor parallelism: worker ranks load their shards while this process (rank 0) loads its own.
        split = config.tensor_parallel_size > 1
        self.parallel = TensorParallelExecutor(config.tensor_parallel_size) if split else None
        try:
            self._build(config, spec_config)
        except BaseException:
            self.close()
            raise

    def _build(self, config: EngineConfig, spec_config: SpeculativeConfig | None) -> None:
        load_args = {"model": str(self.model_dir), "dtype": config.torch_dtype}
        load_args["quantization"] = config.quantization
        if self.parallel is not None:
            self.parallel.load(**load_args)
        shard = self.parallel.shard if self.parallel is not None else None
        self.model, hf_config, self.tokenizer = load_model(**load_args, shard=shard)
        self.model_config = text_config_of(hf_config)
        self.vocab_size = self.model_config.vocab_size
        self.max_model_len = effective_max_model_len(config, self.model_config)
        self.eos_token_ids = eos_token_ids(self.model_dir, self.model_config, self.tokenizer)
        num_blocks = kv_cache_blocks(self.model, config, self.max_model_len)
        hybrid = self.model.has_recurrent_state
        num_slots = config.max_num_seqs if hybrid else 0
        # A hybrid target's cached prefix needs the recurrent state at its end too (state checkpoints).
        checkpoints = state_checkpoint_slots(self.model, config)
        self.enable_prefix_caching = config.enable_prefix_caching and (not hybrid or checkpoints > 0)
        self.block_manager = BlockManager(num_blocks, config.block_size, self.enable_prefix_caching)
        prefix_states = None
        if hybrid and self.enable_prefix_caching:
            slots = range(num_slots, num_slots + checkpoints)
            prefix_states = PrefixStates(slots, config.state_checkpoint_interval, config.block_size)
        runner_args = (num_blocks, config.block_size, config.torch_dtype, num_slots + checkpoints)
        if self.parallel is not None:
            self.runner = self.parallel.runner(self.model, *runner_args)
        else:
            self.runner = ModelRunner(self.model, *runner_args)
        self.generator = torch.Generator().manual_seed(config.seed)
        self.input_processor = InputProcessor(self.tokenizer, self.vocab_size, self.max_model_len)
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids)
        self.sampler = StepSampler(self.vocab_size, self.generator)
        self.speculator = (
            Speculator(spec_config, self.target_context, self.runner, self.block_manager)
            if spec_config
            else None
        )
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            SlotPool(num_slots) if num_slots else None,
            drafter_prefix=self.speculator,
            prefix_states=prefix_states,
        )
        self.requests: dict[str, Sequence] = {}
        self._ids = itertools.count()

    @property
    def target_context(self) -> TargetContext:
        """What a drafter (or the cost profiler) may know of this engine."""
        return TargetContext(
            model=self.model,
            model_config=self.model_config,
            tokenizer=self.tokenizer,
            model_name=str(self.config.model),
            model_dir=str(self.model_dir),
            dtype=self.config.dtype,
            block_size=self.config.block_size,
            num_kv_blocks=self.block_manager.num_blocks,
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_prefix_caching=self.enable_prefix_caching,
            eos_token_ids=self.eos_token_ids,
            generator=self.generator,
            tensor_parallel_size=self.config.tensor_parallel_size,
            kv_caches=None if self.parallel is not None else self.runner.kv_caches,
        )

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (the engine cannot step afterwards)."""
        if self.parallel is not None:
            self.parallel.close()

    @property
    def spec_stats(self) -> SpecStats:
        """Speculative decoding counters (empty without a drafter)."""
        return self.speculator.stats if self.speculator is not None else SpecStats()

    # ---- requests -------------------------------------------------------------------------------------
    def make_sequence(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str | None = None,
        grammar: RequestGrammar | None = None,
    ) -> Sequence:
        """Validate a request completely (nothing runs yet). `grammar`: its output constraint compiled
        beforehand (the server compiles off the engine thread); otherwise it is compiled here."""
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise SpecserveError(f"request id {request_id!r} is already in use")
        seq = self.input_processor.process(prompt, params, request_id)
        if params.structured_outputs is not None:
            seq.grammar = grammar or self.grammars.compile(params.structured_outputs)
        return seq

    def add_sequence(self, seq: Sequence) -> None:
        self.requests[seq.request_id] = seq
        self.scheduler.add(seq)

    def add_request(self, prompt: PromptType, params: SamplingParams, request_id: str | None = None) -> str:
        seq = self.make_sequence(prompt, params, request_id)
        self.add_sequence(seq)
        return seq.request_id

    def abort(self, request_id: str) -> None:
        seq = self.requests.pop(request_id, None)
        if seq is not None and not seq.is_finished:
            seq.finish("abort")
            self.scheduler.finish(seq)
            if self.speculator is not None:
                self.speculator.release(seq)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def final_output(self, seq: Sequence) -> RequestOutput:
        return self.output_processor.output(seq)

    # ---- one step ---------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Propose drafts, schedule, run the target once, sample or verify, and return an update for every
        request that gained tokens."""
        spec = self.speculator
        plan = spec.propose(self.scheduler.decoding(), self.scheduler.load) if spec is not None else None
        batch = self.scheduler.schedule(plan.drafts if plan is not None else None)
        for seq in batch.preempted:
            if spec is not None:
                spec.release(seq)
        if not batch.pieces:
            return []
        now = time.monotonic()
        for piece in batch.pieces:
            if piece.seq.metrics.first_scheduled_time is None:
                piece.seq.metrics.first_scheduled_time = now
        for piece in batch.pieces:  # a hybrid prefix hit starts from the checkpointed state
            if piece.seq.restore_state_from is not None:
                self.runner.copy_states(piece.seq.restore_state_from, piece.seq.state_slot)
                piece.seq.restore_state_from = None
        layout = StepLayout(batch.pieces)
        start = time.perf_counter()
        forward = self.runner.forward(
            [
                PieceInput(p.token_ids, p.start, p.seq.block_table, p.seq.state_slot, p.draft is not None)
                for p in batch.pieces
            ],
            layout.logit_rows,
            capture_layers=spec.capture_layers if spec is not None else (),
        )
        results = self.sampler(batch.pieces, layout, forward.logits)
        self.runner.roll_back_states(  # recurrent states to the accepted prefix (KV: by length, below)
            forward.checkpoints, {i: layout.num_tokens[i] + results[i].num_accepted for i in layout.verified}
        )
        verify_s = time.perf_counter() - start
        self._score_prompts(batch.pieces, layout, forward.hidden)
        updates = [
            update
            for piece, result in zip(batch.pieces, results)
            if result is not None and (update := self.output_processor.append(piece.seq, result)) is not None
        ]
        for src, dst in self.scheduler.update_from_output(batch, results):
            self.runner.copy_states(src, dst)  # a prefix's state kept for later hits
        for piece in batch.pieces:
            if piece.seq.is_finished:
                self.requests.pop(piece.seq.request_id, None)
        if spec is not None:
            spec.update(plan, batch, layout, results, forward.captured, verify_s)
        return updates

    def _score_prompts(self, pieces: list[ScheduledPiece], layout: StepLayout, hidden: torch.Tensor) -> None:
        """Prompt logprobs: each prompt row this forward computed for a request that asks scores the next
        prompt token; its step joins the sequence's `prompt_logprobs`. They come from the prefill forward
        alone (never from drafts), chunk by chunk, and are raw, log_softmax of the model's logits (as
        vLLM's): no logit_bias, penalty, temperature or truncation."""
        if not layout.prompt_rows:
            return
        rows, targets = [], []
        for i, piece_rows in layout.prompt_rows.items():
            position = pieces[i].start + piece_rows.start - layout.query_start[i]  # of the piece's first row
            rows += piece_rows
            targets += pieces[i].seq.prompt_token_ids[position + 1 : position + 1 + len(piece_rows)]
        num_top = max(pieces[i].seq.params.prompt_logprobs for i in layout.prompt_rows)
        scored = self.runner.score(hidden, rows, targets, num_top)
        at = 0
        for i, piece_rows in layout.prompt_rows.items():
            seq, scored_rows = pieces[i].seq, range(at, at + len(piece_rows))
            seq.prompt_logprobs += logprob_steps(scored, scored_rows, seq.params.prompt_logprobs)
            at += len(piece_rows)
