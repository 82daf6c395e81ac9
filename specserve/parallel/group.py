"""The tensor-parallel process group: collectives inside a forward, and the commands that start one.

Every rank runs the same code over its shard. The driver (rank 0, inside the engine) decides what runs:
`run(name, *args)` broadcasts the command's name and its small arguments (the step's metadata: token ids,
positions, block tables) to the workers, then runs it itself; each worker's loop receives the command and
runs the same handler, so all ranks meet at the same collectives. Tensors cross ranks only inside a
forward: an all-reduce of each block's [tokens, hidden] output and a gather of the logits rows asked for.

Commands travel on a gloo group (small pickled objects from the host) whose timeout is effectively infinite:
a worker waits for the next step as long as the engine is idle. A command's tensor arguments cross on the
host and land on the receiving rank's device. Collectives run on a group of the platform's backend (gloo on
the CPU, NCCL over each rank's GPU on CUDA: `Platform.collective_backend`), opened once the `load` command
has said where the ranks run, with `timeout_s`: on gloo a peer that died or hangs ends the step with
`TensorParallelError` instead of a hang. NCCL's collectives are asynchronous: their timeout is enforced by
torch's watchdog thread, which tears the process down (TORCH_NCCL_ASYNC_ERROR_HANDLING's default) rather
than raising in the step; a worker that died between steps should still fail the next step's command
broadcast, on gloo, with `TensorParallelError` (docs/tensor-parallel.md).
"""

from __future__ import annotations

import datetime
import pickle
from collections.abc import Callable

import torch
import torch.distributed as dist

from specserve.config import SpecserveError
from specserve.models.sharding import Shard
from specserve.platform import Platform

IDLE_TIMEOUT = datetime.timedelta(days=365)  # how long a worker waits for its next command


class TensorParallelError(SpecserveError):
    """A collective failed: a rank died, hung past the timeout, or could not join."""


def _collective(what: str):
    """A group method that talks to the other ranks: once one has failed, the group is done (every later
    call fails at once with the first error instead of waiting on a dead peer)."""

    def wrap(fn):
        def run(group: TensorParallelGroup, *args, **kwargs):
            if group.failure is not None:
                raise group.failure
            try:
                return fn(group, *args, **kwargs)
            except (RuntimeError, dist.DistError) as exc:
                reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                peers = group.describe_failure()
                group.failure = TensorParallelError(
                    f"tensor-parallel {what} failed: {reason}{peers}; the engine has stopped"
                )
                raise group.failure from exc

        return run

    return wrap


class TensorParallelGroup:
    def __init__(self, shard: Shard, init_method: str, timeout_s: float):
        self.shard = shard
        self.timeout_s = timeout_s
        self.failure: TensorParallelError | None = None
        self.describe_failure: Callable[[], str] = lambda: ""  # the executor says which workers exited
        self._join(init_method)
        self.commands = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        self.handlers: dict[str, Callable] = {}
        self.in_command = shard.rank != 0  # a worker only ever runs inside a command
        self.shut_down = False  # `shutdown` was sent (driver) or received (worker)
        # This rank's device and the group of the collectives, both set by `open_collectives`.
        self.device = torch.device("cpu")
        self.collectives: dist.ProcessGroup | None = None
        # What crosses ranks, counted on this rank: pickled command bytes the driver broadcast, and the
        # bytes of the tensors it entered into all-reduces and all-gathers (each rank's own share).
        self.command_bytes = 0
        self.collective_bytes = 0

    @_collective("start-up (a rank did not join)")
    def _join(self, init_method: str) -> None:
        dist.init_process_group(
            "gloo",
            init_method=init_method,
            rank=self.shard.rank,
            world_size=self.shard.world_size,
            timeout=datetime.timedelta(seconds=self.timeout_s),
        )

    @property
    def is_driver(self) -> bool:
        return self.shard.rank == 0

    @_collective("opening the collectives' group")
    def open_collectives(self, platform: Platform) -> None:
        """Every rank, once it knows its platform (the `load` command): the group of the collectives, on the
        platform's backend. This rank's GPU becomes the current device first, the one NCCL's communicator
        and Triton's kernels use."""
        platform.make_current()
        self.device = platform.device
        timeout = datetime.timedelta(seconds=self.timeout_s)
        self.collectives = dist.new_group(backend=platform.collective_backend, timeout=timeout)

    # ---- collectives (inside a forward) -------------------------------------------------------------
    @_collective("all-reduce")
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        self.collective_bytes += t.numel() * t.element_size()
        dist.all_reduce(t, group=self.collectives)
        return t

    @_collective("all-gather")
    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        self.collective_bytes += t.numel() * t.element_size()
        parts = [torch.empty_like(t) for _ in range(self.shard.world_size)]
        dist.all_gather(parts, t.contiguous(), group=self.collectives)
        return parts

    # ---- commands ---------------------------------------------------------------------------------------
    def run(self, name: str, *args):
        """Driver: run command `name` on every rank and return the driver's result."""
        handler = self.handlers[name]
        if self.in_command:  # already inside one (the LM head inside a forward)
            return handler(*args)
        self.send((name, _moved(args, torch.device("cpu"))))
        self.in_command = True
        try:
            return handler(*args)
        finally:
            self.in_command = False

    @_collective("command broadcast")
    def send(self, command: tuple) -> None:
        """Driver: broadcast a command to the workers (without running it here): its pickled length, then
        its bytes."""
        data = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
        self.command_bytes += len(data)
        dist.broadcast(torch.tensor([len(data)]), src=0, group=self.commands)
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=0, group=self.commands)
        self.shut_down = command[0] == "shutdown"

    @_collective("command receive")
    def receive(self) -> tuple[str, tuple]:
        length = torch.zeros(1, dtype=torch.long)
        dist.broadcast(length, src=0, group=self.commands)
        data = torch.empty(int(length), dtype=torch.uint8)
        dist.broadcast(data, src=0, group=self.commands)
        command = pickle.loads(data.numpy().tobytes())
        self.shut_down = command[0] == "shutdown"
        return command

    def serve(self) -> None:
        """Worker: run the driver's commands until it sends `shutdown`."""
        while True:
            name, args = self.receive()
            if name == "shutdown":
                return
            self.handlers[name](*_moved(args, self.device))

    def close(self) -> None:
        """Leave the group. After a clean `shutdown` every rank first meets at a barrier: a rank that tore its
        connections down while a peer's gloo threads still used them could abort that peer at exit."""
        if not dist.is_initialized():
            return
        if self.shut_down and self.failure is None:
            try:
                self._farewell()
            except TensorParallelError:
                pass  # a peer is gone: nothing left to wait for
        dist.destroy_process_group()

    @_collective("shutdown barrier")
    def _farewell(self) -> None:
        dist.barrier()


def _moved(args: tuple, device: torch.device) -> tuple:
    """A command's arguments with its tensors (a drafter's ids or hidden states for the shared embedding or
    head) on `device`: pickled on the host, used on the receiving rank's device (a pickled GPU tensor would
    come back on the sender's GPU)."""
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
