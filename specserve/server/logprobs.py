"""Engine log-probabilities in the two OpenAI shapes: chat's per-token objects and completions' columns.

The engine gives, per generated token (and per prompt token, for an echoed prompt), a dict {token id:
logprob} holding that token and the top-k alternatives (it may be among them). Token strings come from the
tokenizer's `decode`, which only reads the tokenizer, so it is safe here beside the engine thread; models
without a tokenizer show ids as "token_id:<id>", as vLLM does (and so does any request with
`return_tokens_as_token_ids`).
"""

from __future__ import annotations

from specserve.server.protocol import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob

Step = dict[int, float]
# JSON has no -inf: a token the request rules out (its constraint, top-k / top-p) reads this, as in vLLM.
MIN_LOGPROB = -9999.0


def _logprob(step: Step, token_id: int) -> float:
    return max(step[token_id], MIN_LOGPROB)


class TokenText:
    """Strings for token ids; "token_id:<id>" without a tokenizer or when asked (exact ids for clients)."""

    def __init__(self, tokenizer, as_ids: bool = False):
        self._tokenizer = tokenizer
        self._as_ids = as_ids

    def __call__(self, token_id: int) -> str:
        if self._tokenizer is None or self._as_ids:
            return f"token_id:{token_id}"
        return self._tokenizer.decode([token_id])


def _top(step: Step, k: int) -> list[tuple[int, float]]:
    return [
        (t, max(lp, MIN_LOGPROB))
        for t, lp in sorted(step.items(), key=lambda item: item[1], reverse=True)[:k]
    ]


def chat_logprobs(text_of: TokenText, token_ids: list[int], steps: list[Step], k: int) -> ChatLogprobs:
    def entry(token_id: int, logprob: float) -> dict:
        text = text_of(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return ChatLogprobs(
        content=[
            TokenLogprob(
                **entry(token, _logprob(step, token)),
                top_logprobs=[TopLogprob(**entry(t, lp)) for t, lp in _top(step, k)],
            )
            for token, step in zip(token_ids, steps)
        ]
    )


def completion_logprobs(
    text_of: TokenText, token_ids: list[int], steps: list[Step | None], k: int, text_offset: int
) -> CompletionLogprobs:
    """`text_offset` is where the first of these tokens starts in the choice's text. A step is None for an
    echoed prompt's first token (nothing comes before it): its logprob and top entry are null."""
    tokens = [text_of(t) for t in token_ids]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    top_logprobs = []
    for token, step in zip(token_ids, steps):
        if step is None:
            top_logprobs.append(None)
            continue
        # OpenAI's legacy semantics: the k likeliest tokens and always the sampled one (up to k + 1
        # entries; with logprobs 0, just the sampled token).
        top: dict[str, float] = {}
        for token_id, logprob in _top(step, k):
            top.setdefault(text_of(token_id), logprob)  # two ids may decode alike: keep the likelier
        top.setdefault(text_of(token), _logprob(step, token))
        top_logprobs.append(top)
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[None if step is None else _logprob(step, t) for t, step in zip(token_ids, steps)],
        top_logprobs=top_logprobs,
        text_offset=offsets,
    )
