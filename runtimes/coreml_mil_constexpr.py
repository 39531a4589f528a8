"""The MIL evaluator's compressed weights: the constexpr ops that coremltools.optimize.coreml writes
(linear_quantize_weights, palettize_weights) decompressed in numpy, as Core ML does when it loads a
package. Semantics from the MIL op reference (coremltools.converters.mil.mil.ops.defs iOS16/iOS18):

- constexpr_affine_dequantize (iOS16, iOS17): scale * (quantized_data - zero_point), the scale and
  zero point a scalar or one value per index of `axis`;
- constexpr_blockwise_shift_scale (iOS18): scale * (data - offset), scale and offset of the data's
  rank, each axis of the data split into equal blocks, one value per block;
- constexpr_lut_to_dense: a lookup table indexed by n-bit indices. iOS16 packs the indices in bytes
  (the first index in the lowest bits) and gives the output `shape`; iOS18 gives the indices in the
  output's shape and a table per block ([blocks per axis..., 2^n, vector size]).

An op whose arguments fit neither form is refused, so a check never evaluates a guess.
"""
from __future__ import annotations

import numpy as np

from adaptex.graphs.errors import AdaptexError


def _along(v: np.ndarray, axis: int, ndim: int) -> np.ndarray:
    """A scalar as is; a vector shaped to broadcast along `axis` of an ndim tensor."""
    v = np.asarray(v)
    if v.ndim == 0 or v.size == 1:
        return v.reshape(())
    shape = [1] * ndim
    shape[int(axis) % ndim] = v.size
    return v.reshape(shape)


def affine_dequantize(quantized_data, zero_point, scale, axis=0):
    q = np.asarray(quantized_data)
    zp = _along(zero_point, axis, q.ndim).astype(np.float32)
    s = _along(scale, axis, q.ndim)
    return ((q.astype(np.float32) - zp) * s.astype(np.float32)).astype(s.dtype)


def _blocks(small: np.ndarray, shape: tuple[int, ...], what: str) -> np.ndarray:
    """`small` (one value per block of each axis) repeated to `shape`."""
    if small.ndim != len(shape) or any(n % b for n, b in zip(shape, small.shape)):
        raise AdaptexError(f"MIL evaluation: a {what} of shape {small.shape} does not split data of shape {shape} "
                           "into equal blocks")
    for axis, (n, b) in enumerate(zip(shape, small.shape)):
        small = np.repeat(small, n // b, axis=axis)
    return small


def blockwise_shift_scale(data, scale, offset=None):
    d = np.asarray(data)
    s = _blocks(np.asarray(scale), d.shape, "scale")
    x = d.astype(np.float32)
    if offset is not None:
        x = x - _blocks(np.asarray(offset), d.shape, "offset").astype(np.float32)
    return (x * s.astype(np.float32)).astype(s.dtype)


def _unpack(indices: np.ndarray, nbits: int, count: int) -> np.ndarray:
    bits = np.unpackbits(np.asarray(indices, dtype=np.uint8), bitorder="little")
    if bits.size < count * nbits:
        raise AdaptexError(f"MIL evaluation: {indices.size} bytes of packed indices hold fewer than {count} "
                           f"{nbits}-bit indices")
    bits = bits[:count * nbits].reshape(count, nbits).astype(np.int64)
    return (bits << np.arange(nbits)).sum(axis=1)


def lut_to_dense(indices, lut, shape=None, vector_axis=None):
    lut = np.asarray(lut)
    if shape is not None:  # iOS16: one table, indices packed in bytes
        if lut.ndim != 1 or lut.size & (lut.size - 1):
            raise AdaptexError(f"MIL evaluation: an iOS16 lookup table must be 2^n values, not shape {lut.shape}")
        shape = tuple(int(n) for n in np.asarray(shape))
        idx = _unpack(indices, lut.size.bit_length() - 1, int(np.prod(shape)))
        return lut[idx].reshape(shape)
    idx = np.asarray(indices).astype(np.int64)  # iOS18: indices in the output's shape, a table per block
    if lut.ndim != idx.ndim + 2 or lut.shape[-1] != 1 or vector_axis is not None:
        raise AdaptexError(f"MIL evaluation: a lookup table of shape {lut.shape} for indices {idx.shape} (vector "
                           "palettization) has no evaluator")
    per_block = lut[..., 0]  # [blocks per axis..., 2^n]
    block_of = [np.arange(n) // (n // b) for n, b in zip(idx.shape, per_block.shape[:-1])]
    where = np.ix_(*block_of)
    return per_block[tuple(np.broadcast_arrays(*where)) + (idx,)]


EVAL = {"constexpr_affine_dequantize": affine_dequantize, "constexpr_blockwise_shift_scale": blockwise_shift_scale,
        "constexpr_lut_to_dense": lut_to_dense}
