"""User-facing configuration: sampling parameters and engine settings, validated with clear errors."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# (defined apart so that the platform layer needs no config)
from specserve.errors import SpecserveError, check


@dataclass
class StructuredOutputsParams:
    """A constraint on a request's output (vLLM's names): exactly one of a JSON schema (`json`, a dict or
    its JSON text), any JSON object (`json_object`), a regular expression (`regex`), one of a list of
    strings (`choice`), or a Lark grammar (`grammar`). `disable_any_whitespace`: JSON without whitespace
    between tokens (a model that pads JSON with newlines then cannot)."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        for name in ("json_object", "disable_any_whitespace"):  # a string "no" would mean yes
            check(
                isinstance(getattr(self, name), bool),
                f"structured_outputs.{name} must be true or false, got {getattr(self, name)!r}",
                f"structured_outputs.{name}",
            )
        given = [
            name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None
        ] + (["json_object"] if self.json_object else [])
        check(
            len(given) == 1,
            f"structured_outputs takes exactly one constraint, got {given or 'none'}",
            "structured_outputs",
        )
        check(
            self.json is None or isinstance(self.json, dict | str),
            "structured_outputs.json must be a JSON schema (an object or its JSON text)",
            "structured_outputs.json",
        )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            check(
                value is None or isinstance(value, str),
                f"structured_outputs.{name} must be a string",
                f"structured_outputs.{name}",
            )
        if self.choice is not None:
            check(
                isinstance(self.choice, list | tuple)
                and bool(self.choice)
                and all(isinstance(c, str) and c for c in self.choice),
                "structured_outputs.choice must be a non-empty list of non-empty strings",
                "structured_outputs.choice",
            )
            self.choice = list(self.choice)

    @property
    def kind(self) -> str:
        """The key that holds the constraint: "json", "json_object", "regex", "choice" or "grammar"."""
        if self.json_object:
            return "json_object"
        return next(
            name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None
        )

    @classmethod
    def from_value(cls, value: StructuredOutputsParams | dict | None) -> StructuredOutputsParams | None:
        if value is None or isinstance(value, cls):
            return value
        check(
            isinstance(value, dict),
            f"structured_outputs must be a mapping, got {type(value).__name__}",
            "structured_outputs",
        )
        unknown = sorted(
            set(value) - {"json", "json_object", "regex", "choice", "grammar", "disable_any_whitespace"}
        )
        check(not unknown, f"structured_outputs has unknown keys {unknown}", "structured_outputs")
        return cls(**value)


