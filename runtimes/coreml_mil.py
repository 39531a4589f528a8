"""Linux-side check of a saved Core ML package: the ML program loaded back from disk and evaluated
op by op in numpy, in the program's own precision.

fp16 ops take and give fp16 values. By default they accumulate products, sums and normalisation
statistics in fp32, as Core ML's CPU and GPU kernels are believed to; `accumulate="fp16"` evaluates
the worst case, everything in fp16 (runtimes/fp16.py), which is what a package that may run on the
Neural Engine must survive. This is a MIL reference evaluation, not the Core ML runtime: it proves
the saved program computes what the eager model computes; it does not prove how Core ML schedules
it. The ops of adaptex's lowerings have their evaluators here, ordinary layers' ops in
runtimes/coreml_mil_layers.py, and any other op falls back to coremltools' own value inference; an
op none of them computes is listed by `unevaluable`, and a check reports it rather than evaluating.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from adaptex.exporter.targets.coreml.package import load_spec, package_meta, read_package_meta  # noqa: F401
from adaptex.graphs.errors import AdaptexError
from adaptex.runtimes import fp16
from adaptex.runtimes.base import IOSpec, Runner, limits_of

_erf = np.vectorize(math.erf, otypes=[np.float64])
DT = {"fp32": np.float32, "fp16": np.float16, "int32": np.int32, "bool": np.bool_, "int64": np.int64,
      "int16": np.int16, "uint16": np.uint16, "int8": np.int8, "uint8": np.uint8}

def _axes(a, nd):
    return sorted(int(x) % nd for x in np.atleast_1d(a))

def _slice(x, begin, end, stride=None, begin_mask=None, end_mask=None, squeeze_mask=None):
    n = x.ndim; sl = []
    stride = np.ones(n, int) if stride is None else stride
    for i in range(n):
        if squeeze_mask is not None and squeeze_mask[i]:  # MIL: a squeezed axis takes element begin[i], end is ignored
            b = int(begin[i])
            sl.append(slice(b, b + 1 if b != -1 else None))
            continue
        b = None if (begin_mask is not None and begin_mask[i]) else int(begin[i])
        e = None if (end_mask is not None and end_mask[i]) else int(end[i])
        sl.append(slice(b, e, int(stride[i])))
    out = x[tuple(sl)]
    if squeeze_mask is not None and any(squeeze_mask):
        out = np.squeeze(out, axis=tuple(i for i, m in enumerate(squeeze_mask) if m))
    return out

_ACCUMULATE = ["fp32"]  # the evaluation's accumulation, set by run()


def _worst(*xs) -> bool:
    """Evaluate in fp16 arithmetic: the worst case was asked for and the op computes in fp16."""
    return _ACCUMULATE[-1] == "fp16" and any(getattr(x, "dtype", None) == np.float16 for x in xs)


def _ln(x, axes=None, gamma=None, beta=None, epsilon=1e-5):
    if _worst(x):  # mean and variance summed in fp16
        ax = tuple(_axes(axes, x.ndim))
        n = np.float16(np.prod([x.shape[a] for a in ax]))
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            m = fp16.sum16(x, ax, keepdims=True) / n
            d = (x - m).astype(np.float16)
            v = fp16.sum16(d * d, ax, keepdims=True) / n
            y = d / np.sqrt(v + np.float16(epsilon))
            return (y * (1 if gamma is None else gamma.astype(np.float16)) + (0 if beta is None else beta.astype(np.float16))).astype(np.float16)
    x32 = x.astype(np.float32)
    ax = tuple(_axes(axes, x.ndim)); m = x32.mean(ax, keepdims=True); v = ((x32 - m) ** 2).mean(ax, keepdims=True)
    y = (x32 - m) / np.sqrt(v + np.float32(epsilon))
    return (y * (1 if gamma is None else gamma) + (0 if beta is None else beta)).astype(x.dtype)

def _gelu(x, mode="EXACT"):
    """MIL gelu in each of its modes (GPT-2's gelu_new converts to TANH_APPROXIMATION)."""
    x64 = x.astype(np.float64)
    if mode == "TANH_APPROXIMATION":
        y = 0.5 * x64 * (1 + np.tanh(math.sqrt(2 / math.pi) * (x64 + 0.044715 * x64 ** 3)))
    elif mode == "SIGMOID_APPROXIMATION":
        y = x64 / (1 + np.exp(-1.702 * x64))
    else:
        y = 0.5 * x64 * (1 + _erf(x64 / math.sqrt(2)))
    return y.astype(x.dtype)

def _softmax(x, axis=-1):
    if _worst(x):  # the sum of exps in fp16
        with np.errstate(over="ignore", invalid="ignore"):
            e = np.exp(x - x.max(axis, keepdims=True)).astype(np.float16)
            return (e / fp16.sum16(e, axis, keepdims=True)).astype(np.float16)
    x32 = x.astype(np.float32)
    e = np.exp(x32 - x32.max(axis, keepdims=True)); return (e / e.sum(axis, keepdims=True)).astype(x.dtype)


def _gather_nd(x, indices, batch_dims=0, validate_indices=False):
    """x[indices[..., 0], ..., indices[..., K-1]]: shape indices.shape[:-1] + x.shape[K:] (batch_dims 0)."""
    if int(batch_dims) != 0:
        raise AdaptexError("MIL evaluation: gather_nd with batch_dims > 0 has no numpy evaluator")
    return x[tuple(np.moveaxis(indices.astype(np.int64), -1, 0))]


_SCATTER = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide, "max": np.maximum,
            "min": np.minimum}


