"""Training data for drafters (DSPARK.md §5.1-5.2): prompts, the target's own answers, tokens + loss masks.

- `code_prompts`: offline prompts made from Python functions found on this machine (the standard library
  by default): explain / document / complete / test this function. Never the evaluation sets.
- `regenerate`: the target answers prompts with specserve's own engine, batched, resumable, writing
  DeepSpec's JSONL rows ({"id", "conversations": [...], "status": "success"}).
- `tokenize_conversation`: the chat template renders the whole conversation; the loss mask covers each
  assistant turn (Qwen: after "<|im_start|>assistant\\n" up to and including "<|im_end|>\\n"; Gemma 4: after
  "<|turn>model\\n" and its empty thought prefix, up to "<turn|>\\n"). Character spans become token spans by
  tokenising the text before each span boundary.
"""

from __future__ import annotations

import ast
import json
import random
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from specserve.config import SamplingParams, SpecserveError, check
from specserve.jsonl import read_jsonl


@dataclass(frozen=True)
class ChatFormat:
    assistant_header: str
    turn_end: str
    default_system: str | None = None
    excluded_prefix: str = ""  # rendered at the start of assistant content, not trained on


CHAT_FORMATS = {
    "qwen": ChatFormat("<|im_start|>assistant\n", "<|im_end|>\n", "You are a helpful assistant."),
    "gemma4": ChatFormat("<|turn>model\n", "<turn|>\n", None, "<|channel>thought\n<channel|>"),
}


def chat_format_of(tokenizer) -> ChatFormat:
    template = getattr(tokenizer, "chat_template", None) or ""
    for marker, name in (("<|im_start|>", "qwen"), ("<|turn>", "gemma4")):
        if marker in template:
            return CHAT_FORMATS[name]
    raise SpecserveError("the tokenizer's chat template is neither Qwen's (ChatML) nor Gemma 4's")


