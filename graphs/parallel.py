"""Which rows of a data-parallel global batch this process holds, for the layers that draw noise,
and the one step a sharded (FSDP) model needs before its weights are read or changed.

A layer that draws exploration noise per sample (BudgetFormer's score noise, Elastic's Gumbel
samples) asks `batch_noise` for it: outside data-parallel training that is the draw itself; inside,
every process draws the noise of the whole global batch from its (identically seeded) generator and
keeps its own rows, so a sample's noise does not depend on the number of processes.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch

_shard: tuple[int, int] | None = None  # (rank, world) while a data-parallel step runs


@contextlib.contextmanager
def rows_of(rank: int, world: int) -> Iterator[None]:
    """Within the block, this process holds rows [rank * b, (rank + 1) * b) of a global batch of world * b."""
    global _shard
    before, _shard = _shard, ((rank, world) if world > 1 else None)
    try:
        yield
    finally:
        _shard = before


def batch_noise(shape: tuple[int, ...], draw: Callable[[tuple[int, ...]], torch.Tensor]) -> torch.Tensor:
    """draw(shape), or this process's rows of draw(global shape) in data-parallel training."""
    if _shard is None:
        return draw(tuple(shape))
    rank, world = _shard
    b = shape[0]
    return draw((b * world, *shape[1:]))[rank * b:(rank + 1) * b]


def reshard(model: torch.nn.Module) -> None:
    """Free the gathered parameters of a model sharded with FSDP (fully_shard), so that its state
    dict, a change to its weights and its next forward all see the sharded parameters. The outermost
    sharded module keeps its gathered parameters after a forward; nothing else does. A model that is
    not sharded is left as it is."""
    import sys

    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None:  # nothing was ever sharded in this process
        return
    for m in model.modules():
        if isinstance(m, fsdp.FSDPModule):
            m.reshard()