def is_int(value) -> bool:
    """An int proper: Python counts bool as one, but True is never meant as a count, an id or a seed."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    """A finite number: NaN fails every range check silently, and inf passes some (temperature >= 0)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class SamplingParams:
    """How to pick tokens for one request (names and meanings as in vLLM / the OpenAI API)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    # vLLM's: per prompt token after the first, its raw logprob and the top-k alternatives (None: off)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | dict | None = None
    # OpenAI's: token id -> a bias in [-100, 100] added to its logit before anything else sees the row
    logit_bias: dict[int, float] | None = None

    def __post_init__(self) -> None:
        self.structured_outputs = StructuredOutputsParams.from_value(self.structured_outputs)
        self._check_logit_bias()
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        # list() alone would take a dict's keys, a string's characters or an int's TypeError
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name)
            check(
                value is None or isinstance(value, list | tuple),
                f"{name} must be a list, got {type(value).__name__}",
            )
            setattr(self, name, list(value or []))
        check(is_int(self.n) and self.n == 1, f"n must be 1 for now, got {self.n!r}")
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        ):
            value = getattr(self, name)
            check(_is_real(value), f"{name} must be a finite number, got {value!r}")
        check(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        check(
            is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1),
            f"top_k must be -1 (disabled) or >= 1, got {self.top_k!r}",
        )
        check(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        check(self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        check(
            -2 <= self.presence_penalty <= 2,
            f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
        )
        check(
            -2 <= self.frequency_penalty <= 2,
            f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
        )
        check(
            self.max_tokens is None or (is_int(self.max_tokens) and self.max_tokens >= 1),
            f"max_tokens must be an integer >= 1, got {self.max_tokens!r}",
        )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            check(
                value is None or (is_int(value) and 0 <= value <= 20),
                f"{name} must be an integer in [0, 20], got {value!r}",
            )
        # what torch.Generator.manual_seed takes (negative seeds wrap, as vLLM's)
        check(
            self.seed is None or (is_int(self.seed) and -(2**63) <= self.seed < 2**64),
            f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}",
        )
        check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings")
        check(
            all(is_int(t) and t >= 0 for t in self.stop_token_ids),
            f"stop_token_ids must be token ids (integers >= 0), got {self.stop_token_ids!r}",
        )
        for name in ("ignore_eos", "skip_special_tokens"):
            value = getattr(self, name)
            check(isinstance(value, bool), f"{name} must be true or false, got {value!r}")

    def _check_logit_bias(self) -> None:
        if self.logit_bias is None:
            return
        check(
            isinstance(self.logit_bias, dict), "logit_bias must be a dict of token id -> bias", "logit_bias"
        )
        for token, bias in self.logit_bias.items():
            check(
                is_int(token) and token >= 0,
                f"logit_bias keys must be token ids (integers >= 0), got {token!r}",
                "logit_bias",
            )
            check(
                _is_real(bias) and -100 <= bias <= 100,
                f"logit_bias values must be numbers in [-100, 100], got {bias!r} for token {token}",
                "logit_bias",
            )
        self.logit_bias = {token: float(bias) for token, bias in self.logit_bias.items()} or None

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


_MEMORY_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
}


def parse_memory(value: int | str) -> int:
    """Bytes from an int or a string such as '2GiB', '512MB'."""
    if isinstance(value, int) and not isinstance(value, bool):
        amount = value
    else:
        text = str(value).strip().upper().replace(" ", "")
        number = text.rstrip("KMGIB")
        unit = text[len(number) :]
        check(
            bool(number) and unit in _MEMORY_UNITS, f"cannot read a memory size from {value!r} (try '2GiB')"
        )
        try:
            amount = int(float(number) * _MEMORY_UNITS[unit])
        except ValueError:
            raise SpecserveError(f"cannot read a memory size from {value!r} (try '2GiB')") from None
    check(amount > 0, f"memory size must be positive, got {value!r}")
    return amount


_DTYPES = {
    "auto": "auto",
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}


QUANTIZATION_MODES = ("int8", "int4")
DEFAULT_CPU_CACHE_MEMORY = "2GiB"
LOAD_FORMATS = ("auto", "dummy")


def _check_quantization(mode: str | None) -> None:
    check(
        mode in (None, *QUANTIZATION_MODES),
        f"quantization must be None or one of {', '.join(QUANTIZATION_MODES)}, got {mode!r}",
    )


@dataclass
class EngineConfig:
    """Engine settings. `max_model_len=None` takes the model's context length, capped at 8192."""

    model: str
    # auto: bf16 on CUDA, and on a CPU with native bf16 when weights are not quantized (auto_dtype.py)
    dtype: str = "auto"
    max_model_len: int | None = None
    # Every cache's budget (KV, recurrent states, the drafter's). None: 2GiB on the CPU; on CUDA what
    # gpu_memory_utilization leaves of the GPU after the weights and a forward's activation peak.
    kv_cache_memory: int | str | None = None
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    seed: int = 0
    revision: str | None = None
    quantization: str | None = None  # weight-only "int8" | "int4" linear layers (specserve/layers/quant.py)
    enable_prefix_caching: bool = True  # reuse the KV blocks of prompt prefixes seen before
    # Hybrid targets with prefix caching: the recurrent state is kept at every multiple of this many
    # tokens (a multiple of block_size; 64 keeps the chunked delta rule's chunks where they would be).
    state_checkpoint_interval: int = 256
    # Processes the target model is split over (tensor parallelism, specserve/parallel/); 1: no split.
    tensor_parallel_size: int = 1
    # "auto" (CUDA when torch sees a GPU, else the CPU) | "cpu" | "cuda" | "cuda:N" (specserve/platform.py)
    device: str = "auto"
    gpu_memory_utilization: float = 0.9  # CUDA: the share of the GPU's memory this engine may use (vLLM's)
    # "auto": the checkpoint's weights; "dummy": random ones, no checkpoint read, a draft model's too
    # (vLLM's; benchmarks)
    load_format: str = "auto"
    # CUDA: no graphs, every step eager (graphs replay decode and verification steps, worker/cuda_graphs.py)
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        check(isinstance(self.model, str) and bool(self.model), "model must be a non-empty name or path")
        _check_quantization(self.quantization)
        check(
            isinstance(self.tensor_parallel_size, int)
            and not isinstance(self.tensor_parallel_size, bool)
            and self.tensor_parallel_size >= 1,
            f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}",
        )
        self._choose_platform()
        check(
            str(self.dtype).lower() in _DTYPES,
            f"dtype must be one of {sorted(set(_DTYPES.values()))}, got {self.dtype!r}",
        )
        self.dtype = _DTYPES[str(self.dtype).lower()]
        self.dtype_reason = "asked for"
        if self.dtype == "auto":
            pinned, why = self.platform.auto_dtype(self.quantization)
            self.dtype = _DTYPES.get(pinned.lower(), "auto")
            check(self.dtype != "auto", f"{why}: unknown dtype {pinned!r}")
            self.dtype_reason = f"auto: {why}"
        check(
            self.max_model_len is None or (isinstance(self.max_model_len, int) and self.max_model_len >= 2),
            f"max_model_len must be an integer >= 2, got {self.max_model_len!r}",
        )
        check(
            isinstance(self.gpu_memory_utilization, int | float)
            and not isinstance(self.gpu_memory_utilization, bool)
            and 0 < self.gpu_memory_utilization <= 1,
            f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}",
        )
        check(
            self.load_format in LOAD_FORMATS,
            f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}",
        )
        check(
            isinstance(self.enforce_eager, bool),
            f"enforce_eager must be true or false, got {self.enforce_eager!r}",
        )
        if self.kv_cache_memory is None and not self.platform.is_cuda:
            self.kv_cache_memory = DEFAULT_CPU_CACHE_MEMORY
        # None: measured once the model is on the GPU (`engine.device_cache_budget`)
        self.kv_cache_bytes = None if self.kv_cache_memory is None else parse_memory(self.kv_cache_memory)
        check(
            self.block_size in (1, 2, 4, 8, 16, 32, 64, 128),
            f"block_size must be a power of 2 <= 128, got {self.block_size}",
        )
        check(isinstance(self.max_num_seqs, int) and self.max_num_seqs >= 1, "max_num_seqs must be >= 1")
        check(
            isinstance(self.max_num_batched_tokens, int) and self.max_num_batched_tokens >= 1,
            "max_num_batched_tokens must be >= 1",
        )
        check(isinstance(self.seed, int), f"seed must be an integer, got {self.seed!r}")
        check(
            isinstance(self.enable_prefix_caching, bool),
            f"enable_prefix_caching must be true or false, got {self.enable_prefix_caching!r}",
        )
        check(
            isinstance(self.state_checkpoint_interval, int)
            and self.state_checkpoint_interval >= self.block_size
            and self.state_checkpoint_interval % self.block_size == 0,
            f"state_checkpoint_interval must be a positive multiple of block_size ({self.block_size}), "
            f"got {self.state_checkpoint_interval!r}",
        )

    def _choose_platform(self) -> None:
        """`platform` (specserve/platform.py) and why. "auto" takes CUDA where torch sees a GPU, unless the
        settings ask for what runs on the CPU alone (more tensor-parallel ranks than GPUs): then the CPU. A
        device named outright that cannot run the settings is an error that says what to change."""
        from specserve.platform import CPU, check_device, resolve_platform

        self.platform = resolve_platform(self.device)
        self.device_reason = "asked for" if check_device(self.device) != "auto" else "auto"
        refused = self.platform.refusals(self.tensor_parallel_size)
        if refused and self.device_reason == "auto":
            self.platform, self.device_reason = CPU, f"auto: {' and '.join(refused)} run on the CPU only"
            refused = []
        check(
            not refused,
            f"{' and '.join(refused)} do(es) not run on {self.platform.device} yet: use device 'cpu' "
            "(--device cpu) or drop it",
        )

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)


