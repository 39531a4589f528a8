"""Contracts: what the exporter, parity and bench need to know about a model, so that they never
ask which model it is.

A `Contract` holds a model's I/O: the names of its inputs and outputs, the decisions among the
outputs (which adaptive layer took each, of what kind), example inputs and dynamic shapes for
tracing, and how to call the model with flat inputs and get flat outputs back. Decisions come from
the adaptive layers' recorder (graphs/nn.py), the same way for every model.

- `GenericContract.from_model(model, example_inputs)`: any `nn.Module` built from adaptex.nn
  layers. Its inputs are the forward's arguments, its outputs what forward returns plus every
  decision, named `decisions.<module path>.<field>`.
- A shipped family's contract (beside its model, e.g. graphs/budgetformer.py) subclasses Contract
  with the family's own names (`decisions.layer0.k`), its parity and bench inputs, its FLOP model,
  its counterpart modes and its training recipe; `family_contract(model)` finds it by the model's
  config, `FAMILIES` by name.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np
import torch
from torch import Tensor

from adaptex.graphs.errors import AdaptexError, InputError
from adaptex.graphs.nn import ConditionalBlock, adaptive_mode, name_layers, record_decisions
from adaptex.graphs.ops.facts import decision_kinds
from adaptex.graphs.user_io import Call, dynamic_shapes_for, flatten_outputs, split_example

ADAPTIVE_MODES = ("hard", "naive", "hard_dense", "eager")  # modes whose graphs carry decision outputs

# A parity batch's attention scores (batch x heads x keys^2) at most this many, generated or the caller's:
# a check holds a few such tensors at once in the reference, the runtime and the MIL evaluator.
# charlm-dense's 8 rows of 4,096 tokens (2^29 scores) took `adaptex check` on ONNX to a 7.5 GB peak.
PARITY_SCORES_PER_BATCH = 1 << 26


@dataclass(frozen=True)
class DecisionSpec:
    """One decision output: its name, its kind (the op's facts: graphs/ops/facts.py), the layer that takes it
    (module path, the recorder's key) and the field. A head_set names the budget it is the top-k of."""
    name: str
    kind: str
    path: str
    field: str
    k_name: str | None = None


@dataclass(frozen=True)
class RecordedOutput:
    """An output taken from the recorder: a decision or a recorded value (s, p, logits)."""
    name: str
    path: str
    field: str


@dataclass
class Reference:
    """One eager run: outputs by name, each decision's distance to its boundary, and what a
    head_set's check needs besides (the head preferences p), by decision name."""
    outputs: dict[str, np.ndarray]
    margins: dict[str, np.ndarray] = field(default_factory=dict)
    aux: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)


@dataclass
class Original:
    """A pretrained checkpoint's own module, wrapped to take the artifact's inputs and give its first
    output: what a user exports without adaptex (bench times it as a dense candidate)."""
    module: torch.nn.Module
    example: tuple
    dynamic_shapes: tuple
    input_names: list[str]
    output_names: list[str]
    source: str  # e.g. "transformers BertModel from <dir> + mean pooling"
    model_type: str = "bert"  # for ONNX Runtime's transformer optimizer
    num_heads: int = 0
    hidden_size: int = 0
    legacy_module: torch.nn.Module | None = None  # for the legacy exporter, if not `module` (eager attention)
    legacy_source: str = ""


class Contract:
    """A model's I/O contract. Subclasses fill in the family-specific parts; the defaults suit a
    model whose inputs the caller supplies (no parity or bench input generator, no FLOP model)."""

    family = "custom"
    config_cls = model_cls = None  # a shipped family's config dataclass and model (checkpoints load them)
    decoder = False  # prefill then decode steps over a KV cache
    decode_graph = False  # ONNX exports of a decoder: a decode-step graph too by default (--decode-graph)
    # the programs (calls of one kind) whose trace the model shapes itself, given `program=` in call()
    traced_programs: tuple[str, ...] = ()
    recipe: str | None = None  # its module in graphs/recipes/: `adaptex train FAMILY` runs it (recipes())
    counterpart_modes = {"dense": "dense", "naive": "naive"}  # bench: the mode each counterpart exports
    ort_model_type = "bert"  # bench: the model_type ONNX Runtime's transformer optimizer tries on the dense graph
    coreml_default_precision = "fp16"
    # what an fp16 Core ML package keeps in fp32 besides the routing (exporter.targets.coreml.precision)
    coreml_fp32_roles: tuple[str, ...] = ()

    def __init__(self, cfg=None):
        self.cfg = cfg

    # --- I/O ---------------------------------------------------------------------------------------
    def input_names(self, mode: str = "hard") -> list[str]:
        raise NotImplementedError

    def model_output_names(self, mode: str = "hard") -> list[str]:
        """The outputs of the model itself, before the recorded ones."""
        raise NotImplementedError

    def recorded(self, mode: str = "hard") -> list[RecordedOutput]:
        """The outputs taken from the recorder (none in the dense modes, which take no decisions)."""
        raise NotImplementedError

    def output_names(self, mode: str = "hard") -> list[str]:
        return self.model_output_names(mode) + [r.name for r in self.recorded(mode)]

    def decisions(self, mode: str = "hard") -> list[DecisionSpec]:
        """The recorded outputs that are decisions, with their kinds (in output order)."""
        out, by_path = [], {}
        for r in self.recorded(mode):
            by_path.setdefault(r.path, {})[r.field] = r.name
        kinds = decision_kinds()  # as the ops declare them, an op registered later included
        for r in self.recorded(mode):
            kind = kinds.get(r.field)
            if kind:
                out.append(DecisionSpec(r.name, kind, r.path, r.field,
                                        k_name=by_path[r.path].get("k") if kind == "head_set" else None))
        return out

    def call(self, model: torch.nn.Module, inputs: tuple, mode: str) -> tuple:
        """Run the model on flat inputs (input_names order); flat outputs (model_output_names order)."""
        raise NotImplementedError

    def example_inputs(self, mode: str = "hard") -> tuple:
        raise NotImplementedError

    def dynamic_shapes(self, mode: str = "hard"):
        raise NotImplementedError

    def axis_names(self, mode: str = "hard") -> dict[str, dict[int, str]]:
        """Axis names the dynamic shapes cannot give: {input name: {axis: name or expression}}."""
        return {}

    # --- what the exporter traces, and what parity compares against ----------------------------------
    def wrapper(self, model: torch.nn.Module, mode: str = "hard", program: str | None = None) -> torch.nn.Module:
        """The module torch.export traces; program (one of traced_programs): the call kind it is traced for."""
        return ContractWrapper(model, self, mode, program).eval()

    @torch.no_grad()
    def reference(self, model: torch.nn.Module, feeds: dict[str, np.ndarray], mode: str = "hard",
                  force: dict[str, np.ndarray] | None = None) -> Reference:
        """Run eager on `feeds` (numpy, by input name); `force` {decision name: array} replays decisions."""
        model.eval()
        specs = {d.name: d for d in self.decisions(mode)}
        forced: dict = {}
        for name, arr in (force or {}).items():
            d = specs[name]
            forced.setdefault(d.path, {})[d.field] = torch.from_numpy(np.asarray(arr))
        inputs = tuple(torch.from_numpy(np.ascontiguousarray(feeds[n])) for n in self.input_names(mode))
        with record_decisions(model, force=forced) as rec:
            outs = self.call(model, inputs, mode)
        named = dict(zip(self.model_output_names(mode), outs))
        for r in self.recorded(mode):
            named[r.name] = _recorded(rec, r)
        margins, aux = {}, {}
        for d in specs.values():
            m = rec.margins.get(d.path, {}).get(d.field)
            if m is not None:
                margins[d.name] = m.double().numpy()
            aux[d.name] = {k: v.float().numpy() for k, v in rec.aux.get(d.path, {}).items()}
        return Reference({n: t.detach().numpy() for n, t in named.items()}, margins, aux)

    # --- family knowledge (a user model has none of these) -------------------------------------------
    def short_call_keys(self) -> int | None:
        """Decoders with a short-call program (traced_programs' "short"): the most tokens a
        prefill may have to run it; None for models without one."""
        return None

    def masked_call_keys(self, policy=None) -> int | None:
        """Decoders with a masked short-call program (traced_programs' "masked"): the most tokens a
        prefill may have to run it at any batch (more than short_call_keys()); None for models without one."""
        return None

    def masked_call_excess(self, policy=None) -> dict | None:
        """Decoders with a masked short-call program: {"heads", "beyond", "up_to"}, where longer prefills
        also run it, batch x heads x keys x max(0, keys - beyond) <= up_to; None for none."""
        return None

    @property
    def max_sequence(self) -> int | None:
        return getattr(self.cfg, "max_len", None)

    @property
    def vocab_size(self) -> int | None:
        return getattr(self.cfg, "vocab_size", None)

    def config_dict(self) -> dict:
        return self.cfg.to_dict() if self.cfg is not None else {}

    def routing_meta(self) -> dict:
        return {}

    def io_descriptions(self) -> dict[str, str]:
        """A one-line description of each input and output, for artifacts (ONNX doc_string, Core ML)."""
        return {}

    def parity_items(self, task: str | None, samples: int, seed: int = 0) -> list | None:
        """Generated parity inputs, or None: the caller must supply them."""
        return None

    def bench_feeds(self, task: str | None, batch: int, seq: int, past: int = 0, seed: int = 0) -> dict | None:
        return None

    def original(self, model: torch.nn.Module):
        """Where the model wraps a pretrained checkpoint: that checkpoint's own module as an
        Original (bench times its stock export as a dense candidate), else None."""
        return None

    def flops(self, outputs: dict, variant: str, seq: int, past: int = 0, target: str = "onnx",
              policy=None) -> dict | None:
        """{'flop_ratio', 'executed_flop_ratio', and a summary of the decisions}, or None. `target`
        is the artifact's (its lowerings may execute differently: ONNX Runtime's dispatch at run time)."""
        return None

    # --- how parity walks an input (one call; a decoder steps through its cache) -----------------------
    def steps(self, item: dict) -> Iterator[tuple[dict, dict]]:
        """Yield (feeds, info) for each call an input makes; receives each call's Reference back
        (a decoder builds the next step's cache from it). One call by default."""
        yield item, {"where": ""}

    def select(self, name: str, values: np.ndarray, feeds: dict, info: dict, rows: np.ndarray) -> np.ndarray:
        """The part of an output parity compares (a decoder drops its padding tokens); `rows` are the
        batch rows kept."""
        return values

    def decision_region(self, name: str, feeds: dict, info: dict) -> np.ndarray | None:
        """Where a decision's flips count (a decoder's real tokens), or None for everywhere."""
        return None


def _recorded(rec, r: RecordedOutput) -> Tensor:
    try:
        return rec.decisions[r.path][r.field]
    except KeyError:
        raise AdaptexError(f"the model recorded no {r.field!r} at {r.path!r} (it recorded "
                           f"{sorted(rec.decisions)}); was the layer called in this forward?") from None


class ContractWrapper(torch.nn.Module):
    """A model with flat tensors in and out, in its contract's order: what torch.export traces."""

    def __init__(self, model: torch.nn.Module, contract: Contract, mode: str = "hard", program: str | None = None):
        super().__init__()
        if program is not None and program not in contract.traced_programs:
            raise AdaptexError(f"a {contract.family} model has no {program!r} program to trace")
        self.model, self.contract, self.mode, self.program = model, contract, mode, program
        name_layers(model)

    def forward(self, *inputs: Tensor):
        program = {} if self.program is None else {"program": self.program}
        with record_decisions() as rec:
            outs = self.contract.call(self.model, inputs, self.mode, **program)
        return tuple(outs) + tuple(_recorded(rec, r) for r in self.contract.recorded(self.mode))


# --- a user's model ---------------------------------------------------------------------------------

class GenericContract(Contract):
    """The contract of any model built from adaptex.nn layers, derived by running it once on its
    example inputs: inputs from the forward's signature, outputs from its return value, decisions
    from what its adaptive layers record (named by module path)."""

    family = "custom"

    def __init__(self, input_names: list[str], output_names: list[str], recorded: list[RecordedOutput],
                 example: tuple, dynamic: tuple | None, structure: Callable, model_name: str = ""):
        super().__init__(None)
        self._inputs, self._outputs, self._recorded = list(input_names), list(output_names), list(recorded)
        self._example, self._dynamic, self._structure = example, dynamic, structure
        self.model_name = model_name
        self._call = Call(list(input_names), len(input_names))

    @classmethod
    def from_model(cls, model: torch.nn.Module, example_inputs, dynamic_shapes=None,
                   input_names: list[str] | None = None, example_kwargs: dict | None = None,
                   call: Call | None = None) -> "GenericContract":
        """example_inputs: a tensor, a tuple of tensors (positional) or a dict by argument name;
        example_kwargs: more keyword arguments (a non-tensor one is a constant of every call);
        dynamic_shapes: any of torch.export's forms (graphs.user_io.dynamic_shapes_for). call: how the
        flat inputs call the model (an artifact's, when check rebuilds the contract)."""
        if call is None:
            example, call = split_example(model, example_inputs, example_kwargs, input_names)
        else:
            example = tuple(example_inputs)
        model.eval()
        name_layers(model)
        with torch.no_grad(), adaptive_mode("hard"), record_decisions() as rec:
            try:
                out = call(model, example)
            except AdaptexError:
                raise
            except Exception as e:  # the model's own code refused the example: the inputs' fault, not a bug
                shapes = ", ".join(f"{n} {list(t.shape)} {str(t.dtype).removeprefix('torch.')}"
                                   for n, t in zip(call.names, example) if isinstance(t, Tensor))
                first = (str(e).strip().splitlines() or [""])[0]
                raise InputError(f"the model's forward raised {type(e).__name__} ({first}) on the example inputs "
                                 f"({shapes}); give example inputs of the shapes and dtypes it takes") from e
        names, _ = flatten_outputs(out)
        recorded = [RecordedOutput(f"decisions.{p}.{f}", p, f) for p, fields in rec.decisions.items() for f in fields]
        clash = set(names) & {r.name for r in recorded}
        if clash:
            raise AdaptexError(f"the model's outputs {sorted(clash)} clash with its decision names; rename them")
        dynamic = dynamic_shapes_for(dynamic_shapes, call.names, example)
        contract = cls(call.names, names, recorded, example, dynamic, lambda o: flatten_outputs(o)[1],
                       type(model).__name__)
        contract._call = call
        if any(isinstance(m, ConditionalBlock) for m in model.modules()):
            # a decoder of TSA blocks: its residual stream and norms stay fp32 in an fp16 Core ML package
            # (standard mixed precision; an fp16 residual stream compounds over the blocks), and fp32
            # is its default there, as for the shipped TSA decoders
            contract.coreml_fp32_roles = ("residual_stream",)
            contract.coreml_default_precision = "fp32"
        return contract

    def input_names(self, mode: str = "hard") -> list[str]:
        return list(self._inputs)

    def model_output_names(self, mode: str = "hard") -> list[str]:
        return list(self._outputs)

    def recorded(self, mode: str = "hard") -> list[RecordedOutput]:
        return list(self._recorded) if mode in ADAPTIVE_MODES else []

    def call(self, model, inputs, mode):
        with adaptive_mode(mode):
            return tuple(self._structure(self._call(model, tuple(inputs))))

    def example_inputs(self, mode: str = "hard") -> tuple:
        return self._example

    def dynamic_shapes(self, mode: str = "hard"):
        return (self._dynamic,)  # the wrapper takes *inputs: one positional entry holding them all

    def to_meta(self) -> dict:
        return {"model": self.model_name, **self._call.to_meta()}


def _dynamic_axes(spec, rank: int) -> set[int]:
    """The axes a normalised dynamic-shapes entry for one input marks dynamic (a dict by axis, or a
    tuple/list per axis; None, an int or Dim.STATIC: static)."""
    if spec is None:
        return set()
    items = spec.items() if isinstance(spec, dict) else enumerate(spec) if isinstance(spec, (tuple, list)) else ()
    static = getattr(torch.export.Dim, "STATIC", None)
    return {int(a) for a, d in items if d is not None and not isinstance(d, int) and d is not static and
            0 <= int(a) < rank}


def refuse_unexportable_examples(names: list[str], example: tuple, dynamic: tuple | None,
                                 explicit: bool = False) -> None:
    """An export's example inputs (once its dynamic shapes are normalised; a check's inputs may be of
    any size) that cannot export a usable artifact, refused before tracing: an axis of size 0
    (ONNX Runtime then refuses the file), or a size of 1 on an axis meant to be dynamic (torch.export
    fixes it to 1: the artifact would take only that size). Without explicit dynamic_shapes, the batch
    and length axes (0, 1) are the ones meant to be dynamic."""
    axis_name = {0: ("batch", "batch >= 2"), 1: ("length", "length >= 2")}
    specs = tuple(dynamic) if isinstance(dynamic, (tuple, list)) else (None,) * len(example)
    for name, t, spec in zip(names, example, specs + (None,) * (len(example) - len(specs))):
        for axis, size in enumerate(t.shape):
            what, fix = axis_name.get(axis, (f"axis {axis}", f"axis {axis} >= 2"))
            if size == 0:
                raise InputError(f"{name}: the example has {what} 0 (shape {list(t.shape)}), which exports an artifact "
                                 f"no runtime loads; pass an example of {fix}")
        dyn = _dynamic_axes(spec, t.dim()) if explicit else ({0, 1} & _dynamic_axes(spec, t.dim()))
        for axis in sorted(dyn):
            if t.shape[axis] == 1:
                what, fix = axis_name.get(axis, (f"axis {axis}", f"axis {axis} >= 2"))
                raise InputError(f"{name}: the example has {what} 1 (shape {list(t.shape)}) on an axis meant to be "
                                 f"dynamic, and torch.export fixes a size of 1; pass an example of {fix}, or mark "
                                 f"the axis static in dynamic_shapes")


# --- shipped families --------------------------------------------------------------------------------

FAMILIES: dict[str, type[Contract]] = {}


def register_family(cls: type[Contract]) -> type[Contract]:
    """Class decorator: a shipped family's contract, found by its config's `family` field."""
    FAMILIES[cls.family] = cls
    return cls


def family_contract(model_or_cfg) -> Contract:
    """The contract of a shipped family's model (or config)."""
    cfg = getattr(model_or_cfg, "cfg", model_or_cfg)
    name = getattr(cfg, "family", None)
    load_families()
    if name not in FAMILIES:
        raise AdaptexError(f"no family contract for {name!r}; known: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[name](cfg)


def contract_for(model: torch.nn.Module, example_inputs=None, dynamic_shapes=None,
                 input_names: list[str] | None = None, example_kwargs: dict | None = None) -> Contract:
    """A shipped family's contract when the model is one (and no example inputs are given), else the
    generic contract derived from the model and its example inputs."""
    cfg = getattr(model, "cfg", None)
    load_families()
    if example_inputs is None and not example_kwargs:
        if getattr(cfg, "family", None) in FAMILIES:
            return family_contract(cfg)
        raise InputError("example_inputs are needed to export a model of your own (a tuple with one tensor per "
                         "forward argument, batch >= 2)")
    return GenericContract.from_model(model, () if example_inputs is None else example_inputs, dynamic_shapes,
                                      input_names, example_kwargs)


def load_families() -> None:
    # the family modules register their contracts when imported
    from adaptex.graphs import budgetformer, elastic, elastic_decoder, tsa  # noqa: F401
