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
from specserve.core.block_manager import BlockManager
from specserve.core.cache_coordinator import CacheCoordinator, plan_cache_memory
from specserve.core.sequence import Sequence
from specserve.core.spec_stats import SpecStats
from specserve.engine.input_processor import InputProcessor, PromptType
from specserve.engine.output_processor import OutputProcessor
from specserve.engine.outputs import RequestOutput
from specserve.engine.sampling import StepSampler
from specserve.engine.scheduler import Scheduler
from specserve.models.generation_config import eos_token_ids
from specserve.models.loader import load_model, resolve_model
from specserve.models.registry import text_config_of
from specserve.parallel.executor import TensorParallelExecutor
from specserve.preflight import check_before_loading, effective_max_model_len
from specserve.spec_decode.context import TargetContext
from specserve.spec_decode.speculator import Speculator
from specserve.structured.grammar import GrammarCompiler, RequestGrammar
from specserve.worker.cuda_graphs import graph_config
from specserve.worker.device_memory import device_cache_budget, lm_activation_bytes
from specserve.worker.model_runner import ModelRunner, PieceInput, PromptScoring, cache_layout

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
    @classmethod
    def from_args(
        cls, model: str, speculative_config: SpeculativeConfig | dict | str | None = None, **engine_args
    ) -> LLMEngine:
        """The engine for a user's arguments, parsed and checked before anything loads: a typo or anything
        config.json and the arguments decide (preflight.py) fails in seconds."""
        config = EngineConfig(model=model, **engine_args)
        spec_config = SpeculativeConfig.from_value(speculative_config)
        check_before_loading(config, spec_config)
        return cls(config, spec_config)

    def __init__(self, config: EngineConfig, speculative_config: SpeculativeConfig | None = None):
        """Both configurations come validated (`from_args` parses and checks a user's)."""
        _freeze_import_heap()
        self.config = config
        config.platform.make_current()  # "cuda:1": Triton launches its kernels on the current GPU
        self.model_dir = resolve_model(  # for its config and tokenizer: `load_model` reads the weights
            config.model, revision=config.revision, need_weights=False
        )
        # Tensor parallelism: worker ranks load their shards while this process (rank 0) loads its own.
        split = config.tensor_parallel_size > 1
        self.parallel = TensorParallelExecutor(config.tensor_parallel_size) if split else None
        # Split, every forward runs eagerly, the drafters' too: the workers run each step's command with the
        # driver, and a replayed graph (a drafter's calling the shared embedding or head) would skip them.
        self.enforce_eager = config.enforce_eager or split
        try:
            self._build(config, speculative_config)
        except BaseException:
            self.close()
            raise

    def _build(self, config: EngineConfig, spec_config: SpeculativeConfig | None) -> None:
        load_args = {"model": str(self.model_dir), "dtype": config.torch_dtype}
        load_args.update(
            quantization=config.quantization, platform=config.platform, load_format=config.load_format
        )
        if self.parallel is not None:
            self.parallel.load(**load_args)
        shard = self.parallel.shard if self.parallel is not None else None
        self.model, hf_config, self.tokenizer = load_model(**load_args, shard=shard)
        self.model_config = text_config_of(hf_config)
        self.vocab_size = self.model_config.vocab_size
        self.max_model_len = effective_max_model_len(config, self.model_config)
        self.eos_token_ids = eos_token_ids(self.model_dir, self.model_config, self.tokenizer)
        self.generator = torch.Generator(config.platform.device).manual_seed(config.seed)
        self.speculator = Speculator(spec_config, self.target_context) if spec_config else None
        # One budget for every cache, the drafter's included.
        spec = self.speculator
        drafter_spec = spec.cache_spec(config.block_size) if spec is not None else None
        layout = cache_layout(self.model, config.block_size, config.torch_dtype, drafter_spec)
        budget, budget_text = config.kv_cache_bytes, f"kv_cache_memory={config.kv_cache_memory!r}"
        rows_per_piece = 1 + (spec.num_draft_tokens if spec is not None else 0)
        graphs = graph_config(
            config.platform,
            self.enforce_eager,
            self.model,
            config.max_num_batched_tokens,
            config.max_num_seqs,
            rows_per_piece,
            -(-self.max_model_len // config.block_size) + 1,  # a verification's slack block included
        )
        if budget is None:  # on a GPU: what gpu_memory_utilization leaves after weights and activations
            rows = config.max_num_seqs * rows_per_piece  # a full decode batch: every verification's rows
            activations = lm_activation_bytes(
                self.model,
                config.max_num_batched_tokens,
                rows,
                config.block_size,
                config.torch_dtype,
                graph_tokens=graphs.largest_bucket if graphs is not None else 0,
            )
            # The drafter's, added: its graphs keep a pool of their own; its eager peak comes at another
            # time than the target's, but what a round leaves (its drafts' q rows) lives through the
            # target's forward, so the sum is the simple bound.
            activations += spec.activation_bytes() if spec is not None else 0
            if self.parallel is not None:
                # The probe ran on this rank's shard alone: a split head's logits come all-gathered (every
                # rank's part, then their concatenation: the whole vocabulary's rows twice).
                activations += 2 * rows * self.vocab_size * config.torch_dtype.itemsize
            device = next(self.model.parameters()).device
            budget = device_cache_budget(device, config.gpu_memory_utilization, activations)
            budget_text = (
                f"gpu_memory_utilization={config.gpu_memory_utilization} ({budget / 2**30:.2f} GiB left "
                "for caches after the weights and activations; or give kv_cache_memory)"
            )
        # The scratch block of each paged cache whose steps may replay graphs (the target's, the drafter's)
        scratch = layout.kv_bytes_per_block if graphs is not None else 0
        if config.platform.captures_graphs and not self.enforce_eager:
            scratch += sum(spec.bytes_per_block for spec in layout.drafter.paged)
        plan = plan_cache_memory(
            layout,
            budget - scratch,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len,
            enable_prefix_caching=config.enable_prefix_caching,
            budget_text=budget_text,
        )
        self.caches = CacheCoordinator.build(
            plan,
            layout,
            block_size=config.block_size,
            state_checkpoint_interval=config.state_checkpoint_interval,
        )
        runner_args = (plan.num_blocks, config.block_size, config.torch_dtype)
        runner_args += (plan.num_state_slots + plan.num_checkpoints,)
        if self.parallel is not None:
            self.runner = self.parallel.runner(self.model, *runner_args)
        else:
            self.runner = ModelRunner(self.model, *runner_args, graphs=graphs)
        self.input_processor = InputProcessor(
            self.tokenizer, self.vocab_size, self.max_model_len, config.platform.device
        )
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids)
        self.sampler = StepSampler(self.vocab_size, self.generator)
        if spec is not None:
            spec.bind(self.runner, self.caches)
        self.scheduler = Scheduler(self.caches, config.max_num_seqs, config.max_num_batched_tokens)
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
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            eos_token_ids=self.eos_token_ids,
            generator=self.generator,
            platform=self.config.platform,
            load_format=self.config.load_format,
            enforce_eager=self.enforce_eager,
            tensor_parallel_size=self.config.tensor_parallel_size,
        )

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (the engine cannot step afterwards)."""
        if self.parallel is not None:
            self.parallel.close()

    @property
    def block_manager(self) -> BlockManager:
        """The target's KV blocks (what `/metrics` and tests count)."""
        return self.caches.kv.blocks

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
        if not batch.pieces:
            return []
        layout = StepLayout(batch.pieces)
        start = time.perf_counter()
        forward = self.runner.forward(
            [
                PieceInput(
                    p.token_ids, p.start, p.block_table, p.state_slot, p.draft is not None, p.prompt_only
                )
                for p in batch.pieces
            ],
            layout.logit_rows,
            capture_layers=spec.capture_layers if spec is not None else (),
            restores=batch.restores,  # prefix hits of hybrid targets start from a kept state
            scoring=self._prompt_scoring(batch.pieces, layout),
        )
        results = self.sampler(batch.pieces, layout, forward.logits)
        verify_s = time.perf_counter() - start
        if forward.prompt_scores is not None:
            self.output_processor.add_prompt_logprobs(batch.pieces, layout, forward.prompt_scores)
        updates, emitted = [], [0] * len(results)
        for i, (piece, result) in enumerate(zip(batch.pieces, results)):
            if result is not None:
                emitted[i], update = self.output_processor.append(piece.seq, result)
                if update is not None:
                    updates.append(update)
        commit = self.scheduler.update_from_output(batch, results)
        # Recurrent states back to the accepted prefix (KV: by length), then kept for the prefix cache.
        self.runner.commit_states(commit.keep, commit.saves)
        for piece in batch.pieces:
            if piece.seq.is_finished:
                self.requests.pop(piece.seq.request_id, None)
        if spec is not None:
            spec.update(plan, batch, layout, results, emitted, forward.captured, verify_s)
        return updates

    def _prompt_scoring(self, pieces: list[ScheduledPiece], layout: StepLayout) -> PromptScoring | None:
        """Prompt logprobs: each prompt row this forward computes for a request that asks scores the next
        prompt token. They come from the prefill forward alone (never from drafts), chunk by chunk, and are
        raw, log_softmax of the model's logits (as vLLM's): no logit_bias, penalty, temperature or
        truncation."""
        if not layout.prompt_rows:
            return None
        rows, targets = [], []
        for i, piece_rows in layout.prompt_rows.items():
            scored = pieces[i].prompt_positions_to_score  # the positions of rows `piece_rows`
            rows += piece_rows
            targets += pieces[i].seq.prompt_token_ids[scored.start + 1 : scored.stop + 1]
        num_top = max(pieces[i].seq.params.prompt_logprobs for i in layout.prompt_rows)
        return PromptScoring(rows, targets, num_top)
