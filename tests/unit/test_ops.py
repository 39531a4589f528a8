"""adaptex::budgeted_attention: the eager kernel against a dense masked reference."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptex.graphs.ops import budgeted_attention as ba


def _inputs(B, T, H, dh, seed, pad=True):
    g = torch.Generator().manual_seed(seed)
    d = H * dh
    x = torch.randn(B, T, d, generator=g)
    lengths = torch.randint(1, T + 1, (B,), generator=g) if pad else torch.full((B,), T)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    s = torch.rand(B, generator=g)
    p = torch.softmax(3 * torch.randn(B, H, generator=g), -1)
    w_qkv, b_qkv = torch.randn(3 * d, d, generator=g) / math.sqrt(d), torch.randn(3 * d, generator=g)
    w_o, b_o = torch.randn(d, d, generator=g) / math.sqrt(d), torch.randn(d, generator=g)
    return x, mask, s, p, w_qkv, b_qkv, w_o, b_o, H


@settings(max_examples=60, deadline=None)
@given(B=st.integers(1, 5), T=st.integers(1, 24), H=st.sampled_from([1, 2, 3, 4, 8]),
       dh=st.sampled_from([1, 2, 4, 8]), seed=st.integers(0, 10_000))
def test_kernel_matches_dense_masked_reference(B, T, H, dh, seed):
    args = _inputs(B, T, H, dh, seed)
    y, k, mask = torch.ops.adaptex.budgeted_attention(*args)
    y_ref, k_ref, mask_ref = ba.budgeted_attention_dense_reference(*args)
    assert torch.equal(k, k_ref) and torch.equal(mask, mask_ref)
    assert torch.equal(mask.sum(-1), k)
    # the routing checked independently of select_heads: floor/clamp by hand, top-k by a stable sort
    s, p = args[2], args[3]
    for b in range(B):
        kb = min(max(int(math.floor(float(s[b]) * H)), 1), H)
        order = sorted(range(H), key=lambda i: (-float(p[b, i]), i))
        assert int(k[b]) == kb
        assert mask[b].tolist() == [i in order[:kb] for i in range(H)]
    valid = args[1][:, :, None]  # padded query rows are don't-care
    torch.testing.assert_close(y * valid, y_ref * valid, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("s, expected", [(0.0, 1), (0.01, 1), (0.124, 1), (0.125, 1), (0.25, 2),
                                         (0.2499, 1), (0.5, 4), (0.99, 7), (0.999999, 7)])
def test_budget_is_clamped_floor(s, expected):
    assert ba.head_budget(torch.tensor([s]), 8).item() == expected


def test_ties_go_to_the_lower_head_index():
    p = torch.tensor([[0.1, 0.3, 0.3, 0.3]])
    k, mask, ranks = ba.select_heads(torch.tensor([0.5]), p, 4)  # k = 2
    assert k.item() == 2
    assert mask.tolist() == [[False, True, True, False]]
    assert ranks.tolist() == [[3, 0, 1, 2]]


def test_unselected_heads_weights_are_never_read():
    """Poison every unselected head's weight rows and output columns with NaN: the output stays
    finite only if the kernel never touches them (the saving is real, not a mask)."""
    x, mask, s, p, w_qkv, b_qkv, w_o, b_o, H = _inputs(1, 9, 8, 4, seed=3, pad=False)
    s = torch.tensor([0.3])  # k = 2
    _, head_mask, _ = ba.select_heads(s, p, H)
    dh, d = 4, 32
    w_qkv, w_o, b_qkv = w_qkv.clone(), w_o.clone(), b_qkv.clone()
    for h in torch.nonzero(~head_mask[0]).flatten().tolist():
        for third in range(3):
            w_qkv[third * d + h * dh: third * d + (h + 1) * dh] = float("nan")
            b_qkv[third * d + h * dh: third * d + (h + 1) * dh] = float("nan")
        w_o[:, h * dh:(h + 1) * dh] = float("nan")
    y, k, _ = torch.ops.adaptex.budgeted_attention(x, mask, s, p, w_qkv, b_qkv, w_o, b_o, H)
    assert k.item() == 2
    assert torch.isfinite(y).all()


def test_samples_in_a_batch_keep_their_own_heads():
    x, mask, _, p, w_qkv, b_qkv, w_o, b_o, H = _inputs(3, 6, 4, 2, seed=5, pad=False)
    s = torch.tensor([0.1, 0.6, 0.99])  # k = 1, 2, 3
    y, k, _ = torch.ops.adaptex.budgeted_attention(x, mask, s, p, w_qkv, b_qkv, w_o, b_o, H)
    assert k.tolist() == [1, 2, 3]
    for b in range(3):  # each sample alone gives what it gave inside the batch
        one = slice(b, b + 1)
        y1, _, _ = torch.ops.adaptex.budgeted_attention(x[one], mask[one], s[one], p[one],
                                                        w_qkv, b_qkv, w_o, b_o, H)
        torch.testing.assert_close(y1[0], y[b], atol=1e-6, rtol=1e-5)


def test_fake_kernel_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        args = _inputs(2, 5, 4, 2, seed=0)
        y, k, mask = torch.ops.adaptex.budgeted_attention(*args)
    assert y.shape == (2, 5, 8) and k.shape == (2,) and k.dtype == torch.int64
    assert mask.shape == (2, 4) and mask.dtype == torch.bool


def test_model_modes_agree_at_inference():
    """hard (the op), eager (its kernel as plain Python) and naive (all heads, masked) are the
    same function; only their cost and traceability differ."""
    from tests.support import zoo

    model = zoo.tiny_model()
    ids, mask = torch.randint(1, 64, (4, 11)), torch.ones(4, 11, dtype=torch.int64)
    mask[2, 6:] = 0
    with torch.no_grad():
        outs = {m: model(ids, mask, mode=m) for m in ("hard", "eager", "naive")}
    for m in ("eager", "naive"):
        torch.testing.assert_close(outs[m][0], outs["hard"][0], atol=1e-5, rtol=1e-4)
        for a, b in zip(outs[m][1], outs["hard"][1]):
            assert torch.equal(a["k"], b["k"]) and torch.equal(a["head_mask"], b["head_mask"])