SPECULATIVE_METHODS = ("ngram", "draft_model", "dspark", "dflash", "eagle3", "mtp")
# Methods whose `model` is a drafter checkpoint (DeepSpec format) that reads the target's hidden states.
CHECKPOINT_DRAFTERS = ("dspark", "dflash", "eagle3")
VERIFY_POLICIES = ("fixed", "threshold", "dspark", "dspark_async")
SCHEDULED_POLICIES = ("dspark", "dspark_async")  # the load-aware ones, which read the cost profile
THRESHOLD_SEMANTICS = ("specserve", "deepspec")


@dataclass
class SpeculativeConfig:
    """Speculative decoding settings; the JSON keys are vLLM's (`--speculative-config '{...}'`).

    `num_speculative_tokens` defaults to 3 for ngram / draft_model, to the block size for DSpark-type
    drafters and to 1 for `mtp` (without `model`: the target's own multi-token-prediction layer, applied
    recursively; with one: a Gemma 4 assistant).
    `verify_policy` decides how many of them each request verifies per step: `fixed` (all),
    `threshold` (DeepSpec's: up to the first draft whose confidence is below `confidence_threshold`),
    `dspark` / `dspark_async` (load-aware, from the confidences and the engine's cost profile: the JSON
    file `cost_profile`, or one measured at start and cached); with `live_recalibration` (the default)
    those read the drafter's confidences corrected by the acceptance the engine has seen so far.
    `threshold_semantics: "deepspec"` makes `threshold` DeepSpec's exactly: the confidence head's raw
    confidences (no STS temperatures), and a drafter without a head verifies its whole block
    (docs/speculative-decoding.md lists every difference).
    `quantization` ("int8" | "int4") makes the drafter's linear layers weight-only quantized,
    independently of the target's.
    """

    method: str
    num_speculative_tokens: int | None = None
    model: str | None = None
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    verify_policy: str = "fixed"
    confidence_threshold: float | None = None
    cost_profile: str | None = None
    live_recalibration: bool = True
    threshold_semantics: str = "specserve"
    quantization: str | None = None

    def __post_init__(self) -> None:
        check(
            self.method in SPECULATIVE_METHODS,
            f"unknown speculative method {self.method!r}; choose one of {', '.join(SPECULATIVE_METHODS)}",
        )
        k = self.num_speculative_tokens
        check(
            k is None or (isinstance(k, int) and not isinstance(k, bool) and k >= 1),
            f"num_speculative_tokens must be an integer >= 1, got {k!r}",
        )
        check(
            self.verify_policy in VERIFY_POLICIES,
            f"unknown verify_policy {self.verify_policy!r}; choose one of {', '.join(VERIFY_POLICIES)}",
        )
        threshold = self.confidence_threshold
        if self.verify_policy == "threshold":
            check(
                isinstance(threshold, int | float) and not isinstance(threshold, bool) and 0 < threshold <= 1,
                f"verify_policy 'threshold' needs confidence_threshold in (0, 1], got {threshold!r}",
            )
        else:
            check(threshold is None, "confidence_threshold is only used with verify_policy 'threshold'")
        check(
            self.threshold_semantics in THRESHOLD_SEMANTICS,
            f"threshold_semantics must be one of {', '.join(THRESHOLD_SEMANTICS)}, "
            f"got {self.threshold_semantics!r}",
        )
        check(
            self.threshold_semantics == "specserve" or self.verify_policy == "threshold",
            "threshold_semantics 'deepspec' is only used with verify_policy 'threshold'",
        )
        check(
            isinstance(self.live_recalibration, bool),
            f"live_recalibration must be true or false, got {self.live_recalibration!r}",
        )
        _check_quantization(self.quantization)
        check(
            self.quantization is None or self.method != "ngram",
            "quantization applies to a drafter's weights; method 'ngram' has none",
        )
        if self.method == "draft_model":
            check(bool(self.model), "method 'draft_model' needs 'model': the draft model's name or path")
        if self.method in CHECKPOINT_DRAFTERS:
            check(
                bool(self.model),
                f"method {self.method!r} needs 'model': a drafter checkpoint directory or hub id",
            )
        check(
            self.model is None or isinstance(self.model, str) and bool(self.model),
            f"model must be a drafter's name or path, got {self.model!r}",
        )
        if self.method == "ngram":
            check(
                isinstance(self.prompt_lookup_min, int) and self.prompt_lookup_min >= 1,
                f"prompt_lookup_min must be an integer >= 1, got {self.prompt_lookup_min!r}",
            )
            check(
                isinstance(self.prompt_lookup_max, int) and self.prompt_lookup_max >= self.prompt_lookup_min,
                f"prompt_lookup_max must be an integer >= prompt_lookup_min, got {self.prompt_lookup_max!r}",
            )

    @classmethod
    def from_value(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """From a config, a dict, or a JSON string (as the CLI passes it); unknown keys are errors."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            import json

            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise SpecserveError(f"speculative config is not valid JSON: {e}") from None
        check(isinstance(value, dict), "speculative config must be a JSON object")
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(value) - known)
        check(
            not unknown,
            f"unknown speculative config keys: {', '.join(unknown)}; known: {', '.join(sorted(known))}",
        )
        check("method" in value, "speculative config needs 'method'")
        return cls(**value)
