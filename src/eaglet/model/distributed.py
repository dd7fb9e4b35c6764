"""torch.distributed set-up for runs under torchrun (one process per GPU or CPU worker)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import EagletError


@dataclass(frozen=True)
class Dist:
    rank: int
    world: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def device(self, requested: str) -> str:
        """``auto`` -> this rank's GPU (cuda:LOCAL_RANK) when there is one, else cpu; anything else checked."""
        from .target import pick_device

        if requested != "auto":
            return pick_device(requested)
        if torch.cuda.is_available():
            if self.local_rank >= torch.cuda.device_count():
                raise EagletError(
                    f"process {self.local_rank} of this node has no GPU of its own: the node has "
                    f"{torch.cuda.device_count()}; start at most that many (torchrun --nproc-per-node) or pass "
                    "--device cpu"
                )
            return f"cuda:{self.local_rank}"
        return "cpu"


def all_reduce_sum(tensors: list[torch.Tensor], group: Dist) -> list[torch.Tensor]:
    """Each tensor summed over the ranks, in place (a plain run: unchanged)."""
    if group.world > 1:
        for tensor in tensors:
            dist.all_reduce(tensor)
    return tensors


def any_rank(flag: bool, group: Dist, device: torch.device) -> bool:
    """True on every rank when it is true on any: all ranks stop at the same step."""
    if group.world == 1:
        return flag
    value = torch.tensor([int(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def from_main(values: list[int], group: Dist, device: torch.device | str) -> list[int]:
    """Rank 0's integers on every rank: a choice made by timing, which ranks would otherwise make apart."""
    if group.world == 1:
        return values
    tensor = torch.tensor(values, dtype=torch.long, device=device)
    dist.broadcast(tensor, src=0)
    return tensor.tolist()


def init_distributed() -> Dist:
    """Join the process group torchrun describes in the environment; a plain run is rank 0 of 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    if dist.is_initialized():
        return Dist(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))
    return Dist(0, 1, 0)
