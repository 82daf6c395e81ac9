"""Batched token sampling: penalties, temperature, top-k / top-p / min-p, seeded exponential-race draws.

One `SamplingBatch` is built per engine step from the requests' `SamplingParams`; `sample` turns logits
[M, V] into one token per row. `processed_logprobs` and `target_probs` expose the distribution actually
sampled from, so the speculative rejection sampler verifies against exactly what plain decoding would draw.

Transform order (per row): penalties -> temperature -> top-k -> top-p -> min-p. Greedy rows (temperature
< 1e-5) see temperature 1 and their token is the exact argmax of the penalised logits (ties -> lowest id).

Speculative verification: build the batch with one entry per logits ROW. For a request r verified on
drafts d1..dk, pass its params k+1 times and output_ids `out_r`, `out_r + [d1]`, ..., `out_r + [d1..dk]`,
so row j sees penalties as if the first j drafts had been emitted; pass the request's generator on each
of its (consecutive) rows: they are drawn together in one call, whatever else is in the batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace

import numpy as np
import torch

from specserve.config import SamplingParams
from specserve.layers.transfer import to_host

_NEG_INF = float("-inf")
# Above this k, one full sort beats topk(k) + a masked logsumexp on typical hardware.
_TOPK_SUBSET_MAX = 1024
# top-p without top-k on CPU: candidates tried before falling back to a full sort.
_TOP_P_CANDIDATES = 1024


@dataclass
class SamplingBatch:
    """Per-row sampling tensors for one step; the bool/int fields let the common case skip work.

    Penalties are stored sparsely as unique (row, token) pairs: `pen_rows`, `pen_ids` index the logits,
    `pen_rep` is the row's repetition penalty (every pair is in prompt+output), `pen_offset` is
    frequency * output_count + presence * (output_count > 0) (zero for prompt-only tokens).
    """

    temperature: torch.Tensor  # [M] fp32, 1.0 on greedy rows
    top_k: torch.Tensor  # [M] int64, 0 when off (also for top_k >= V)
    top_p: torch.Tensor  # [M] fp32, 1.0 when off
    min_p: torch.Tensor  # [M] fp32, 0.0 when off
    is_greedy: torch.Tensor  # [M] bool
    pen_rows: torch.Tensor | None
    pen_ids: torch.Tensor | None
    pen_rep: torch.Tensor | None
    pen_offset: torch.Tensor | None
    generators: list[torch.Generator | None]  # per row; None -> `generator`
    generator: torch.Generator | None  # shared (engine) generator; None -> torch's default
    greedy_rows: list[bool]
    vocab_size: int
    all_greedy: bool
    any_greedy: bool
    need_penalties: bool
    need_temperature: bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    max_top_k: int  # largest active top_k, 0 when none
    top_p_within_top_k: bool  # every top-p row also has a small top-k: topk() replaces a full sort

    @property
    def num_rows(self) -> int:
        return len(self.greedy_rows)

    @property
    def device(self) -> torch.device:
        return self.temperature.device

    def to(self, device: torch.device | str) -> SamplingBatch:
        """This batch with its tensors on `device` (self when already there); generators do not move."""
        device = torch.device(device)
        if device == self.device:
            return self
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return replace(self, **moved)

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
        vocab_size: int,
        generators: Sequence[torch.Generator | None] | None = None,
        *,
        generator: torch.Generator | None = None,
        device: torch.device | str = "cpu",
    ) -> SamplingBatch:
        """Prepare one step's tensors; one entry per logits row (see the module docstring for spec decode).

        Repetition penalty applies to prompt + output tokens (as in HF / vLLM); presence and frequency
        penalties to output tokens only. `generators[i]` is row i's seeded generator (or None to use the
        shared `generator`); generators must live on the logits' device. Build on that device to avoid
        a copy per call (`sample` etc. move the batch with `to()` otherwise).
        """
        m = len(params)
        if len(prompt_ids) != m or len(output_ids) != m:
            raise ValueError(
                f"need one prompt_ids/output_ids entry per row: {m} rows, "
                f"{len(prompt_ids)} prompts, {len(output_ids)} outputs"
            )
        gens = list(generators) if generators is not None else [None] * m
        if len(gens) != m:
            raise ValueError(f"need one generator entry per row: {m} rows, {len(gens)} generators")
        greedy = [p.greedy for p in params]
        temps = [1.0 if g else float(p.temperature) for p, g in zip(params, greedy, strict=True)]
        top_k = [p.top_k if 0 < p.top_k < vocab_size else 0 for p in params]
        top_p = [float(p.top_p) for p in params]
        min_p = [float(p.min_p) for p in params]
        max_top_k = max(top_k, default=0)
        need_top_p = any(p < 1.0 for p in top_p)
        top_p_within_top_k = (
            need_top_p
            and 0 < max_top_k <= _TOPK_SUBSET_MAX
            and all(k > 0 for k, p in zip(top_k, top_p, strict=True) if p < 1.0)
        )

        pen = _build_penalties(params, prompt_ids, output_ids, vocab_size)
        dev = torch.device(device)

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(dev, non_blocking=True)

        return cls(
            temperature=tensor(temps, torch.float32),
            top_k=tensor(top_k, torch.int64),
            top_p=tensor(top_p, torch.float32),
            min_p=tensor(min_p, torch.float32),
            is_greedy=tensor(greedy, torch.bool),
            pen_rows=None if pen is None else pen[0].to(dev, non_blocking=True),
            pen_ids=None if pen is None else pen[1].to(dev, non_blocking=True),
            pen_rep=None if pen is None else pen[2].to(dev, non_blocking=True),
            pen_offset=None if pen is None else pen[3].to(dev, non_blocking=True),
            generators=gens,
            generator=generator,
            greedy_rows=greedy,
            vocab_size=vocab_size,
            all_greedy=m > 0 and all(greedy),
            any_greedy=any(greedy),
            need_penalties=pen is not None,
            need_temperature=any(t != 1.0 for t in temps),
            need_top_k=max_top_k > 0,
            need_top_p=need_top_p,
            need_min_p=any(p > 0.0 for p in min_p),
            max_top_k=max_top_k,
            top_p_within_top_k=top_p_within_top_k,
        )


def _build_penalties(
    params: Sequence[SamplingParams],
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
    vocab_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    rows, ids, rep, offset = [], [], [], []
    for i, p in enumerate(params):
        if not p.has_penalties:
            continue
        out = np.asarray(output_ids[i], dtype=np.int64)
        seen = np.unique(np.concatenate([np.asarray(prompt_ids[i], dtype=np.int64), out]))
        if seen.size == 0:
            continue
        if seen[0] < 0 or seen[-1] >= vocab_size:
            raise ValueError(f"row {i}: token ids must lie in [0, {vocab_size})")
        out_ids, out_counts = np.unique(out, return_counts=True)
        counts = np.zeros(seen.size, dtype=np.float64)
        counts[np.searchsorted(seen, out_ids)] = out_counts
        rows.append(np.full(seen.size, i, dtype=np.int64))
        ids.append(seen)
        rep.append(np.full(seen.size, p.repetition_penalty, dtype=np.float32))
        offset.append((p.frequency_penalty * counts + p.presence_penalty * (counts > 0)).astype(np.float32))
    if not rows:
        return None
    return tuple(torch.from_numpy(np.concatenate(a)) for a in (rows, ids, rep, offset))  # type: ignore[return-value]


@dataclass
class SampleOutput:
    """`logprobs` / `top_logprobs` are RAW model log-probabilities, log_softmax(logits), as vLLM returns by
    default (not the penalised / tempered / truncated distribution that was sampled from)."""

    token_ids: torch.Tensor  # [M] int64
    logprobs: torch.Tensor | None = None  # [M] fp32, raw log-prob of token_ids (when asked for)
    top_logprobs: tuple[torch.Tensor, torch.Tensor] | None = None  # (ids [M, n] int64, values [M, n] fp32)

    def to_host(self) -> SampleOutput:
        """This output on the host, in one transfer (`layers/transfer.py`): it is read row by row there."""
        ids, values = self.top_logprobs or (None, None)
        token_ids, logprobs, ids, values = to_host(self.token_ids, self.logprobs, ids, values)
        return SampleOutput(token_ids, logprobs, None if ids is None else (ids, values))


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A per-request generator for `SamplingParams.seed` (the engine keeps it across steps)."""
    return torch.Generator(device=device).manual_seed(seed)


