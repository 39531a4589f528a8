"""Ordinary PyTorch and Hugging Face layers around adaptex.nn ones, as users combine them: each model
with its example inputs and a generator of check inputs (padded rows, batches 1 to 3, lengths 1 to
the maximum). tests/models/test_user_zoo.py exports each to every target."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import adaptex.nn as ann

MAX_LEN = 24


def _spread(model: nn.Module, factor: float = 8.0) -> nn.Module:
    """Routers spread so that decisions vary across inputs."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, ann.BudgetedAttention):
                m.router.budget[2].weight.mul_(factor)
                m.router.scorer[2].weight.mul_(factor)
    return model.eval()


def _masked_pools(x, keep):
    m = keep[..., None].to(x.dtype)
    mean = (x * m).sum(1) / m.sum(1).clamp_min(1)
    return mean, x.masked_fill(~keep[..., None], float("-inf")).amax(1)


class IssueClassifier(nn.Module):
    """Float features, a BudgetedAttention, an FFN, a plain nn.MultiheadAttention with a
    key_padding_mask, a second BudgetedAttention, masked mean and max pooling."""

    def __init__(self, f: int = 6, d: int = 16, h: int = 2, classes: int = 3):
        super().__init__()
        self.embed = nn.Linear(f, d)
        self.attn1 = ann.BudgetedAttention(d, h, router_hidden=8)
        self.ffn = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.mha = nn.MultiheadAttention(d, h, batch_first=True)
        self.attn2 = ann.BudgetedAttention(d, h, router_hidden=8)
        self.head = nn.Linear(2 * d, classes)

    def forward(self, feats, mask):
        keep = mask.bool()
        x = self.embed(feats)
        x = x + self.attn1(x, mask)
        x = x + self.ffn(x)
        x = x + self.mha(x, x, x, key_padding_mask=~keep, need_weights=False)[0]
        x = x + self.attn2(x, mask)
        return self.head(torch.cat(_masked_pools(x, keep), -1))


