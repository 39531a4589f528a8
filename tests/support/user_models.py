"""Models a user would write against the documented API (adaptex.nn), defined here and never in the
package: (a) a ViT-like patch classifier with budgeted attention in some layers and plain attention in
others, a custom head and float inputs; (b) a decoder of its own layout, TSA blocks and elastic
attention in alternating layers, with its KV cache stacked into two tensors."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn

import adaptex.nn as ann


class PlainAttention(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.h, self.qkv, self.out = h, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x, mask):
        B, T, d = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        bias = torch.zeros(B, 1, 1, T).masked_fill(~mask.bool()[:, None, None, :], -1e4)
        a = torch.softmax(q @ k.transpose(-1, -2) * (d // self.h) ** -0.5 + bias, -1) @ v
        return self.out(a.transpose(1, 2).reshape(B, T, d))


class PatchBlock(nn.Module):
    def __init__(self, d: int, h: int, budgeted: bool):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = ann.BudgetedAttention(d, h, router_hidden=16) if budgeted else PlainAttention(d, h)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x, mask):
        x = x + self.attn(self.norm1(x), mask)
        return x + self.mlp(self.norm2(x))


class PatchClassifier(nn.Module):
    """(a): patches (B, N, P) float and a patch mask (B, N) -> class scores (B, C)."""

    def __init__(self, patch: int = 12, d: int = 32, heads: int = 4, classes: int = 5):
        super().__init__()
        self.embed = nn.Linear(patch, d)
        self.encoder = nn.ModuleDict({"layers": nn.ModuleList(
            [PatchBlock(d, heads, True), PatchBlock(d, heads, False), PatchBlock(d, heads, True)])})
        self.head = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, classes))

    def forward(self, patches, mask):
        x = self.embed(patches)
        for block in self.encoder["layers"]:
            x = block(x, mask)
        m = mask.to(x.dtype)[..., None]
        return self.head((x * m).sum(1) / m.sum(1).clamp_min(1.0))


def patch_classifier(seed: int = 0, spread: float = 8.0) -> PatchClassifier:
    """Routers spread so that k varies across inputs; a head scaled so logits are O(3) (errors show)."""
    torch.manual_seed(seed)
    model = PatchClassifier()
    with torch.no_grad():
        for block in model.encoder["layers"]:
            if isinstance(block.attn, ann.BudgetedAttention):
                block.attn.router.budget[2].weight.mul_(spread)
                block.attn.router.scorer[2].weight.mul_(spread)
        model.head[1].weight.mul_(4)
    return model.eval()


def patch_inputs(n: int, seed: int = 0, patch: int = 12) -> list[tuple[np.ndarray, np.ndarray]]:
    """n varied inputs: batch 1..8, 1..40 patches, padded rows, inputs at several scales."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        B, N = [1, 2, 3, 8][i % 4], int(rng.choice([1, 2, 7, 16, 40]))
        x = (rng.normal(size=(B, N, patch)) * [0.5, 1.0, 3.0][i % 3]).astype(np.float32)
        mask = np.ones((B, N), bool)
        if B > 1 and N > 1:
            mask[1:, rng.integers(1, N):] = False
        out.append((x, mask))
    return out


