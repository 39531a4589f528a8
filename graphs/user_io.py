"""A model of your own's inputs and outputs as torch.export takes them: example arguments (positional
and keyword), `dynamic_shapes` in each of torch.export's forms, and the forward's return value
flattened to named tensors. graphs/family.py's GenericContract is built from these."""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from adaptex.graphs.errors import AdaptexError, InputError

# a keyword argument that is not a tensor is a constant of the call: traced in, recorded, replayed
CONSTANT_TYPES = (bool, int, float, str, type(None))

DYNAMIC_FORMS = ("dynamic_shapes takes torch.export's forms: a dict keyed by argument name ({name}), or a tuple "
                 "or list with one entry per argument; each entry None (static), {{axis: Dim}} or a tuple/list "
                 "with one Dim per axis, where a Dim is torch.export.Dim('name', min=, max=), Dim.AUTO, "
                 "Dim.DYNAMIC, Dim.STATIC or None")


@dataclass
class Call:
    """How the flat inputs (in `names` order) call the model: the first `positional` by position, the
    rest by keyword, with `constants` (non-tensor keyword arguments) added to every call."""
    names: list[str]
    positional: int
    constants: dict[str, Any] = field(default_factory=dict)

    def __call__(self, model: torch.nn.Module, inputs: tuple):
        kwargs = dict(zip(self.names[self.positional:], inputs[self.positional:]))
        return model(*inputs[:self.positional], **kwargs, **self.constants)

    def to_meta(self) -> dict:
        """What `check` needs to call the model again ({} for positional arguments alone)."""
        if self.positional == len(self.names) and not self.constants:
            return {}
        return {"call": {"keyword": self.names[self.positional:], "constants": dict(self.constants)}}

    @classmethod
    def from_meta(cls, names: list[str], meta: dict) -> "Call":
        call = meta.get("call") or {}
        keyword = call.get("keyword") or []
        constants = call.get("constants") or {}
        if not (isinstance(keyword, list) and all(k in names for k in keyword) and isinstance(constants, dict)
                and all(isinstance(v, CONSTANT_TYPES) for v in constants.values())):
            raise AdaptexError("the artifact's metadata 'call' is malformed (keyword: input names, constants: "
                               "numbers, strings, booleans or null); re-export it with adaptex")
        return cls(list(names), len(names) - len(keyword), dict(constants))


