"""Parity: an artifact against the eager reference on many inputs, decisions first, then values.

Nothing here knows a model family. The model's contract (graphs/family.py) names its decisions and
their kinds, walks each input (a decoder steps through its cache) and generates inputs where the
model has a generator; the caller's inputs serve otherwise. For each decision a flip is excused
only when the reference sat within a stated margin of the boundary, in the kind's own unit
(report.MARGIN_UNITS). Values are then compared with the artifact's routing replayed in the
reference wherever an excused flip happened, so one excused flip does not read as a numeric
failure; rows with an unexcused flip have already failed and their values are not compared.
"""
from __future__ import annotations

from typing import Callable, Iterable

import numpy as np

from adaptex.graphs import memory
from adaptex.graphs.errors import AdaptexError, InputError
from adaptex.graphs.family import PARITY_SCORES_PER_BATCH, Contract, Reference, family_contract
from adaptex.runtimes.base import Runner
from adaptex.runtimes.report import (FLIP_BOUNDS, MARGIN_UNITS, MARGINS, TOLERANCES, DecisionStat, OutputStat,
                                     ParityReport)
from adaptex.runtimes.torch_ref import TorchRunner


class ArtifactReference:
    """Another artifact as the reference of a check (`adaptex check A --against B`): its outputs are
    what A is compared with. The margins that excuse a flip come from the eager model (an artifact
    reports no margins), and a row with an excused flip is compared no further: an artifact cannot
    replay another's decisions, so its values there would differ by design."""

    replays = False

    def __init__(self, runner: Runner, eager: TorchRunner):
        self.runner, self.eager = runner, eager
        self.contract, self.mode, self.model = eager.contract, eager.mode, eager.model

    def input_metadata(self) -> dict:
        """The eager model's inputs: what --inputs are made to look like, for both artifacts."""
        return self.eager.input_metadata()

    def reference(self, feeds: dict, force: dict | None = None) -> Reference:
        e = self.eager.reference(feeds)
        specs = self.runner.input_metadata()
        out = self.runner.infer({n: np.asarray(a).astype(specs[n].dtype) for n, a in feeds.items() if n in specs})
        outputs = {n: (_like(np.asarray(out[n]), np.asarray(v)) if np.asarray(v).dtype == np.bool_
                       else np.asarray(out[n]).astype(np.asarray(v).dtype)) if n in out else v
                   for n, v in e.outputs.items()}
        return Reference(outputs, e.margins, e.aux)


def parity_inputs(cfg, task: str | None, samples: int, seed: int = 0) -> list[dict]:
    """A shipped family's generated parity inputs (its contract's)."""
    return family_contract(cfg).parity_items(task, samples, seed)


PARITY_CHUNK = 1000  # generated samples made at a time: inputs are streamed, never all built up front
LINE_BYTES = 256  # a failure line the report keeps, at most one per output and decision per batch


