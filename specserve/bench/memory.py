"""Peak memory while loading, against the memory the loaded engine keeps.

    python -m specserve.bench.memory --model qwen2.5-coder-1.5b --quantization none int8 int4 \\
        --draft qwen2.5-coder-0.5b

Each case loads an engine in a fresh process (so peaks do not carry over) and reports the process's
resident memory before loading (Python, torch), its peak while loading (ru_maxrss), and its resident
memory once loaded; `peak / kept` is (peak - before) / (loaded - before): 1.0 means no transient copy at
all. With `--draft` each mode also loads the draft model beside the target (quantized alike). The KV cache
is kept small (`--kv-cache-memory`) so that the weights dominate. Writes `load-memory.json` and
`load-memory.md` to `--out`.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path


def resident_gb() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**20
    raise RuntimeError("no VmRSS in /proc/self/status")


def measure_here(model: str, quantization: str | None, draft: str | None, kv_cache_memory: str) -> dict:
    from specserve.config import EngineConfig, SpeculativeConfig
    from specserve.engine.engine import LLMEngine

    before = resident_gb()
    spec = None
    if draft is not None:
        spec = SpeculativeConfig("draft_model", model=draft, quantization=quantization)
    config = EngineConfig(
        model, quantization=quantization, kv_cache_memory=kv_cache_memory, max_model_len=2048
    )
    engine = LLMEngine(config, spec)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    loaded = resident_gb()
    engine.close()
    return {
        "model": model,
        "draft": draft,
        "quantization": quantization or "none",
        "dtype": config.dtype,
        "before_gb": before,
        "peak_gb": peak,
        "loaded_gb": loaded,
        "peak_over_kept": (peak - before) / (loaded - before),
    }


def measure(model: str, quantization: str | None, draft: str | None, kv_cache_memory: str) -> dict:
    command = [sys.executable, "-m", "specserve.bench.memory", "--child", "--model", model]
    command += ["--quantization", quantization or "none", "--kv-cache-memory", kv_cache_memory]
    command += ["--draft", draft] if draft else []
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def report(rows: list[dict]) -> str:
    lines = [
        "| model | draft | quantization | dtype | before GB | peak GB | loaded GB | peak / kept |",
        "|---|---|---|---|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['model']} | {r['draft'] or '-'} | {r['quantization']} | {r['dtype']} | {r['before_gb']:.2f} "
        f"| {r['peak_gb']:.2f} | {r['loaded_gb']:.2f} | {r['peak_over_kept']:.2f}x |"
        for r in rows
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m specserve.bench.memory",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--quantization", nargs="+", default=["none", "int8", "int4"])
    parser.add_argument("--draft", default=None, help="also load this draft model beside the target")
    parser.add_argument("--kv-cache-memory", default="256MiB")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/load-memory"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    modes = [None if q == "none" else q for q in args.quantization]
    if args.child:
        print(json.dumps(measure_here(args.model, modes[0], args.draft, args.kv_cache_memory)))
        return 0
    drafts = [None, args.draft] if args.draft else [None]
    rows = []
    for draft in drafts:
        for mode in modes:
            rows.append(measure(args.model, mode, draft, args.kv_cache_memory))
            print(report(rows[-1:]).splitlines()[-1], flush=True)
    table = report(rows)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "load-memory.json").write_text(json.dumps(rows, indent=1))
    command = " ".join(["python -m specserve.bench.memory", *(sys.argv[1:] if argv is None else argv)])
    (args.out / "load-memory.md").write_text(f"`{command}`\n\n{table}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
