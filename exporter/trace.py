"""Tracing: an adaptive model -> torch.export ExportedProgram whose adaptive parts are single
`adaptex::` nodes, with dynamic batch and sequence length and named decision outputs."""
from __future__ import annotations

import warnings

import torch
from torch import Tensor

import graphs  # noqa: F401  (registers the adaptex ops)
from exporter.errors import ExportError

INPUT_NAMES = ["input_ids", "attention_mask"]
DECISION_FIELDS = ("k", "head_mask", "s")  # per layer, in this order


def output_names(num_layers: int, adaptive: bool = True) -> list[str]:
    names = ["logits"]
    if adaptive:
        for i in range(num_layers):
            names += [f"decisions.layer{i}.{f}" for f in DECISION_FIELDS]
    return names


class ExportWrapper(torch.nn.Module):
    """Flat tuple outputs in `output_names` order; `mode` picks the attention implementation."""

    def __init__(self, model: torch.nn.Module, mode: str = "hard"):
        super().__init__()
        self.model, self.mode = model, mode

    def forward(self, input_ids: Tensor, attention_mask: Tensor):
        logits, decisions = self.model(input_ids, attention_mask, mode=self.mode)
        outs = [logits]
        for dec in decisions:
            outs += [dec[f] for f in DECISION_FIELDS if f in dec]
        return tuple(outs)


def example_inputs(cfg, batch: int = 2, seq: int = 16) -> tuple[Tensor, Tensor]:
    ids = torch.randint(1, cfg.vocab_size, (batch, seq))
    mask = torch.ones(batch, seq, dtype=torch.int64)
    mask[-1, seq // 2:] = 0  # one padded row so the trace never assumes a full mask
    return ids, mask


def dynamic_shapes(cfg):
    batch = torch.export.Dim("batch", min=1, max=4096)
    seq = torch.export.Dim("sequence", min=1, max=cfg.max_len)
    return {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}}


def trace(model: torch.nn.Module, mode: str = "hard") -> torch.export.ExportedProgram:
    """torch.export the model in inference mode with dynamic batch and sequence axes."""
    model.eval()
    wrapper = ExportWrapper(model, mode).eval()
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.export.export(wrapper, example_inputs(model.cfg), dynamic_shapes=dynamic_shapes(model.cfg))
    except Exception as e:  # torch.export raises many types; the first line is the useful one
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ExportError(f"torch.export failed in mode {mode!r}: {first}") from e


def adaptex_nodes(ep: torch.export.ExportedProgram) -> list[torch.fx.Node]:
    """The adaptex:: custom-op nodes of a traced graph."""
    return [n for n in ep.graph.nodes
            if n.op == "call_function" and str(getattr(n.target, "namespace", "")) == "adaptex"]
