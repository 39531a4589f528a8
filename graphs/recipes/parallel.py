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


def _units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """What FSDP gathers as one: each block of a layer stack (an nn.ModuleList's items). FSDP gathers
    a unit when its forward is called, so a block that is only a container (no forward of its own:
    the model calls its layers one by one, as the Hugging Face decoders' wrappers do) is replaced by
    its children, by the same rule."""
    def split(m: torch.nn.Module) -> list[torch.nn.Module]:
        if next(m.parameters(), None) is None:
            return []
        if type(m).forward is not torch.nn.Module.forward:
            return [m]
        return [u for c in m.children() for u in split(c)]

    units = [u for m in model.modules() if isinstance(m, torch.nn.ModuleList) for b in m for u in split(b)]
    return list({id(u): u for u in units}.values())  # a stack within a container's children: once


class DataParallel:
    """The process group of a torchrun launch, or a single process (world 1) that changes nothing.

    shard: FSDP (torch.distributed.fsdp.fully_shard) instead of DDP. Each process then holds 1/N of
    every parameter (and of its gradient and optimiser state), gathered block by block for the
    forward and backward passes; the model's state is gathered whole, in CPU memory and on rank 0
    only, where a checkpoint is written."""

    def __init__(self, world: int = 1, rank: int = 0, device: str = "cpu", shard: bool = False):
        self.world, self.rank, self.device = world, rank, device
        self.shard = shard and world > 1

    @property
    def sharded(self) -> bool:
        return self.shard

    @property
    def main(self) -> bool:
        """Rank 0: the process that shows progress and writes checkpoints and summaries."""
        return self.rank == 0

    @classmethod
    def from_env(cls, shard: bool = False) -> "DataParallel":
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
        return cls(world, rank, f"cuda:{local}" if cuda else "cpu", shard)

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
        """The module to call for training steps: DDP around `model` across processes, `model` itself
        sharded in place (FSDP) with shard, else `model`. Make the optimiser after this: sharding
        replaces the parameters."""
        if self.world == 1:
            return model
        if self.shard:
            from torch.distributed.fsdp import fully_shard

            for unit in reversed(_units(model)):  # innermost first, then the rest of the model
                fully_shard(unit)
            fully_shard(model)
            return model
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model)  # the training modes use every trainable parameter in every step

    # --- a sharded model's state, whole ----------------------------------------------------------
    def gather(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The model's whole state dict: with shard, gathered from every process (call it in all of
        them) into CPU tensors on rank 0, empty elsewhere; else its own state dict."""
        if not self.shard:
            return model.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        parallel.reshard(model)
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load(self, model: torch.nn.Module, state: dict[str, torch.Tensor]):
        """Whole tensors (the same in every process) into the model, sharded as it is; strict=False,
        returning (missing, unexpected) as load_state_dict does."""
        if not self.shard:
            return model.load_state_dict(state, strict=False)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        parallel.reshard(model)  # torch distributes the dict it is given in place: give it a copy
        return set_model_state_dict(model, dict(state), options=StateDictOptions(full_state_dict=True, strict=False))

    def optimizer_state(self, model: torch.nn.Module, opt) -> dict:
        """The optimiser's state dict; with shard its whole state keyed by parameter name, on rank 0."""
        if not self.shard:
            return opt.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        parallel.reshard(model)
        return get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_optimizer(self, model: torch.nn.Module, opt, state: dict) -> None:
        if not self.shard:
            opt.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        parallel.reshard(model)
        set_optimizer_state_dict(model, opt, state, options=StateDictOptions(full_state_dict=True))

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
