"""What an exported program runs through before coremltools converts it: rewrites of ATen ops whose
coremltools 9 translation computes something else than PyTorch (docs/coreml.md, "coremltools
translations adaptex rewrites", has each one's reproduction).

- Tensor factories that take a `dtype` (zeros_like, ones_like, full_like, empty_like, new_zeros,
  new_ones, new_full, new_empty, zeros, empty): coremltools reads the dtype only where TorchScript
  passes it (positionally), so under torch.export the result keeps the input's dtype (zeros_like)
  or becomes fp32 (zeros, new_zeros). nn.MultiheadAttention's key_padding_mask is
  `zeros_like(mask, dtype=float).masked_fill(mask, -inf)`: converted, that is a bool tensor, True on
  the padded keys, which scaled_dot_product_attention then reads as the keys to keep, attending to
  the padding only. Every factory becomes aten.full with the dtype resolved here, whose translation
  reads its dtype keyword.
- clamp_min / clamp_max with a scalar of another type (x.clamp_min(1) on a float x): coremltools
  asserts the types match; they become aten.clamp, whose translation promotes.
- triu(x, k > 0) and tril(x, k < 0): coremltools computes them as x - band_part(x), which is NaN
  wherever x is infinite; nn.Transformer.generate_square_subsequent_mask is triu(full(-inf), 1), so
  every nn.TransformerDecoderLayer given that causal mask gave NaN. Both become where(band, x, 0).
- where(c, x, scalar): coremltools translates neither that overload nor the prims.where of torch's
  own decomposition (TSA's router masks its gate so); it becomes where(c, x, tensor).
"""
from __future__ import annotations


def decompositions() -> dict:
    """{ATen overload: its rewrite}, for ExportedProgram.run_decompositions."""
    import torch

    aten = torch.ops.aten

    def full(size, value, dtype):
        return torch.full(size, value, dtype=dtype)

    def like(value):
        def fill(x, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
            return full(x.shape, value, dtype or x.dtype)
        return fill

    def full_like(x, value, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
        return full(x.shape, value, dtype or x.dtype)

    def new(value):
        def fill(x, size, dtype=None, layout=None, device=None, pin_memory=None):
            return full(size, value, dtype or x.dtype)
        return fill

    def new_full(x, size, value, dtype=None, layout=None, device=None, pin_memory=None):
        return full(size, value, dtype or x.dtype)

    def zeros(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
        return full(size, 0, dtype or torch.get_default_dtype())

    def clamp_min(x, low):
        return torch.clamp(x, min=low)

    def clamp_max(x, high):
        return torch.clamp(x, max=high)

    def band(x, diagonal, upper: bool):
        rows = torch.arange(x.shape[-2])[:, None]
        cols = torch.arange(x.shape[-1])[None, :]
        keep = (cols - rows >= diagonal) if upper else (cols - rows <= diagonal)
        return torch.where(keep, x, full(x.shape, 0, x.dtype))

    def triu(x, diagonal=0):
        return band(x, diagonal, True)

    def tril(x, diagonal=0):
        return band(x, diagonal, False)

    def where_scalar_other(cond, x, other):
        return torch.where(cond, x, full(x.shape, other, x.dtype))

    return {aten.zeros_like.default: like(0), aten.ones_like.default: like(1), aten.empty_like.default: like(0),
            aten.full_like.default: full_like, aten.new_zeros.default: new(0), aten.new_ones.default: new(1),
            aten.new_empty.default: new(0), aten.new_full.default: new_full, aten.zeros.default: zeros,
            aten.empty.memory_format: zeros, aten.clamp_min.default: clamp_min,
            aten.clamp_max.default: clamp_max, aten.triu.default: triu, aten.tril.default: tril,
            aten.where.ScalarOther: where_scalar_other}
