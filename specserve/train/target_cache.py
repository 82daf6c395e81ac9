"""The target cache: per training token, the target's view of it, in DeepSpec's binary layout
(DSPARK.md §5.3) so that caches move between DeepSpec and specserve.

Each sample is five arrays written back to back into a shard: input_ids int32 [S], attention_mask uint8
[S], loss_mask uint8 [S], target_hidden_states bf16 [S, n_f H] (the target_layer_ids outputs, concatenated)
and target_last_hidden_states bf16 [S, H] (final-normed). `samples.idx` holds one 56-byte little-endian
record per sample (u64 sample id, u32 shard, u32 length, 5 x u64 byte offsets); `manifest.json` says what
was cached. Reading memory-maps the shards.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specserve.config import SpecserveError
from specserve.train.trainer import Sample

RECORD = struct.Struct("<QII5Q")  # 56 bytes
MANIFEST_VERSION = 2
DEFAULT_SHARD_BYTES = 64 << 30


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


def write_target_cache(
    directory: str | Path, samples: Iterable[Sample], info: CacheInfo, shard_bytes: int = DEFAULT_SHARD_BYTES
) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    shard_id, shard, shard_size = 0, None, 0
    shards, records = [], []
    width = info.hidden_size * len(info.target_layer_ids)
    try:
        for sample_id, s in enumerate(samples):
            n = len(s.input_ids)
            if tuple(s.features.shape) != (n, width) or tuple(s.last_hidden.shape) != (n, info.hidden_size):
                raise SpecserveError(f"sample {sample_id}: features/hidden shapes do not match the cache's")
            arrays = [
                s.input_ids.to(torch.int32).numpy().tobytes(),
                np.ones(n, dtype=np.uint8).tobytes(),
                s.loss_mask.to(torch.uint8).numpy().tobytes(),
                _bf16_bytes(s.features),
                _bf16_bytes(s.last_hidden),
            ]
            size = sum(len(a) for a in arrays)
            if shard is None or (shard_size and shard_size + size > shard_bytes):
                if shard is not None:
                    shard.close()
                    shard_id += 1
                name = f"shard-{shard_id:05d}.bin"
                shards.append({"shard_id": shard_id, "file_name": name})
                shard, shard_size = open(directory / name, "wb"), 0
            offsets = []
            for a in arrays:
                offsets.append(shard_size)
                shard.write(a)
                shard_size += len(a)
            records.append(RECORD.pack(sample_id, shard_id, n, *offsets))
    finally:
        if shard is not None:
            shard.close()
    (directory / "samples.idx").write_bytes(b"".join(records))
    manifest = {
        "version": MANIFEST_VERSION,
        "num_samples": len(records),
        "num_shards": len(shards),
        "target_layer_ids": list(info.target_layer_ids),
        "hidden_dtype": "bfloat16",
        "token_dtype": "int32",
        "mask_dtype": "uint8",
        "index_record_size": RECORD.size,
        "hidden_size": info.hidden_size,
        "shards": shards,
        "target_model_name_or_path": info.target_model,
        **(info.extra or {}),
    }
    (directory / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return directory


class TargetCache:
    """Random access to a written cache; samples come back as fp32 tensors."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        try:
            self.manifest = json.loads((self.directory / "manifest.json").read_text())
        except FileNotFoundError:
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

    def check(self, drafter_config, target_model: str | None = None) -> None:
        """Refuse a cache made for other target layers, another hidden size or another target."""
        m = self.manifest
        problems = []
        if list(m["target_layer_ids"]) != list(drafter_config.target_layer_ids):
            problems.append(f"target_layer_ids {m['target_layer_ids']} != {drafter_config.target_layer_ids}")
        if m["hidden_size"] != drafter_config.hidden_size:
            problems.append(f"hidden_size {m['hidden_size']} != {drafter_config.hidden_size}")
        if target_model is not None and m.get("target_model_name_or_path") != target_model:
            problems.append(f"target {m.get('target_model_name_or_path')!r} != {target_model!r}")
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
    hidden = target.config.hidden_size
    tokens = sum(len(ids) for ids, _ in kept)
    size = tokens * bytes_per_token(hidden, len(layer_ids))
    print(
        f"target cache: {len(kept)} of {len(tokenized)} samples (>= {min_loss_tokens} loss tokens), "
        f"{tokens} tokens, {size / 2**30:.2f} GiB",
        flush=True,
    )

    def samples() -> Iterator[Sample]:
        for ids, mask in tqdm(kept, desc="target features"):
            features, last_hidden = target_features(target, ids, layer_ids)
            yield Sample(torch.tensor(ids), torch.tensor(mask), features, last_hidden)

    info = CacheInfo(
        list(layer_ids), hidden, target_name, {"max_length": max_length, "min_loss_tokens": min_loss_tokens}
    )
    return write_target_cache(directory, samples(), info)
