"""The eager PyTorch reference: the model's inference ("hard") mode, the parity reference."""
from __future__ import annotations

import numpy as np
import torch

from adaptex.exporter.trace import DECISION_FIELDS, INPUT_NAMES, io_names, is_decoder, output_names
from adaptex.runtimes.base import IOSpec, ModelLimits, Runner


class TorchRunner(Runner):
    name = "torch"

    def __init__(self, model: torch.nn.Module, mode: str = "hard"):
        super().__init__(ModelLimits(model.cfg.max_len, model.cfg.vocab_size))
        self.model, self.mode = model.eval(), mode
        self.decoder = is_decoder(model.cfg)
        self.elastic = model.cfg.family == "elastic"
        self.elastic_decoder = model.cfg.family == "elastic_decoder"
        self.inputs, self.names = io_names(model.cfg, mode)
        if not self.decoder and not self.elastic:
            self.names = output_names(model.cfg.num_layers, model.cfg.adaptive)

    def input_metadata(self) -> dict[str, IOSpec]:
        if self.decoder:
            cfg = self.model.cfg
            kv = ("batch", cfg.num_heads, "past_sequence", cfg.d_model // cfg.num_heads)
            return {n: IOSpec(n, "int64", ("batch", "sequence")) if n in INPUT_NAMES
                    else IOSpec(n, "bool", ("batch", cfg.num_heads)) if n.startswith("head_modes.")
                    else IOSpec(n, "float32", kv) for n in self.inputs}
        return {n: IOSpec(n, "int64", ("batch", "sequence")) for n in INPUT_NAMES}

    def _infer(self, feeds):
        return self.run_with_routing(feeds)[0]

    @torch.no_grad()
    def run_with_routing(self, feeds, force_masks: list[np.ndarray] | None = None):
        """Outputs by name, plus each router's preferences p (for decision margins).

        force_masks replays a given routing (per layer (B, H) head masks for BudgetFormer, per router
        (B, T) keep masks for TSA; None entries route as usual): parity uses it so that an excused
        decision flip does not show up again as a numeric error."""
        ids = torch.from_numpy(feeds["input_ids"])
        mask = torch.from_numpy(feeds["attention_mask"])
        fm = None if force_masks is None else [None if m is None else torch.from_numpy(m) for m in force_masks]
        if self.decoder:
            L = self.model.cfg.num_layers
            past = [(torch.from_numpy(feeds[f"past_key_values.{i}.key"]),
                     torch.from_numpy(feeds[f"past_key_values.{i}.value"])) for i in range(L)]
            if self.elastic_decoder:  # routing info: the [FA, SA] logit gap per head (the decision margin)
                modes = [torch.from_numpy(feeds[f"head_modes.{i}"]) for i in range(L)] if self.mode != "full" else None
                logits, decisions, presents = self.model(ids, mask, past=past, head_modes=modes, mode=self.mode,
                                                         force_sa=fm)
                outs = [logits] + [t for kv in presents for t in kv] + [t for d in decisions for t in (d["sa"], d["logits"])]
                gaps = [(d["logits"][..., 1] - d["logits"][..., 0]).abs().numpy() for d in decisions]
                return {n: t.numpy() for n, t in zip(self.names, outs)}, gaps
            logits, decisions, presents = self.model(ids, mask, past=past, mode=self.mode, force_keep=fm)
            outs = [logits] + [t for kv in presents for t in kv] + [t for d in decisions for t in (d["keep"], d["p"])]
            return {n: t.numpy() for n, t in zip(self.names, outs)}, [d["p"].numpy() for d in decisions]
        if self.elastic:  # routing info: the [FA, SA] logit gap per head (the decision margin)
            emb, decisions = self.model(ids, mask, mode=self.mode, force_sa=fm)
            outs = [emb] + [t for d in decisions for t in (d["sa"], d["logits"])]
            gaps = [(d["logits"][..., 1] - d["logits"][..., 0]).abs().numpy() for d in decisions]
            return {n: t.numpy() for n, t in zip(self.names, outs)}, gaps
        logits, decisions = self.model(ids, mask, mode=self.mode, force_masks=fm)
        outs = [logits] + [d[f] for d in decisions for f in DECISION_FIELDS if f in d]
        named = {n: t.numpy() for n, t in zip(self.names, outs)}
        return named, [d["p"].numpy() for d in decisions if "p" in d]
