"""The MIL evaluator (runtimes/coreml_mil.py), the only Core ML oracle on Linux, op by op.

Each case is a one-op ML program built with coremltools' Builder and evaluated by `coreml_mil.run`, as
a saved package is. Where coremltools infers the op's value itself (its `value_inference`, which the
Builder runs on constant inputs), that value is the reference; where it has none (gather_nd,
scatter_nd, silu, ...) or a broken one (cumsum with exclusive=True), a numpy reference written here
is, and the op's first input is a program input (no inference is attempted). Every evaluator has a
case."""
from __future__ import annotations

import math

import numpy as np
import pytest
from coremltools.converters.mil import Builder as mb

from adaptex.runtimes import coreml_mil

rng = np.random.default_rng(0)
A = rng.normal(size=(2, 3, 4)).astype(np.float32)
B = rng.normal(size=(2, 3, 4)).astype(np.float32)
POS = (np.abs(A) + 0.1).astype(np.float32)
INT = rng.integers(-7, 9, size=(2, 3, 4)).astype(np.int32)
BOOL, BOOL2 = A > 0, B > 0
IDX = np.array([[0, 1], [1, 2], [0, 0]], np.int32)
ORDER = np.argsort(A, axis=-1).astype(np.int32)
SQUARE = rng.normal(size=(5, 5)).astype(np.float32)


def _scatter(mode):
    def ref(data, indices, updates, **_):
        out = data.copy()
        for i, (a, b) in enumerate(indices):
            out[a, b] = updates[i] if mode == "update" else out[a, b] + updates[i]
        return out
    return ref


# op: [(inputs, numpy reference or None: coremltools' value inference), ...]
CASES = {
    "cast": [dict(x=A * 3, dtype="int32"), dict(x=INT, dtype="fp32"), dict(x=A, dtype="fp16")],
    "expand_dims": [dict(x=A, axes=[0, -1])],
    "squeeze": [dict(x=A[:, :1], axes=[1]), dict(x=A[:1, :1])],
    "linear": [dict(x=A, weight=rng.normal(size=(5, 4)).astype(np.float32), bias=np.arange(5, dtype=np.float32))],
    "mul": [dict(x=A, y=B)], "add": [dict(x=A, y=B)], "sub": [dict(x=A, y=B)], "real_div": [dict(x=A, y=POS)],
    "maximum": [dict(x=A, y=B)], "minimum": [dict(x=A, y=B)],
    "less": [dict(x=A, y=B)], "greater": [dict(x=A, y=B)], "greater_equal": [dict(x=INT, y=np.int32(1))],
    "less_equal": [dict(x=INT, y=np.int32(1))], "equal": [dict(x=INT, y=np.int32(2))],
    "not_equal": [dict(x=INT, y=np.int32(2))],
    "floor_div": [dict(x=INT, y=np.int32(3)), dict(x=A, y=np.float32(0.3))],
    "cumsum": [dict(x=A, axis=1),
               (dict(x=A, axis=2, exclusive=True, reverse=True),  # each element: the sum of those after it
                lambda x, **_: np.stack([x[..., i + 1:].sum(-1) for i in range(x.shape[-1])], -1))],
    "reduce_l2_norm": [dict(x=A, axes=[-1], keep_dims=True)],
    "tile": [dict(x=A, reps=[1, 2, 1])],
    "logical_not": [dict(x=BOOL)], "logical_and": [dict(x=BOOL, y=BOOL2)], "logical_or": [dict(x=BOOL, y=BOOL2)],
    "logical_xor": [dict(x=BOOL, y=BOOL2)],
    "reduce_mean": [dict(x=A, axes=[1])], "reduce_min": [dict(x=A, axes=[0, 2], keep_dims=True)],
    "reduce_argmax": [(dict(x=A, axis=-1), lambda x, axis, **_: np.argmax(x, axis).astype(np.int32)),
                      (dict(x=A, axis=1, keep_dims=True),
                       lambda x, axis, **_: np.expand_dims(np.argmax(x, axis), axis).astype(np.int32))],
    "reduce_prod": [dict(x=POS, axes=[2])], "reduce_sum_square": [dict(x=A, axes=[1])],
    "reduce_sum": [dict(x=A, axes=[-1], keep_dims=True), dict(x=A.astype(np.float16), axes=[1])],
    "reduce_max": [dict(x=A, axes=[1])],
    "exp": [dict(x=A)], "log": [dict(x=POS)], "sqrt": [dict(x=POS)], "rsqrt": [dict(x=POS)],
    "inverse": [dict(x=POS)], "tanh": [dict(x=A)], "abs": [dict(x=A)], "square": [dict(x=A)],
    "pow": [dict(x=POS, y=B)], "sign": [dict(x=A)], "sin": [dict(x=A)], "cos": [dict(x=A)], "erf": [dict(x=A)],
    "silu": [(dict(x=A), lambda x: x / (1 + np.exp(-x.astype(np.float64))))], "softplus": [dict(x=A)], "leaky_relu": [dict(x=A, alpha=0.2)], "relu": [dict(x=A)],
    "sigmoid": [dict(x=A)], "ceil": [dict(x=A * 3)], "floor": [dict(x=A * 3)], "round": [dict(x=A * 3)],
    "mod": [dict(x=INT, y=np.int32(3))],
    "stack": [dict(values=[A, B], axis=1)],
    "band_part": [dict(x=SQUARE, lower=1, upper=2), dict(x=SQUARE, lower=-1, upper=0)],
    "select": [dict(cond=BOOL, a=A, b=B)],
    "clip": [dict(x=A, alpha=np.float32(-0.5), beta=np.float32(0.5))],
    "matmul": [dict(x=A, y=rng.normal(size=(2, 5, 4)).astype(np.float32), transpose_y=True),
               dict(x=A.transpose(0, 2, 1), y=rng.normal(size=(2, 4, 5)).astype(np.float32), transpose_x=True)],
    "gelu": [dict(x=A, mode="EXACT")],
    "layer_norm": [dict(x=A, axes=[-1], gamma=np.arange(1, 5, dtype=np.float32), beta=np.ones(4, np.float32),
                        epsilon=np.float32(1e-5))],
    "softmax": [dict(x=A, axis=-1), dict(x=A, axis=1)],
    "shape": [dict(x=A)],
    "concat": [dict(values=[A, B], axis=2)],
    "slice_by_index": [dict(x=A, begin=np.array([0, 1, 0], np.int32), end=np.array([2, 3, 4], np.int32),
                            stride=np.array([1, 1, 2], np.int32)),
                       dict(x=A, begin=np.array([1, 0, 0], np.int32), end=np.array([0, 2, 0], np.int32),
                            begin_mask=[False, True, True], end_mask=[True, False, True],
                            squeeze_mask=[True, False, False])],
    "slice_by_size": [dict(x=A, begin=np.array([0, 1, 1], np.int32), size=np.array([-1, 2, 2], np.int32))],
    "non_zero": [dict(x=BOOL.astype(np.float32))],
    "gather_nd": [(dict(x=A, indices=IDX), lambda x, indices, **_: np.stack([x[a, b] for a, b in indices]))],
    "scatter_nd": [(dict(data=A, indices=IDX[:2], updates=B[0, :2], mode="update"), _scatter("update")),
                   (dict(data=A, indices=IDX, updates=B[1], mode="add"), _scatter("add"))],
    "gather": [dict(x=A, indices=np.array([[2, 0]], np.int32), axis=1)],
    "gather_along_axis": [dict(x=A, indices=ORDER, axis=2)],
    "argsort": [dict(x=A, axis=-1, ascending=False), dict(x=A, axis=1, ascending=True)],
    "range_1d": [dict(start=np.int32(1), end=np.int32(9), step=np.int32(2))],
    "split": [dict(x=A, num_splits=2, axis=2), dict(x=A, split_sizes=np.array([1, 3], np.int32), axis=2)],
    "transpose": [dict(x=A, perm=[2, 0, 1])],
    "reshape": [dict(x=A, shape=np.array([6, 4], np.int32))],
    "identity": [dict(x=A)],
    "fill_like": [dict(ref_tensor=A, value=np.float32(1.5))],
    "fill": [dict(shape=np.array([2, 3], np.int32), value=np.float32(2.0))],
}


