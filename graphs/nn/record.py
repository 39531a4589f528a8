"""Decisions of adaptive layers: their modes, their recording and their replay (see graphs.nn)."""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch.nn as nn
from torch import Tensor

import adaptex.graphs.ops  # noqa: F401  (registers the ops and their facts)
from adaptex.graphs.errors import InputError
from adaptex.graphs.ops.facts import decision_kinds

# What each decision field is, for parity (runtimes.checks): a flip of a field of kind
#   budget     is excused when |s*H - round(s*H)| is below the margin (k, heads per sample)
#   head_set   when the gap between the k-th and (k+1)-th head preference is (the heads chosen)
#   keep       when |p - threshold| is (a TSA token's keep)
#   head_mode  when the router's |SA - FA logit| is (an elastic head's mode; never when the modes
#              were an input, as at a decoder's decode steps)
# Other recorded fields (s, p, logits) are values, compared like any output.
# recorded field -> decision kind, as the ops declare them (graphs/ops/<op>.py, FACTS)
DECISION_KINDS = decision_kinds()
SOFT_MODES = ("soft", "st")


# --- decisions: recording and replay ----------------------------------------------------------------

class Recorder:
    """The decisions of one forward pass, per layer path: values, margins and replays."""

    def __init__(self, force: dict[str, dict[str, Tensor]] | None = None):
        self.decisions: dict[str, dict[str, Tensor]] = {}  # path -> field -> tensor, in call order
        self.margins: dict[str, dict[str, Tensor]] = {}  # path -> decision field -> distance to the boundary
        self.aux: dict[str, dict[str, Tensor]] = {}  # path -> what a margin needs besides (head preferences)
        self.force = force or {}

    def record(self, path: str, values: dict, margins: dict | None = None, aux: dict | None = None) -> None:
        if path in self.decisions:  # one layer called twice in a forward (shared weights)
            n = 1
            while f"{path}.call{n}" in self.decisions:
                n += 1
            path = f"{path}.call{n}"
        self.decisions[path] = dict(values)
        self.margins[path] = dict(margins or {})
        self.aux[path] = dict(aux or {})

    def forced(self, path: str, field: str) -> Tensor | None:
        return self.force.get(path, {}).get(field)

    def flat(self) -> dict[str, Tensor]:
        """Every recorded field as `decisions.<path>.<field>`, in call order."""
        return {f"decisions.{p}.{f}": t for p, fields in self.decisions.items() for f, t in fields.items()}


_RECORDERS: list[Recorder] = []
_MODES: list[str] = []


def name_layers(model: nn.Module) -> None:
    """Give every adaptive layer of `model` its module path (what its decisions are recorded under)."""
    for name, m in model.named_modules():
        if isinstance(m, AdaptiveLayer):
            m.adaptex_path = name or type(m).__name__


@contextlib.contextmanager
def record_decisions(model: nn.Module | None = None, force: dict | None = None) -> Iterator[Recorder]:
    """Record the decisions of every adaptive layer called inside the block (named by their module
    path in `model`); `force` {path: {field: tensor}} replays given decisions instead of routing."""
    if model is not None:
        name_layers(model)
    rec = Recorder(force)
    _RECORDERS.append(rec)
    try:
        yield rec
    finally:
        _RECORDERS.remove(rec)


@contextlib.contextmanager
def adaptive_mode(mode: str) -> Iterator[None]:
    """Run every adaptive layer in `mode` (soft, st, hard, naive, dense) inside the block, whatever
    model.training says."""
    mode = ALIASES.get(mode, mode)
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    _MODES.append(mode)
    try:
        yield
    finally:
        _MODES.pop()


@contextlib.contextmanager
def _pushed(stack: list[bool], enabled: bool) -> Iterator[None]:
    """`enabled` on top of a tracing flag's stack for the block (the flag reads the top)."""
    stack.append(enabled)
    try:
        yield
    finally:
        stack.pop()


def _top(stack: list[bool]) -> bool:
    return bool(stack and stack[-1])


