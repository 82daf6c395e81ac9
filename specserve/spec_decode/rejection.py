"""Lossless speculative verification: accept a prefix of each request's drafts, then one corrected token.

For request r with drafts d1..dk (k may be 0) the target forward yields k+1 rows: row j is the target
distribution p_{j+1} for the token after verify token j (anchor, d1, ..., dk). Draft d_i, drawn from q_i, is
accepted with probability min(1, p_i(d_i) / q_i(d_i)); the accepted count a is the length of the accepted
prefix. On a rejection at i = a+1 the next token is drawn from normalize(max(p_i - q_i, 0)) (from p_i when
that mass is <= 1e-8, e.g. p == q up to rounding); if all k are accepted it is a bonus token from the last
row. The emitted tokens d1..da, x are then distributed exactly as a+1 tokens of plain decoding from the
target (Leviathan et al. 2023; Chen et al. 2023). A deterministic drafter passes q = None, meaning a point
mass on the drafted token: accept with probability p_i(d_i), on rejection sample p_i without d_i.

Greedy rows (p one-hot at the penalised argmax): accept iff d_i is that argmax; the next token is the argmax;
no randomness is consumed. Random draws come from each row's own generator (`draw_uniform` /
`draw_exponential`), one uniform per draft then one exponential race over the vocabulary per request, so a
seeded request's outcome depends only on its own logits, drafts and generator, never on the batch.

Not done here (the engine's job): truncating the emitted tokens at a stop token or at max_tokens (an
accepted stop token ends the request and its later tokens, bonus included, are dropped), KV rollback, and
drafter state updates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from specserve.config import SamplingParams
from specserve.core.batch import verify_row_starts
from specserve.layers.sampler import (
    SamplingBatch,
    draw_exponential,
    draw_uniform,
    first_argmax,
    sample,
    target_probs,
)

PLACEHOLDER_TOKEN_ID = -1
# q(d) is clamped here in the accept ratio; a residual with at most this mass falls back to p (DSpark, §7.17).
_Q_FLOOR = 1e-8
_RESIDUAL_MIN_MASS = 1e-8
# Draft probabilities up to this many elements in all are concatenated (one gather); larger ones are read
# per request, which avoids copying [k, V] rows of a large vocabulary.
_Q_CAT_MAX_ELEMENTS = 1 << 20


@dataclass
class RejectionOutput:
    """Per request r: `token_ids[r]` = d1..d_a followed by the corrected (a < k) or bonus (a == k) token."""

    token_ids: list[list[int]]  # a_r + 1 tokens each
    num_accepted: list[int]  # a_r in 0..k_r
    num_draft_tokens: list[int]  # k_r
    accepted: torch.Tensor  # [R, k_max] bool: draft i of request r accepted (a prefix; False past k_r)
    output_token_ids: torch.Tensor  # [R, k_max + 1] int64 on the logits' device, padded with -1

    @property
    def num_requests(self) -> int:
        return len(self.token_ids)


def build_verify_batch(
    params: Sequence[SamplingParams],
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
    draft_token_ids: Sequence[Sequence[int]],
    vocab_size: int,
    generators: Sequence[torch.Generator | None] | None = None,
    *,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
) -> SamplingBatch:
    """The per-row `SamplingBatch` for verification: request r contributes k_r + 1 rows, row j with
    output_ids out_r + d1..dj (penalties as if those drafts were emitted) and the request's generator."""
    gens = list(generators) if generators is not None else [None] * len(params)
    row_params, row_prompts, row_outputs, row_gens = [], [], [], []
    for p, prompt, out, drafts, g in zip(params, prompt_ids, output_ids, draft_token_ids, gens, strict=True):
        for j in range(len(drafts) + 1):
            row_params.append(p)
            row_prompts.append(prompt)
            row_outputs.append(list(out) + list(drafts[:j]) if j else out)
            row_gens.append(g)
    return SamplingBatch.build(
        row_params, row_prompts, row_outputs, vocab_size, row_gens, generator=generator, device=device
    )


