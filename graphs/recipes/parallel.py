"""Data-parallel training under `torchrun`: DistributedDataParallel over `gloo` (CPU) or `nccl` (CUDA).

Every process samples the same global batch from the same seeded generator and keeps its own slice
of rows; DDP averages the gradients. A loss that is a ratio over the batch (a mean over rows, a sum
over real tokens divided by their count) or a function of batch statistics (BudgetFormer's budget
hinge of the mean s) is computed from sums reduced over all processes (`total`, differentiable), so
every process computes the global batch's loss, and the averaged gradient is its gradient: the run
does not depend on the number of processes, up to the order of floating-point sums. One process
(world size 1) computes exactly what it computes without torchrun.
"""
from __future__ import annotations

import dataclasses
import os

import torch

from adaptex.graphs import parallel
from adaptex.graphs.errors import AdaptexError


class DataParallel:
    """The process group of a torchrun launch, or a single process (world 1) that changes nothing."""

    def __init__(self, world: int = 1, rank: int = 0, device: str = "cpu"):
        self.world, self.rank, self.device = world, rank, device

    @property
    def main(self) -> bool:
        """Rank 0: the process that shows progress and writes checkpoints and summaries."""
        return self.rank == 0

    @classmethod
    def from_env(cls) -> "DataParallel":
        """torchrun's WORLD_SIZE, RANK and LOCAL_RANK; a single process without them."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls()
        import torch.distributed as dist

        rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(local)
        if not dist.is_initialized():
            dist.init_process_group(backend="nccl" if cuda else "gloo")
        return cls(world, rank, f"cuda:{local}" if cuda else "cpu")

    def check_batch(self, batch_size: int) -> None:
        if batch_size % self.world:
            raise AdaptexError(f"--batch-size {batch_size} does not split over {self.world} processes; give a "
                               f"multiple of {self.world} (the global batch, the same for any number of processes)")

    def mine(self, v):
        """This process's rows of `v` (a tensor of the global batch, batch first); anything else as it is."""
        if self.world == 1 or not torch.is_tensor(v) or v.dim() == 0:
            return v
        self.check_batch(v.shape[0])
        b = v.shape[0] // self.world
        return v[self.rank * b:(self.rank + 1) * b]

    def rows(self, batch):
        """This process's rows of a global batch (a dataclass of tensors with the batch first)."""
        if self.world == 1:
            return batch
        return dataclasses.replace(batch, **{k: self.mine(v) for k, v in vars(batch).items()
                                             if not k.startswith("_")})

    def wrap(self, model: torch.nn.Module):
        """The module to call for training steps: DDP around `model` across processes, else `model`."""
        if self.world == 1:
            return model
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model)  # the training modes use every trainable parameter in every step

    def step(self):
        """The block of one training step: layers that draw noise draw this process's rows of it."""
        return parallel.rows_of(self.rank, self.world)

    def total(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of `t` over all processes, differentiable (each process's gradient of a loss made of
        totals is then the global loss's; DDP's averaging divides the N copies back)."""
        if self.world == 1:
            return t
        from torch.distributed.nn.functional import all_reduce

        return all_reduce(t)

    def mean_rows(self, per_row: torch.Tensor) -> torch.Tensor:
        """The mean of per-row values over the global batch."""
        if self.world == 1:
            return per_row.mean()
        return self.total(per_row.sum()) / (per_row.shape[0] * self.world)

    def ratio(self, num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
        """num / den of global sums (den clamped at 1: a batch with no real token)."""
        if self.world == 1:
            return num / den.clamp(min=1)
        return self.total(num) / self.total(den.detach()).clamp(min=1)

    def close(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
