"""A step's logits -> each sampling piece's new tokens: plain rows sampled under the request's parameters,
verification rows through lossless rejection sampling, and logprobs where the request asks for them.
A request's logit_bias is added to every row it samples from, and a request with an output constraint has
each such row (each verify row included) masked to what its grammar allows after the tokens before that
row, so rejection sampling keeps the target's distribution under bias and constraint exactly; logprobs
are those of the biased, masked logits."""

from __future__ import annotations

import torch

from specserve.core.batch import PieceResult, ScheduledPiece, StepLayout, verify_row_starts
from specserve.core.sequence import Sequence
from specserve.layers.sampler import SampleOutput, SamplingBatch, add_logit_bias, raw_logprobs, sample
from specserve.layers.transfer import to_device
from specserve.spec_decode.rejection import build_verify_batch, rejection_sample
from specserve.structured.masks import mask_logits


class StepSampler:
    def __init__(self, vocab_size: int, generator: torch.Generator):
        self.vocab_size = vocab_size
        self.generator = generator  # unseeded requests draw from the engine's generator

    def __call__(
        self, pieces: list[ScheduledPiece], layout: StepLayout, logits: torch.Tensor
    ) -> list[PieceResult | None]:
        """Per piece its result; None for a prompt chunk that does not reach its sequence's end."""
        results: list[PieceResult | None] = [None] * len(pieces)
        logits = self._processed(pieces, layout, logits)
        if layout.plain:
            seqs = [pieces[i].seq for i in layout.plain]
            for i, result in zip(
                layout.plain, self._sample(seqs, logits[layout.logit_rows_of(layout.plain)])
            ):
                results[i] = result
        if layout.verified:
            verified = [pieces[i] for i in layout.verified]
            for i, result in zip(
                layout.verified, self._verify(verified, logits[layout.logit_rows_of(layout.verified)])
            ):
                results[i] = result
        return results

    @staticmethod
    def _processed(pieces: list[ScheduledPiece], layout: StepLayout, logits: torch.Tensor) -> torch.Tensor:
        """`logits` with each request's logit_bias added to its rows and the rows of constrained requests
        masked by their grammars: what every later stage (penalties, temperature, verification) sees."""
        sampled = layout.plain + layout.verified
        biased = [i for i in sampled if pieces[i].seq.params.logit_bias]
        constrained = [i for i in sampled if pieces[i].seq.grammar is not None]
        if not biased and not constrained:
            return logits
        logits = logits.clone()
        for i in biased:
            add_logit_bias(logits, layout.logit_rows_of([i]), pieces[i].seq.params.logit_bias)
        if constrained:
            rows = layout.logit_rows_of(constrained)
            masks = torch.cat(
                [
                    pieces[i].seq.grammar.masks(
                        pieces[i].draft.token_ids if pieces[i].draft is not None else []
                    )
                    for i in constrained
                ]
            )
            logits[rows] = mask_logits(logits[rows], masks)
        return logits

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[PieceResult]:
        batch = SamplingBatch.build(
            [s.params for s in seqs],
            [s.prompt_token_ids for s in seqs],
            [s.output_token_ids for s in seqs],
            self.vocab_size,
            [s.generator for s in seqs],
            generator=self.generator,
            device=logits.device,
        )
        wanted = [s.params.logprobs for s in seqs if s.params.logprobs is not None]
        out = sample(logits, batch, num_logprobs=max(wanted) if wanted else None).to_host()
        tokens = out.token_ids.tolist()
        return [
            PieceResult([token], 0, logprob_steps(out, [i], seq.params.logprobs))
            for i, (seq, token) in enumerate(zip(seqs, tokens))
        ]

    def _verify(self, pieces: list[ScheduledPiece], logits: torch.Tensor) -> list[PieceResult]:
        seqs = [p.seq for p in pieces]
        drafts = [p.draft for p in pieces]
        batch = build_verify_batch(
            [s.params for s in seqs],
            [s.prompt_token_ids for s in seqs],
            [s.output_token_ids for s in seqs],
            [d.token_ids for d in drafts],
            self.vocab_size,
            [s.generator for s in seqs],
            generator=self.generator,
            device=logits.device,
        )
        out = rejection_sample(logits, batch, [d.token_ids for d in drafts], [d.probs for d in drafts])
        # A request's j-th new token was drawn from its j-th verify row; score those of requests that ask.
        starts = verify_row_starts([len(d.token_ids) for d in drafts])
        asking = [r for r, seq in enumerate(seqs) if seq.params.logprobs is not None]
        scored, first = None, {}
        if asking:
            rows, tokens = [], []
            for r in asking:
                first[r] = len(rows)
                rows += range(starts[r], starts[r] + len(out.token_ids[r]))
                tokens += out.token_ids[r]
            rows, tokens = to_device(logits.device, torch.tensor(rows), torch.tensor(tokens))
            num_top = max(seqs[r].params.logprobs for r in asking)
            scored = raw_logprobs(logits[rows], tokens, num_top).to_host()
        results = []
        for r, (seq, tokens) in enumerate(zip(seqs, out.token_ids)):
            rows = range(first[r], first[r] + len(tokens)) if r in first else []
            results.append(
                PieceResult(tokens, out.num_accepted[r], logprob_steps(scored, rows, seq.params.logprobs))
            )
        return results


def logprob_steps(scored: SampleOutput | None, rows, num_top: int | None) -> list[dict] | None:
    """One {token: logprob} per row of `scored` (the chosen token first, then the top `num_top`), or None
    when the request asked for none."""
    if num_top is None:
        return None
    steps = []
    for row in rows:
        step = {int(scored.token_ids[row]): float(scored.logprobs[row])}
        if num_top:
            ids, values = scored.top_logprobs
            for t, v in zip(ids[row, :num_top].tolist(), values[row, :num_top].tolist()):
                step.setdefault(t, v)
        steps.append(step)
    return steps