def _generated(contract: Contract, task: str | None, samples: int, seed: int) -> Iterable | None:
    """The contract's parity inputs, PARITY_CHUNK samples at a time (the first chunk is what
    parity_items(task, min(samples, PARITY_CHUNK), seed) gives); None when it has no generator."""
    first = contract.parity_items(task, min(samples, PARITY_CHUNK), seed)
    if first is None:
        return None

    def chunks():
        yield from first
        for done in range(PARITY_CHUNK, samples, PARITY_CHUNK):
            yield from contract.parity_items(task, min(PARITY_CHUNK, samples - done),
                                             seed * 1_000_003 + done // PARITY_CHUNK)
    return chunks() if first else []


def bound_samples(samples: int, lines_per_batch: int) -> None:
    """Refuse a --samples whose report could pass the memory limit (a failure line per output and
    decision of every batch, a batch as small as one sample)."""
    memory.require("--samples", samples, lambda n: n * lines_per_batch * LINE_BYTES,
                   "the report's failure lines (one per output and decision of each batch, at worst)")


def check(artifact: Runner, reference: TorchRunner, *, samples: int = 200, task: str | None = None,
          precision: str = "fp32", seed: int = 0, artifact_name: str = "", inputs: Iterable | None = None,
          atol: float | None = None, rtol: float | None = None, progress: Callable | None = None) -> ParityReport:
    """Compare `artifact` with `reference` on `inputs` (feed dicts by input name; default: the
    contract's generated inputs, `samples` sequences). atol/rtol override the precision's tolerance."""
    contract: Contract = reference.contract
    tol = dict(TOLERANCES[precision])
    tol.update({k: v for k, v in (("atol", atol), ("rtol", rtol)) if v is not None})
    kinds = {d.kind for d in contract.decisions(reference.mode)}
    margins = {k: v for k, v in MARGINS[precision].items() if k in kinds}
    report = ParityReport(artifact_name, artifact.name, precision, tol, margins, flip_bound=FLIP_BOUNDS.get(precision))
    if "MIL reference" in artifact.name:
        report.note = ("the saved ML program evaluated op by op in numpy (MIL reference evaluation), "
                       "not the Core ML runtime")
    meta = getattr(artifact, "meta", None) or {}
    if inputs is None:
        bound_samples(samples, len(meta.get("outputs") or []) + len(contract.decisions(reference.mode)) + 1)
    items = list(inputs) if inputs is not None else _generated(contract, task, samples, seed)
    if items is None:
        raise AdaptexError("this model has no parity input generator; pass its inputs (inputs=[...] in Python, "
                           "--inputs FILE.npz on the command line)")
    if not items:
        raise AdaptexError("no inputs to compare (an empty list); pass at least one batch, or let a shipped model "
                           "generate its own")
    missing = getattr(artifact, "unevaluable", lambda: [])()
    if missing:  # the MIL evaluation cannot compute these ops: say so rather than fail midway
        report.failures.append(f"MIL evaluation: no evaluator for {', '.join(missing)}; this package cannot be "
                               "checked on Linux (check it on macOS, where Core ML runs it)")
        return report
    if inputs is not None:  # the caller's arrays, made to look like generated ones (dtypes, byte order, size)
        want, heads, batched = reference.input_metadata(), _heads(reference), _batched_inputs(meta)
        items = [piece for item in items
                 for piece in (_bounded(conform(item, want), heads, batched) if isinstance(item, dict) else [item])]
    specs = artifact.input_metadata()
    axes = _batch_axes(meta)
    for bi, item in enumerate(items):
        walk = contract.steps(item)
        feeds, info = next(walk)
        report.samples += _batch(feeds)
        while True:
            report.batches += 1
            where = f"batch {bi} " + (info["where"] or _shape_note(feeds))
            got = artifact.infer({n: np.asarray(a).astype(specs[n].dtype) for n, a in feeds.items() if n in specs})
            report.failures += [f"{where}: {f}" for f in artifact.findings()]
            ref, bad = _decisions(report, contract, reference, feeds, info, got, where)
            decided = {d.name for d in contract.decisions(reference.mode)}
            rows = ~bad
            for name in ref.outputs:
                if name in decided:
                    continue
                if name not in got:
                    report.failures.append(f"{name}: the artifact has no such output (it gives {sorted(got)})")
                    continue
                axis = axes.get(name, 0)
                a = contract.select(name, _take(np.asarray(got[name]).astype(np.float64), rows, axis), feeds, info, rows)
                r = contract.select(name, _take(np.asarray(ref.outputs[name]).astype(np.float64), rows, axis),
                                    feeds, info, rows)
                _compare_values(report, name, a, r, where)
            if progress:
                progress(report)
            try:
                feeds, info = walk.send(ref)
            except StopIteration:
                break
    if report.flip_bound is not None and report.flip_rate > report.flip_bound:
        report.failures.append(f"{report.flip_rate:.4f} of the decisions flipped under {precision}, past the bound "
                               f"{report.flip_bound:g} (agreement {report.decision_agreement:.4f}); keep the routers "
                               "fp32 (no --quantize-routers) or quantize to more bits")
    report.ranges = getattr(artifact, "ranges", None)
    if report.ranges is not None:
        report.failures += [f"{name} ({r.op_type}): reaches {r.worst:.4g}, past fp16's 65504"
                            for name, r in report.ranges.over()]
    return report


def conform(feeds: dict, specs: dict) -> dict:
    """Feeds in the dtypes `specs` name (native byte order), converted only where no value changes:
    float ids 3.0 become 3, a float mask of 0.5 is refused (an InputError naming the fix)."""
    out = dict(feeds)
    for name, spec in specs.items():
        if name not in feeds:
            continue  # the artifact's validation names what is missing
        a = np.asarray(feeds[name])
        want = np.dtype(spec.dtype)
        if a.dtype.kind not in "biuf":
            raise InputError(f"{name}: dtype {a.dtype}, not numbers; pass {want.name} values")
        with np.errstate(invalid="ignore", over="ignore"):
            conv = a.astype(want)
            lossy = want.kind in "biu" and not np.array_equal(conv.astype(a.dtype), a)
        if lossy:
            bad = a[conv.astype(a.dtype) != a].ravel()[0].item()
            raise InputError(f"{name}: {a.dtype.name} values that are not {want.name} values (e.g. {bad}); pass "
                             f"{want.name} values")
        out[name] = conv
    return out


def _heads(reference) -> int:
    """The reference model's attention heads: its config's, else its widest layer's (1 if none says)."""
    h = getattr(getattr(reference.contract, "cfg", None), "num_heads", 0)
    if not h and reference.model is not None:
        h = max((m.num_heads for m in reference.model.modules() if isinstance(getattr(m, "num_heads", None), int)),
                default=0)
    return max(1, h or 1)


def _batched_inputs(meta: dict) -> set[str] | None:
    """The artifact's inputs whose first axis is the batch (None where its metadata names no inputs: all)."""
    inputs = meta.get("inputs")
    if not inputs:
        return None
    return {n for n, spec in inputs.items() if (spec.get("shape") or [None])[0] == "batch"}


def _bounded(item: dict, heads: int, batched: set[str] | None) -> list[dict]:
    """A caller's batch in runs of whole rows whose attention scores (rows x heads x keys^2, keys the
    longest 2-D batched input's length: a decoder's key mask spans its cache too) fit
    PARITY_SCORES_PER_BATCH, as generated batches do: --inputs of 8 rows of 4,096 tokens took a check
    of charlm-dense to 8.3 GB. Rows are independent, so the comparison is the same."""
    split = [n for n, a in item.items() if (batched is None or n in batched) and np.ndim(a) >= 1]
    if not split:
        return [item]
    rows = np.shape(item[split[0]])[0]
    keys = max((np.shape(item[n])[1] for n in split if np.ndim(item[n]) == 2), default=1)
    per = max(1, PARITY_SCORES_PER_BATCH // max(1, heads * keys * keys))  # keys 0: the runner names the empty input
    if rows <= per:
        return [item]
    return [{n: a[i:i + per] if n in split else a for n, a in item.items()} for i in range(0, rows, per)]


def _batch_axes(meta: dict) -> dict[str, int]:
    """Each output's batch axis (the one named 'batch' in the artifact's metadata; 0 by default)."""
    out = {}
    for name, spec in (meta.get("outputs") or {}).items():
        shape = spec.get("shape", [])
        out[name] = shape.index("batch") if "batch" in shape else (-1 if shape else 0)
    return out


def _take(values: np.ndarray, rows: np.ndarray, axis: int) -> np.ndarray:
    """The rows kept, along the output's batch axis (an output without one is compared whole)."""
    if axis < 0 or values.ndim == 0 or values.shape[axis] != len(rows):
        return values
    return np.take(values, np.flatnonzero(rows), axis=axis)


def _batch(feeds: dict) -> int:
    return int(np.asarray(next(iter(feeds.values()))).shape[0]) if feeds else 0


def _shape_note(feeds: dict) -> str:
    first = np.asarray(next(iter(feeds.values())))
    if first.ndim == 2:
        return f"(B={first.shape[0]}, T={first.shape[1]})"
    return f"(shape {list(first.shape)})"


def _decisions(report: ParityReport, contract: Contract, reference: TorchRunner, feeds: dict, info: dict,
               got: dict, where: str) -> tuple[Reference, np.ndarray]:
    """Count each decision's flips in order; replay the artifact's decision from an excused flip on.
    Returns the (replayed) reference and the rows with an unexcused flip."""
    ref = reference.reference(feeds)
    bad = np.zeros(_batch(feeds), dtype=bool)
    force: dict[str, np.ndarray] = {}
    specs = contract.decisions(reference.mode)
    pending: dict[str, np.ndarray] = {}  # a layer's replays, applied once all its decisions are checked
    for i, d in enumerate(specs):
        if d.name not in got:
            report.failures.append(f"{d.name}: the artifact has no such decision output (it gives {sorted(got)})")
            continue
        r = np.asarray(ref.outputs[d.name])
        g = _like(np.asarray(got[d.name]), r)
        region = contract.decision_region(d.name, feeds, info)
        if d.kind == "head_set":
            k_got = _like(np.asarray(got[d.k_name]), np.asarray(ref.outputs[d.k_name])) if d.k_name in got else r.sum(-1)
            k_flip = k_got != np.asarray(ref.outputs[d.k_name]) if d.k_name else np.zeros(len(r), bool)
            p = ref.aux[d.name]["p"]
            # the head set must be the top k_got of the reference's preferences, whichever k was used:
            # an excused k flip does not excuse a wrong set
            expect = np.where(k_flip[:, None], _top_k_mask(p, k_got), r)
            flip = (expect != g).any(-1)
            margin = _mask_margin(p, k_got)
        else:
            flip = r != g
            margin = ref.margins[d.name]
            if region is not None:
                flip = flip & region
        limit = report.margins[d.kind]
        ok = margin < limit
        if report.flip_bound is not None:  # quantized: a flip is counted (excused or not) and replayed
            st = report.decisions.setdefault(d.name, DecisionStat(kind=d.kind))
            st.count(flip, ok, region)
            ok = np.ones_like(ok, dtype=bool)
        st = report.decisions.setdefault(d.name, DecisionStat(kind=d.kind))
        if report.flip_bound is None:
            st.count(flip, ok, region)
        _count_values(st, d.kind, g, region)
        for idx in zip(*np.nonzero(flip & ~ok)):
            bad[idx[0]] = True
            at = f"row {idx[0]}" + (f" {'head' if d.kind == 'head_mode' else 'token'} {idx[1]}" if len(idx) > 1 else "")
            m = float(margin[idx])
            why = (f"the reference's {MARGIN_UNITS[d.kind]} was {m:.2e}; a margin of {m:.2e} would excuse it "
                   f"(stated margin {limit:g})" if np.isfinite(m) else
                   "the decision was an input of this call, so the artifact must pass it through")
            report.failures.append(f"{d.name}: unexcused flip at {where} {at}: reference {_show(r[idx])} vs artifact "
                                   f"{_show(g[idx])}; {why}")
        if (flip & ok).any() and not getattr(reference, "replays", True):
            bad |= (flip & ok).reshape(len(bad), -1).any(-1)  # another artifact: compare those rows no further
        elif (flip & ok).any():
            # replay the artifact's decision from here on, so later layers and the values are compared
            # on what the artifact actually computed (a budget is replayed through its head set)
            target = next((s for s in specs if s.kind == "head_set" and s.k_name == d.name), d)
            if target.name in got:
                pending[target.name] = _like(np.asarray(got[target.name]), np.asarray(ref.outputs[target.name]))
        if pending and (i + 1 == len(specs) or specs[i + 1].path != d.path):
            force.update(pending)
            pending = {}
            ref = reference.reference(feeds, force=dict(force))
    return ref, bad


def _like(got: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """The artifact's decision in the reference's dtype (Core ML gives bools as float32 0/1)."""
    if ref.dtype == np.bool_:
        return got > 0.5 if got.dtype.kind == "f" else got.astype(bool)
    return got.astype(ref.dtype)


def _show(v) -> str:
    v = np.asarray(v)
    return str(v.tolist()) if v.ndim else str(v.item())


def _count_values(st: DecisionStat, kind: str, g: np.ndarray, region) -> None:
    if kind == "budget":
        for v in g.tolist():
            st.values_seen[v] = st.values_seen.get(v, 0) + 1
    elif kind == "keep":
        w = np.ones_like(g, bool) if region is None else region
        for v in (0, 1):
            st.values_seen[v] = st.values_seen.get(v, 0) + int(((g == bool(v)) & w).sum())
    elif kind == "head_mode":
        n = int(g.sum())
        st.values_seen["SA"] = st.values_seen.get("SA", 0) + n
        st.values_seen["FA"] = st.values_seen.get("FA", 0) + g.size - n


def _mask_margin(p: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Gap between the k-th and (k+1)-th largest preference per row (inf when k = H)."""
    srt = -np.sort(-p.astype(np.float64), axis=-1)
    H = p.shape[-1]
    kk = np.clip(k, 1, H)
    kth = srt[np.arange(len(p)), kk - 1]
    nxt = np.where(kk < H, srt[np.arange(len(p)), np.minimum(kk, H - 1)], -np.inf)
    return kth - nxt


def _top_k_mask(p: np.ndarray, k: np.ndarray) -> np.ndarray:
    """(B, H) mask of the k largest preferences per row, ties to the lower index."""
    order = np.argsort(-p.astype(np.float64), axis=-1, kind="stable")
    ranks = np.empty_like(order)
    np.put_along_axis(ranks, order, np.arange(p.shape[-1])[None, :].repeat(len(p), 0), axis=-1)
    return ranks < k[:, None]


def _compare_values(report: ParityReport, name: str, a: np.ndarray, r: np.ndarray, where: str) -> None:
    """Fold one output's artifact values `a` against the reference `r` into the report."""
    tol = report.tolerance
    st = report.outputs.setdefault(name, OutputStat())
    if a.size == 0:
        return
    if a.shape != r.shape:
        report.failures.append(f"{name}: shape {list(a.shape)} at {where}, the reference's is {list(r.shape)}")
        return
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        err = np.abs(a - r)
        finite = bool(np.isfinite(err).all())
        if not finite:  # NaN or Inf on either side: every figure of this output is inf, as printed
            report.failures.append(f"{name}: non-finite values at {where} (the artifact's or the reference's)")
            err = np.where(np.isfinite(err), err, np.inf)
        need = float(np.max(err - tol["rtol"] * np.abs(r))) if finite else float("inf")
        rel = float((err / np.maximum(np.abs(r), 1e-12)).max()) if finite else float("inf")
        if tol.get("of_largest") and finite:  # a quantized artifact's: atol as a fraction of the largest |value|
            # an error within the absolute floor passes whatever the values' size (bf16: a score near 0)
            need = 0.0 if need <= tol.get("floor", 0.0) else need / max(float(np.abs(r).max()), 1e-12)
    if err.max() > st.max_abs_err:
        st.max_abs_err, st.worst_input = float(err.max()), where
    st.max_rel_err = max(st.max_rel_err, rel)
    st.needed_atol = max(st.needed_atol, need)
    if need > tol["atol"]:
        of = " of the largest |value|" if tol.get("of_largest") else ""
        of += f" (or {tol['floor']:g})" if tol.get("floor") else ""
        report.failures.append(f"{name}: error {err.max():.3e} at {where} exceeds atol={tol['atol']:g}{of} "
                               f"rtol={tol['rtol']:g}; the smallest atol that passes is {need:.3e}{of}")
