"""Tracing: an adaptive model -> torch.export ExportedProgram whose adaptive parts are single
`adaptex::` nodes, with dynamic batch and sequence length and named decision outputs."""
from __future__ import annotations

import warnings

import torch
from torch import Tensor

import adaptex.graphs  # noqa: F401  (registers the adaptex ops)
from adaptex.exporter.errors import ExportError

INPUT_NAMES = ["input_ids", "attention_mask"]
DECISION_FIELDS = ("k", "head_mask", "s")  # per layer, in this order


def output_names(num_layers: int, adaptive: bool = True) -> list[str]:
    names = ["logits"]
    if adaptive:
        for i in range(num_layers):
            names += [f"decisions.layer{i}.{f}" for f in DECISION_FIELDS]
    return names


def decoder_input_names(num_layers: int) -> list[str]:
    """Optimum's decoder-with-past names: input_ids, attention_mask, past_key_values.{i}.key/value."""
    names = list(INPUT_NAMES)
    for i in range(num_layers):
        names += [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
    return names


def decoder_output_names(num_layers: int, adaptive: bool = True) -> list[str]:
    """logits, present.{i}.key/value, then per gated block l = 1..L-1 its keep decision and p."""
    names = ["logits"]
    for i in range(num_layers):
        names += [f"present.{i}.key", f"present.{i}.value"]
    if adaptive:
        for li in range(1, num_layers):
            names += [f"decisions.layer{li}.keep", f"decisions.layer{li}.p"]
    return names


ELASTIC_FIELDS = ("sa", "logits")  # per layer: head modes (B, H) bool, [FA, SA] logits (B, H, 2)


def elastic_output_names(num_layers: int, adaptive: bool = True) -> list[str]:
    names = ["sentence_embedding"]
    if adaptive:
        for i in range(num_layers):
            names += [f"decisions.layer{i}.{f}" for f in ELASTIC_FIELDS]
    return names


def elastic_decoder_io_names(num_layers: int, adaptive: bool = True) -> tuple[list[str], list[str]]:
    """The decoder's names plus head modes: inputs head_modes.{i} (used at decode steps), outputs
    decisions.layer{i}.sa and .logits (taken at prefill)."""
    inputs, outputs = decoder_input_names(num_layers), decoder_output_names(num_layers, adaptive=False)
    if adaptive:
        inputs += [f"head_modes.{i}" for i in range(num_layers)]
        for i in range(num_layers):
            outputs += [f"decisions.layer{i}.{f}" for f in ELASTIC_FIELDS]
    return inputs, outputs


def is_decoder(cfg) -> bool:
    """A decoder with a KV cache (prefill, then one step per token)."""
    return cfg.family in ("tsa", "elastic_decoder")


def io_names(cfg, mode: str = "hard") -> tuple[list[str], list[str]]:
    """(input names, output names) of a traced model of cfg's family."""
    adaptive = cfg.adaptive and mode not in ("dense", "full")
    if cfg.family == "elastic_decoder":
        return elastic_decoder_io_names(cfg.num_layers, adaptive)
    if cfg.family == "elastic":
        return list(INPUT_NAMES), elastic_output_names(cfg.num_layers, adaptive)
    if cfg.family == "tsa":
        return decoder_input_names(cfg.num_layers), decoder_output_names(cfg.num_layers, adaptive)
    return list(INPUT_NAMES), output_names(cfg.num_layers, adaptive)


class DecoderExportWrapper(torch.nn.Module):
    """A decoder with a KV cache as flat tensors in and out, in `io_names` order."""

    def __init__(self, model: torch.nn.Module, mode: str = "hard"):
        super().__init__()
        self.model, self.mode = model, mode

    def forward(self, input_ids: Tensor, attention_mask: Tensor, *past_flat: Tensor):
        L = self.model.cfg.num_layers
        past = [(past_flat[2 * i], past_flat[2 * i + 1]) for i in range(L)]
        kw = {}
        if len(past_flat) > 2 * L:  # an elastic decoder's head modes (decode steps)
            kw["head_modes"] = list(past_flat[2 * L:])
        logits, decisions, presents = self.model(input_ids, attention_mask, past=past, mode=self.mode, **kw)
        outs = [logits]
        for k, v in presents:
            outs += [k, v]
        fields = ELASTIC_FIELDS if self.model.cfg.family == "elastic_decoder" else ("keep", "p")
        for dec in decisions:
            outs += [dec[f] for f in fields]
        return tuple(outs)


def export_wrapper(model: torch.nn.Module, mode: str = "hard") -> torch.nn.Module:
    return (DecoderExportWrapper if is_decoder(model.cfg) else ExportWrapper)(model, mode).eval()


class ExportWrapper(torch.nn.Module):
    """Flat tuple outputs in `output_names` order; `mode` picks the attention implementation."""

    def __init__(self, model: torch.nn.Module, mode: str = "hard"):
        super().__init__()
        self.model, self.mode = model, mode

    def forward(self, input_ids: Tensor, attention_mask: Tensor):
        logits, decisions = self.model(input_ids, attention_mask, mode=self.mode)
        fields = ELASTIC_FIELDS if self.model.cfg.family == "elastic" else DECISION_FIELDS
        outs = [logits]
        for dec in decisions:
            outs += [dec[f] for f in fields if f in dec]
        return tuple(outs)


def example_inputs(cfg, batch: int = 2, seq: int = 16, mode: str = "hard") -> tuple[Tensor, ...]:
    if is_decoder(cfg):  # a step with a past of 3 tokens (not 0 or 1: those would specialise)
        seq, past = min(seq, cfg.max_len - 3), 3
        H, dh = cfg.num_heads, cfg.d_model // cfg.num_heads
        ids = torch.randint(1, cfg.vocab_size, (batch, seq))
        mask = torch.ones(batch, past + seq, dtype=torch.int64)
        modes = []
        if cfg.family == "elastic_decoder" and mode not in ("full", "dense"):
            modes = [torch.rand(batch, H) < 0.5 for _ in range(cfg.num_layers)]
        return (ids, mask, *[torch.randn(batch, H, past, dh) for _ in range(2 * cfg.num_layers)], *modes)
    ids = torch.randint(1, cfg.vocab_size, (batch, seq))
    mask = torch.ones(batch, seq, dtype=torch.int64)
    mask[-1, seq // 2:] = 0  # one padded row so the trace never assumes a full mask
    return ids, mask


def dynamic_shapes(cfg, mode: str = "hard"):
    batch = torch.export.Dim("batch", min=1, max=4096)
    seq = torch.export.Dim("sequence", min=1, max=cfg.max_len)
    if is_decoder(cfg):
        past = torch.export.Dim("past_sequence", min=0, max=cfg.max_len - 1)
        flat = [{0: batch, 2: past} for _ in range(2 * cfg.num_layers)]
        if cfg.family == "elastic_decoder" and mode not in ("full", "dense"):
            flat += [{0: batch} for _ in range(cfg.num_layers)]
        return {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: torch.export.Dim.AUTO},
                "past_flat": tuple(flat)}
    return {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}}


