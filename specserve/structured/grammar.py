"""A request's output constraint as an llguidance matcher over the model's vocabulary: the token masks of
the rows a step samples from, the longest grammatical prefix of a draft, and advancing by emitted tokens.

llguidance, not xgrammar: measured here (Qwen2.5's 152K vocabulary, a JSON schema, 2 CPU threads) its mask
costs 0.08 ms a token (xgrammar 0.013 ms; both under 0.1% of a decode step), it validates a whole draft in
one call, covers JSON Schema broadly, and installs as one 3 MB wheel with no dependencies, where xgrammar
pulls triton and a TVM runtime into a CPU engine.

Compiling is the costly part, and the part a hostile constraint can make costly: it runs on worker threads
of its own (llguidance releases the GIL while it compiles), whose stacks are deep enough for the deepest
grammar a size limit lets through (llguidance recurses once per nested rule: ~3,000 rules overflow a
default 8 MiB thread stack, which kills the process). Compiled grammars are cached by their source, and
each request gets a copy of the cached matcher.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import queue
import re
import threading
from collections import OrderedDict

import llguidance
import llguidance.hf
import torch

from specserve.config import SpecserveError, StructuredOutputsParams
from specserve.structured.schema import admits_a_value

logger = logging.getLogger(__name__)

WORKER_STACK_BYTES = 256 * 2**20  # virtual: pages are only committed as deep as a compile goes
# Parser limits as llguidance's defaults, but errors without the parser's state (it can echo the output).
PARSER_LIMITS = llguidance.LLParserLimits(verbose_errors=False)
NO_VALUE = (
    "no JSON value satisfies this schema: a value would have to contain itself without end (a reference "
    'cycle with no way out, as in {"$ref": "#"})'
)


class ConstraintError(SpecserveError):
    """A constraint that does not compile (or constrains nothing); `kind` names its structured_outputs key,
    `reason` says what is wrong."""

    def __init__(self, kind: str, reason: str):
        super().__init__(f"structured_outputs.{kind}: {reason}")
        self.kind = kind
        self.reason = reason


def grammar_source(params: StructuredOutputsParams) -> tuple[str, str]:
    """(the field that holds the constraint, llguidance's grammar text for it)."""
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if params.json_object else params.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ConstraintError(kind, f"is not JSON: {exc.msg}") from None
        if isinstance(schema, dict) and not admits_a_value(schema):
            raise ConstraintError(kind, NO_VALUE)
        options = {"whitespace_flexible": not params.disable_any_whitespace}
        try:
            return kind, llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        except ValueError as exc:
            raise ConstraintError(kind, compiler_error(str(exc))) from None
    if kind == "regex":
        return kind, llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        # Lark string literals take JSON's escapes.
        alternatives = " | ".join(json.dumps(c) for c in params.choice)
        return kind, llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
    return kind, llguidance.LLMatcher.grammar_from_lark(params.grammar)


_PANIC = re.compile(r"^\s*panic\b", re.IGNORECASE)


def compiler_error(text: str) -> str:
    """llguidance's error as a client may read it: no Rust panic or backtrace, no parser state dump."""
    if _PANIC.match(text):
        return "too large or too complex for the grammar compiler; simplify it"
    return re.split(r"\n\s*<(?:state|backtrace|non-verbose/)>", text, maxsplit=1)[0].strip()


class Grammar:
    """A compiled constraint, never advanced: each request starts from a copy of it."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self._matcher = matcher

    def start(self) -> RequestGrammar:
        return RequestGrammar(self._matcher.deep_copy())


class GrammarCompiler:
    """One engine's: the tokenizer's llguidance view, the compile workers, and the cache of compiled
    grammars. `prepare()` builds the view (seconds at 152K tokens, mostly holding the GIL) and starts the
    workers; without it, the first compile does."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        num_workers: int = 2,
        cache_size: int = 64,
    ):
        self.hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.num_workers = num_workers
        self.cache_size = cache_size
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._tokenizer_failure: str | None = None
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()  # the cache and the workers
        self._tokenizer_lock = threading.Lock()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []

    def prepare(self) -> None:
        """Build what every compile needs, now (a server does this before it says it is ready). A
        tokenizer llguidance cannot take leaves constrained requests to fail, saying why."""
        if self.hf_tokenizer is not None:
            try:
                self._llg_tokenizer()
            except SpecserveError as exc:
                logger.warning("%s", exc)
        self._start_workers()

    def submit(self, params: StructuredOutputsParams) -> concurrent.futures.Future[Grammar]:
        """Compile `params` on a worker; the future fails with a ConstraintError when it does not compile.
        Cancelling the future before a worker takes it drops the job."""
        self._start_workers()
        future: concurrent.futures.Future[Grammar] = concurrent.futures.Future()
        self._jobs.put((future, params))
        return future

    def compile(self, params: StructuredOutputsParams) -> RequestGrammar:
        """A fresh matcher for one request (waits for the workers)."""
        return self.submit(params).result().start()

    # ---- worker threads -----------------------------------------------------------------------------------
    def _start_workers(self) -> None:
        with self._lock:
            if self._workers:
                return
            previous = threading.stack_size(WORKER_STACK_BYTES)
            try:
                for i in range(self.num_workers):
                    worker = threading.Thread(target=self._work, name=f"specserve-grammar-{i}", daemon=True)
                    worker.start()
                    self._workers.append(worker)
            finally:
                threading.stack_size(previous)

    def _work(self) -> None:
        while True:
            future, params = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue  # its request went away while it waited
            try:
                future.set_result(self._build(params))
            except BaseException as exc:
                future.set_exception(exc)

    def _build(self, params: StructuredOutputsParams) -> Grammar:
        kind, source = grammar_source(params)
        with self._lock:
            grammar = self._cache.get(source)
            if grammar is not None:
                self._cache.move_to_end(source)
                return grammar
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), source, log_level=0, limits=PARSER_LIMITS)
        if not matcher.is_error():
            matcher.compute_bitmask()  # the first mask: some errors only show here
        error = matcher.get_error() if matcher.is_error() else ""
        # No token may start it (llguidance says "NoExtensionBias"), or it stops before any: no text fits.
        stopped = not error and matcher.is_stopped() and not matcher.is_accepting()
        if error.startswith("NoExtensionBias") or stopped:
            raise ConstraintError(kind, "matches no text at all")
        if error:
            raise ConstraintError(kind, compiler_error(error))
        grammar = Grammar(matcher)
        with self._lock:
            self._cache[source] = grammar
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return grammar

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        with self._tokenizer_lock:
            if self._tokenizer is None:
                if self.hf_tokenizer is None:
                    raise SpecserveError("structured outputs need the model's tokenizer; this model has none")
                if self._tokenizer_failure is None:
                    try:
                        self._tokenizer = llguidance.hf.from_tokenizer(
                            self.hf_tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None
                        )
                    except Exception as exc:  # built once: the same tokenizer fails the same way
                        self._tokenizer_failure = (
                            "structured outputs are not available with this model's tokenizer "
                            f"({type(exc).__name__}: {exc})"
                        )
                if self._tokenizer_failure is not None:
                    raise SpecserveError(self._tokenizer_failure)
            return self._tokenizer


