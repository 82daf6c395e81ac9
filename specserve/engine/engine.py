"""The engine: requests in, one scheduled model step at a time, request updates out."""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from pathlib import Path

import torch

from specserve.config import EngineConfig, SamplingParams, SpecserveError
from specserve.engine.detokenizer import Detokenizer
from specserve.engine.kv_cache import BlockManager
from specserve.engine.model_runner import ModelRunner, PieceInput, kv_bytes_per_block
from specserve.engine.outputs import CompletionOutput, RequestOutput
from specserve.engine.scheduler import Scheduler, SchedulerOutput
from specserve.engine.sequence import Sequence
from specserve.layers.sampler import SamplingBatch, sample
from specserve.models.loader import load_model, resolve_model
from specserve.models.registry import text_config_of

logger = logging.getLogger(__name__)

PromptType = str | list[int] | Mapping[str, object]
DEFAULT_MAX_MODEL_LEN = 8192


def read_generation_config(model_dir: Path) -> dict:
    path = model_dir / "generation_config.json"
    return json.loads(path.read_text()) if path.exists() else {}


def eos_token_ids(model_config, tokenizer, generation_config: dict | None = None) -> set[int]:
    """Every id that ends a generation: generation_config's eos list, the tokenizer's and the config's."""
    ids: set[int] = set()
    for source in (
        (generation_config or {}).get("eos_token_id"),
        getattr(model_config, "eos_token_id", None),
    ):
        if source is not None:
            ids.update([source] if isinstance(source, int) else source)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        model_dir = resolve_model(config.model, revision=config.revision)
        self.model, hf_config, self.tokenizer = load_model(str(model_dir), dtype=config.torch_dtype)
        generation_config = read_generation_config(model_dir)
        self.model_config = text_config_of(hf_config)
        self.vocab_size = self.model_config.vocab_size
        context = getattr(self.model_config, "max_position_embeddings", None) or DEFAULT_MAX_MODEL_LEN
        self.max_model_len = config.max_model_len or min(context, DEFAULT_MAX_MODEL_LEN)
        if self.max_model_len > context:
            raise SpecserveError(
                f"max_model_len {self.max_model_len} exceeds the model's context length {context}"
            )

        num_blocks = config.kv_cache_bytes // kv_bytes_per_block(
            self.model, config.block_size, config.torch_dtype
        )
        if num_blocks * config.block_size < self.max_model_len:
            raise SpecserveError(
                f"kv_cache_memory={config.kv_cache_memory!r} holds {num_blocks * config.block_size} tokens, "
                f"fewer than max_model_len={self.max_model_len}; raise kv_cache_memory or lower max_model_len"
            )
        self.block_manager = BlockManager(num_blocks, config.block_size)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(self.model, num_blocks, config.block_size, config.torch_dtype)
        self.detokenizer = Detokenizer(self.tokenizer)
        self.eos_token_ids = eos_token_ids(self.model_config, self.tokenizer, generation_config)
        self.generator = torch.Generator().manual_seed(config.seed)
        self.requests: dict[str, Sequence] = {}
        self._ids = itertools.count()

    # ---- requests -------------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: PromptType) -> tuple[list[int], str | None]:
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return self._check_token_ids(prompt["prompt_token_ids"]), None
            if "prompt" in prompt:
                return self.tokenize_prompt(prompt["prompt"])
            raise SpecserveError("a prompt dict needs 'prompt_token_ids' or 'prompt'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise SpecserveError("this model has no tokenizer: pass prompts as lists of token ids")
            if not prompt:
                raise SpecserveError("the prompt is empty")
            return self.tokenizer(prompt).input_ids, prompt
        if isinstance(prompt, list | tuple):
            return self._check_token_ids(prompt), None
        raise SpecserveError(
            f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}"
        )

    def _check_token_ids(self, ids) -> list[int]:
        ids = list(ids)
        if not ids:
            raise SpecserveError("the prompt is empty")
        bad = [
            t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size
        ]
        if bad:
            raise SpecserveError(
                f"prompt token ids must be integers in [0, {self.vocab_size}), got {bad[:5]}"
            )
        return ids

    def make_sequence(
        self, prompt: PromptType, params: SamplingParams, request_id: str | None = None
    ) -> Sequence:
        """Validate a request completely (nothing runs yet)."""
        if not isinstance(params, SamplingParams):
            raise SpecserveError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        token_ids, text = self.tokenize_prompt(prompt)
        if len(token_ids) >= self.max_model_len:
            raise SpecserveError(
                f"the prompt has {len(token_ids)} tokens; max_model_len is {self.max_model_len}, so at most "
                f"{self.max_model_len - 1} prompt tokens leave room for one generated token"
            )
        room = self.max_model_len - len(token_ids)
        max_tokens = min(params.max_tokens or room, room)
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise SpecserveError(f"request id {request_id!r} is already in use")
        generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        return Sequence(request_id, token_ids, params, max_tokens, prompt=text, generator=generator)

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
            self._finish(seq, "abort")

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    # ---- one step ---------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample, and return an update for every request that changed."""
        plan = self.scheduler.schedule()
        if not plan.pieces:
            return []
        now = time.monotonic()
        for piece in plan.pieces:
            if piece.seq.metrics.first_scheduled_time is None:
                piece.seq.metrics.first_scheduled_time = now
        sampled = self._run(plan)
        updates = []
        for piece in plan.pieces:
            piece.seq.num_computed_tokens += piece.num_tokens
        for seq, token, logprobs in sampled:
            self._append_token(seq, token, logprobs)
            updates.append(self._output(seq))
        return updates

    def _run(self, plan: SchedulerOutput) -> list[tuple[Sequence, int, dict | None]]:
        inputs, rows, to_sample = [], [], []
        offset = 0
        for piece in plan.pieces:
            inputs.append(PieceInput(piece.token_ids, piece.start, piece.seq.block_table))
            offset += piece.num_tokens
            if piece.reaches_end:
                rows.append(offset - 1)
                to_sample.append(piece.seq)
        out = self.runner.forward(inputs, rows)
        if not to_sample:
            return []
        batch = SamplingBatch.build(
            [s.params for s in to_sample],
            [s.prompt_token_ids for s in to_sample],
            [s.output_token_ids for s in to_sample],
            self.vocab_size,
            [s.generator for s in to_sample],
            generator=self.generator,
        )
        wanted = [s.params.logprobs for s in to_sample if s.params.logprobs is not None]
        num_logprobs = max(wanted) if wanted else None
        result = sample(out.logits, batch, num_logprobs=num_logprobs)
        sampled = []
        for i, seq in enumerate(to_sample):
            token = int(result.token_ids[i])
            logprobs = None
            if seq.params.logprobs is not None:
                logprobs = {token: float(result.logprobs[i])}
                if seq.params.logprobs:
                    ids, values = result.top_logprobs
                    for t, v in zip(
                        ids[i, : seq.params.logprobs].tolist(), values[i, : seq.params.logprobs].tolist()
                    ):
                        logprobs.setdefault(t, v)
            sampled.append((seq, token, logprobs))
        return sampled

    def _append_token(self, seq: Sequence, token: int, logprobs: dict | None) -> None:
        if seq.metrics.first_token_time is None:
            seq.metrics.first_token_time = time.monotonic()
        seq.output_token_ids.append(token)
        if logprobs is not None:
            seq.output_logprobs.append(logprobs)
        stop = self.detokenizer.update(seq)
        if stop is not None:
            self._finish(seq, "stop", stop)
        elif token in seq.params.stop_token_ids:
            self._finish(seq, "stop", token)
        elif token in self.eos_token_ids and not seq.params.ignore_eos:
            self._finish(seq, "stop", token)
        elif len(seq.output_token_ids) >= seq.max_tokens:
            self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        seq.metrics.finish_time = time.monotonic()
        self.scheduler.finish(seq)
        self.requests.pop(seq.request_id, None)

    def _output(self, seq: Sequence) -> RequestOutput:
        text = Detokenizer.emittable_text(seq)
        delta_text = text[seq.num_emitted_chars :]
        delta_tokens = seq.output_token_ids[seq.num_emitted_tokens :]
        seq.num_emitted_chars, seq.num_emitted_tokens = len(text), len(seq.output_token_ids)
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=list(seq.output_token_ids),
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            logprobs=list(seq.output_logprobs) if seq.params.logprobs is not None else None,
            delta_text=delta_text,
            delta_token_ids=delta_tokens,
        )
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            outputs=[completion],
            finished=seq.is_finished,
            metrics=seq.metrics,
            error=seq.error,
        )

    def final_output(self, seq: Sequence) -> RequestOutput:
        return self._output(seq)

    def run_to_completion(self, seqs: Seq[Sequence]) -> None:
        for seq in seqs:
            self.add_sequence(seq)
        while any(not s.is_finished for s in seqs):
            self.step()