def split_example(model: torch.nn.Module, example_inputs, example_kwargs: dict | None,
                  input_names: list[str] | None) -> tuple[tuple, Call]:
    """(the flat example tensors, the Call that feeds them): example_inputs a tensor, a tuple or list of
    tensors (positional) or a dict by argument name (keywords); example_kwargs more keywords, where
    a non-tensor value (None, a bool, a number, a string) is a constant of every call."""
    if isinstance(example_inputs, Tensor):
        args, kwargs = (example_inputs,), {}
    elif isinstance(example_inputs, (tuple, list)):
        args, kwargs = tuple(example_inputs), {}
    elif isinstance(example_inputs, dict):
        args, kwargs = (), dict(example_inputs)
    else:
        raise InputError(f"example_inputs is a {type(example_inputs).__name__}: give a tensor, a tuple of tensors "
                         "(one per forward argument) or a dict of tensors by argument name")
    for k, v in (example_kwargs or {}).items():
        if k in kwargs:
            raise InputError(f"keyword argument {k!r} given twice (in example_inputs and example_kwargs)")
        kwargs[k] = v
    if not all(isinstance(t, Tensor) for t in args):
        raise InputError("example_inputs must be a tensor or a tuple of tensors, one per forward argument")
    tensors = {k: v for k, v in kwargs.items() if isinstance(v, Tensor)}
    constants = {k: v for k, v in kwargs.items() if not isinstance(v, Tensor)}
    odd = [k for k, v in constants.items() if not isinstance(v, CONSTANT_TYPES)]
    if odd:
        raise InputError(f"keyword argument {odd[0]!r} is a {type(constants[odd[0]]).__name__}; keyword arguments are "
                         "tensors (inputs) or None, booleans, numbers and strings (constants of the call)")
    if input_names is None:
        params = [p for p in inspect.signature(model.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        input_names = [p.name for p in params[:len(args)]]
        input_names += [f"input_{i}" for i in range(len(input_names), len(args))]
        input_names += list(tensors)
        clash = set(input_names[:len(args)]) & set(kwargs)
        if clash:
            raise InputError(f"argument {sorted(clash)[0]!r} given both by position and by keyword")
    example = args + tuple(tensors.values())
    if len(input_names) != len(example):
        raise InputError(f"{len(input_names)} input names for {len(example)} example inputs")
    return example, Call(list(input_names), len(args), constants)


def _dim_ok(d) -> bool:
    hint = torch.export.dynamic_shapes._DimHint
    return d is None or isinstance(d, (torch.export.Dim, hint)) or (isinstance(d, int) and not isinstance(d, bool))


def dynamic_shapes_for(dynamic_shapes, names: list[str], example: tuple) -> tuple:
    """One spec per flat input (names order), from any of torch.export's forms; an argument the caller
    left out (or the default, None) gets every axis Dim.AUTO. A form that is none of them: InputError."""
    forms = DYNAMIC_FORMS.format(name=", ".join(names))
    if dynamic_shapes is None:
        return auto_dynamic(example)
    if isinstance(dynamic_shapes, dict):
        unknown = [k for k in dynamic_shapes if k not in names]
        if unknown:
            raise InputError(f"dynamic_shapes names {unknown[0]!r}, not an argument of the model's forward; "
                             + forms)
        specs = [dynamic_shapes.get(n, _AUTO) for n in names]
    elif isinstance(dynamic_shapes, (tuple, list)):
        if len(dynamic_shapes) != len(names):
            raise InputError(f"dynamic_shapes has {len(dynamic_shapes)} entries for {len(names)} arguments; "
                             + forms)
        specs = list(dynamic_shapes)
    else:
        raise InputError(f"dynamic_shapes is a {type(dynamic_shapes).__name__}; " + forms)
    out = []
    for name, spec, t in zip(names, specs, example):
        if spec is _AUTO:
            out.append({i: torch.export.Dim.AUTO for i in range(t.dim())})
            continue
        if isinstance(spec, (tuple, list)):
            if len(spec) != t.dim():
                raise InputError(f"dynamic_shapes[{name!r}] has {len(spec)} axes; {name} has {t.dim()}; " + forms)
            spec = dict(enumerate(spec))
        if spec is not None and not isinstance(spec, dict):
            raise InputError(f"dynamic_shapes[{name!r}] is a {type(spec).__name__}; " + forms)
        for axis, d in (spec or {}).items():
            if not isinstance(axis, int) or isinstance(axis, bool) or not -t.dim() <= axis < t.dim() or not _dim_ok(d):
                raise InputError(f"dynamic_shapes[{name!r}][{axis!r}] = {d!r} (on a {t.dim()}-axis tensor); " + forms)
        out.append({axis % t.dim(): d for axis, d in spec.items() if d is not None} if spec else None)
    return tuple(out)


_AUTO = object()  # an argument the dynamic_shapes dict leaves out


def auto_dynamic(example: tuple) -> tuple:
    """Every axis dynamic where tracing allows (torch.export's Dim.AUTO): an axis the model ties to a
    weight (a feature width) stays static, batch and sequence axes stay free. AUTO specialises a
    size of 0 or 1, so give example inputs of batch >= 2."""
    return tuple({i: torch.export.Dim.AUTO for i in range(t.dim())} for t in example)


def flatten_outputs(out: Any, prefix: str = "output") -> tuple[list[str], list[Tensor]]:
    """A forward's return value as (names, tensors): a tensor is `output`, a tuple `output.0`...,
    a dict its keys (nested containers joined with dots); None entries are left out."""
    if isinstance(out, Tensor):
        return [prefix], [out]
    if isinstance(out, dict):
        items = [(f"{k}" if prefix == "output" else f"{prefix}.{k}", v) for k, v in out.items()]
    elif isinstance(out, (tuple, list)):
        items = [(f"{prefix}.{i}", v) for i, v in enumerate(out)]
    else:
        raise AdaptexError(f"the model returned a {type(out).__name__} at {prefix!r}; adaptex exports models that "
                           "return a tensor, or tuples, lists and dicts of tensors (nested)")
    names, tensors = [], []
    for name, v in items:
        if v is None:
            continue
        n, t = flatten_outputs(v, name)
        names += n
        tensors += t
    return names, tensors