def float_mode_inputs(example: tuple, cfg) -> tuple:
    """An elastic decoder's example head_modes as float32 0/1 (Core ML has no bool features: its
    package takes back its own float32 decisions_layer{i}_sa outputs)."""
    n = 2 + 2 * cfg.num_layers
    return (*example[:n], *[m.float() for m in example[n:]]) if cfg.family == "elastic_decoder" else example


def trace(model: torch.nn.Module, mode: str = "hard", float_modes: bool = False) -> torch.export.ExportedProgram:
    """torch.export the model in inference mode with dynamic batch and sequence axes. float_modes:
    an elastic decoder's head_modes inputs as float32 0/1 (Core ML has no bool inputs)."""
    model.eval()
    wrapper = export_wrapper(model, mode)
    example = example_inputs(model.cfg, mode=mode)
    if float_modes:
        example = float_mode_inputs(example, model.cfg)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.export.export(wrapper, example, dynamic_shapes=dynamic_shapes(model.cfg, mode))
    except Exception as e:  # torch.export raises many types; the first line is the useful one
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ExportError(f"torch.export failed in mode {mode!r}: {first}") from e


def adaptex_nodes(ep: torch.export.ExportedProgram) -> list[torch.fx.Node]:
    """The adaptex:: custom-op nodes of a traced graph."""
    return [n for n in ep.graph.nodes
            if n.op == "call_function" and str(getattr(n.target, "namespace", "")) == "adaptex"]
