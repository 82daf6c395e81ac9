"""The driver's side of tensor parallelism: start the worker ranks, and run the target's runner on all.

One node: the engine starts `python -m specserve.parallel.worker` once per extra rank (a fresh interpreter,
so a user's script is never re-run) and they meet on a free local port. Several nodes: the
processes come from `torchrun` (or any launcher that sets MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE); rank 0
runs the engine and every other rank the worker loop (docs/tensor-parallel.md).

Each step the driver broadcasts the step's metadata (pickled `PieceInput`s: token ids, positions, block
tables) and every rank runs the forward on its shard; rank 0's logits, hidden states and captured features
are the whole ones (the residual stream is replicated), so drafters read them there at no extra cost.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import time
from collections.abc import Sequence as Seq

import torch

from specserve.config import SpecserveError
from specserve.core.cache_groups import StateCopy
from specserve.local_port import free_local_port
from specserve.models.sharding import Shard
from specserve.parallel.group import TensorParallelError, TensorParallelGroup
from specserve.parallel.install import install_collectives
from specserve.platform import local_world_size
from specserve.worker.model_runner import ForwardOutput, ModelRunner, PieceInput, PromptScoring

TIMEOUT_ENV = "SPECSERVE_TP_TIMEOUT"
DEFAULT_TIMEOUT_S = 120.0  # a collective (or the start-up rendezvous) waits this long for a peer
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def collective_timeout() -> float:
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    try:
        value = float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        value = -1.0
    if value <= 0:
        raise SpecserveError(f"{TIMEOUT_ENV}={raw!r}: expected a number of seconds > 0")
    return value


def launched_by_torchrun() -> bool:
    return all(os.environ.get(name) for name in LAUNCHER_ENV)


def threads_per_rank(world_size: int) -> int:
    """Ranks on one node share its cores: each takes its share of the driver's torch threads."""
    return max(1, torch.get_num_threads() // max(1, local_world_size(world_size)))


class ShardedRunner:
    """The target's `ModelRunner` on every rank at once: on the driver each call is a command the workers
    run too (a rank's state checkpoints stay on it, for `commit_states` after the forward)."""

    def __init__(self, runner: ModelRunner, group: TensorParallelGroup):
        self.runner = runner
        self.group = group
        group.handlers.update(forward=runner.forward, commit_states=runner.commit_states)

    @property
    def model(self):
        return self.runner.model

    @property
    def kv_caches(self) -> list:
        """This rank's (the driver's) shard of the target's caches."""
        return self.runner.kv_caches

    def forward(
        self,
        pieces: Seq[PieceInput],
        logit_rows: Seq[int],
        capture_layers: Seq[int] = (),
        restores: Seq[StateCopy] = (),
        scoring: PromptScoring | None = None,
    ) -> ForwardOutput:
        args = (list(pieces), list(logit_rows), tuple(capture_layers), list(restores), scoring)
        return self.group.run("forward", *args)

    def commit_states(self, keep: dict[int, int], saves: Seq[StateCopy] = ()) -> None:
        if keep or saves:  # an attention-only model's steps send nothing here
            self.group.run("commit_states", keep, list(saves))


EXIT_GRACE_S = 2.0


class TensorParallelExecutor:
    """Starts (or joins) the worker ranks; `load` and `runner` set them up like the driver."""

    def __init__(self, world_size: int):
        if torch.distributed.is_initialized():
            raise SpecserveError("a tensor-parallel engine is already running in this process")
        self.world_size = world_size
        self.workers: list[subprocess.Popen] = []
        timeout = collective_timeout()
        if launched_by_torchrun():
            launched = int(os.environ["WORLD_SIZE"])
            if launched != world_size or int(os.environ["RANK"]) != 0:
                raise SpecserveError(
                    f"tensor_parallel_size={world_size}, but the launcher started WORLD_SIZE={launched} "
                    f"processes and this one is RANK={os.environ['RANK']}: the engine runs on rank 0"
                )
            init_method = "env://"
        else:
            init_method = f"tcp://127.0.0.1:{free_local_port()}"
            self.workers = [self._spawn(rank, init_method, timeout) for rank in range(1, world_size)]
        atexit.register(self.close)
        self.shard = Shard(0, world_size)
        try:
            self.group = TensorParallelGroup(self.shard, init_method, timeout)
        except TensorParallelError as exc:
            self.close()
            raise TensorParallelError(f"{exc}{self.worker_report()}") from exc
        self.group.describe_failure = self.worker_report
        self._threads = torch.get_num_threads()  # given back by `close`
        torch.set_num_threads(threads_per_rank(world_size))

    def _spawn(self, rank: int, init_method: str, timeout: float) -> subprocess.Popen:
        command = [sys.executable, "-m", "specserve.parallel.worker", "--rank", str(rank)]
        command += ["--world-size", str(self.world_size), "--init-method", init_method]
        env = {**os.environ, TIMEOUT_ENV: str(timeout), "LOCAL_RANK": str(rank)}  # all on this node
        return subprocess.Popen(command, env=env)

    def worker_report(self) -> str:
        """Which local workers have exited (with their codes), for error messages. A killed rank's sockets
        close while it exits, so a collective can fail a moment before the exit can be seen: the workers
        get EXIT_GRACE_S together to show it (a failure stops the engine; this runs once)."""
        deadline = time.monotonic() + EXIT_GRACE_S
        dead = []
        for rank, p in enumerate(self.workers, start=1):
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                continue
            dead.append(f"rank {rank} exited with code {p.returncode}")
        return f" ({'; '.join(dead)}; its log is above)" if dead else ""

    def load(self, **load_args) -> None:
        """Workers load their shards (`load_model` arguments; its `platform` is the driver's, each worker's
        its own: `Platform.of_rank`) while the driver loads its own."""
        self.group.send(("load", {**load_args, "threads": torch.get_num_threads()}))
        self.group.open_collectives(load_args["platform"])

    def runner(
        self, model, num_blocks: int, block_size: int, dtype: torch.dtype, num_slots: int
    ) -> ShardedRunner:
        install_collectives(model, self.group)
        self.group.send(("runner", (num_blocks, block_size, dtype, num_slots)))
        return ShardedRunner(ModelRunner(model, num_blocks, block_size, dtype, num_slots), self.group)

    def close(self) -> None:
        """Stop the workers (they also stop by themselves when the driver goes away)."""
        group = getattr(self, "group", None)
        if group is not None and group.failure is None:
            try:
                group.send(("shutdown", ()))
            except TensorParallelError:
                pass
        if group is not None:
            group.close()  # meets the workers at the shutdown barrier before they exit
            torch.set_num_threads(self._threads)
        for process in self.workers:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.group = None
        self.workers = []
        atexit.unregister(self.close)
