"""Benchmark prompts as token ids, so every prompt's length is known exactly and the server never
re-tokenizes.

- `random`: ids drawn uniformly from the vocabulary, special and added tokens left out (the seed's setting:
  8192 random input tokens). Needs only the vocabulary: the tokenizer, or config.json without one.
- `eval:FILE`: DeepSpec eval prompts (`{"turns": [...]}` per line), the first turn through the chat template.
- `jsonl:FILE`: one object per line, `{"prompt": "text"}` (tokenized as is, no chat template) or
  `{"prompt_token_ids": [...]}`, with an optional `"output_len"` that overrides the run's.
- `multiturn` / `multiturn:TURNS` (default 4): chats that share one system prompt of `input_len` random
  tokens; each turn adds a user message of USER_TURN_LEN tokens to the conversation so far, and the reply
  in the conversation is `output_len` random tokens (the real one is not known when the prompts are built;
  a real client would resend the model's reply, whose cached blocks would add to the hits). A chat's turns
  go one after another, each after the previous reply, as a user sends them.

File datasets keep their prompts' own lengths; when more prompts are asked for than a file has, its rows
repeat.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

from specserve.config import SpecserveError
from specserve.jsonl import read_jsonl

USER_TURN_LEN = 64
DEFAULT_TURNS = 4


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int
    conversation: int | None = None  # the chat it is a turn of (sent after the chat's previous turn)
    turn: int = 0


class Vocabulary:
    """The tokenizer of a model (None when it has none) and the ids random prompts may use."""

    def __init__(self, model: str):
        from specserve.models.loader import load_hf_config, load_tokenizer, resolve_model

        model_dir = resolve_model(model, need_weights=False)
        self.tokenizer = load_tokenizer(model_dir)
        if self.tokenizer is not None:
            added = set(self.tokenizer.added_tokens_decoder)
            self.random_ids = [i for i in range(len(self.tokenizer)) if i not in added]
        else:
            self.random_ids = list(range(load_hf_config(model_dir).get_text_config().vocab_size))

    def encode_chat(self, text: str) -> list[int]:
        tokenizer = self.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise SpecserveError("eval datasets need a tokenizer with a chat template (see --tokenizer)")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        # transformers 5 returns a BatchEncoding here, older versions a plain list.
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise SpecserveError("text prompts need a tokenizer (see --tokenizer)")
        return self.tokenizer(text).input_ids


def build_requests(
    dataset: str, num_prompts: int, vocabulary: Vocabulary, input_len: int, output_len: int, seed: int = 0
) -> list[BenchRequest]:
    """`num_prompts` requests from `dataset` ('random', 'eval:FILE', 'jsonl:FILE' or 'multiturn[:TURNS]')."""
    kind, _, path = dataset.partition(":")
    if kind == "random" and not path:
        rng = random.Random(seed)
        ids = vocabulary.random_ids
        return [BenchRequest(rng.choices(ids, k=input_len), output_len) for _ in range(num_prompts)]
    if kind == "multiturn":
        if path and not (path.isdigit() and int(path) >= 1):
            raise SpecserveError(f"dataset {dataset!r}: expected multiturn:TURNS with TURNS >= 1")
        turns = int(path) if path else DEFAULT_TURNS
        return multiturn_requests(
            -(-num_prompts // turns), turns, vocabulary.random_ids, input_len, output_len, seed
        )
    if kind == "eval" and path:
        rows = read_jsonl(path)
        if any(not isinstance(row.get("turns"), list) or not row["turns"] for row in rows):
            raise SpecserveError(f"{path}: eval files hold {{'turns': [...]}} per line")
        prompt_ids = lambda row: vocabulary.encode_chat(row["turns"][0])
    elif kind == "jsonl" and path:
        rows = read_jsonl(path)
        prompt_ids = lambda row: _prompt_ids(row, vocabulary, path)
    else:
        raise SpecserveError(
            f"dataset {dataset!r}: expected random, eval:FILE, jsonl:FILE or multiturn[:TURNS]"
        )
    if not rows:
        raise SpecserveError(f"dataset {dataset!r} has no prompts")
    return [
        BenchRequest(prompt_ids(row), int(row.get("output_len", output_len)))
        for row in itertools.islice(itertools.cycle(rows), num_prompts)
    ]


def multiturn_requests(
    num_chats: int, turns: int, ids: list[int], system_len: int, reply_len: int, seed: int
) -> list[BenchRequest]:
    """Chat by chat, turn by turn (see the module docstring)."""
    rng = random.Random(seed)
    system = rng.choices(ids, k=system_len)
    requests = []
    for chat in range(num_chats):
        history = list(system)
        for turn in range(turns):
            history += rng.choices(ids, k=USER_TURN_LEN)
            requests.append(BenchRequest(list(history), reply_len, conversation=chat, turn=turn))
            history += rng.choices(ids, k=reply_len)
    return requests


def _prompt_ids(row: dict, vocabulary: Vocabulary, path: str) -> list[int]:
    if "prompt_token_ids" in row:
        return list(row["prompt_token_ids"])
    if "prompt" in row:
        return vocabulary.encode(row["prompt"])
    raise SpecserveError(f"{path}: each line needs 'prompt' or 'prompt_token_ids', got keys {sorted(row)}")
