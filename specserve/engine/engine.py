"""The engine: requests in, one scheduled model step at a time, request updates out."""

from __future__ import annotations

import functools
import itertools
import json
import logging
import time
from collections import deque
from collections.abc import Mapping
from pathlib import Path

import torch

from specserve.config import EngineConfig, SamplingParams, SpecserveError, SpeculativeConfig
from specserve.engine.detokenizer import Detokenizer
from specserve.engine.kv_cache import BlockManager
from specserve.engine.model_runner import ModelRunner, PieceInput, kv_bytes_per_block
from specserve.engine.outputs import CompletionOutput, RequestOutput
from specserve.engine.scheduler import Scheduler, SchedulerOutput
from specserve.engine.sequence import Sequence
from specserve.layers.sampler import SamplingBatch, sample
from specserve.models.loader import load_model, resolve_model
from specserve.models.registry import text_config_of
from specserve.spec_decode.calibration import LiveCalibration, Recalibration, VerificationRecords
from specserve.spec_decode.cost_model import CostProfile, cache_path, engine_key, profile_engine
from specserve.spec_decode.drafters import build_drafter
from specserve.spec_decode.drafters.base import DraftProposal
from specserve.spec_decode.metrics import SpecStats, StepRecord
from specserve.spec_decode.planner import Plan, build_planner, survival
from specserve.spec_decode.rejection import build_verify_batch, rejection_sample

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
    def __init__(
        self, config: EngineConfig, speculative_config: SpeculativeConfig | dict | str | None = None
    ):
        self.config = config
        model_dir = resolve_model(config.model, revision=config.revision)
        self.model, hf_config, self.tokenizer = load_model(
            str(model_dir), dtype=config.torch_dtype, quantization=config.quantization
        )
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
        # Never more than the running batch can fill: every sequence at max_model_len (plus a block of
        # verification slack). The cache is allocated (and zeroed) up front, so this saves real memory.
        per_sequence = -(-self.max_model_len // config.block_size) + 1
        num_blocks = min(num_blocks, config.max_num_seqs * per_sequence)
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
        self.spec_config = SpeculativeConfig.from_value(speculative_config)
        self.spec_stats = SpecStats()
        self.drafter = build_drafter(self.spec_config, self) if self.spec_config else None
        self.calibration = LiveCalibration()  # predicted vs realised draft survival, per position
        self.recalibration = Recalibration()  # realised acceptance by position and raw confidence
        if self.drafter is not None:
            self.num_draft_tokens = self.spec_config.num_speculative_tokens or self.drafter.default_num_tokens
            self.planner = build_planner(
                self.spec_config, self._cost_profile(), self.num_draft_tokens, self.recalibration
            )
        self.step_log: deque[StepRecord] = deque(maxlen=1024)  # the latest speculative steps
        self.verification_records: VerificationRecords | None = None  # set to collect STS data
        self._planned: Plan | None = None

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
        """Propose drafts, schedule, run the target once, sample or verify, and return an update for every
        request that changed."""
        if self.drafter is not None:
            self._propose()
        plan = self.scheduler.schedule()
        for seq in plan.preempted:
            self._release_draft_state(seq)
        if not plan.pieces:
            return []
        now = time.monotonic()
        for piece in plan.pieces:
            if piece.seq.metrics.first_scheduled_time is None:
                piece.seq.metrics.first_scheduled_time = now
        start = time.perf_counter()
        results, features = self._run(plan)
        if any(p.num_drafts for p in plan.pieces):
            self.spec_stats.verification_s += time.perf_counter() - start
        updates = []
        row = 0
        for piece, (tokens, num_accepted, logprobs) in zip(plan.pieces, results):
            seq = piece.seq
            seq.num_computed_tokens += piece.num_tokens + num_accepted
            if piece.num_drafts:
                self._record_verification(seq.draft.truncate(piece.num_drafts), num_accepted)
            seq.draft = None
            emitted = 0  # fewer than len(tokens) when a stop condition ends the request inside the round
            for i, token in enumerate(tokens):
                self._append_token(seq, token, logprobs[i] if logprobs else None)
                emitted += 1
                if seq.is_finished:
                    break
            if piece.num_drafts:
                # A stop inside the accepted drafts truncates the round there (DeepSpec's accounting).
                accepted = min(num_accepted, emitted)
                seq.spec_stats.record(piece.num_drafts, accepted, emitted)
                self.spec_stats.record(piece.num_drafts, accepted, emitted)
            if tokens:
                updates.append(self._output(seq))
            if features is not None and not seq.is_finished:
                # The drafter's next context: the rows now in the target's cache, never rejected drafts.
                kept = piece.num_tokens + num_accepted
                self.drafter.observe(seq, piece.start, features[row : row + kept])
            row += piece.num_query_tokens
            if piece.num_drafts and not seq.is_finished:
                # Roll back by length: blocks past the verified tokens go back to the free list.
                self.block_manager.shrink(seq, seq.num_tokens)
        if self._planned is not None:
            self.step_log.append(
                StepRecord(
                    budgets=self._planned.lengths,
                    batch_tokens=plan.num_tokens,
                    expected_accepted=self._planned.expected_accepted,
                    accepted=sum(r[1] for r, p in zip(results, plan.pieces) if p.num_drafts),
                )
            )
            self._planned = None
        return updates

    def _record_verification(self, draft: DraftProposal, num_accepted: int) -> None:
        """Live calibration (and STS records when collecting) from one verified proposal."""
        self.recalibration.record(draft.slot_confidences(), num_accepted)
        if draft.confidences is None:
            return
        self.calibration.record(survival(draft), num_accepted)
        if self.verification_records is not None:
            self.verification_records.add(torch.logit(draft.confidences.double(), eps=1e-12), num_accepted)

    def _cost_profile(self) -> CostProfile | None:
        """The SPS table the scheduled verify policies need: the configured file, else the cached
        measurement for this model / dtype / threads / drafter, else measured now (and cached)."""
        if self.spec_config.verify_policy not in ("dspark", "dspark_async"):
            return None
        if self.spec_config.cost_profile:
            return CostProfile.load(self.spec_config.cost_profile)
        key = engine_key(self)
        path = cache_path(key)
        if path.is_file():
            return CostProfile.load(path)
        logger.info("measuring the cost profile (cached in %s)", path)
        profile = profile_engine(self, self.config.max_num_batched_tokens)
        profile.meta.update(key)
        profile.save(path)
        profile.plot(path.with_suffix(".png"))
        return profile

    def _propose(self) -> None:
        """Drafts for every running sequence whose next step is a decode step (one token not yet cached)."""
        decoding = [s for s in self.scheduler.running if s.num_uncomputed_tokens == 1]
        if not decoding:
            return
        start = time.perf_counter()
        # The planner weighs drafts against the step's decode tokens, and prices each request still in
        # prefill or waiting as one more: while requests queue, a second of drafting delays them all,
        # so engine time is worth the throughput of the load they make, not that of the few decoding
        # (measured at c = 64: the first request of a wave, alone, drafted 7 tokens a step for 0.9 s
        # while 63 prompts waited). The prompt chunks themselves are work done anyway: counted as tokens
        # that emit nothing, they made any step with a prefill look slow, and drafting look cheap.
        load = len(self.scheduler.running) + len(self.scheduler.waiting)
        base_tokens = min(load, self.config.max_num_seqs)
        remaining = [
            min(seq.max_tokens - len(seq.output_token_ids), self.max_model_len - seq.num_tokens)
            for seq in decoding
        ]
        may_draft = self.planner.catch_up([self.drafter.backlog(s) for s in decoding], remaining, base_tokens)
        if not any(may_draft) or (
            not self.drafter.drafts_serially and not self.planner.draft_round(len(decoding), base_tokens)
        ):
            # A plain step. A drafter conditioned on the target's features keeps collecting them
            # (`observe`) and takes them all into its context at its next round.
            self._planned = self.planner.plan([DraftProposal([]) for _ in decoding], base_tokens)
            return
        keep_drafting = functools.partial(
            self.planner.keep_drafting, base_tokens=base_tokens, may_draft=may_draft
        )
        proposals = self.drafter.propose(decoding, self.num_draft_tokens, keep_drafting)
        self.spec_stats.drafting_s += time.perf_counter() - start
        # Never draft past max_tokens or max_model_len: a round emits at most drafts + 1 tokens.
        capped = [proposal.truncate(max(0, left - 1)) for proposal, left in zip(proposals, remaining)]
        self._planned = self.planner.plan(capped, base_tokens)
        for seq, proposal, length in zip(decoding, capped, self._planned.lengths):
            proposal = proposal.truncate(length)
            seq.draft = proposal if proposal.token_ids else None

    def _run(
        self, plan: SchedulerOutput
    ) -> tuple[list[tuple[list[int], int, list[dict] | None]], torch.Tensor | None]:
        """One target forward; per piece the new tokens, how many drafts were accepted, and logprobs; plus
        the drafter's target features of every row ([N, n_f * H]) when it reads any."""
        inputs, rows = [], []
        offset = 0
        for piece in plan.pieces:
            inputs.append(PieceInput(piece.token_ids, piece.start, piece.seq.block_table))
            offset += piece.num_query_tokens
            if piece.reaches_end:
                rows.extend(range(offset - piece.num_drafts - 1, offset))
        layers = self.drafter.capture_layers if self.drafter is not None else ()
        out = self.runner.forward(inputs, rows, capture_layers=layers)
        logits = out.logits
        features = torch.cat([out.captured[i] for i in layers], dim=-1) if layers else None
        results: list[tuple[list[int], int, list[dict] | None]] = [([], 0, None)] * len(plan.pieces)
        plain = [i for i, p in enumerate(plan.pieces) if p.reaches_end and not p.num_drafts]
        verify = [i for i, p in enumerate(plan.pieces) if p.num_drafts]
        row_of_piece, row = {}, 0
        for i, piece in enumerate(plan.pieces):
            if piece.reaches_end:
                row_of_piece[i] = row
                row += piece.num_drafts + 1
        if plain:
            picked = logits[torch.tensor([row_of_piece[i] for i in plain])]
            for i, result in zip(plain, self._sample([plan.pieces[i].seq for i in plain], picked)):
                results[i] = result
        if verify:
            rows_v = torch.cat(
                [
                    torch.arange(row_of_piece[i], row_of_piece[i] + plan.pieces[i].num_drafts + 1)
                    for i in verify
                ]
            )
            for i, result in zip(verify, self._verify([plan.pieces[i] for i in verify], logits[rows_v])):
                results[i] = result
        return results, features

    def _sample(
        self, seqs: list[Sequence], logits: torch.Tensor
    ) -> list[tuple[list[int], int, list[dict] | None]]:
        batch = SamplingBatch.build(
            [s.params for s in seqs],
            [s.prompt_token_ids for s in seqs],
            [s.output_token_ids for s in seqs],
            self.vocab_size,
            [s.generator for s in seqs],
            generator=self.generator,
        )
        wanted = [s.params.logprobs for s in seqs if s.params.logprobs is not None]
        result = sample(logits, batch, num_logprobs=max(wanted) if wanted else None)
        out = []
        for i, seq in enumerate(seqs):
            token = int(result.token_ids[i])
            logprobs = None
            if seq.params.logprobs is not None:
                logprobs = {token: float(result.logprobs[i])}
                if seq.params.logprobs:
                    ids, values = result.top_logprobs
                    n = seq.params.logprobs
                    for t, v in zip(ids[i, :n].tolist(), values[i, :n].tolist()):
                        logprobs.setdefault(t, v)
                logprobs = [logprobs]
            out.append(([token], 0, logprobs))
        return out

    def _verify(self, pieces: list, logits: torch.Tensor) -> list[tuple[list[int], int, list[dict] | None]]:
        seqs = [p.seq for p in pieces]
        drafts = [p.seq.draft.truncate(p.num_drafts) for p in pieces]
        batch = build_verify_batch(
            [s.params for s in seqs],
            [s.prompt_token_ids for s in seqs],
            [s.output_token_ids for s in seqs],
            [d.token_ids for d in drafts],
            self.vocab_size,
            [s.generator for s in seqs],
            generator=self.generator,
        )
        result = rejection_sample(logits, batch, [d.token_ids for d in drafts], [d.probs for d in drafts])
        out = []
        row = 0
        for r, seq in enumerate(seqs):
            tokens = result.token_ids[r]
            logprobs = None
            if seq.params.logprobs is not None:
                raw = logits[row : row + len(tokens)].float().log_softmax(-1)
                logprobs = []
                for j, token in enumerate(tokens):
                    step = {token: float(raw[j, token])}
                    if seq.params.logprobs:
                        top = raw[j].topk(seq.params.logprobs)
                        for t, v in zip(top.indices.tolist(), top.values.tolist()):
                            step.setdefault(t, v)
                    logprobs.append(step)
            out.append((tokens, result.num_accepted[r], logprobs))
            row += len(drafts[r].token_ids) + 1
        return out

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

    def _release_draft_state(self, seq: Sequence) -> None:
        if self.drafter is not None:
            self.drafter.release(seq)

    def _finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        self._release_draft_state(seq)
        seq.draft = None
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
