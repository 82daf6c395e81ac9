"""Tokens out: each new token appended with its stop checks (stop strings through incremental
detokenisation, stop token ids, end of sequence, a completed output constraint, max_tokens), the prompt
logprobs a forward scored, and the RequestOutput updates users see."""

from __future__ import annotations

import time

from specserve.core.batch import PieceResult, ScheduledPiece, StepLayout
from specserve.core.sequence import Sequence
from specserve.engine.detokenizer import Detokenizer
from specserve.engine.outputs import CompletionOutput, RequestOutput
from specserve.engine.sampling import logprob_steps
from specserve.layers.sampler import SampleOutput


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: frozenset[int]):
        self.detokenizer = Detokenizer(tokenizer)
        self.eos_token_ids = eos_token_ids

    def append(self, seq: Sequence, result: PieceResult) -> tuple[int, RequestOutput | None]:
        """Append a piece's new tokens up to the first that ends the request; how many it kept, and the
        request's update, if it gained any."""
        emitted = 0
        for i, token in enumerate(result.token_ids):
            self._append_token(seq, token, result.logprobs[i] if result.logprobs else None)
            emitted += 1
            if seq.is_finished:
                break
        return emitted, self.output(seq) if result.token_ids else None

    @staticmethod
    def add_prompt_logprobs(pieces: list[ScheduledPiece], layout: StepLayout, scored: SampleOutput) -> None:
        """Each prompt row the forward scored joins its sequence's `prompt_logprobs`, in order."""
        at = 0
        for i, piece_rows in layout.prompt_rows.items():
            seq, scored_rows = pieces[i].seq, range(at, at + len(piece_rows))
            seq.prompt_logprobs += logprob_steps(scored, scored_rows, seq.params.prompt_logprobs)
            at += len(piece_rows)

    def _append_token(self, seq: Sequence, token: int, logprobs: dict | None) -> None:
        if seq.metrics.first_token_time is None:
            seq.metrics.first_token_time = time.monotonic()
        seq.output_token_ids.append(token)
        out = seq.output
        if logprobs is not None:
            out.logprobs.append(logprobs)
        if seq.grammar is not None and not seq.grammar.accept(token):
            # The sampler masks every row with the grammar: the matcher failed (one of its per-step limits),
            # or the engine has a bug; never the user's error.
            out.error = f"token {token} broke the request's output constraint ({seq.grammar.error})"
            seq.finish("error")
            return
        stop = self.detokenizer.update(seq)
        if stop is None and (token in seq.params.stop_token_ids or self._is_eos(seq, token)):
            stop = token
        if stop is not None:
            out.stop_reason = stop
            seq.finish("stop")
        elif seq.grammar is not None and seq.grammar.finished:
            seq.finish("stop")
        elif len(seq.output_token_ids) >= seq.max_tokens:
            seq.finish("length")

    def _is_eos(self, seq: Sequence, token: int) -> bool:
        return token in self.eos_token_ids and not seq.params.ignore_eos

    def output(self, seq: Sequence) -> RequestOutput:
        """The request as it stands, with what is new since its previous update."""
        out, text = seq.output, Detokenizer.emittable_text(seq)
        delta_text = text[out.num_emitted_chars :]
        delta_tokens = seq.output_token_ids[out.num_emitted_tokens :]
        out.num_emitted_chars, out.num_emitted_tokens = len(text), len(seq.output_token_ids)
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=list(seq.output_token_ids),
            finish_reason=seq.finish_reason,
            stop_reason=out.stop_reason,
            logprobs=list(out.logprobs) if seq.params.logprobs is not None else None,
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
            error=out.error,
            num_cached_tokens=seq.num_cached_tokens,
            prompt_logprobs=[None, *seq.prompt_logprobs] if seq.params.prompt_logprobs is not None else None,
            spec_stats=seq.spec_stats,
        )
