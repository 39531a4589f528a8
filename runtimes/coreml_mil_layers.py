"""The MIL evaluator's ops for ordinary PyTorch layers (runtimes/coreml_mil.py evaluates the program):
convolutions, pooling, normalisations, activations, resampling and shape ops, as coremltools'
converter emits them for common models, each a numpy evaluator with MIL's semantics (tested against
PyTorch and coremltools in tests/unit/test_mil_layers.py).

An op with no numpy evaluator falls back to coremltools' own value inference (`infer`), which most
MIL elementwise and shape ops implement: the op is rebuilt in a one-op MIL function on constant
inputs, as the coremltools Builder does when it folds constants. An op with neither (`UNEVALUABLE`:
recurrent layers, loops, lists, random ops, ...) cannot be evaluated here: `adaptex check` lists it
in its report and checks nothing on Linux.
"""
from __future__ import annotations

import itertools
import math

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from adaptex.runtimes import coreml_mil as _mil


def _acc(x: np.ndarray) -> np.ndarray:
    """fp16 values accumulate in fp32 (fp16 in the worst case, runtimes/coreml_mil.py)."""
    return x if x.dtype != np.float16 or _mil._worst(x) else x.astype(np.float32)


def _ints(v, n: int, default: int = 1) -> list[int]:
    return [default] * n if v is None else [int(a) for a in np.atleast_1d(v)]


def _pads(pad_type, pad, spatial, kernel, strides, dilations, ceil_mode=False) -> list[tuple[int, int]]:
    """(before, after) padding per spatial axis, by MIL's pad_type: valid, custom (pad = [b0, e0, b1,
    e1, ...]), same (extra padding after) or same_lower (extra padding before); ceil_mode pads the
    end so that a partial last window counts."""
    n = len(spatial)
    pad_type = str(pad_type or "valid").lower()
    if pad_type == "custom":
        p = _ints(pad, 2 * n, 0)
        out = [(p[2 * i], p[2 * i + 1]) for i in range(n)]
    elif pad_type in ("same", "same_lower"):
        out = []
        for size, k, s, d in zip(spatial, kernel, strides, dilations):
            total = max((math.ceil(size / s) - 1) * s + (k - 1) * d + 1 - size, 0)
            small, big = total // 2, total - total // 2
            out.append((big, small) if pad_type == "same_lower" else (small, big))
    else:
        out = [(0, 0)] * n
    if ceil_mode:
        grown = []
        for (b, e), size, k, s in zip(out, spatial, kernel, strides):
            span = size + b + e - k
            extra = (math.ceil(span / s) * s - span) if span % s else 0
            if extra and (math.ceil(span / s)) * s >= size + b:  # a last window must start inside the input
                extra = 0
            grown.append((b, e + extra))
        out = grown
    return out


def _windows(x: np.ndarray, kernel, strides, dilations, pads, value) -> np.ndarray:
    """(N, C, *out, *kernel) windows of x (N, C, *spatial) padded with `value`."""
    n = len(kernel)
    xp = np.pad(x, [(0, 0), (0, 0)] + list(pads), constant_values=value)
    extent = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
    w = sliding_window_view(xp, extent, axis=tuple(range(2, 2 + n)))
    return w[(slice(None), slice(None)) + tuple(slice(None, None, s) for s in strides)
             + tuple(slice(None, None, d) for d in dilations)]


