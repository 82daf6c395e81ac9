"""Requests in: a prompt (text, token ids or a dict) and its sampling parameters, validated completely and
tokenized into a Sequence before anything of it runs."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from specserve.config import SamplingParams, SpecserveError, check, is_int
from specserve.core.sequence import Sequence
from specserve.layers.sampler import make_generator

PromptType = str | list[int] | Mapping[str, object]


def check_prompt_fits(num_tokens: int, max_model_len: int) -> None:
    """A prompt must leave room for one generated token (the engine's, and the server's before it queues)."""
    check(
        num_tokens < max_model_len,
        f"the prompt has {num_tokens} tokens; max_model_len is {max_model_len}, so at most "
        f"{max_model_len - 1} prompt tokens leave room for one generated token",
        "prompt",
    )


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, device: torch.device):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.device = device  # where a seeded request's generator draws: the logits' device

    def tokenize(self, prompt: PromptType) -> tuple[list[int], str | None]:
        """Token ids, and the text when the prompt was text."""
        if isinstance(prompt, Mapping):
            # any other key (a typo, vLLM's multi_modal_data, both at once) would be ignored silently
            keys = sorted(map(str, prompt))
            check(
                keys in (["prompt_token_ids"], ["prompt"]),
                f"a prompt dict takes exactly one key, 'prompt_token_ids' or 'prompt'; got {keys}",
                "prompt",
            )
            if "prompt_token_ids" in prompt:
                return self._check_token_ids(prompt["prompt_token_ids"]), None
            return self.tokenize(prompt["prompt"])
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise SpecserveError(
                    "this model has no tokenizer: pass prompts as lists of token ids", "prompt"
                )
            if not prompt:
                raise SpecserveError("the prompt is empty", "prompt")
            return self.tokenizer(prompt).input_ids, prompt
        if isinstance(prompt, list | tuple):
            return self._check_token_ids(prompt), None
        raise SpecserveError(
            f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}", "prompt"
        )

    def _check_token_ids(self, ids) -> list[int]:
        check(
            isinstance(ids, list | tuple),
            f"prompt token ids must be a list of integers, got {type(ids).__name__}",
            "prompt",
        )
        ids = list(ids)
        if not ids:
            raise SpecserveError("the prompt is empty", "prompt")
        bad = [t for t in ids if not is_int(t) or not 0 <= t < self.vocab_size]
        if bad:
            raise SpecserveError(
                f"prompt token ids must be integers in [0, {self.vocab_size}), got {bad[:5]}", "prompt"
            )
        return ids

    def _check_vocabulary(self, params: SamplingParams) -> None:
        """Token ids in the parameters: a stop id outside the vocabulary would never stop anything."""
        for name, ids in (("logit_bias", params.logit_bias or ()), ("stop_token_ids", params.stop_token_ids)):
            outside = [t for t in ids if t >= self.vocab_size]
            check(
                not outside,
                f"{name} names token ids outside the vocabulary [0, {self.vocab_size}): {outside[:5]}",
                name,
            )

    def process(self, prompt: PromptType, params: SamplingParams, request_id: str) -> Sequence:
        if not isinstance(params, SamplingParams):
            raise SpecserveError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        token_ids, text = self.tokenize(prompt)
        self._check_vocabulary(params)
        check_prompt_fits(len(token_ids), self.max_model_len)
        room = self.max_model_len - len(token_ids)
        max_tokens = min(params.max_tokens or room, room)
        generator = make_generator(params.seed, self.device) if params.seed is not None else None
        return Sequence(request_id, token_ids, params, max_tokens, prompt=text, generator=generator)
