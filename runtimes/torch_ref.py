"""The eager PyTorch reference: a model in its inference ("hard") mode, the parity reference."""
from __future__ import annotations

import numpy as np
import torch

from adaptex.graphs.family import Contract, Reference, family_contract
from adaptex.runtimes.base import IOSpec, ModelLimits, Runner

_DTYPES = {torch.int64: "int64", torch.int32: "int32", torch.float32: "float32", torch.bool: "bool",
           torch.float16: "float16"}


class TorchRunner(Runner):
    """Runs a model through its contract (a shipped family's, found by its config, or the one given);
    `reference(feeds, force)` also returns each decision's margin and replays forced decisions."""

    name = "torch"

    def __init__(self, model: torch.nn.Module, mode: str = "hard", contract: Contract | None = None):
        self.contract = contract or family_contract(model)
        c = self.contract
        limits = ModelLimits(c.max_sequence, c.vocab_size) if c.max_sequence and c.vocab_size else None
        super().__init__(limits)
        self.model, self.mode = model.eval(), mode

    def input_metadata(self) -> dict[str, IOSpec]:
        example = self.contract.example_inputs(self.mode)
        # axis names of its own per input: the eager model checks its inputs' agreement itself
        return {n: IOSpec(n, _DTYPES.get(t.dtype, str(t.dtype)), tuple(f"{n}_{i}" for i in range(t.dim())))
                for n, t in zip(self.contract.input_names(self.mode), example)}

    def _infer(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.reference(feeds).outputs

    def reference(self, feeds: dict[str, np.ndarray], force: dict[str, np.ndarray] | None = None) -> Reference:
        return self.contract.reference(self.model, feeds, self.mode, force)