def _apply_penalties(x: torch.Tensor, batch: SamplingBatch) -> None:
    """In place: repetition divides positive / multiplies negative logits, then subtract freq/presence."""
    assert batch.pen_rows is not None and batch.pen_ids is not None
    v = x[batch.pen_rows, batch.pen_ids]
    penalized = torch.where(v > 0, v / batch.pen_rep, v * batch.pen_rep) - batch.pen_offset
    # a tiny penalty (positive as the client's float64, 0 in fp32) must not make a logit infinite: an
    # inf beside the masks of top-k / grammars turns the row's softmax into NaN; and a masked token
    # (-inf: a grammar's, a logit_bias of -inf) stays masked (-inf x 0 would be NaN, and sampled)
    finite = torch.finfo(v.dtype).max
    x[batch.pen_rows, batch.pen_ids] = torch.where(v.isneginf(), v, penalized.clamp(-finite, finite))


def _penalized(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """fp32 logits with penalties applied; a new tensor whenever the input would otherwise be modified."""
    x = logits.float()
    if batch.need_penalties:
        x = x.clone() if x is logits else x
        _apply_penalties(x, batch)
    return x


def _truncation_threshold(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor | None:
    """Per-row logit threshold [M, 1]: tokens below it are masked (top-k, then top-p, then min-p).

    Top-k keeps every token tied with the k-th value (as HF / vLLM); top-p keeps the smallest descending
    prefix of the top-k-renormalised distribution whose mass reaches top_p, plus every token tied with its
    last member; min-p keeps p >= min_p * p_max, i.e. logit >= max + log(min_p). A ratio to the max, min-p is
    unchanged by renormalisation and all three masks keep the max, so the masks combine as one threshold.
    """
    thresh = None
    if batch.need_top_k and not (batch.need_top_p and not batch.top_p_within_top_k):
        # top-k alone, or top-p on a top-k subset: topk(max_k) is enough
        vals = x.topk(batch.max_top_k, dim=-1).values
        kth = _kth_value(vals, batch.top_k)
        thresh = kth
        if batch.need_top_p:
            thresh = _top_p_threshold(vals, _subset_probs(x, vals, kth), batch.top_p, kth)
    elif batch.need_top_p:
        vals = probs = None
        if not batch.need_top_k and x.device.type == "cpu" and x.shape[1] > 2 * _TOP_P_CANDIDATES:
            # a full CPU sort is slow: the cut usually lies in the top few hundred tokens (checked; no sync
            # concern on CPU), so try exact masses on topk() candidates first
            vals = x.topk(_TOP_P_CANDIDATES, dim=-1).values
            probs = _subset_probs(x, vals, None)
            active = batch.top_p < 1.0
            if not bool(((probs.sum(dim=-1) - probs[:, -1] >= batch.top_p) | ~active).all()):
                vals = probs = None
        if vals is None:
            vals = x.sort(dim=-1, descending=True).values
        kth = _kth_value(vals, batch.top_k) if batch.need_top_k else torch.full_like(vals[:, :1], _NEG_INF)
        if probs is None:
            probs = vals.masked_fill(vals < kth, _NEG_INF).softmax(dim=-1)
        thresh = _top_p_threshold(vals, probs, batch.top_p, kth)
    if batch.need_min_p:
        floor = x.amax(dim=-1, keepdim=True) + batch.min_p.log().unsqueeze(1)
        thresh = floor if thresh is None else torch.maximum(thresh, floor)
    return thresh


def _kth_value(vals: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """[M, 1] k-th largest value from descending `vals` [M, n >= max k]; -inf where top-k is off (0)."""
    k_idx = (top_k - 1).clamp(min=0).unsqueeze(1)
    return vals.gather(1, k_idx).masked_fill(top_k.unsqueeze(1) == 0, _NEG_INF)


def _subset_probs(x: torch.Tensor, vals: torch.Tensor, kth: torch.Tensor | None) -> torch.Tensor:
    """Exact probabilities [M, n] of the descending top-n `vals` under softmax(x) restricted to x >= kth.

    Tokens outside the subset but inside the top-k set are ties at the k-th value, so their mass is a
    count times one term; this keeps top-p exact when such ties spill past the subset.
    """
    top = vals[:, :1]
    if kth is None:
        z = (x - top).exp().sum(dim=-1, keepdim=True)
    else:
        spill = (x >= kth).sum(dim=-1, keepdim=True) - (vals >= kth).sum(dim=-1, keepdim=True)
        z = ((vals - top).exp() * (vals >= kth)).sum(dim=-1, keepdim=True) + spill * (kth - top).exp()
    return (vals - top).exp() / z


def _top_p_threshold(
    vals: torch.Tensor, probs: torch.Tensor, top_p: torch.Tensor, kth: torch.Tensor
) -> torch.Tensor:
    """vals/probs sorted descending [M, n]; keep j while the mass strictly before j is < top_p.

    Positions past a row's top-k cut may hold junk probabilities (or -inf values): the max with `kth`
    keeps the cut when rounding leaves the kept mass just under a top_p close to 1.
    """
    mass_before = probs.cumsum(dim=-1) - probs
    n_keep = (mass_before < top_p.unsqueeze(1)).sum(dim=-1, keepdim=True).clamp(min=1)
    thresh = torch.maximum(vals.gather(1, n_keep - 1), kth)
    return torch.where(top_p.unsqueeze(1) >= 1.0, kth, thresh)


def _scaled_logits(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 penalised, tempered logits (never the input tensor itself) and the truncation threshold."""
    x = _penalized(logits, batch)
    if batch.need_temperature:
        x = x / batch.temperature.unsqueeze(1)
    return (x.clone() if x is logits else x), _truncation_threshold(x, batch)


def _truncated_probs(x: torch.Tensor, thresh: torch.Tensor | None, normalize: bool) -> torch.Tensor:
    # multiplying by the keep-mask is several times cheaper on CPU than masked_fill before the softmax
    probs = x.softmax(dim=-1)
    if thresh is not None:
        probs.mul_(x >= thresh)
        if normalize:
            probs.div_(probs.sum(dim=-1, keepdim=True))
    return probs


def processed_logprobs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """fp32 [M, V] log-probabilities of the distribution sampled from (greedy rows: temperature 1)."""
    batch = batch.to(logits.device)
    x, thresh = _scaled_logits(logits, batch)
    if thresh is not None:
        x = x.masked_fill_(x < thresh, _NEG_INF)
    return x.log_softmax(dim=-1)


def add_logit_bias(logits: torch.Tensor, rows: list[int], bias: dict[int, float]) -> None:
    """Adds a request's logit_bias (token id -> value) to rows `rows` of `logits`, in place."""
    on = {"device": logits.device}
    index = torch.tensor(rows, **on)[:, None]
    logits[index, torch.tensor(list(bias), **on)] += torch.tensor(
        list(bias.values()), dtype=logits.dtype, **on
    )


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1), bit for bit (the first maximum; NaN counts as the largest), through max: on CPU
    ~3x faster over a vocabulary row (150k logits: 70 against 210 us)."""
    return x.max(dim=-1).indices


def target_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """fp32 [M, V] distribution for rejection sampling: one-hot argmax on greedy rows, else processed."""
    batch = batch.to(logits.device)
    if batch.all_greedy:
        x = _penalized(logits, batch)
        return torch.zeros_like(x).scatter_(1, first_argmax(x).unsqueeze(1), 1.0)
    x, thresh = _scaled_logits(logits, batch)
    probs = _truncated_probs(x, thresh, normalize=True)
    if batch.any_greedy:
        one_hot = torch.zeros_like(probs).scatter_(1, first_argmax(x).unsqueeze(1), 1.0)
        probs = torch.where(batch.is_greedy.unsqueeze(1), one_hot, probs)
    return probs


def _draw(
    batch: SamplingBatch,
    num_cols: int,
    fill: Callable[[torch.Tensor, torch.Generator | None], torch.Tensor],
    skip_value: float,
    skip_greedy: bool,
) -> torch.Tensor:
    m = batch.num_rows
    out = torch.empty(m, num_cols, device=batch.device)
    skip = batch.greedy_rows if skip_greedy else [False] * m
    gens = [batch.generator if g is None else g for g in batch.generators]
    i = 0
    while i < m:  # one draw per run of consecutive rows that share a generator object
        j = i + 1
        while j < m and skip[j] == skip[i] and gens[j] is gens[i]:
            j += 1
        if skip[i]:
            out[i:j].fill_(skip_value)
        else:
            fill(out[i:j], gens[i])
        i = j
    return out


def draw_exponential(batch: SamplingBatch, num_cols: int, skip_greedy: bool = True) -> torch.Tensor:
    """[M, num_cols] Exp(1) draws in (0, inf] from each row's generator (None -> `batch.generator`).

    Drawn as -log(U), U ~ U[0, 1): ~5x faster than `exponential_` on CPU, never 0 (so p / E is never
    nan), and U = 0 gives inf, i.e. that token loses the race (probability ~2**-24, negligible).

    Consecutive rows holding the same generator object are drawn in one call, so a seeded request's rows
    (one, or k+1 in verification) get the same values whatever else is in the batch. Greedy rows consume
    no randomness when `skip_greedy` and hold 1.0.
    """
    return _draw(batch, num_cols, lambda t, g: t.uniform_(generator=g).log_().neg_(), 1.0, skip_greedy)


def draw_uniform(batch: SamplingBatch, num_cols: int, skip_greedy: bool = True) -> torch.Tensor:
    """[M, num_cols] U[0, 1) draws with the same generator rules as `draw_exponential`; skipped greedy
    rows hold 0.0."""
    return _draw(batch, num_cols, lambda t, g: t.uniform_(generator=g), 0.0, skip_greedy)


def sample(logits: torch.Tensor, batch: SamplingBatch, num_logprobs: int | None = None) -> SampleOutput:
    """One token per row of `logits` [M, V] (any float dtype; never modified).

    `num_logprobs=None` skips log-probabilities altogether; n >= 0 returns the chosen token's and the
    top-n (the logsumexp over the vocabulary is not free on CPU).

    Greedy rows: argmax of the penalised logits, ties to the lowest id. Random rows: exponential race,
    argmax(p / E) with E ~ Exp(1) and p the processed distribution, so a seeded row's token depends only
    on its logits and its own generator. Returned logprobs are raw (see `SampleOutput`).
    """
    batch = batch.to(logits.device)
    if batch.all_greedy:
        x = _penalized(logits, batch)
        tokens = first_argmax(x)
    else:
        x, thresh = _scaled_logits(logits, batch)
        weights = _truncated_probs(x, thresh, normalize=False)  # the race ignores per-row scale
        tokens = first_argmax(weights.div_(draw_exponential(batch, x.shape[1])))
        if batch.any_greedy:
            tokens = torch.where(batch.is_greedy, first_argmax(x), tokens)
    if num_logprobs is None:
        return SampleOutput(token_ids=tokens)
    return raw_logprobs(logits, tokens, num_logprobs)


def raw_logprobs(logits: torch.Tensor, tokens: torch.Tensor, num_top: int) -> SampleOutput:
    """Raw log-probabilities (log_softmax of `logits` [M, V]) of `tokens` [M] and each row's top `num_top`."""
    raw = logits.float()
    lse = raw.logsumexp(dim=-1)
    out = SampleOutput(token_ids=tokens, logprobs=raw.gather(1, tokens.unsqueeze(1)).squeeze(1) - lse)
    if num_top > 0:
        top = raw.topk(min(num_top, raw.shape[1]), dim=-1)
        out.top_logprobs = (top.indices, top.values - lse.unsqueeze(1))
    return out


__all__ = [
    "SampleOutput",
    "SamplingBatch",
    "draw_exponential",
    "first_argmax",
    "draw_uniform",
    "make_generator",
    "processed_logprobs",
    "raw_logprobs",
    "sample",
    "target_probs",
]
