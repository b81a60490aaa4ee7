"""Data-parallel runs on ``torch.distributed``: several processes started by ``torchrun`` calibrate one model.

``torchrun --nproc-per-node N -m salaquant gptq ...`` starts N processes with ``WORLD_SIZE`` / ``RANK`` /
``LOCAL_RANK`` set; `from_environment` joins them into one process group (NCCL when the run's device is CUDA,
each process on GPU ``LOCAL_RANK``; gloo on CPUs). Each process holds its own samples' hidden states (the leaves of
`.shards` it owns), accumulates their statistics, and `combine` adds the processes' partial sums in the
fixed tree on rank 0, which sends the total to every process; each then quantizes the layer from the same
statistics (the same bits everywhere) and propagates its own samples. Rank 0 alone writes the work folder's
layer files, the resume state and the export; each process writes its own leaves' hidden states. When a process
dies, ``torchrun`` stops the others; a collective that waits longer than ``TIMEOUT`` (a process hung rather than
dead) fails with that as its message.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from .shards import TreeSum, owned_leaves

T = TypeVar("T")

TIMEOUT = timedelta(minutes=30)
"""How long a collective waits for the other processes (the slowest layer's solve comes first)."""


@dataclass(frozen=True)
class Ranks:
    """This process's place in the run: ``rank`` of ``world`` (one process: 0 of 1)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def parallel(self) -> bool:
        return self.world > 1

    def leaves(self) -> range:
        return owned_leaves(self.rank, self.world)


SINGLE = Ranks()


def from_environment(device: str) -> Ranks:
    """The process group of a ``torchrun`` launch (``WORLD_SIZE`` > 1), joined once; `SINGLE` otherwise.

    Refuses a process count the statistics tree does not serve and, on CUDA, fewer visible GPUs than processes
    on this host, before any work. ``device``: the run's ``--device`` (``auto`` is CUDA where there is one)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return SINGLE
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    owned_leaves(rank, world)  # the process count, checked
    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if cuda:
        if torch.cuda.device_count() <= local:
            raise ValueError(
                f"torchrun process {local} on this host: only {torch.cuda.device_count()} CUDA device(s) visible; "
                "start at most that many processes per node"
            )
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {"backend": "nccl" if cuda else "gloo", "timeout": TIMEOUT}
        if cuda:
            kwargs["device_id"] = torch.device("cuda", local)
        dist.init_process_group(**kwargs)
    return Ranks(rank, world, local)


def device_for(ranks: Ranks, device: torch.device) -> torch.device:
    """The run's device for this process: GPU ``LOCAL_RANK`` when the run is on CUDA with several processes."""
    if ranks.parallel and device.type == "cuda":
        return torch.device("cuda", ranks.local_rank)
    return device


def comm_device(ranks: Ranks) -> torch.device:
    """Where tensors travel: this process's GPU under NCCL, the CPU under gloo (and for one process)."""
    if ranks.parallel and dist.get_backend() == "nccl":
        return torch.device("cuda", ranks.local_rank)
    return torch.device("cpu")


def barrier(ranks: Ranks) -> None:
    if ranks.parallel:
        dist.barrier()


def broadcast_object(obj: T, ranks: Ranks) -> T:
    """Rank 0's ``obj`` on every process (a small picklable value: a resume point, an error message)."""
    if not ranks.parallel:
        return obj
    box = [obj if ranks.main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]  # type: ignore[return-value]


def combine(
    local: T,
    ranks: Ranks,
    tensors: Callable[[T], Sequence[torch.Tensor]],
    empty: Callable[[], T],
    merge: Callable[[T, T], T],
) -> T:
    """The sum over all processes of each one's ``local`` sum (the root of its subtree of leaves): rank 0 receives
    them in rank order and adds them in the upper levels of the fixed tree, then sends the total to every process.
    ``tensors(x)`` lists ``x``'s tensors in a fixed order (received into those of ``empty()``)."""
    if not ranks.parallel:
        return local
    if ranks.main:
        tree: TreeSum[T] = TreeSum(merge)
        tree.push(local)
        for src in range(1, ranks.world):
            other = empty()
            for t in tensors(other):
                dist.recv(t, src=src)
            tree.push(other)
        total = tree.root()
    else:
        for t in tensors(local):
            dist.send(t, dst=0)
        total = local
    for t in tensors(total):
        dist.broadcast(t, src=0)
    return total


def shard_tokens(lengths: Sequence[int], leaves: Sequence[Sequence[int]], world: int) -> list[int]:
    """Tokens each of ``world`` processes holds, given the leaves' sample indices."""
    return [sum(lengths[i] for v in owned_leaves(r, world) for i in leaves[v]) for r in range(world)]


def gather_object(value: T, ranks: Ranks) -> list[T]:
    """Every process's ``value`` (small, picklable), in rank order, on every process."""
    if not ranks.parallel:
        return [value]
    got: list[Any] = [None] * ranks.world
    dist.all_gather_object(got, value)
    return got


def same_everywhere(value: Any, ranks: Ranks, what: str) -> None:
    """Fail on every process when ``value`` (picklable) differs between them: the processes must have read the same
    calibration data and settings."""
    got = gather_object(value, ranks)
    if any(g != got[0] for g in got):
        differ = [r for r, g in enumerate(got) if g != got[0]]
        raise RuntimeError(f"{what} differs between processes (ranks {differ} against rank 0)")


def assign(costs: Sequence[float], world: int) -> list[int]:
    """The process each job runs on: the costliest first (ties by index), each to the least loaded process (ties
    to the lowest rank). Every process computes the same assignment from the same costs."""
    load = [0.0] * world
    owner = [0] * len(costs)
    for k in sorted(range(len(costs)), key=lambda k: (-costs[k], k)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[k] = r
        load[r] += costs[k]
    return owner


def share(
    tensors: dict[str, torch.Tensor] | None, extra: Any, src: int, ranks: Ranks, device: torch.device
) -> tuple[dict[str, torch.Tensor], Any]:
    """Process ``src``'s ``tensors`` (and a small picklable ``extra``) on every process, on ``device`` (the
    process group's: a CUDA device under NCCL, the CPU under gloo); the others pass ``None``."""
    if not ranks.parallel:
        assert tensors is not None
        return tensors, extra
    meta = [(n, tuple(t.shape), t.dtype) for n, t in tensors.items()] if ranks.rank == src and tensors else []
    box: list[Any] = [meta, extra] if ranks.rank == src else [None, None]
    dist.broadcast_object_list(box, src=src)
    meta, extra = box
    out: dict[str, torch.Tensor] = {}
    for name, shape, dtype in meta:
        # as raw bytes: the backends do not carry every dtype (gloo has no float8)
        if ranks.rank == src:
            assert tensors is not None
            raw = tensors[name].to(device).contiguous().reshape(-1).view(torch.uint8)
        else:
            raw = torch.empty(math.prod(shape) * dtype.itemsize, dtype=torch.uint8, device=device)
        dist.broadcast(raw, src=src)
        out[name] = raw.view(dtype).reshape(shape)
    return out, extra


def spread(
    jobs: Sequence[Callable[[], tuple[dict[str, torch.Tensor], Any]]], costs: Sequence[float], ranks: Ranks
) -> Iterator[tuple[dict[str, torch.Tensor], Any]]:
    """Each job's ``(tensors, extra)`` on every process, in job order: each job runs on one process (`assign`),
    the tensors of other processes' jobs arrive on `comm_device`. One process runs and yields them one at a time,
    so that it holds one job's results at once."""
    if not ranks.parallel:
        for job in jobs:
            yield job()
        return
    owners = assign(costs, ranks.world)
    done = {k: job() for k, job in enumerate(jobs) if owners[k] == ranks.rank}
    for k in range(len(jobs)):
        tensors, extra = done.pop(k, (None, None))
        yield share(tensors, extra, owners[k], ranks, comm_device(ranks))