def rejection_sample(
    target_logits: torch.Tensor,
    batch: SamplingBatch,
    draft_token_ids: Sequence[Sequence[int]],
    draft_probs: Sequence[torch.Tensor | None],
) -> RejectionOutput:
    """Verify every request's drafts at once; see the module docstring for the semantics.

    target_logits: [sum_r (k_r + 1), V], request r's rows consecutive (anchor row, then one per draft).
    batch: one entry per logits row (`build_verify_batch`); all rows of a request share params and generator.
    draft_token_ids: d1..dk per request. draft_probs: per request the [k_r, V] rows each draft was sampled
    from (any float dtype; exactly the drafter's sampling distribution), or None for a deterministic drafter.
    """
    num_req = len(draft_token_ids)
    ks = [len(d) for d in draft_token_ids]
    _validate(target_logits, batch, draft_token_ids, draft_probs, ks)
    dev = target_logits.device
    batch = batch.to(dev)
    vocab = target_logits.shape[1]
    k_max = max(ks, default=0)
    if num_req == 0:
        empty = torch.zeros(0, 0, dtype=torch.long, device=dev)
        return RejectionOutput([], [], [], empty.bool(), empty)

    # Host-side index construction (one pass over requests); all math below is batched over rows.
    row_start = verify_row_starts(ks)
    draft_rows, draft_req, draft_pos, flat_drafts = [], [], [], []
    q_req, q_list, q_drafts, q_start = [], [], [], []  # requests with draft probabilities, their rows
    for r, (drafts, q) in enumerate(zip(draft_token_ids, draft_probs, strict=True)):
        k = len(drafts)
        if q is not None and k:
            q_req.append(r)
            q_list.append(q)
            q_start.append(len(q_drafts))
            q_drafts.extend(range(len(flat_drafts), len(flat_drafts) + k))
        draft_rows.extend(range(row_start[r], row_start[r] + k))
        draft_req.extend([r] * k)
        draft_pos.extend(range(k))
        flat_drafts.extend(int(d) for d in drafts)

    def idx(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(dev, non_blocking=True)

    k_t, start_t = idx(ks), idx(row_start)
    d_tok, d_req, d_pos = idx(flat_drafts), idx(draft_req), idx(draft_pos)
    drafts_pad = torch.full((num_req, k_max + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.long, device=dev)
    drafts_pad[d_req, d_pos] = d_tok
    ok = torch.zeros(num_req, k_max, dtype=torch.bool, device=dev)

    if batch.all_greedy:
        # p is one-hot at the penalised argmax: accept iff d == argmax, the next token is the argmax.
        argmax = sample(target_logits, batch).token_ids
        ok[d_req, d_pos] = d_tok == argmax[idx(draft_rows)]
        num_acc = ok.to(torch.uint8).cummin(dim=1).values.sum(dim=1) if k_max else k_t
        token = argmax[start_t + num_acc]
    else:
        p = target_probs(target_logits, batch)  # [M, V] fp32; greedy rows one-hot

        # 1. Accept test for every draft at once: U < p(d) / q(d) (q = 1 for a point mass). Greedy rows
        #    draw U = 0 and consume nothing: accept iff p(d) > 0, i.e. d is the argmax.
        p_d = p[idx(draft_rows), d_tok]
        q_d = torch.ones_like(p_d)
        q_req_t, q_drafts_t = idx(q_req), idx(q_drafts)
        # Many small q tensors (small vocab) are cheapest as one; large ones are read in place per request.
        q_all = None
        if q_list and sum(q.numel() for q in q_list) <= _Q_CAT_MAX_ELEMENTS:
            q_all = torch.cat(q_list).to(dev, torch.float32)
            q_vals = q_all.gather(1, d_tok[q_drafts_t].unsqueeze(1)).squeeze(1)
        elif q_list:
            q_tok = d_tok[q_drafts_t].unsqueeze(1)
            q_vals = torch.cat([q.to(dev).gather(1, q_tok[o : o + len(q)]) for q, o in zip(q_list, q_start)])
            q_vals = q_vals.squeeze(1).float()
        if q_list:
            q_d[q_drafts_t] = q_vals.clamp(min=_Q_FLOOR)
        u = draw_uniform(_row_subset(batch, draft_rows), 1).squeeze(1)
        ok[d_req, d_pos] = u < p_d / q_d
        num_acc = ok.to(torch.uint8).cummin(dim=1).values.sum(dim=1) if k_max else k_t

        # 2. One distribution per request: the residual at the first rejection, else the bonus row.
        p_sel = p[start_t + num_acc]  # [R, V]
        rejected = num_acc < k_t
        d_next = drafts_pad.gather(1, num_acc.unsqueeze(1)).squeeze(1).clamp(min=0)  # the rejected draft
        q_pos = torch.minimum(num_acc, k_t - 1).clamp(min=0)[q_req_t]  # the rejected draft's q row
        if q_all is not None:
            q_rows = q_all[idx(q_start) + q_pos]
        elif q_list:
            q_rows = torch.cat([q.to(dev).index_select(0, q_pos[i : i + 1]) for i, q in enumerate(q_list)])
            q_rows = q_rows.float()
        else:
            q_rows = p_sel.new_zeros(0, vocab)
        is_q = torch.zeros(num_req, dtype=torch.bool, device=dev)
        is_q[q_req_t] = True
        w = _residual_weights(p_sel, q_req_t, q_rows, rejected, d_next, rejected & ~is_q)
        fallback = rejected & (w.sum(dim=1) <= _RESIDUAL_MIN_MASS)
        torch.where(fallback.unsqueeze(1), p_sel, w, out=w)

        # 3. Exponential race argmax(w / E), E ~ Exp(1) from each request's generator (its anchor row's).
        race = first_argmax(w.div_(draw_exponential(_row_subset(batch, row_start), vocab)))
        token = torch.where(batch.is_greedy[start_t], first_argmax(p_sel), race) if batch.any_greedy else race

    cols = torch.arange(k_max + 1, device=dev).unsqueeze(0)
    out = torch.where(cols < num_acc.unsqueeze(1), drafts_pad, PLACEHOLDER_TOKEN_ID)
    out.scatter_(1, num_acc.unsqueeze(1), token.unsqueeze(1))
    host = torch.cat([num_acc.unsqueeze(1), out], dim=1).tolist()  # the one device -> host sync
    return RejectionOutput(
        token_ids=[h[1 : h[0] + 2] for h in host],
        num_accepted=[h[0] for h in host],
        num_draft_tokens=ks,
        accepted=cols[:, :k_max] < num_acc.unsqueeze(1),
        output_token_ids=out,
    )


def _residual_weights(
    p: torch.Tensor,
    q_req: torch.Tensor,
    q_rows: torch.Tensor,
    rejected: torch.Tensor,
    rejected_token: torch.Tensor,
    point_mass: torch.Tensor,
) -> torch.Tensor:
    """Unnormalised residual [R, V]: max(p - q, 0) on rejected rows with a q row (`q_rows[i]` belongs to
    request `q_req[i]`; consumed), p without the rejected token on `point_mass` rows, exactly p elsewhere."""
    w = p.clone()
    if q_rows.numel():
        w.index_add_(0, q_req, q_rows.mul_(rejected[q_req].unsqueeze(1)), alpha=-1)
    w.clamp_(min=0)
    col = rejected_token.unsqueeze(1)
    return w.scatter_(1, col, w.gather(1, col) * ~point_mass.unsqueeze(1))


def _row_subset(batch: SamplingBatch, rows: list[int]) -> SamplingBatch:
    """`batch` restricted to `rows` (in order) for drawing randomness; penalties are dropped."""
    sel = torch.tensor(rows, dtype=torch.long).to(batch.device, non_blocking=True)
    greedy = [batch.greedy_rows[i] for i in rows]
    return replace(
        batch,
        temperature=batch.temperature[sel],
        top_k=batch.top_k[sel],
        top_p=batch.top_p[sel],
        min_p=batch.min_p[sel],
        is_greedy=batch.is_greedy[sel],
        pen_rows=None,
        pen_ids=None,
        pen_rep=None,
        pen_offset=None,
        need_penalties=False,
        generators=[batch.generators[i] for i in rows],
        greedy_rows=greedy,
        all_greedy=bool(rows) and all(greedy),
        any_greedy=any(greedy),
    )


def _validate(
    target_logits: torch.Tensor,
    batch: SamplingBatch,
    draft_token_ids: Sequence[Sequence[int]],
    draft_probs: Sequence[torch.Tensor | None],
    ks: list[int],
) -> None:
    if target_logits.dim() != 2:
        raise ValueError(f"target_logits must be [rows, vocab], got shape {tuple(target_logits.shape)}")
    rows, vocab = target_logits.shape
    if len(draft_probs) != len(draft_token_ids):
        raise ValueError(
            f"need one draft_probs entry per request: {len(draft_token_ids)} requests, "
            f"{len(draft_probs)} given"
        )
    if rows != sum(ks) + len(ks):
        raise ValueError(f"target_logits has {rows} rows; the drafts need sum(k + 1) = {sum(ks) + len(ks)}")
    if batch.num_rows != rows:
        raise ValueError(f"batch has {batch.num_rows} rows, target_logits {rows}: need one entry per row")
    for r, (drafts, q) in enumerate(zip(draft_token_ids, draft_probs, strict=True)):
        if drafts and not (0 <= min(drafts) and max(drafts) < vocab):
            raise ValueError(f"request {r}: draft token ids must lie in [0, {vocab}), got {list(drafts)}")
        if q is not None and tuple(q.shape) != (len(drafts), vocab):
            raise ValueError(
                f"request {r}: draft_probs must be [k, V] = [{len(drafts)}, {vocab}], got {tuple(q.shape)}"
            )


__all__ = ["PLACEHOLDER_TOKEN_ID", "RejectionOutput", "build_verify_batch", "rejection_sample"]
