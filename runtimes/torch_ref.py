"""The eager PyTorch reference: the model's inference ("hard") mode, the parity reference."""
from __future__ import annotations

import numpy as np
import torch

from exporter.trace import DECISION_FIELDS, INPUT_NAMES, output_names
from runtimes.base import IOSpec, ModelLimits, Runner


class TorchRunner(Runner):
    name = "torch"

    def __init__(self, model: torch.nn.Module, mode: str = "hard"):
        super().__init__(ModelLimits(model.cfg.max_len, model.cfg.vocab_size))
        self.model, self.mode = model.eval(), mode
        self.names = output_names(model.cfg.num_layers, model.cfg.adaptive)

    def input_metadata(self) -> dict[str, IOSpec]:
        return {n: IOSpec(n, "int64", ("batch", "sequence")) for n in INPUT_NAMES}

    def _infer(self, feeds):
        return self.run_with_routing(feeds)[0]

    @torch.no_grad()
    def run_with_routing(self, feeds, force_masks: list[np.ndarray] | None = None):
        """Outputs by name, plus each layer's head preferences p (for decision margins).

        force_masks replays a given routing (per layer (B, H) bool, or None to route as usual): parity uses it so that an
        excused decision flip does not show up again as a numeric error."""
        ids = torch.from_numpy(feeds["input_ids"])
        mask = torch.from_numpy(feeds["attention_mask"])
        fm = None if force_masks is None else [None if m is None else torch.from_numpy(m) for m in force_masks]
        logits, decisions = self.model(ids, mask, mode=self.mode, force_masks=fm)
        outs = [logits] + [d[f] for d in decisions for f in DECISION_FIELDS if f in d]
        named = {n: t.numpy() for n, t in zip(self.names, outs)}
        return named, [d["p"].numpy() for d in decisions if "p" in d]
