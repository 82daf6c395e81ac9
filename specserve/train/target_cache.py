"""The target cache: per training token, the target's view of it, in DeepSpec's binary layout
(DSPARK.md §5.3) so that caches move between DeepSpec and specserve.

Each sample is five arrays written back to back into a shard: input_ids int32 [S], attention_mask uint8
[S], loss_mask uint8 [S], target_hidden_states bf16 [S, n_f H] (the target_layer_ids outputs, concatenated)
and target_last_hidden_states bf16 [S, H] (final-normed). `samples.idx` holds one 56-byte little-endian
record per sample (u64 sample id, u32 shard, u32 length, 5 x u64 byte offsets); `manifest.json` says what
was cached and marks the cache complete; until then `partial.json` holds the build's settings and a
fingerprint of its inputs, and an interrupted build resumes after its last whole sample. Reading
memory-maps the shards.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specserve.config import SpecserveError, check
from specserve.models import local_models
from specserve.train.trainer import Sample

RECORD = struct.Struct("<QII5Q")  # 56 bytes
MANIFEST_VERSION = 2
DEFAULT_SHARD_BYTES = 64 << 30
PARTIAL = "partial.json"  # present while a build is under way: its settings and inputs


def bytes_per_token(hidden_size: int, num_layers: int) -> int:
    """6 bytes of ids and masks plus bf16 features of n_f layers and the last hidden state."""
    return 6 + 2 * hidden_size * (num_layers + 1)


def _bf16_bytes(x: torch.Tensor) -> bytes:
    return x.detach().to(torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes()


@dataclass
class CacheInfo:
    target_layer_ids: list[int]
    hidden_size: int
    target_model: str
    extra: dict | None = None  # source files, chat template, max_length... (recorded as given)


def _shard_name(shard_id: int) -> str:
    return f"shard-{shard_id:05d}.bin"


class TargetCacheWriter:
    """Appends samples to a cache directory. A sample is kept once its index record is written (after
    its arrays): an interrupted build resumes after the last whole sample, cutting off a half-written
    one. `inputs` fingerprints what the samples are made from, so that a resume never mixes two builds."""

    def __init__(
        self, directory: str | Path, info: CacheInfo, shard_bytes: int = DEFAULT_SHARD_BYTES, inputs: str = ""
    ):
        self.directory, self.info, self.shard_bytes = Path(directory), info, shard_bytes
        if (self.directory / "manifest.json").exists():
            raise SpecserveError(f"{self.directory} is a complete target cache: remove it or choose another")
        self.directory.mkdir(parents=True, exist_ok=True)
        state = json.loads(json.dumps({"info": dataclasses.asdict(info), "inputs": inputs}))
        partial = self.directory / PARTIAL
        resuming = partial.exists()
        if resuming and json.loads(partial.read_text()) != state:
            raise SpecserveError(
                f"{self.directory} holds part of a target cache built from other inputs or settings: "
                "remove it or choose another"
            )
        partial.write_text(json.dumps(state))
        index_path = self.directory / "samples.idx"
        index = index_path.read_bytes() if resuming and index_path.exists() else b""
        self.num_written = len(index) // RECORD.size
        self.shard_id, self.shard_size, self.shard = 0, 0, None
        if self.num_written:
            _, self.shard_id, n, *offsets = RECORD.unpack_from(index, (self.num_written - 1) * RECORD.size)
            self.shard_size = offsets[-1] + 2 * n * info.hidden_size  # the end of its last_hidden
        self._cut_after_last_record()
        if index_path.exists():
            os.truncate(index_path, self.num_written * RECORD.size)
        self.index = open(index_path, "ab")

    def _cut_after_last_record(self) -> None:
        """Drop what an interrupted build wrote past its last whole sample (or a stale build's shards)."""
        for path in self.directory.glob("shard-*.bin"):
            if not self.num_written or path.name > _shard_name(self.shard_id):
                path.unlink()
        if self.num_written:
            os.truncate(self.directory / _shard_name(self.shard_id), self.shard_size)

    def add(self, s: Sample) -> None:
        n, width = len(s.input_ids), self.info.hidden_size * len(self.info.target_layer_ids)
        if tuple(s.features.shape) != (n, width) or tuple(s.last_hidden.shape) != (n, self.info.hidden_size):
            raise SpecserveError(f"sample {self.num_written}: features/hidden shapes do not match the cache")
        arrays = [
            s.input_ids.to(torch.int32).numpy().tobytes(),
            np.ones(n, dtype=np.uint8).tobytes(),
            s.loss_mask.to(torch.uint8).numpy().tobytes(),
            _bf16_bytes(s.features),
            _bf16_bytes(s.last_hidden),
        ]
        size = sum(len(a) for a in arrays)
        if self.shard_size and self.shard_size + size > self.shard_bytes:
            self._close_shard()
            self.shard_id, self.shard_size = self.shard_id + 1, 0
        if self.shard is None:
            self.shard = open(self.directory / _shard_name(self.shard_id), "ab")
        offsets = []
        for a in arrays:
            offsets.append(self.shard_size)
            self.shard.write(a)
            self.shard_size += len(a)
        self.shard.flush()
        self.index.write(RECORD.pack(self.num_written, self.shard_id, n, *offsets))
        self.index.flush()
        self.num_written += 1

    def finish(self) -> Path:
        """The manifest, which marks the cache complete."""
        self.close()
        info = self.info
        num_shards = self.shard_id + 1 if self.num_written else 0
        manifest = {
            "version": MANIFEST_VERSION,
            "num_samples": self.num_written,
            "num_shards": num_shards,
            "target_layer_ids": list(info.target_layer_ids),
            "hidden_dtype": "bfloat16",
            "token_dtype": "int32",
            "mask_dtype": "uint8",
            "index_record_size": RECORD.size,
            "hidden_size": info.hidden_size,
            "shards": [{"shard_id": i, "file_name": _shard_name(i)} for i in range(num_shards)],
            "target_model_name_or_path": info.target_model,
            **(info.extra or {}),
        }
        (self.directory / "manifest.json").write_text(json.dumps(manifest, indent=2))
        (self.directory / PARTIAL).unlink()
        return self.directory

    def _close_shard(self) -> None:
        if self.shard is not None:
            self.shard.close()
            self.shard = None

    def close(self) -> None:
        self._close_shard()
        self.index.close()

    def __enter__(self) -> TargetCacheWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_target_cache(
    directory: str | Path,
    samples: Iterable[Sample],
    info: CacheInfo,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    inputs: str = "",
) -> Path:
    """Writes `samples` and the manifest; after an interruption, only the samples not yet written."""
    with TargetCacheWriter(directory, info, shard_bytes, inputs) as writer:
        for s in itertools.islice(samples, writer.num_written, None):
            writer.add(s)
        return writer.finish()


def _target_key(model: str) -> str:
    """A target as `TargetCache.check_target` compares it: an existing local path resolved (`./m` and
    `/abs/m` are one target), a local model name or hub id as written."""
    path = Path(model).expanduser()
    if model in local_models.LOCAL_MODELS or not path.exists():
        return model
    return str(path.resolve())


class TargetCache:
    """Random access to a written cache; samples come back as fp32 tensors."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        try:
            self.manifest = json.loads((self.directory / "manifest.json").read_text())
        except (FileNotFoundError, NotADirectoryError):
            raise SpecserveError(f"{self.directory} is not a target cache (no manifest.json)") from None
        if self.manifest.get("version") != MANIFEST_VERSION:
            raise SpecserveError(f"{self.directory}: manifest version {self.manifest.get('version')!r} != 2")
        index = (self.directory / "samples.idx").read_bytes()
        self.records = [RECORD.unpack_from(index, i) for i in range(0, len(index), RECORD.size)]
        self.shards = {
            s["shard_id"]: np.memmap(self.directory / s["file_name"], dtype=np.uint8, mode="r")
            for s in self.manifest["shards"]
        }
        self.hidden_size = self.manifest["hidden_size"]
        self.width = self.hidden_size * len(self.manifest["target_layer_ids"])

    def __len__(self) -> int:
        return len(self.records)

    def longest(self, num_samples: int | None = None) -> int:
        """The most tokens in one of the first `num_samples` samples (all: None), read from the index."""
        return max(length for _, _, length, *_ in self.records[:num_samples])

    def _tokens(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids int32 [S], loss_mask uint8 [S]) of sample i, views into its shard."""
        _, shard_id, n, ids, _, loss, _, _ = self.records[i]
        buf = self.shards[shard_id]
        return (
            np.frombuffer(buf, dtype=np.int32, count=n, offset=ids),
            np.frombuffer(buf, dtype=np.uint8, count=n, offset=loss),
        )

    def __getitem__(self, i: int) -> Sample:
        _, shard_id, n, _, _, _, feats, last = self.records[i]
        buf = self.shards[shard_id]

        def bf16(offset: int, cols: int) -> torch.Tensor:
            raw = np.frombuffer(buf, dtype=np.int16, count=n * cols, offset=offset).copy()
            return torch.from_numpy(raw).view(torch.bfloat16).float().view(n, cols)

        ids, loss = self._tokens(i)
        return Sample(
            input_ids=torch.from_numpy(ids.astype(np.int64)),
            loss_mask=torch.from_numpy(loss.astype(np.int64)),
            features=bf16(feats, self.width),
            last_hidden=bf16(last, self.hidden_size),
        )

    def supervised_tokens(self, num_samples: int | None = None) -> torch.Tensor:
        """The sorted ids of every token a loss mask covers in the first `num_samples` samples (all: None),
        read without the features."""
        seen = [ids[loss.astype(bool)] for ids, loss in map(self._tokens, range(len(self))[:num_samples])]
        return torch.from_numpy(np.unique(np.concatenate(seen)).astype(np.int64))

    def check_target(self, target_model: str, text_config=None) -> None:
        """Refuse, before the target loads, a cache built for another target: by the name it was built with,
        and by the hidden size and layer count of the target's config (None: not known without a download)."""
        m, problems = self.manifest, []
        built_for = m.get("target_model_name_or_path")
        if not isinstance(built_for, str) or _target_key(built_for) != _target_key(target_model):
            problems.append(f"it was built for {built_for!r}, not {target_model!r}")
        if text_config is not None:
            if m["hidden_size"] != text_config.hidden_size:
                problems.append(f"hidden_size {m['hidden_size']} != the target's {text_config.hidden_size}")
            if max(m["target_layer_ids"], default=0) >= text_config.num_hidden_layers:
                problems.append(
                    f"target_layer_ids {m['target_layer_ids']} past the target's "
                    f"{text_config.num_hidden_layers} layers"
                )
        check(
            not problems,
            f"{self.directory} is not a target cache of {target_model} ({'; '.join(problems)}): build one "
            f"with `specserve data target-cache --model {target_model}`, or train with the cache's target",
        )

    def check(self, drafter_config) -> None:
        """Refuse a cache made for other target layers or another hidden size than the drafter reads."""
        m = self.manifest
        problems = []
        if list(m["target_layer_ids"]) != list(drafter_config.target_layer_ids):
            problems.append(f"target_layer_ids {m['target_layer_ids']} != {drafter_config.target_layer_ids}")
        if m["hidden_size"] != drafter_config.hidden_size:
            problems.append(f"hidden_size {m['hidden_size']} != {drafter_config.hidden_size}")
        if problems:
            raise SpecserveError(f"{self.directory} does not match the drafter: " + "; ".join(problems))


def build_target_cache(
    target,
    tokenizer,
    conversations: list[list[dict]],
    layer_ids: list[int],
    directory: str | Path,
    target_name: str,
    max_length: int = 4096,
    min_loss_tokens: int = 14,
) -> Path:
    """Tokenise conversations (loss masks from the chat template), run the target once per sample for
    its features, and write the cache; prints the size estimate before it starts."""
    from tqdm import tqdm

    from specserve.train.data import tokenize_conversation
    from specserve.train.forward import target_features

    tokenized = [tokenize_conversation(tokenizer, c, max_length) for c in conversations]
    kept = [(ids, mask) for ids, mask in tokenized if sum(mask) >= min_loss_tokens]
    check(
        bool(kept),
        f"none of the {len(tokenized)} samples has >= {min_loss_tokens} loss tokens (--min-loss-tokens): "
        "the cache would be empty",
    )
    hidden = target.config.hidden_size
    tokens = sum(len(ids) for ids, _ in kept)
    size = tokens * bytes_per_token(hidden, len(layer_ids))
    print(
        f"target cache: {len(kept)} of {len(tokenized)} samples (>= {min_loss_tokens} loss tokens), "
        f"{tokens} tokens, {size / 2**30:.2f} GiB",
        flush=True,
    )

    info = CacheInfo(
        list(layer_ids), hidden, target_name, {"max_length": max_length, "min_loss_tokens": min_loss_tokens}
    )
    inputs = hashlib.sha256(json.dumps(kept).encode()).hexdigest()
    with TargetCacheWriter(directory, info, inputs=inputs) as writer:
        if writer.num_written:
            print(f"resuming after {writer.num_written} samples already in {directory}", flush=True)
        done = writer.num_written
        for ids, mask in tqdm(kept[done:], desc="target features", initial=done, total=len(kept)):
            features, last_hidden = target_features(target, ids, layer_ids)
            writer.add(Sample(torch.tensor(ids), torch.tensor(mask), features, last_hidden))
        return writer.finish()