class RequestGrammar:
    """The matcher of one request, advanced by its emitted tokens only."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher

    @property
    def finished(self) -> bool:
        """The constraint is complete and nothing may follow: the request stops here."""
        return self.matcher.is_stopped()

    def grammatical_prefix(self, tokens: list[int]) -> int:
        """How many leading tokens of `tokens` the grammar allows from here."""
        return self.matcher.validate_tokens(tokens) if tokens else 0

    def masks(self, drafts: list[int]) -> torch.Tensor:
        """int32 [len(drafts) + 1, W]: the allowed tokens after each prefix d_1..d_i of `drafts` (i = 0..k).
        After a draft the grammar refuses, that row repeats the one before: the target rejects the draft
        (it has no mass there), so what follows it is never sampled."""
        valid = self.grammatical_prefix(drafts)
        rows = [self._mask()]
        consumed = 0
        for token in drafts[:valid]:
            consumed += self._consume(token)
            rows.append(self._mask())
        self._rollback(consumed)
        rows += [rows[-1]] * (len(drafts) - valid)
        return torch.stack(rows)

    def mask_after(self, tokens: list[int]) -> torch.Tensor | None:
        """int32 [W]: the allowed tokens after `tokens` (a draft so far); None when the grammar refuses
        them or allows nothing after them (a draft past its end: the target rejects it anyway)."""
        if self.grammatical_prefix(tokens) < len(tokens):
            return None
        consumed = sum(self._consume(token) for token in tokens)
        mask = self._mask()
        self._rollback(consumed)
        return mask if bool(mask.any()) else None

    def _consume(self, token: int) -> int:
        """Advance by a grammatical token; 1 if the matcher recorded it. Once it has stopped, a token (the
        end of sequence) is not recorded, and rolling it back would undo one before it."""
        if self.matcher.is_stopped():
            return 0
        self.matcher.consume_token(token)
        return 1

    def _rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)

    def accept(self, token: int) -> bool:
        return self.matcher.consume_token(token)

    @property
    def error(self) -> str | None:
        """Why the matcher failed (a token it refused, one of its per-step limits), if it did."""
        return compiler_error(self.matcher.get_error()) if self.matcher.is_error() else None

    def _mask(self) -> torch.Tensor:
        return torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.int32)