class MaskSweep(nn.Module):
    """Attention masks of every kind (bool, float -inf, additive finfo.min, causal, causal with padding),
    nn.MultiheadAttention in both batch_first settings with key padding and attention masks, masked
    fills, tensor factories with a dtype, pooling over padded rows: one named output each."""

    def __init__(self, f: int = 6, d: int = 16, h: int = 2):
        super().__init__()
        self.h = h
        self.embed = nn.Linear(f, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.mha = nn.MultiheadAttention(d, h, batch_first=True)
        self.mha_seq = nn.MultiheadAttention(d, h)
        self.attn = ann.BudgetedAttention(d, h, router_hidden=8)

    def forward(self, feats, mask):
        x = self.embed(feats)
        keep = mask.bool()
        B, T, d = x.shape
        q, k, v = [t.view(B, T, self.h, d // self.h).transpose(1, 2) for t in self.qkv(x).chunk(3, -1)]  # (B, h, T, dh)
        keys = keep[:, None, None, :]
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        out = {"sdpa_bool": F.scaled_dot_product_attention(q, k, v, attn_mask=keys)}
        inf = torch.zeros_like(keep, dtype=x.dtype).masked_fill(~keep, float("-inf"))
        out["sdpa_float_inf"] = F.scaled_dot_product_attention(q, k, v, attn_mask=inf[:, None, None, :])
        additive = (1.0 - keys.to(x.dtype)) * torch.finfo(x.dtype).min  # Hugging Face's extended mask
        out["sdpa_additive"] = F.scaled_dot_product_attention(q, k, v, attn_mask=additive)
        out["sdpa_causal"] = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out["sdpa_causal_padded"] = F.scaled_dot_product_attention(q, k, v, attn_mask=causal & keys)
        scores = (q @ k.transpose(-1, -2)).masked_fill(~keys, -1e9)
        out["masked_fill_softmax"] = torch.softmax(scores, -1) @ v
        out["mha_key_padding"] = self.mha(x, x, x, key_padding_mask=~keep, need_weights=False)[0]
        float_keys = x.new_zeros((B, T)).masked_fill(~keep, float("-inf"))
        float_causal = torch.zeros(T, T).masked_fill(~causal, float("-inf"))
        out["mha_float_masks"] = self.mha(x, x, x, key_padding_mask=float_keys, attn_mask=float_causal,
                                          need_weights=False)[0]
        xs = x.transpose(0, 1)  # (T, B, d): batch_first=False
        out["mha_sequence_first"] = self.mha_seq(xs, xs, xs, key_padding_mask=~keep, attn_mask=~causal,
                                                 need_weights=False)[0].transpose(0, 1)
        ones = torch.ones_like(keep, dtype=torch.float32)
        out["factories"] = ones.cumsum(1) * torch.full_like(keep, 0.5, dtype=torch.float32) \
            + x.new_zeros((B, T), dtype=torch.bool).logical_or(keep).float()
        y = x + self.attn(x, mask)
        out["mean_pool"], out["max_pool_fill"] = _masked_pools(y, keep)
        out["max_pool_where"] = torch.where(keep[..., None], y, torch.full_like(y, -1e4)).max(1).values
        out["zero_fill"] = torch.where(keep[..., None], y, 0.0)
        return out


class ConvEncoder(nn.Module):
    """A Conv1d stem, nn.TransformerEncoderLayers (norm_first and not) with src_key_padding_mask around
    a BudgetedAttention."""

    def __init__(self, f: int = 6, d: int = 16, h: int = 2, classes: int = 3):
        super().__init__()
        self.stem = nn.Conv1d(f, d, 3, padding=1)
        layer = dict(dim_feedforward=2 * d, dropout=0.0, batch_first=True)
        self.pre = nn.TransformerEncoderLayer(d, h, norm_first=True, **layer)
        self.attn = ann.BudgetedAttention(d, h, router_hidden=8)
        self.post = nn.TransformerEncoderLayer(d, h, norm_first=False, **layer)
        self.head = nn.Linear(d, classes)

    def forward(self, feats, mask):
        keep = mask.bool()
        x = self.stem(feats.transpose(1, 2)).transpose(1, 2)  # (B, T, d)
        x = self.pre(x, src_key_padding_mask=~keep)
        x = x + self.attn(x, mask)
        x = self.post(x, src_key_padding_mask=~keep)
        return self.head(_masked_pools(x, keep)[0])


class Seq2Seq(nn.Module):
    """nn.TransformerDecoderLayer with a causal mask and padded targets, over a memory a
    BudgetedAttention encodes; dict outputs."""

    def __init__(self, f: int = 6, d: int = 16, h: int = 2, vocab: int = 11):
        super().__init__()
        self.src, self.tgt = nn.Linear(f, d), nn.Linear(f, d)
        self.enc = ann.BudgetedAttention(d, h, router_hidden=8)
        self.dec = nn.TransformerDecoderLayer(d, h, 2 * d, dropout=0.0, batch_first=True)
        self.out = nn.Linear(d, vocab)

    def forward(self, src, src_mask, tgt, tgt_mask):
        memory = self.src(src)
        memory = memory + self.enc(memory, src_mask)
        T = tgt.shape[1]
        causal = nn.Transformer.generate_square_subsequent_mask(T)
        y = self.dec(self.tgt(tgt), memory, tgt_mask=causal, tgt_key_padding_mask=~tgt_mask.bool(),
                     memory_key_padding_mask=~src_mask.bool(), tgt_is_causal=True)
        return {"logits": self.out(y), "memory": _masked_pools(memory, src_mask.bool())[0]}


class PatchViT(nn.Module):
    """A ViT-style convolutional patch stem: images (B, 3, H, W) -> 4x4 patches -> budgeted attention."""

    def __init__(self, d: int = 16, h: int = 2, classes: int = 3):
        super().__init__()
        self.patch = nn.Conv2d(3, d, 4, stride=4)
        self.norm = nn.LayerNorm(d)
        self.attn = ann.BudgetedAttention(d, h, router_hidden=8)
        self.head = nn.Linear(d, classes)

    def forward(self, images):
        x = self.patch(images).flatten(2).transpose(1, 2)  # (B, N, d)
        x = x + self.attn(self.norm(x))
        return self.head(x.mean(1))


class BertBudget(nn.Module):
    """A transformers BertModel (from a save_pretrained directory) with a BudgetedAttention over its
    hidden states and a masked-mean head; dict outputs."""

    def __init__(self, path: Path):
        super().__init__()
        import transformers

        self.bert = transformers.BertModel.from_pretrained(path)
        d = self.bert.config.hidden_size
        self.attn = ann.BudgetedAttention(d, 4, router_hidden=8)
        self.head = nn.Linear(d, 3)

    def forward(self, input_ids, attention_mask):
        h = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        h = h + self.attn(h, attention_mask)
        return {"logits": self.head(_masked_pools(h, attention_mask.bool())[0]), "hidden": h}


class GPT2Elastic(nn.Module):
    """A transformers GPT2Model (from a save_pretrained directory) with a causal ElasticAttention on
    top (each head full or streaming) and an LM head."""

    def __init__(self, path: Path):
        super().__init__()
        import transformers

        self.gpt = transformers.GPT2Model.from_pretrained(path)
        d, self.h = self.gpt.config.n_embd, 4
        self.q, self.kv = nn.Linear(d, d), nn.Linear(d, 2 * d)
        self.mix = ann.ElasticAttention(self.h, d // self.h, sink=1, window=3, causal=True, router_hidden=8,
                                        pool_tokens=4)
        self.lm = nn.Linear(d, self.gpt.config.vocab_size)

    def forward(self, input_ids, attention_mask):
        h = self.gpt(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        B, T, d = h.shape
        q = self.q(h).view(B, T, self.h, d // self.h).transpose(1, 2)  # (B, H, T, dh)
        k, v = self.kv(h).view(B, T, 2, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        o = self.mix(q, k, v, attention_mask)
        return self.lm(h + o.transpose(1, 2).reshape(B, T, d))


def hf_dir(kind: str, root: Path) -> Path:
    """A tiny random-initialised BertModel or GPT2Model, written with save_pretrained."""
    import transformers as tf

    torch.manual_seed(0)
    if kind == "bert":
        model = tf.BertModel(tf.BertConfig(vocab_size=60, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                           intermediate_size=24, max_position_embeddings=64))
    else:
        model = tf.GPT2Model(tf.GPT2Config(vocab_size=60, n_positions=64, n_embd=16, n_layer=1, n_head=2))
    model.save_pretrained(root / kind)
    return root / kind


def _lengths(rng, i: int) -> tuple[int, int]:
    return [1, 2, 3][i % 3], [1, MAX_LEN, 2, 7, 16][i % 5] if i < 5 else int(rng.integers(1, MAX_LEN + 1))


def _mask(rng, B: int, T: int, dtype=bool) -> np.ndarray:
    m = np.ones((B, T), dtype)
    if B > 1 and T > 1:  # every row after the first padded at a random length (>= 1 real token)
        for b in range(1, B):
            m[b, rng.integers(1, T):] = 0
    return m


def _varied(n: int, seed: int, make) -> list[tuple]:
    """n inputs, make(rng, batch, length) each."""
    rng = np.random.default_rng(seed)
    return [make(rng, *_lengths(rng, i)) for i in range(n)]


def feature_inputs(n: int, seed: int = 0, f: int = 6) -> list[tuple]:
    return _varied(n, seed, lambda rng, B, T: (rng.normal(size=(B, T, f)).astype(np.float32), _mask(rng, B, T)))


def seq2seq_inputs(n: int, seed: int = 0, f: int = 6) -> list[tuple]:
    """(src, src_mask, tgt, tgt_mask): the source of a random length, the target of the varied one."""
    def make(rng, B, T):
        S = int(rng.integers(1, MAX_LEN + 1))
        return (rng.normal(size=(B, S, f)).astype(np.float32), _mask(rng, B, S),
                rng.normal(size=(B, T, f)).astype(np.float32), _mask(rng, B, T))
    return _varied(n, seed, make)


def image_inputs(n: int, seed: int = 0) -> list[tuple]:
    """16 x 24 images (24 patches), batches 1 to 3."""
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=(1 + i % 3, 3, 16, 24)).astype(np.float32),) for i in range(n)]


def token_inputs(n: int, seed: int = 0, vocab: int = 60) -> list[tuple]:
    return _varied(n, seed, lambda rng, B, T: (rng.integers(1, vocab, size=(B, T)), _mask(rng, B, T, np.int64)))


def build(name: str, root: Path):
    """(model, example inputs, check inputs, export options) of one zoo model."""
    torch.manual_seed(0)
    feats = (torch.randn(2, 10, 6), torch.ones(2, 10, dtype=torch.bool))
    if name == "issue-classifier":
        return _spread(IssueClassifier()), feats, feature_inputs(10), {}
    if name == "mask-sweep":
        return _spread(MaskSweep()), feats, feature_inputs(10), {}
    if name == "conv-encoder":
        return _spread(ConvEncoder()), feats, feature_inputs(10), {}
    if name == "seq2seq":
        # the target's length differs from the source's in the example: torch.export gives axes of
        # equal example sizes one symbol (duck sizing), which would tie the two lengths
        tgt = (torch.randn(2, 7, 6), torch.ones(2, 7, dtype=torch.bool))
        return _spread(Seq2Seq()), feats + tgt, seq2seq_inputs(10), {}
    if name == "patch-vit":
        # a fixed resolution, as ViTs take (coremltools fails to convert a conv stem over dynamic image
        # sides: its output size mixes int and float in a concat)
        return _spread(PatchViT()), (torch.randn(2, 3, 16, 24),), image_inputs(6), \
            {"dynamic_shapes": {"images": {0: torch.export.Dim("batch", max=16)}}}
    ids = (torch.randint(1, 60, (2, 8)), torch.ones(2, 8, dtype=torch.long))
    if name == "bert":
        return _spread(BertBudget(hf_dir("bert", root))), ids, token_inputs(10), {}
    if name == "gpt2":
        model = GPT2Elastic(hf_dir("gpt2", root))
        with torch.no_grad():
            model.mix.router[2].weight.mul_(20)
        return model.eval(), ids, token_inputs(10), {}
    raise KeyError(name)


ZOO = ("issue-classifier", "mask-sweep", "conv-encoder", "seq2seq", "patch-vit", "bert", "gpt2")
