"""Serving benchmark: a streaming client at fixed concurrency against an OpenAI-compatible server, the serving
metrics (TTFT, TPOT, ITL, E2E, throughput, goodput), the speculative statistics from /metrics, and the
concurrency sweep over server configurations that draws the throughput-vs-interactivity Pareto frontier.

`specserve bench serve` runs `benchmark.benchmark_server`; `specserve bench sweep` runs `sweep.run_sweep`.
"""