def _scatter_nd(data, indices, updates, mode="add", validate_indices=False):
    """A copy of data with updates written (mode update) or combined (add, sub, ...) at indices."""
    out = np.array(data, copy=True)
    where = tuple(np.moveaxis(indices.astype(np.int64), -1, 0))
    updates = np.asarray(updates, dtype=out.dtype)
    if mode == "update":
        out[where] = updates
    else:
        _SCATTER[mode].at(out, where, updates)
    return out


def _cumsum(x, axis=0, exclusive=False, reverse=False):
    """Running sum along axis (fp16 accumulates in fp32, in fp16 in the worst case); exclusive drops
    the element itself."""
    x32 = x.astype(np.float32) if x.dtype == np.float16 and not _worst(x) else x
    if reverse:
        x32 = np.flip(x32, int(axis))
    out = np.cumsum(x32, axis=int(axis))
    if exclusive:
        out = out - x32
    if reverse:
        out = np.flip(out, int(axis))
    return out.astype(x.dtype)


def _reduce_l2_norm(x, axes=None, keep_dims=False):
    """sqrt(sum(x^2)) over axes, accumulated in fp32 (an elastic encoder's L2-normalised embedding)."""
    ax = tuple(_axes(axes, x.ndim)) if axes is not None else None
    if _worst(x):
        with np.errstate(over="ignore", invalid="ignore"):
            return np.sqrt(fp16.sum16(x * x, ax, bool(keep_dims))).astype(np.float16)
    x32 = x.astype(np.float32)
    return np.sqrt(np.sum(x32 * x32, axis=ax, keepdims=bool(keep_dims))).astype(x.dtype)


def _floor_div(x, y):
    """Elementwise floor(x / y): integer floor division for ints (block counts), floor of the quotient for floats."""
    if np.issubdtype(np.result_type(x, y), np.integer):
        return np.floor_divide(x, y)
    return np.floor(x / y)


def _argmax(x, axis, keep_dims, output_dtype="int32"):
    """MIL reduce_argmax: the first largest along `axis` (an elastic router's [FA, SA] choice)."""
    out = np.argmax(x, axis=int(axis))
    return (np.expand_dims(out, int(axis)) if keep_dims else out).astype(DT.get(str(output_dtype), np.int32))


