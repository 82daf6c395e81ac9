"""A tensor-parallel worker rank: join the group, load this rank's shard on its device, run the driver's
commands.

Started by the engine (`--rank`, `--world-size`, `--init-method`) or by a launcher such as torchrun (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment). It exits when the driver says `shutdown` or goes
away (its next receive fails).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from specserve.config import SpecserveError
from specserve.models.loader import load_model
from specserve.models.sharding import Shard
from specserve.parallel.executor import ShardedRunner, collective_timeout
from specserve.parallel.group import TensorParallelError, TensorParallelGroup
from specserve.parallel.install import install_collectives
from specserve.platform import local_rank
from specserve.worker.model_runner import ModelRunner


def run_worker(shard: Shard, init_method: str, timeout_s: float) -> None:
    group = TensorParallelGroup(shard, init_method, timeout_s)
    try:
        load_args = _expect(group, "load")
        if load_args is None:
            return
        torch.set_num_threads(load_args.pop("threads"))
        platform = load_args.pop("platform").of_rank(local_rank(shard.rank))  # the driver's: rank 0's
        group.open_collectives(platform)
        model, _, _ = load_model(**load_args, platform=platform, shard=shard)
        install_collectives(model, group)
        runner_args = _expect(group, "runner")
        if runner_args is None:
            return
        ShardedRunner(ModelRunner(model, *runner_args), group)
        group.serve()
    finally:
        group.close()


def _expect(group: TensorParallelGroup, name: str):
    """The arguments of the driver's next command, which must be `name` (None: it said shutdown)."""
    got, args = group.receive()
    if got == "shutdown":
        return None
    if got != name:
        raise SpecserveError(f"worker rank {group.shard.rank}: expected the {name!r} command, got {got!r}")
    return args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specserve.parallel.worker", description=__doc__)
    parser.add_argument("--rank", type=int, default=int(os.environ.get("RANK", -1)))
    parser.add_argument("--world-size", type=int, default=int(os.environ.get("WORLD_SIZE", 0)))
    parser.add_argument("--init-method", default="env://")
    args = parser.parse_args(argv)
    if not 0 < args.rank < args.world_size:
        parser.error(f"--rank must be in 1..world_size-1 (rank 0 is the engine), got {args.rank}")
    try:
        run_worker(Shard(args.rank, args.world_size), args.init_method, collective_timeout())
    except TensorParallelError as exc:  # the driver went away or a peer failed: nothing left to serve
        print(f"specserve worker rank {args.rank}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
