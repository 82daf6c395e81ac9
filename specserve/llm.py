"""The Python API, shaped like vLLM's: `LLM(model=...).generate(prompts, sampling_params)`."""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Iterable, Iterator
from collections.abc import Sequence as Seq

from tqdm import tqdm

from specserve.config import SamplingParams, SpecserveError, SpeculativeConfig, check
from specserve.engine.engine import LLMEngine, PromptType
from specserve.engine.outputs import RequestOutput

Message = dict[str, str]


def peak_memory_bytes() -> int:
    """This process's peak resident memory: Linux's VmHWM (it starts afresh at exec, where getrusage's
    maxrss keeps the pages of the parent a process was forked from), else getrusage's."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def loaded_line(engine: LLMEngine, seconds: float) -> str:
    """What a load took and chose: time, the process's peak memory so far, device, dtype and why."""
    config = engine.config
    quantized = f", {config.quantization} weights" if config.quantization else ""
    peak = peak_memory_bytes()
    return (
        f"loaded {config.model} in {seconds:.1f} s, peak memory {peak / 2**30:.1f} GiB{quantized}, "
        f"{config.platform.device}, {config.dtype} ({config.dtype_reason})"
    )


class LLM:
    """Loads a model once and generates for batches of prompts with continuous batching."""

    def __init__(
        self, model: str, speculative_config: SpeculativeConfig | dict | str | None = None, **engine_args
    ):
        """Loads `model` (progress on stderr: a first load converts or quantizes, later ones map a cache)."""
        start = time.monotonic()
        print(f"[specserve] loading {model} ...", file=sys.stderr, flush=True)
        self.engine = LLMEngine.from_args(model, speculative_config, **engine_args)
        print(
            f"[specserve] {loaded_line(self.engine, time.monotonic() - start)}", file=sys.stderr, flush=True
        )

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Outputs in the order of `prompts`. Every request is validated before any of them runs."""
        prompt_list = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(prompt_list))
        seqs = [self.engine.make_sequence(p, sp) for p, sp in zip(prompt_list, params)]
        for seq in seqs:
            self.engine.add_sequence(seq)
        try:
            with tqdm(total=len(seqs), disable=not use_tqdm, desc="generate") as bar:
                while any(not s.is_finished for s in seqs):
                    for update in self.engine.step():
                        bar.update(int(update.finished))
        finally:
            # a step that raised must not leave these requests scheduled: every later call would fail
            for seq in seqs:
                if not seq.is_finished:
                    self.engine.abort(seq.request_id)
        return [self.engine.final_output(s) for s in seqs]

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        chat_template_kwargs: dict | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of them, through the chat template."""
        check(
            isinstance(messages, list | tuple) and bool(messages),
            "messages must be a non-empty list of {'role': ..., 'content': ...} dicts, or a list of them",
        )
        check(
            chat_template_kwargs is None or isinstance(chat_template_kwargs, dict),
            f"chat_template_kwargs must be a dict, got {type(chat_template_kwargs).__name__}",
        )
        conversations = [messages] if isinstance(messages[0], dict) else messages
        prompts = [
            {"prompt_token_ids": self.apply_chat_template(c, **(chat_template_kwargs or {}))}
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def apply_chat_template(self, messages: list[Message], **kwargs) -> list[int]:
        tokenizer = self.engine.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise SpecserveError("this model has no chat template; use generate() with a plain prompt")
        if not messages or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise SpecserveError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        for message in messages:  # the template would render anything else as its Python repr
            role, content = message["role"], message["content"]
            check(isinstance(role, str), f"a message's role must be a string, got {type(role).__name__}")
            check(
                isinstance(content, str) or (content is None and "tool_calls" in message),
                f"a message's content must be a string (or null beside tool_calls), got "
                f"{type(content).__name__}",
            )
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
        return tokenizer(text, add_special_tokens=False).input_ids

    def stream(
        self, prompt: PromptType, sampling_params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Yields an update whenever the request gains tokens; `outputs[0].delta_text` is the new text.

        Closing the iterator early aborts the request and frees its KV cache.
        """
        seq = self.engine.make_sequence(prompt, sampling_params or SamplingParams())
        self.engine.add_sequence(seq)
        try:
            while not seq.is_finished:
                for update in self.engine.step():
                    if update.request_id == seq.request_id:
                        yield update
        finally:
            if not seq.is_finished:
                self.engine.abort(seq.request_id)


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, str | dict) or (
        isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
    ):
        return [prompts]
    check(
        isinstance(prompts, Iterable),
        f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}",
    )
    prompt_list = list(prompts)
    if not prompt_list:
        raise SpecserveError("no prompts given")
    return prompt_list


def _as_params_list(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    # list() would take a dict's keys or a string's characters as parameters
    check(
        isinstance(params, list | tuple),
        f"sampling_params must be SamplingParams or a list, got {type(params).__name__}",
    )
    params = list(params)
    if len(params) != n:
        raise SpecserveError(f"got {len(params)} sampling_params for {n} prompts")
    return params