def _reduce(fn, x, axes, keep_dims):
    """A reduction accumulated in fp32 for fp16 inputs (fp16 in the worst case), in the input's dtype."""
    ax = tuple(_axes(axes, x.ndim)) if axes is not None else None
    if _worst(x) and fn in (np.sum, np.mean):
        total = fp16.sum16(x, ax, keep_dims)
        n = np.float16(x.size // max(total.size, 1)) if fn is np.mean else None
        return (total / n).astype(np.float16) if n is not None else total
    acc = x.astype(np.float32) if x.dtype == np.float16 else x
    return np.asarray(fn(acc, axis=ax, keepdims=bool(keep_dims))).astype(x.dtype)


def _band_part(x, lower: int, upper: int):
    """Keep the band lower below and upper above the diagonal of the last two axes (-1: all)."""
    r = np.arange(x.shape[-2])[:, None]
    c = np.arange(x.shape[-1])[None, :]
    keep = ((lower < 0) | (r - c <= lower)) & ((upper < 0) | (c - r <= upper))
    return np.where(keep, x, x.dtype.type(0))


def _slice_by_size(x, begin, size):
    return x[tuple(slice(int(b), None if int(n) == -1 else int(b) + int(n)) for b, n in zip(begin, size))]


def _mm(a, b, out_dtype):
    """Products accumulate in fp32 and round to the op's dtype (fp16 all through in the worst case)."""
    if _worst(a, b):
        return fp16.matmul16(a, b).astype(out_dtype)
    return np.matmul(a.astype(np.float32), b.astype(np.float32)).astype(out_dtype)


EVAL = {
    "cast": lambda x, dtype: x.astype(DT[dtype]),
    "expand_dims": lambda x, axes: np.expand_dims(x, tuple(int(a) if a >= 0 else int(a) + x.ndim + len(np.atleast_1d(axes)) for a in np.atleast_1d(axes))),
    "squeeze": lambda x, axes=None: np.squeeze(x) if axes is None else np.squeeze(x, axis=tuple(_axes(axes, x.ndim))),
    "linear": lambda x, weight, bias=None: (_mm(x, weight.T, np.float32) + (0 if bias is None else bias)).astype(x.dtype),
    "mul": lambda x, y: x * y, "add": lambda x, y: x + y, "sub": lambda x, y: x - y, "real_div": lambda x, y: x / y,
    "maximum": lambda x, y: np.maximum(x, y), "minimum": lambda x, y: np.minimum(x, y), "less": lambda x, y: x < y, "greater": lambda x, y: x > y,
    "greater_equal": lambda x, y: x >= y, "less_equal": lambda x, y: x <= y, "equal": lambda x, y: x == y,
    "not_equal": lambda x, y: x != y, "floor_div": _floor_div, "cumsum": _cumsum, "reduce_l2_norm": _reduce_l2_norm,
    "tile": lambda x, reps: np.tile(x, [int(r) for r in reps]),
    "logical_not": lambda x: np.logical_not(x), "logical_and": lambda x, y: np.logical_and(x, y),
    "logical_or": lambda x, y: np.logical_or(x, y),
    "logical_xor": lambda x, y: np.logical_xor(x, y),
    "reduce_mean": lambda x, axes=None, keep_dims=False: _reduce(np.mean, x, axes, keep_dims),
    "reduce_argmax": lambda x, axis=-1, keep_dims=False, output_dtype="int32": _argmax(x, axis, keep_dims, output_dtype),
    "reduce_min": lambda x, axes=None, keep_dims=False: x.min(tuple(_axes(axes, x.ndim)) if axes is not None else None, keepdims=bool(keep_dims)),
    "reduce_prod": lambda x, axes=None, keep_dims=False: _reduce(np.prod, x, axes, keep_dims),
    "reduce_sum_square": lambda x, axes=None, keep_dims=False: _reduce(np.sum, x.astype(np.float32) ** 2, axes, keep_dims).astype(x.dtype),
    "exp": lambda x: np.exp(x.astype(np.float32)).astype(x.dtype), "log": lambda x, epsilon=0.0: np.log(x.astype(np.float32) + epsilon).astype(x.dtype),
    "sqrt": lambda x: np.sqrt(x.astype(np.float32)).astype(x.dtype),
    "rsqrt": lambda x, epsilon=1e-12: (1 / np.sqrt(x.astype(np.float32) + epsilon)).astype(x.dtype),
    "inverse": lambda x, epsilon=1e-4: (1 / (x.astype(np.float32) + epsilon)).astype(x.dtype),
    "tanh": lambda x: np.tanh(x.astype(np.float32)).astype(x.dtype), "abs": lambda x: np.abs(x),
    "square": lambda x: x * x, "pow": lambda x, y: np.power(x, y), "sign": lambda x: np.sign(x),
    "sin": lambda x: np.sin(x.astype(np.float32)).astype(x.dtype), "cos": lambda x: np.cos(x.astype(np.float32)).astype(x.dtype),
    "erf": lambda x: _erf(x.astype(np.float64)).astype(x.dtype),
    "silu": lambda x: (x.astype(np.float32) / (1 + np.exp(-x.astype(np.float32)))).astype(x.dtype),
    "softplus": lambda x: np.logaddexp(0, x.astype(np.float32)).astype(x.dtype),
    "leaky_relu": lambda x, alpha=0.01: np.where(x >= 0, x, x * x.dtype.type(alpha)),
    "ceil": lambda x: np.ceil(x), "round": lambda x: np.round(x), "mod": lambda x, y: np.mod(x, y),
    "stack": lambda values, axis: np.stack(values, int(axis)),
    "band_part": lambda x, lower=-1, upper=-1: _band_part(x, int(lower), int(upper)),
    "relu": lambda x: np.maximum(x, x.dtype.type(0)),
    "select": lambda cond, a, b: np.where(cond, a, b),
    "floor": lambda x: np.floor(x), "clip": lambda x, alpha, beta: np.clip(x, alpha, beta),
    "sigmoid": lambda x: (1 / (1 + np.exp(-x))).astype(x.dtype),
    "matmul": lambda x, y, transpose_x=False, transpose_y=False: _mm(np.swapaxes(x, -1, -2) if transpose_x else x, np.swapaxes(y, -1, -2) if transpose_y else y, np.result_type(x, y)),
    "gelu": lambda x, mode="EXACT": _gelu(x, mode),
    "layer_norm": _ln, "softmax": _softmax,
    "reduce_sum": lambda x, axes=None, keep_dims=False: _reduce(np.sum, x, axes, keep_dims),
    "reduce_max": lambda x, axes=None, keep_dims=False: x.max(tuple(_axes(axes, x.ndim)) if axes is not None else None, keepdims=bool(keep_dims)),
    "shape": lambda x: np.array(x.shape, np.int32),
    "concat": lambda values, axis, interleave=False: np.concatenate([np.atleast_1d(v) for v in values], int(axis)),
    "slice_by_index": _slice, "slice_by_size": _slice_by_size,
    "non_zero": lambda x: np.transpose(np.nonzero(x)).astype(np.int32).reshape(-1, x.ndim),
    "gather_nd": _gather_nd, "scatter_nd": _scatter_nd,
    "gather": lambda x, indices, axis=0, batch_dims=0, validate_indices=False: np.take(x, indices, axis=int(axis)),
    "gather_along_axis": lambda x, indices, axis=0, validate_indices=False: np.take_along_axis(x, indices.astype(np.int64), int(axis)),
    "argsort": lambda x, axis=-1, ascending=False: np.argsort(x if ascending else -x, axis=int(axis), kind="stable").astype(np.int32),
    "range_1d": lambda start, end, step: np.arange(start, end, step, dtype=np.int32),
    "split": lambda x, num_splits=None, split_sizes=None, axis=0: np.split(x, int(num_splits) if split_sizes is None else np.cumsum(split_sizes)[:-1], axis=int(axis)),
    "transpose": lambda x, perm: np.transpose(x, perm),
    "reshape": lambda x, shape: np.reshape(x, [int(v) for v in shape]),
    "identity": lambda x: x,
    "fill_like": lambda ref_tensor, value=0.0: np.full(ref_tensor.shape, value, dtype=np.asarray(value).dtype),
    "fill": lambda shape, value=0.0: np.full([int(v) for v in shape], value, dtype=np.asarray(value).dtype),
}


def canonical_outputs(meta: dict, outputs: dict) -> dict:
    """Core ML names cannot hold dots: the package says decisions_layer0_k for decisions.layer0.k; the
    metadata records each feature's coreml_name."""
    canonical = {spec.get("coreml_name", n): n for n, spec in meta["outputs"].items()}
    return {canonical.get(k, k): np.asarray(v) for k, v in outputs.items()}


def input_specs(meta: dict) -> dict[str, IOSpec]:
    """The package's inputs by canonical name: int32 ids and mask, float32 caches and 0/1 modes."""
    return {n: IOSpec(n, s["dtype"], tuple(s["shape"])) for n, s in meta["inputs"].items()}


def coreml_feeds(meta: dict, feeds: dict) -> dict:
    """Feeds by canonical name -> by the package's feature names (dots become underscores)."""
    return {meta["inputs"][n].get("coreml_name", n): a for n, a in feeds.items()}


class MilReferenceRunner(Runner):
    name = "MIL reference evaluation (numpy; not the Core ML runtime)"

    def __init__(self, path: str | Path, accumulate: str = "fp32", track_ranges: bool = False):
        self.path = Path(path)
        self.accumulate = accumulate
        self.ranges = fp16.Ranges() if track_ranges else None
        if accumulate == "fp16":
            self.name = "MIL reference evaluation, fp16 accumulation (the worst case; numpy, not the Core ML runtime)"
        self.spec, self.program = load_program(self.path)
        self.meta = package_meta(self.spec, self.path)
        self._found: list[str] = []
        super().__init__(limits_of(self.meta))

    def input_metadata(self) -> dict[str, IOSpec]:
        return input_specs(self.meta)

    def _infer(self, feeds):
        # zero-size tensors fail at prediction time on some Core ML devices; a lowering must not make
        # one from non-empty inputs (an empty cache fed at prefill is the documented MIN_PAST risk)
        empty_feed = any(np.asarray(a).size == 0 for a in feeds.values())

        def watch(op, outs):
            if empty_feed:
                return
            for var, o in zip(op.outputs, outs):
                if o.size == 0 and len(self._found) < 20:
                    self._found.append(f"{op.op_type} {op.name} gives a zero-size tensor {var.name} of shape "
                                       f"{list(o.shape)}; Core ML may refuse it at prediction time")
        return canonical_outputs(self.meta, run(self.program, coreml_feeds(self.meta, feeds), on_op=watch,
                                                accumulate=self.accumulate, ranges=self.ranges))

    def unevaluable(self) -> list[str]:
        """The op types this evaluation cannot compute ('lstm (2 ops)'); a check lists them and stops."""
        return unevaluable(self.program)

    def findings(self) -> list[str]:
        found, self._found = self._found, []
        return found


def load_program(path: Path):
    from coremltools.converters.mil.frontend.milproto.load import load as milproto_load

    spec = load_spec(path)
    if not spec.HasField("mlProgram"):
        raise AdaptexError(f"{path}: not an ML program package; adaptex checks mlprogram packages only")
    weights = os.path.join(path, "Data", "com.apple.CoreML", "weights")
    try:
        return spec, milproto_load(spec, specification_version=spec.specificationVersion, file_weights_dir=weights)
    except Exception as e:  # coremltools reads weight.bin here: missing, truncated or overwritten
        first = (str(e).strip().splitlines() or [""])[0][:160]
        raise AdaptexError(f"{path}: a corrupt ML package: its program or weights cannot be read ({type(e).__name__}: "
                           f"{first}); re-export it") from None


_SCALAR_ARGS = ("axis", "num_splits", "dtype", "mode", "transpose_x", "transpose_y", "keep_dims", "ascending",
                "epsilon", "alpha", "beta", "interleave", "batch_dims", "validate_indices", "exclusive", "reverse")


def _partial_bound(op_type: str, args: dict) -> float | None:
    """A bound on the partial sums of an op that reduces (runtimes/fp16.py), else None."""
    x = args.get("x")
    if op_type == "matmul":
        a = np.swapaxes(x, -1, -2) if args.get("transpose_x") else x
        b = np.swapaxes(args["y"], -1, -2) if args.get("transpose_y") else args["y"]
        return fp16.matmul_bound(a, b)
    if op_type == "linear":
        return fp16.matmul_bound(x, args["weight"].T) + float(np.abs(args.get("bias", 0)).max(initial=0))
    if op_type in ("reduce_sum", "reduce_mean", "cumsum"):
        return fp16.sum_bound(x, args.get("axes", args.get("axis")))
    if op_type in ("reduce_l2_norm", "layer_norm"):
        return fp16.sum_bound(x, args.get("axes"), square=True)
    if op_type == "softmax":
        ax = args.get("axis", -1)
        return fp16.sum_bound(np.exp(x.astype(np.float32) - x.astype(np.float32).max(ax, keepdims=True)), ax)
    return None


def run(program, feeds: dict[str, np.ndarray], on_op=None, accumulate: str = "fp32",
        ranges: "fp16.Ranges | None" = None) -> dict[str, np.ndarray]:
    """Evaluate the program's main function on `feeds`; returns its outputs by name. on_op(op, outputs),
    if given, sees every evaluated op and its values (tests check the shapes a program really computes).
    accumulate: "fp32" (Core ML's CPU and GPU) or "fp16" (the worst case). ranges: filled with every
    fp16 op's largest |x| and, for reductions, its partial-sum bound."""
    if accumulate not in ("fp32", "fp16"):
        raise AdaptexError(f"accumulation {accumulate!r}: choose fp32 or fp16")
    _ACCUMULATE.append(accumulate)
    try:
        return _run(program, feeds, on_op, ranges)
    finally:
        _ACCUMULATE.pop()


def _last_uses(fn) -> dict[int, list[str]]:
    """For each op's index, the values it is the last to read, or makes and nothing reads (none of the
    function's outputs): the evaluation drops them there, so it holds what later ops read rather than
    every value it computed (a decoder's long batch kept each layer's (B, H, T, T) scores: over 20 GB
    for charlm-dense's Core ML package at 200 samples)."""
    last: dict[str, int] = {}
    for i, op in enumerate(fn.operations):
        last.update((var.name, i) for var in op.outputs)
        for v in op.inputs.values():
            for u in v if isinstance(v, (list, tuple)) else (v,):
                last[u.name] = i
    outputs = {v.name for v in fn.outputs}
    drops: dict[int, list[str]] = {}
    for name, i in last.items():
        if name not in outputs:
            drops.setdefault(i, []).append(name)
    return drops


def _own(op_type: str):
    """adaptex's numpy evaluator of an op type: adaptex's lowerings' ops here, ordinary layers' ops in
    runtimes/coreml_mil_layers.py, compressed weights in runtimes/coreml_mil_constexpr.py; else None."""
    from adaptex.runtimes import coreml_mil_constexpr as constexpr
    from adaptex.runtimes import coreml_mil_layers as layers

    return EVAL.get(op_type) or layers.EVAL.get(op_type) or constexpr.EVAL.get(op_type)


def evaluator(op):
    """The numpy evaluator of an op (_own); None where coremltools' value inference computes it instead. An op with neither raises."""
    from adaptex.runtimes import coreml_mil_layers as layers

    f = _own(op.op_type)
    if f is None and not layers.has_value_inference(op):
        raise AdaptexError(f"MIL evaluation: op {op.op_type!r} ({op.name}) has {layers.UNEVALUABLE_NOTE}")
    return f


def unevaluable(program) -> list[str]:
    """'op_type (count)' for each op of the program that the evaluation cannot compute."""
    from adaptex.runtimes import coreml_mil_layers as layers

    missing: dict[str, int] = {}
    for op in program.functions["main"].operations:
        if op.op_type != "const" and _own(op.op_type) is None and not layers.has_value_inference(op):
            missing[op.op_type] = missing.get(op.op_type, 0) + 1
    return [f"{t} ({n} op{'s' if n > 1 else ''})" for t, n in missing.items()]


def _run(program, feeds, on_op, ranges):
    from adaptex.runtimes import coreml_mil_layers as layers

    fn = program.functions["main"]
    env = {name: np.asarray(feeds[name]) for name in fn.inputs}
    drops = _last_uses(fn)

    def value(v):
        if isinstance(v, (list, tuple)):
            return [value(u) for u in v]
        if v.name in env:
            return env[v.name]
        if v.val is not None:
            return np.asarray(v.val)
        raise AdaptexError(f"MIL evaluation: value {v.name} is used before it is computed")

    for i, op in enumerate(fn.operations):
        if op.op_type == "const":
            env[op.outputs[0].name] = np.asarray(op.outputs[0].val)
            continue
        f = evaluator(op)
        args = {k: value(v) for k, v in op.inputs.items()}
        for k in _SCALAR_ARGS:
            if k in args and isinstance(args[k], np.ndarray) and args[k].ndim == 0:
                args[k] = args[k].item()
        out = f(**args) if f is not None else layers.infer(op, args)
        for var, o in zip(op.outputs, out if isinstance(out, list) else [out]):
            env[var.name] = np.asarray(o)
        if ranges is not None and env[op.outputs[0].name].dtype == np.float16:
            finite_in = all(np.isfinite(a).all() for a in args.values()
                            if isinstance(a, np.ndarray) and a.dtype.kind == "f")
            ranges.note(op.name, op.op_type, env[op.outputs[0].name], _partial_bound(op.op_type, args), finite_in)
        if on_op is not None:
            on_op(op, [env[var.name] for var in op.outputs])
        for name in drops.get(i, ()):
            env.pop(name, None)
    return {v.name: env[v.name] for v in fn.outputs}