def _case_list():
    for op, cases in sorted(CASES.items()):
        for i, case in enumerate(cases):
            yield pytest.param(op, case, id=f"{op}-{i}")


def _program(op: str, inputs: dict, runtime: str | None = None):
    """The one-op program, and its outputs; `runtime` names the input fed at run time (else a constant
    stands in for it, and the program input goes unused)."""
    from coremltools.converters.mil.mil import types

    box = {}
    value = inputs[runtime] if runtime else np.zeros(1, np.float32)
    dtype = types.numpy_type_to_builtin_type(value.dtype)

    @mb.program(input_specs=[mb.TensorSpec(shape=value.shape, dtype=dtype)])
    def prog(fed):
        out = getattr(mb, op)(**{**inputs, **({runtime: fed} if runtime else {})})
        box["vars"] = list(out) if isinstance(out, (list, tuple)) else [out]
        return tuple(box["vars"])
    return prog, box["vars"], {"fed": value}


def test_every_evaluator_has_a_case():
    assert set(coreml_mil.EVAL) == set(CASES), sorted(set(coreml_mil.EVAL) ^ set(CASES))


@pytest.mark.parametrize("op, case", _case_list())
def test_the_evaluator_matches_coremltools_or_numpy(op, case):
    inputs, numpy_ref = case if isinstance(case, tuple) else (case, None)
    prog, outs, feeds = _program(op, inputs, runtime=next(iter(inputs)) if numpy_ref else None)
    got = coreml_mil.run(prog, feeds)
    if numpy_ref is not None:
        refs = [numpy_ref(**inputs)]
    else:
        refs = [v.val for v in outs]
        assert all(r is not None for r in refs), f"coremltools infers no value for {op}: give it a numpy reference"
    for var, ref in zip(outs, refs):
        mine, ref = got[var.name], np.asarray(ref)
        assert mine.shape == ref.shape, (op, mine.shape, ref.shape)
        assert mine.dtype.kind == ref.dtype.kind, (op, mine.dtype, ref.dtype)
        if mine.dtype.kind == "f":
            tol = 2e-3 if mine.dtype == np.float16 else 1e-6
            np.testing.assert_allclose(mine.astype(np.float64), ref.astype(np.float64), rtol=tol, atol=tol)
        else:
            np.testing.assert_array_equal(mine, ref)


def test_gelu_is_the_exact_form_and_erf_is_math_erf():
    x = np.array([-3.0, -0.5, 0.0, 0.7, 2.5], np.float32)
    want = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x.tolist()])
    np.testing.assert_allclose(coreml_mil.EVAL["gelu"](x), want, rtol=1e-6)