@contextlib.contextmanager
def traced_control_flow(enabled: bool = True) -> Iterator[None]:
    """Inside the block, a layer being traced may put data-dependent control flow in the graph
    (torch.cond: an ONNX `If`) to skip work at run time. The exporter enables it for targets whose
    runtime runs an `If` as such (ONNX Runtime); elsewhere layers trace a select of both results
    (the same values, without the saving)."""
    with _pushed(_CONTROL_FLOW, enabled):
        yield


def control_flow_traced() -> bool:
    """Whether a layer traced now may emit torch.cond (see traced_control_flow)."""
    return _top(_CONTROL_FLOW)


_CONTROL_FLOW: list[bool] = []

MODES = ("soft", "st", "hard", "naive", "dense", "eager")
# the shipped families' older names: hard decisions computed densely, and no routing at all
ALIASES = {"hard_dense": "naive", "full": "dense"}


def _resolve(mode: str | None, training: bool) -> str:
    if mode is None:
        mode = _MODES[-1] if _MODES else ("soft" if training else "hard")
    return ALIASES.get(mode, mode)


class AdaptiveLayer:
    """What every layer that takes decisions shares (a mixin beside nn.Module): its mode and its
    recording."""

    adaptex_path: str = ""

    def resolve_mode(self, mode: str | None) -> str:
        return _resolve(mode, self.training)

    def forced(self, field: str) -> Tensor | None:
        return _RECORDERS[-1].forced(self.adaptex_path or type(self).__name__, field) if _RECORDERS else None

    def record(self, values: dict, margins: dict | None = None, aux: dict | None = None) -> None:
        if _RECORDERS:
            _RECORDERS[-1].record(self.adaptex_path or type(self).__name__, values, margins, aux)




def check_inputs(layer: str, x: Tensor, mask: Tensor | None, width: int | None, rank: int = 3,
                 names: tuple[str, str] = ("x", "mask"), finite: bool = True, weights=None) -> None:
    """One InputError for what a layer cannot take, before torch meets it (eager calls only: traced
    and exported calls see fake tensors, whose shapes the export already checked): a feature tensor
    not floating point, of another rank or width, a mask that does not match its leading axes, or
    NaN/Inf features (routing ranks and gathers on them, and a NaN index crashes), or features of
    another floating dtype than `weights` (a tensor of the layer's)."""
    import torch

    if type(x) is not torch.Tensor or torch.compiler.is_compiling() or torch.jit.is_tracing():
        return
    xn, mn = names
    if not x.is_floating_point():
        raise InputError(f"{layer}: {xn} has dtype {x.dtype}; pass floating-point features (e.g. x.float())")
    if weights is not None and x.dtype != weights.dtype:
        raise InputError(f"{layer}: {xn} has dtype {x.dtype} and the layer's weights {weights.dtype}; pass "
                         f"{xn}.to({weights.dtype}) or convert the model with .to({x.dtype})")
    if x.dim() != rank or (width is not None and x.shape[-1] != width):
        want = ", ".join(["B", "T", "H", "dh"][:rank - 1] + [str(width) if width is not None else "d"])
        raise InputError(f"{layer}: {xn} has shape {list(x.shape)}; this layer takes ({want})")
    if mask is not None and type(mask) is torch.Tensor:
        lead = (x.shape[0], x.shape[-2]) if rank == 4 else tuple(x.shape[:2])
        if tuple(mask.shape) != lead:
            raise InputError(f"{layer}: {mn} has shape {list(mask.shape)}, {xn} {list(x.shape)}; pass a mask of "
                             f"shape {list(lead)} (1 or True for a real token)")
        if mask.is_floating_point() or mask.is_complex():
            raise InputError(f"{layer}: {mn} has dtype {mask.dtype}; pass a bool or integer 0/1 mask")
    if finite and not bool(torch.isfinite(x).all()):
        raise InputError(f"{layer}: {xn} holds NaN or Inf; the router ranks its heads on these features, so pass "
                         "finite values (check the layers before it)")