class ElasticLayer(nn.Module):
    """A causal attention layer whose heads elastic attention routes (full or streaming)."""

    def __init__(self, d: int, h: int, sink: int = 2, window: int = 4):
        super().__init__()
        self.h, self.norm = h, nn.LayerNorm(d)
        self.q, self.kv, self.o = nn.Linear(d, d), nn.Linear(d, 2 * d), nn.Linear(d, d)
        self.mix = ann.ElasticAttention(h, d // h, sink=sink, window=window, causal=True, router_hidden=16,
                                        pool_tokens=4)
        self.mlp = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x, mask, past_k, past_v):
        B, T, d = x.shape
        h = self.norm(x)
        q = self.q(h).view(B, T, self.h, d // self.h).transpose(1, 2)
        k, v = self.kv(h).view(B, T, 2, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        k, v = torch.cat([past_k, k], 2), torch.cat([past_v, v], 2)
        o = self.mix(q, k, v, mask)
        x = x + self.o(o.transpose(1, 2).reshape(B, T, d))
        return x + self.mlp(x), k, v


class MixedDecoder(nn.Module):
    """(b): TSA blocks and elastic layers alternating; a router after each elastic layer gates the next
    TSA block. forward(input_ids (B, T), attention_mask (B, P+T), past_keys and past_values
    (L, B, H, P, dh)) -> (logits, keys, values) with the caches grown by T."""

    def __init__(self, vocab: int = 48, d: int = 32, h: int = 4, layers: int = 4, max_len: int = 64):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(max_len, d)
        self.layers = nn.ModuleList(ann.ConditionalBlock(d, h, 2 * d) if i % 2 == 0 else ElasticLayer(d, h)
                                    for i in range(layers))
        self.gates = nn.ModuleDict({str(i): ann.TokenRouter(d) for i in range(1, layers - 1, 2)})
        self.norm, self.lm = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, input_ids, attention_mask, past_keys, past_values):
        B, T = input_ids.shape
        P = past_keys.shape[3]
        x = self.tok(input_ids) + self.pos(torch.arange(T) + P)[None]
        bias = ann.causal_bias(attention_mask, P, T)
        keep = gate = None
        keys, values = [], []
        for i, layer in enumerate(self.layers):
            if isinstance(layer, ann.ConditionalBlock):
                x, (k, v) = layer(x, bias, (past_keys[i], past_values[i]), keep, gate)
            else:
                x, k, v = layer(x, attention_mask, past_keys[i], past_values[i])
                if str(i) in self.gates:
                    keep, gate = self.gates[str(i)](x)
            keys.append(k)
            values.append(v)
        return self.lm(self.norm(x)), torch.stack(keys), torch.stack(values)


def mixed_decoder(seed: int = 0, spread: float = 6.0) -> MixedDecoder:
    """Routers spread so that keep and head modes vary; the LM head scaled so logits are O(3)."""
    torch.manual_seed(seed)
    model = MixedDecoder()
    with torch.no_grad():
        for r in model.gates.values():
            r.net[0].weight.mul_(spread)
            r.net[2].weight.mul_(spread)
            r.net[2].bias.fill_(0.0)
        ids = torch.randint(1, 48, (16, 20))
        mask = torch.ones(16, 20, dtype=torch.long)
        z = torch.zeros(4, 16, 4, 0, 8)
        for layer in model.layers:  # spread each head router's SA/FA gap, then centre it
            if isinstance(layer, ElasticLayer):
                layer.mix.router[2].weight.mul_(spread * 5)
        with ann.record_decisions(model) as rec:
            model(ids, mask, z, z)
        for name, layer in model.layers.named_children():
            if isinstance(layer, ElasticLayer):
                logits = rec.decisions[f"layers.{name}.mix"]["logits"]
                layer.mix.router[2].bias[1] -= (logits[..., 1] - logits[..., 0]).median()
        model.lm.weight.mul_(4)
    return model.eval()


def decoder_example(batch: int = 2, seq: int = 5, past: int = 3) -> tuple:
    return (torch.randint(1, 48, (batch, seq)), torch.ones(batch, past + seq, dtype=torch.long),
            torch.randn(4, batch, 4, past, 8), torch.randn(4, batch, 4, past, 8))


def decoder_dynamic_shapes() -> tuple:
    """Named axes: batch, sequence, and a past that may be 0 (a prefill passes empty caches)."""
    Dim = torch.export.Dim
    batch, seq, past = Dim("batch", max=64), Dim("sequence", max=60), Dim("past_sequence", min=0, max=59)
    return ({0: batch, 1: seq}, {0: batch, 1: Dim.AUTO}, {1: batch, 3: past}, {1: batch, 3: past})


@torch.no_grad()
def decoder_inputs(model: MixedDecoder, n: int, seed: int = 0) -> list[tuple]:
    """n varied calls: prefills of 1..40 tokens (empty caches), and decode steps of 1..3 tokens on the
    caches the eager model built for the preceding text; batch 1..4."""
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < n:
        B, N = [1, 2, 4][len(out) % 3], int(rng.choice([2, 6, 17, 40]))
        ids = torch.from_numpy(rng.integers(1, 48, size=(B, N)))
        z = torch.zeros(4, B, 4, 0, 8)
        out.append((ids.numpy(), np.ones((B, N), np.int64), z.numpy(), z.numpy()))
        _, keys, values = model(ids, torch.ones(B, N, dtype=torch.long), z, z)
        for step in range(int(rng.integers(1, 4))):
            T = int(rng.integers(1, 4))
            new = rng.integers(1, 48, size=(B, T))
            P = keys.shape[3]
            mask = np.ones((B, P + T), np.int64)
            out.append((new, mask, keys.numpy(), values.numpy()))
            _, keys, values = model(torch.from_numpy(new), torch.from_numpy(mask), keys, values)
    return out[:n]



def patch_classifier_example() -> tuple:
    return torch.randn(3, 10, 12), torch.ones(3, 10, dtype=torch.bool)


class ReadmeTiny(nn.Module):
    """The README's model ("Bring your own model"), at its sizes: features (B, T, 16) and a mask (B, T)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(16, 64)
        self.attn = ann.BudgetedAttention(64, num_heads=8)
        self.head = nn.Linear(64, 3)

    def forward(self, features, mask):
        x = self.embed(features)
        return self.head((x + self.attn(x, mask)).mean(1))