def tokenize_conversation(
    tokenizer, messages: list[dict], max_length: int = 4096, fmt: ChatFormat | None = None
) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of a whole conversation, truncated to max_length tokens."""
    fmt = fmt or chat_format_of(tokenizer)
    if fmt.default_system and (not messages or messages[0]["role"] != "system"):
        messages = [{"role": "system", "content": fmt.default_system}, *messages]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)

    def length(prefix: str) -> int:
        return len(tokenizer(prefix, add_special_tokens=False).input_ids)

    ids = tokenizer(text, add_special_tokens=False).input_ids[:max_length]
    mask = [0] * len(ids)
    start = text.find(fmt.assistant_header)
    while start != -1:
        begin = start + len(fmt.assistant_header)
        if fmt.excluded_prefix and text.startswith(fmt.excluded_prefix, begin):
            begin += len(fmt.excluded_prefix)
        end = text.find(fmt.turn_end, begin)
        end = len(text) if end == -1 else end + len(fmt.turn_end)
        for i in range(length(text[:begin]), min(length(text[:end]), len(ids))):
            mask[i] = 1
        start = text.find(fmt.assistant_header, end)
    return ids, mask


PROMPT_KINDS = (
    "Explain what this Python function does, step by step:\n\n```python\n{source}\n```",
    "Write a clear docstring for this Python function:\n\n```python\n{source}\n```",
    "Write pytest unit tests for this Python function:\n\n```python\n{source}\n```",
    "Complete the body of this Python function:\n\n```python\n{signature}\n```",
    "Suggest how to make this Python function simpler or faster, with code:\n\n```python\n{source}\n```",
)


def code_prompts(num: int, seed: int = 0, roots: list[Path] | None = None, max_lines: int = 40) -> list[str]:
    """`num` prompts about short functions from Python files under `roots` (default: the stdlib)."""
    check(num >= 1, f"the number of code prompts must be >= 1, got {num}")
    roots = roots or [Path(sysconfig.get_paths()["stdlib"])]
    files = sorted(
        p
        for root in roots
        for p in root.rglob("*.py")
        if not {"test", "tests", "site-packages"} & set(p.parts)
    )
    rng = random.Random(seed)
    rng.shuffle(files)
    functions = []
    for path in files:  # files in random order, parsed only until there is plenty to choose from
        functions.extend(_short_functions(path, max_lines))
        if len(functions) >= 4 * num:
            break
    if not functions:
        raise SpecserveError(f"no Python functions found under {', '.join(map(str, roots))}")
    picked = rng.sample(functions, min(num, len(functions)))
    return [rng.choice(PROMPT_KINDS).format(source=src, signature=sig) for src, sig in picked]


def _short_functions(path: Path, max_lines: int) -> Iterator[tuple[str, str]]:
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return
    lines = source.splitlines()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and 4 <= node.end_lineno - node.lineno + 1 <= max_lines:
            body = "\n".join(lines[node.lineno - 1 : node.end_lineno])
            signature_end = node.body[0].lineno - 1
            yield _dedent(body), _dedent("\n".join(lines[node.lineno - 1 : max(signature_end, node.lineno)]))


def _dedent(text: str) -> str:
    import textwrap

    return textwrap.dedent(text)


def read_prompts(path: str | Path) -> list[str]:
    """First user turn of each row: DeepSpec eval rows ({"turns": [...]}) or training rows (conversations)."""
    prompts = []
    for number, row in enumerate(read_jsonl(path), 1):
        try:
            if "turns" in row:
                prompts.append(row["turns"][0])
            else:
                prompts.append(next(m["content"] for m in row["conversations"] if m["role"] == "user"))
        except (KeyError, IndexError, TypeError, StopIteration):
            raise SpecserveError(
                f"{path} row {number}: no prompt ('turns', or 'conversations' with a user turn)"
            ) from None
    check(bool(prompts), f"{path} has no prompts")
    return prompts


def read_conversations(path: str | Path) -> list[list[dict]]:
    """The conversations of the successful rows of a `regenerate` output (DeepSpec JSONL)."""
    rows = read_jsonl(path)
    for number, row in enumerate(rows, 1):
        if not isinstance(row, dict) or not isinstance(row.get("conversations"), list):
            raise SpecserveError(
                f"{path} row {number} has no 'conversations' list (made by `data regenerate`?)"
            )
    conversations = [r["conversations"] for r in rows if r.get("status", "success") == "success"]
    check(bool(conversations), f"{path} has no successful conversations")
    return conversations


def regenerate(
    llm, prompts: list[str], output: str | Path, params: SamplingParams, batch_size: int = 16
) -> Path:
    """The target's answers to `prompts`, appended to `output` as DeepSpec rows as each one finishes.

    Up to `batch_size` requests are in flight and a finished one's place is refilled at once (continuous
    batching: a long answer never holds a whole batch back). Rows already in `output` (by id) are
    skipped, so an interrupted run resumes; answers come in completion order, each row carries its id.
    """
    from tqdm import tqdm

    output = Path(output)
    done = set()
    if output.exists():
        done = {row["id"] for row in read_jsonl(output)}
    output.parent.mkdir(parents=True, exist_ok=True)
    todo = iter([i for i in range(len(prompts)) if i not in done])
    engine = llm.engine
    running = {}  # request id -> (prompt index, messages)

    def admit() -> None:
        while len(running) < batch_size and (i := next(todo, None)) is not None:
            messages = [{"role": "user", "content": prompts[i]}]
            seq = engine.make_sequence({"prompt_token_ids": llm.apply_chat_template(messages)}, params)
            engine.add_sequence(seq)
            running[seq.request_id] = (i, messages)

    with open(output, "a") as out, tqdm(total=len(prompts), initial=len(done), desc="regenerating") as bar:
        admit()
        while running:
            for update in engine.step():
                if update.finished:
                    i, messages = running.pop(update.request_id)
                    reply = {"role": "assistant", "content": update.outputs[0].text}
                    row = {"id": i, "conversations": [*messages, reply], "status": "success"}
                    out.write(json.dumps(row) + "\n")
                    out.flush()
                    bar.update(1)
            admit()
    return output