def conv(x, weight, bias=None, strides=None, pad_type="valid", pad=None, dilations=None, groups=1):
    """N-d convolution (cross-correlation) of x (N, C, *spatial) with weight (Cout, C / groups, *k)."""
    n = x.ndim - 2
    kernel = weight.shape[2:]
    strides, dilations = _ints(strides, n), _ints(dilations, n)
    pads = _pads(pad_type, pad, x.shape[2:], kernel, strides, dilations)
    g = int(groups)
    w = _windows(x, kernel, strides, dilations, pads, 0)  # (N, C, *out, *k)
    N, C, out = x.shape[0], x.shape[1], w.shape[2:2 + n]
    cols = w.reshape(N, g, C // g, *out, *kernel)
    cols = np.moveaxis(cols, 2, 2 + n)  # (N, g, *out, C/g, *k)
    cols = cols.reshape(N, g, int(np.prod(out, dtype=np.int64)), -1)  # (N, g, P, C/g * K)
    wt = weight.reshape(g, weight.shape[0] // g, -1)  # (g, Cout/g, C/g * K)
    y = _mil._mm(cols, np.swapaxes(wt, -1, -2)[None], x.dtype)  # (N, g, P, Cout/g)
    y = np.moveaxis(y, 2, 3).reshape(N, weight.shape[0], *out)
    if bias is not None:
        y = (y + bias.reshape((1, -1) + (1,) * n)).astype(x.dtype)
    return y


def conv_transpose(x, weight, bias=None, pad=None, output_shape=None, pad_type="valid", strides=None,
                   dilations=None, groups=1):
    """Transposed convolution: weight (C, Cout / groups, *k); each input element scatters its kernel."""
    n = x.ndim - 2
    kernel = weight.shape[2:]
    strides, dilations = _ints(strides, n), _ints(dilations, n)
    g = int(groups)
    N, C = x.shape[:2]
    co = weight.shape[1]
    full = [(s - 1) * st + (k - 1) * d + 1 for s, st, k, d in zip(x.shape[2:], strides, kernel, dilations)]
    y = np.zeros((N, g * co, *full), np.float32)
    xg = _acc(x).astype(np.float32).reshape(N, g, C // g, *x.shape[2:])
    wg = weight.astype(np.float32).reshape(g, C // g, co, *kernel)
    for idx in itertools.product(*[range(k) for k in kernel]):
        part = np.einsum("ngc...,gco->ngo...", xg, wg[(slice(None),) * 3 + idx])  # (N, g, co, *in)
        where = tuple(slice(i * d, i * d + (s - 1) * st + 1, st)
                      for i, d, s, st in zip(idx, dilations, x.shape[2:], strides))
        y[(slice(None), slice(None)) + where] += part.reshape(N, g * co, *x.shape[2:])
    pad_type = str(pad_type or "valid").lower()
    if pad_type == "custom" or pad is not None and pad_type != "same":
        p = _ints(pad, 2 * n, 0)
        y = y[(slice(None), slice(None)) + tuple(slice(p[2 * i], full[i] - p[2 * i + 1]) for i in range(n))]
    elif pad_type == "same":
        want = [s * st for s, st in zip(x.shape[2:], strides)]
        y = y[(slice(None), slice(None)) + tuple(slice((f - w) // 2, (f - w) // 2 + w) for f, w in zip(full, want))]
    if output_shape is not None:
        shape = [int(v) for v in np.atleast_1d(output_shape)][-n:]
        grown = np.zeros(y.shape[:2] + tuple(shape), y.dtype)
        grown[(slice(None), slice(None)) + tuple(slice(0, min(a, b)) for a, b in zip(shape, y.shape[2:]))] = \
            y[(slice(None), slice(None)) + tuple(slice(0, min(a, b)) for a, b in zip(shape, y.shape[2:]))]
        y = grown
    if bias is not None:
        y = y + bias.reshape((1, -1) + (1,) * n)
    return y.astype(x.dtype)


def _pool(kind, x, kernel_sizes, strides=None, pad_type="valid", pad=None, ceil_mode=False,
          exclude_padding_from_average=False):
    n = len(np.atleast_1d(kernel_sizes))
    kernel, strides = _ints(kernel_sizes, n), _ints(strides, n)
    pads = _pads(pad_type, pad, x.shape[2:], kernel, strides, [1] * n, bool(ceil_mode))
    axes = tuple(range(-n, 0))
    if kind == "max":
        lowest = np.finfo(x.dtype).min if x.dtype.kind == "f" else np.iinfo(x.dtype).min
        return _windows(x, kernel, strides, [1] * n, pads, lowest).max(axes)
    xa = _acc(x)
    if kind == "l2":
        return np.sqrt((_windows(xa * xa, kernel, strides, [1] * n, pads, 0)).sum(axes)).astype(x.dtype)
    total = _windows(xa, kernel, strides, [1] * n, pads, 0).sum(axes)
    if exclude_padding_from_average:
        count = _windows(np.ones((1, 1) + x.shape[2:], xa.dtype), kernel, strides, [1] * n, pads, 0).sum(axes)
    else:  # the explicit padding counts; ceil_mode's extra end padding does not (as PyTorch)
        plain = _pads(pad_type, pad, x.shape[2:], kernel, strides, [1] * n)
        ones = np.pad(np.ones((1, 1) + x.shape[2:], xa.dtype), [(0, 0), (0, 0)] + list(plain), constant_values=1)
        extra = [(0, e - pe) for (_, e), (_, pe) in zip(pads, plain)]
        count = _windows(ones, kernel, strides, [1] * n, extra, 0).sum(axes)
    return (total / count).astype(x.dtype)


def _norm(x, axes, gamma, beta, epsilon, mean=None, variance=None):
    xa = x.astype(np.float32)
    shape = (1, -1) + (1,) * (x.ndim - 2)
    if mean is None:
        mean = xa.mean(axes, keepdims=True)
        variance = ((xa - mean) ** 2).mean(axes, keepdims=True)
    else:
        mean, variance = mean.reshape(shape).astype(np.float32), variance.reshape(shape).astype(np.float32)
    y = (xa - mean) / np.sqrt(variance + np.float32(epsilon))
    if gamma is not None:
        y = y * gamma.reshape(shape)
    if beta is not None:
        y = y + beta.reshape(shape)
    return y.astype(x.dtype)


def _lrn(x, size, alpha=1e-4, beta=0.75, k=1.0):
    """Local response normalisation across channels (axis 1), PyTorch's and MIL's definition."""
    sq = x.astype(np.float32) ** 2
    size = int(size)
    padded = np.pad(sq, [(0, 0), (size // 2, (size - 1) // 2)] + [(0, 0)] * (x.ndim - 2))
    window = sliding_window_view(padded, size, axis=1).sum(-1)
    return (x / (k + alpha / size * window) ** beta).astype(x.dtype)


def _resize_nearest(x, scale_h, scale_w):
    h, w = x.shape[-2:]
    oh, ow = int(math.floor(h * scale_h)), int(math.floor(w * scale_w))
    rows = np.minimum(np.floor(np.arange(oh) / scale_h).astype(np.int64), h - 1)
    cols = np.minimum(np.floor(np.arange(ow) / scale_w).astype(np.int64), w - 1)
    return x[..., rows[:, None], cols[None, :]]


def _coords(size_in, size_out, scale, align_corners, half_pixel):
    o = np.arange(size_out, dtype=np.float64)
    if align_corners and size_out > 1:
        return o * (size_in - 1) / (size_out - 1)
    if half_pixel:
        return np.clip((o + 0.5) / scale - 0.5, 0, None)
    return o / scale


def _bilinear(x, scale_h, scale_w, align_corners=False, half_pixel_centers=None, out=None):
    h, w = x.shape[-2:]
    oh, ow = out or (int(math.floor(h * scale_h)), int(math.floor(w * scale_w)))
    half = (not align_corners) if half_pixel_centers is None else bool(half_pixel_centers)
    ys, xs = _coords(h, oh, scale_h, align_corners, half), _coords(w, ow, scale_w, align_corners, half)
    y0, x0 = np.minimum(np.floor(ys).astype(np.int64), h - 1), np.minimum(np.floor(xs).astype(np.int64), w - 1)
    y1, x1 = np.minimum(y0 + 1, h - 1), np.minimum(x0 + 1, w - 1)
    fy, fx = (ys - y0)[:, None], (xs - x0)[None, :]
    xa = x.astype(np.float64)
    top = xa[..., y0[:, None], x0[None, :]] * (1 - fx) + xa[..., y0[:, None], x1[None, :]] * fx
    bottom = xa[..., y1[:, None], x0[None, :]] * (1 - fx) + xa[..., y1[:, None], x1[None, :]] * fx
    return (top * (1 - fy) + bottom * fy).astype(x.dtype)


def _pixel_shuffle(x, r):
    N, C, H, W = x.shape
    r = int(r)
    return x.reshape(N, C // (r * r), r, r, H, W).transpose(0, 1, 4, 2, 5, 3).reshape(N, C // (r * r), H * r, W * r)


def _pixel_unshuffle(x, r):
    N, C, H, W = x.shape
    r = int(r)
    return x.reshape(N, C, H // r, r, W // r, r).transpose(0, 1, 3, 5, 2, 4).reshape(N, C * r * r, H // r, W // r)


def _depth_to_space(x, b):
    """MIL depth_to_space (DCR order: the block's rows vary slowest)."""
    N, C, H, W = x.shape
    b = int(b)
    return x.reshape(N, b, b, C // (b * b), H, W).transpose(0, 3, 4, 1, 5, 2).reshape(N, C // (b * b), H * b, W * b)


def _space_to_depth(x, b):
    N, C, H, W = x.shape
    b = int(b)
    return x.reshape(N, C, H // b, b, W // b, b).transpose(0, 3, 5, 1, 2, 4).reshape(N, C * b * b, H // b, W // b)


def _one_hot(indices, one_hot_vector_size, axis=-1, on_value=1, off_value=0):
    n = int(one_hot_vector_size)
    hot = np.arange(n) == np.asarray(indices)[..., None]
    on, off = np.asarray(on_value), np.asarray(off_value)
    out = np.where(hot, on, off).astype(np.result_type(on, off))
    return np.moveaxis(out, -1, int(axis) if int(axis) >= 0 else int(axis) + out.ndim)


def _scatter(data, indices, updates, axis=0, mode="add", validate_indices=False):
    """MIL scatter: whole slices of data along `axis`, at indices (1-d), combined with updates."""
    out = np.array(data, copy=True)
    axis = int(axis) % data.ndim
    moved = np.moveaxis(out, axis, 0)
    upd = np.moveaxis(np.asarray(updates, out.dtype), axis, 0)
    idx = np.asarray(indices).astype(np.int64)
    if str(mode) == "update":
        moved[idx] = upd
    else:
        _mil._SCATTER[str(mode)].at(moved, idx, upd)
    return out


def _sliding_windows(x, axis, size, stride=1):
    """Windows of `size` along axis, every `stride`: the window axis follows `axis`."""
    axis = int(axis) % x.ndim
    w = sliding_window_view(x, int(size), axis=axis)[(slice(None),) * axis + (slice(None, None, int(stride)),)]
    return np.moveaxis(w, -1, axis + 1)


def _reshape_like(x, ref_tensors, begins, ends, end_masks):
    shape = []
    for ref, b, e, m in zip(ref_tensors, begins, ends, end_masks):
        dims = np.asarray(ref).shape
        shape += list(dims[int(b):] if m else dims[int(b):int(e)])
    return x.reshape(shape)


EVAL = {
    "conv": conv, "conv_transpose": conv_transpose,
    "max_pool": lambda x, kernel_sizes, strides=None, pad_type="valid", pad=None, ceil_mode=False:
        _pool("max", x, kernel_sizes, strides, pad_type, pad, ceil_mode),
    "avg_pool": lambda x, kernel_sizes, strides=None, pad_type="valid", pad=None, ceil_mode=False,
        exclude_padding_from_average=False: _pool("avg", x, kernel_sizes, strides, pad_type, pad, ceil_mode,
                                                  exclude_padding_from_average),
    "l2_pool": lambda x, kernel_sizes, strides=None, pad_type="valid", pad=None, ceil_mode=False:
        _pool("l2", x, kernel_sizes, strides, pad_type, pad, ceil_mode),
    "batch_norm": lambda x, mean, variance, gamma=None, beta=None, epsilon=1e-5:
        _norm(x, None, gamma, beta, epsilon, mean, variance),
    "instance_norm": lambda x, gamma=None, beta=None, epsilon=1e-5:
        _norm(x, tuple(range(2, x.ndim)), gamma, beta, epsilon),
    "local_response_norm": _lrn,
    "upsample_nearest_neighbor": lambda x, scale_factor_height=1, scale_factor_width=1:
        _resize_nearest(x, float(scale_factor_height), float(scale_factor_width)),
    "resize_nearest_neighbor": lambda x, target_size_height, target_size_width:
        _resize_nearest(x, int(target_size_height) / x.shape[-2], int(target_size_width) / x.shape[-1]),
    "upsample_bilinear": lambda x, scale_factor_height=1, scale_factor_width=1, align_corners=True,
        half_pixel_centers=None: _bilinear(x, float(scale_factor_height), float(scale_factor_width),
                                           bool(align_corners), half_pixel_centers),
    "pixel_shuffle": lambda x, upscale_factor: _pixel_shuffle(x, upscale_factor),
    "pixel_unshuffle": lambda x, downscale_factor: _pixel_unshuffle(x, downscale_factor),
    "depth_to_space": lambda x, block_size: _depth_to_space(x, block_size),
    "space_to_depth": lambda x, block_size: _space_to_depth(x, block_size),
    "one_hot": _one_hot, "scatter": _scatter, "sliding_windows": _sliding_windows, "reshape_like": _reshape_like,
    "crop": lambda x, crop_height, crop_width: x[..., int(crop_height[0]):x.shape[-2] - int(crop_height[1]),
                                                   int(crop_width[0]):x.shape[-1] - int(crop_width[1])],
    "relu6": lambda x: np.clip(x, 0, 6).astype(x.dtype),
    "elu": lambda x, alpha=1.0: np.where(x > 0, x, alpha * np.expm1(x.astype(np.float32))).astype(x.dtype),
    "sigmoid_hard": lambda x, alpha=0.2, beta=0.5: np.clip(alpha * x.astype(np.float32) + beta, 0, 1).astype(x.dtype),
    "softsign": lambda x: (x / (1 + np.abs(x))).astype(x.dtype),
    "prelu": lambda x, alpha: np.where(x >= 0, x, x * alpha.reshape((1, -1) + (1,) * (x.ndim - 2))).astype(x.dtype),
    "reduce_argmin": lambda x, axis=-1, keep_dims=False, output_dtype="int32":
        _mil._argmax(-x, axis, keep_dims, output_dtype),
    "reduce_log_sum_exp": lambda x, axes=None, keep_dims=False: _logsumexp(x, axes, keep_dims),
}


def _logsumexp(x, axes, keep_dims):
    ax = tuple(_mil._axes(axes, x.ndim)) if axes is not None else None
    xa = x.astype(np.float32)
    m = xa.max(ax, keepdims=True)
    out = np.log(np.exp(xa - m).sum(ax, keepdims=True)) + m
    return (out if keep_dims else np.squeeze(out, ax)).astype(x.dtype)


# ops that neither a numpy evaluator here nor coremltools' value inference can evaluate
UNEVALUABLE_NOTE = "no numpy evaluator, and coremltools infers no value for it"


def has_value_inference(op) -> bool:
    """Whether coremltools' class for this op computes values (overrides Operation.value_inference)."""
    from coremltools.converters.mil.mil.operation import Operation

    return type(op).value_inference is not Operation.value_inference


def infer(op, args: dict):
    """The op's value by coremltools' own value inference: rebuilt on constant inputs in a one-op
    MIL function (the Builder infers the value of an op whose inputs are all constants)."""
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import Function

    consts = {}
    for k, v in args.items():
        if v is None:
            continue
        if isinstance(v, np.ndarray) and v.ndim == 0:  # a scalar argument (k, a mode string): hashable
            v = v.item() if v.dtype.kind in "USb" else v[()]
        consts[k] = tuple(v) if isinstance(v, list) else v
    with Function({}, opset_version=op.opset_version):
        out = getattr(mb, op.op_type)(**consts)
    outs = out if isinstance(out, (list, tuple)) else [out]
    if any(o.val is None for o in outs):
        from adaptex.graphs.errors import AdaptexError

        raise AdaptexError(f"MIL evaluation: coremltools inferred no value for op {op.op_type!r} ({op.name})")
    return [np.asarray(o.val) for o in outs] if isinstance(out, (list, tuple)) else np.asarray(out.val)
