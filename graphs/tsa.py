"""TSA (Token Selective Attention): a pre-norm decoder whose tokens skip later blocks' FFNs.

Blocks f_0..f_{L-1}; f_0 always runs. A router after block l (l = 0..L-2) gives, per token,
  p_l = sigmoid(W2 relu(W1 h + b1) + b2)   (hidden width max(d/4, 16), b2 initialised to -1)
and block l+1's attention and FFN residual updates are scaled by (1 - p_l).
- soft (training): every token computed, updates scaled by 1 - p.
- hard (inference): keep = p <= 0.5. Tokens with keep = False skip block l+1's FFN for real (the
  `adaptex::conditional_ffn` op gathers the kept tokens, runs the FFN, scatters back). Attention
  stays dense over keys: every token's keys and values are computed, so later tokens can attend to
  it; its update is gated by keep * (1 - p), so a skipped token's query side (Q projection, its
  row of scores, AV, output projection) is dead work, and `adaptex::conditional_attention` skips
  it too (queries of the kept tokens only, against every key).
- st (late training): hard decisions forward, soft gradients backward (straight-through), so the
  deployed hard model is the one that is trained.
- dense: no routers, every block ungated: the latency counterpart with the same weights.
`adaptive=False` gives the dense decoder baseline of the same size (trained on its own).

Every forward takes an optional KV cache (`past`: per layer (key, value), each (B, H, P, dh)) and
returns the presents, so generation runs prefill then one step per token; positions continue at P.
Metrics: alpha = mean over routers and real tokens of (1 - p) (hard: of keep); token-layer ops
saved = 1 - (1 + (L-1) alpha) / L.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from adaptex.graphs.budgetformer import sinusoids
from adaptex.graphs.ops import conditional_attention as ca
from adaptex.graphs.ops import conditional_ffn as cf

MODES = ("soft", "st", "hard", "hard_dense", "dense")


@dataclass
class TSAConfig:
    vocab_size: int = 32
    d_model: int = 128
    num_heads: int = 4
    num_layers: int = 6
    d_ff: int = 512
    max_len: int = 128  # positions (fixed sinusoids), hence the KV cache bound (prompt + generated tokens)
    router_hidden: int = 0  # 0: max(d/4, 16), the paper's width
    threshold: float = 0.5  # a token skips when p > threshold
    pad_id: int = 0
    adaptive: bool = True
    ln_eps: float = 1e-5
    # "sinusoid" (fixed; defined at every position up to max_len, whatever the training context) or
    # "learned" (an embedding table: on copy/sort the sinusoids, of amplitude 1 against token
    # embeddings of std 0.02, drowned the token identities and training never left ln(29))
    positions: str = "sinusoid"
    family: str = field(default="tsa", init=False)

    def __post_init__(self):
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}")
        if self.num_layers < 2:
            raise ValueError("TSA needs at least 2 blocks (block 0 always runs)")
        if self.positions not in ("sinusoid", "learned"):
            raise ValueError(f"positions must be 'sinusoid' or 'learned', got {self.positions!r}")
        if not self.router_hidden:
            self.router_hidden = max(self.d_model // 4, 16)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TSAConfig":
        return cls(**{k: v for k, v in d.items() if k != "family"})


def attention_mask_4d(key_ok: Tensor, past_len, T: int) -> Tensor:
    """(B, T, P+T) bool: query i (absolute position P+i) sees real keys at positions <= P+i, and
    always itself (so a padded query row is never empty)."""
    S = key_ok.shape[1]
    qpos = torch.arange(T, device=key_ok.device) + past_len  # (T,)
    kpos = torch.arange(S, device=key_ok.device)  # (S,)
    causal = kpos[None, :] <= qpos[:, None]  # (T, S)
    own = kpos[None, :] == qpos[:, None]  # (T, S)
    return (causal[None] & key_ok[:, None, :]) | own[None]


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: TSAConfig):
        super().__init__()
        self.h, self.dh = cfg.num_heads, cfg.d_model // cfg.num_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: Tensor, bias: Tensor, past_k: Tensor, past_v: Tensor):
        B, T, d = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, self.dh).permute(2, 0, 3, 1, 4)  # each (B, H, T, dh)
        k = torch.cat([past_k, k], dim=2)  # (B, H, P+T, dh)
        v = torch.cat([past_v, v], dim=2)
        att = ((q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(self.dh)) + bias).softmax(-1)  # (B, H, T, P+T)
        y = (att @ v).transpose(1, 2).reshape(B, T, d)  # (B, T, d)
        return self.proj(y), k, v

    def kv(self, x: Tensor, past_k: Tensor, past_v: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values of every token (past + these T), each (B, H, P+T, dh): the rows of the
        fused projection after the query's, so a gated block projects queries for kept tokens only."""
        B, T, d = x.shape
        k, v = F.linear(x, self.qkv.weight[d:], self.qkv.bias[d:]).view(B, T, 2, self.h, self.dh).permute(2, 0, 3, 1, 4)
        return torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)

    def query_args(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(wq, bq, wo, bo) for adaptex::conditional_attention."""
        d = self.proj.weight.shape[0]
        return self.qkv.weight[:d], self.qkv.bias[:d], self.proj.weight, self.proj.bias


class Block(nn.Module):
    def __init__(self, cfg: TSAConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps)
        self.ffn = nn.Sequential(nn.Linear(cfg.d_model, cfg.d_ff), nn.GELU(), nn.Linear(cfg.d_ff, cfg.d_model))

    def ffn_args(self):
        return (self.ln2.weight, self.ln2.bias, self.ffn[0].weight, self.ffn[0].bias,
                self.ffn[2].weight, self.ffn[2].bias, self.ln2.eps)


class TokenRouter(nn.Module):
    """p = sigmoid(W2 relu(W1 h + b1) + b2) per token; b2 = -1 so tokens start mostly kept."""

    def __init__(self, cfg: TSAConfig):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(cfg.d_model, cfg.router_hidden), nn.ReLU(),
                                 nn.Linear(cfg.router_hidden, 1))
        nn.init.constant_(self.net[2].bias, -1.0)

    def forward(self, h: Tensor) -> Tensor:
        return torch.sigmoid(self.net(h.float()).squeeze(-1))  # (B, T) fp32


class TSADecoder(nn.Module):
    def __init__(self, cfg: TSAConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        if cfg.positions == "learned":
            self.pos_emb = nn.Embedding(cfg.max_len, cfg.d_model)
        else:
            self.register_buffer("pos", sinusoids(cfg.max_len, cfg.d_model), persistent=False)  # (max_len, d)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.routers = nn.ModuleList(TokenRouter(cfg) for _ in range(cfg.num_layers - 1)) if cfg.adaptive else None
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps)
        self.apply(self._init)
        if cfg.adaptive:
            for r in self.routers:
                nn.init.constant_(r.net[2].bias, -1.0)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    def empty_past(self, B: int, device=None) -> list[tuple[Tensor, Tensor]]:
        H, dh = self.cfg.num_heads, self.cfg.d_model // self.cfg.num_heads
        z = torch.zeros(B, H, 0, dh, device=device)
        return [(z, z) for _ in range(self.cfg.num_layers)]

    def embed(self, input_ids: Tensor, attention_mask: Tensor | None, P: int) -> tuple[Tensor, Tensor]:
        """Token + position embeddings of the T new tokens (positions P..P+T-1), (B, T, d), and the
        additive attention bias every layer shares, (B, 1, T, P+T): 0 visible, -inf hidden."""
        B, T = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones(B, P + T, dtype=torch.int64, device=input_ids.device)
        allowed = attention_mask_4d(attention_mask.bool(), P, T)  # (B, T, P+T)
        # one additive bias for every layer: an Add per layer, where a masked_fill would be a Where
        # over (B, H, T, P+T) per layer (16% of prefill time at T=512 in ONNX Runtime)
        bias = torch.zeros(allowed.shape, dtype=torch.float32, device=allowed.device).masked_fill(
            ~allowed, float("-inf"))[:, None]  # (B, 1, T, P+T)
        pos = torch.arange(T, device=input_ids.device) + P
        pe = self.pos_emb(pos) if self.cfg.positions == "learned" else self.pos[pos]  # (T, d)
        return self.tok(input_ids) + pe[None], bias

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                past: list[tuple[Tensor, Tensor]] | None = None, mode: str = "hard",
                force_keep: list[Tensor | None] | None = None):
        """input_ids (B, T); attention_mask (B, P+T), 1 for real tokens (default all real).

        Returns logits (B, T, V), decisions (per router: {"keep": (B, T) bool, "p": (B, T) fp32}) and
        presents (per block: (key, value), each (B, H, P+T, dh)). `force_keep` replays a routing."""
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
        cfg = self.cfg
        B, T = input_ids.shape
        past = past if past is not None else self.empty_past(B, input_ids.device)
        P = past[0][0].shape[2]
        h, bias = self.embed(input_ids, attention_mask, P)
        adaptive = cfg.adaptive and mode != "dense"
        decisions, presents = [], []
        gate = None  # (B, T) scale of this block's updates; None: ungated
        keep = None
        for li, blk in enumerate(self.blocks):
            if gate is not None and mode in ("hard", "hard_dense"):
                # gate = keep * (1 - p), zero for the skipping tokens: every token's keys and values,
                # but queries, attention rows and FFN for the kept tokens only
                hn = blk.ln1(h)
                k, v = blk.attn.kv(hn, *past[li])
                presents.append((k, v))
                sparse = mode == "hard"
                attn = ca.conditional_attention if sparse else ca.conditional_attention_dense_reference
                h = attn(h, hn, keep, gate, k, v, bias, *blk.attn.query_args(), cfg.num_heads)
                ffn = cf.conditional_ffn if sparse else cf.conditional_ffn_dense_reference
                h = ffn(h, keep, gate, *blk.ffn_args())
            else:
                a, k, v = blk.attn(blk.ln1(h), bias, *past[li])
                presents.append((k, v))
                if gate is None:
                    h = h + a
                    h = h + blk.ffn(blk.ln2(h))
                else:  # soft, st
                    h = h + a * gate[..., None]
                    h = h + blk.ffn(blk.ln2(h)) * gate[..., None]
            if adaptive and li < cfg.num_layers - 1:
                p = self.routers[li](h)  # (B, T) fp32
                keep = p <= cfg.threshold
                if force_keep is not None and force_keep[li] is not None:
                    keep = force_keep[li].bool()
                if mode == "soft":
                    gate = 1 - p
                elif mode == "st":  # forward: keep * (1 - p); backward: as if soft
                    soft = 1 - p
                    gate = keep.float() * soft + (soft - soft.detach()) * (1 - keep.float())
                else:
                    gate = keep.float() * (1 - p)
                decisions.append({"keep": keep, "p": p})
        logits = F.linear(self.ln_f(h), self.tok.weight)  # (B, T, V), tied embeddings
        return logits, decisions, presents


def alpha(decisions: list[dict], mask: Tensor, hard: bool = True) -> float:
    """Mean keep rate over routers and real tokens: 1 - p (soft) or keep (hard)."""
    if not decisions:
        return 1.0
    m = mask.float()
    vals = [((d["keep"].float() if hard else 1 - d["p"]) * m).sum() / m.sum().clamp(min=1) for d in decisions]
    return float(torch.stack(vals).mean().detach())


def ops_saved(a: float, num_layers: int) -> float:
    """Token-layer ops saved: 1 - (1 + (L-1) alpha) / L (block 0 always runs)."""
    return 1.0 - (1.0 + (num_layers - 1) * a) / num_layers


def flops_per_token(cfg: TSAConfig, context: int, keep_rates: list[float] | None,
                    query_rates: list[float] | None = None) -> float:
    """Multiply-adds per token at a given attention context, with each of blocks 1..L-1 running its
    query side of attention (Q projection, scores, AV, output projection) for a fraction
    query_rates[l-1] of tokens (default: keep_rates) and its FFN for a fraction keep_rates[l-1]
    (None: every token). Keys and values are computed for every token."""
    d, f = cfg.d_model, cfg.d_ff
    kv = 2 * d * d
    query = 2 * d * d + 2 * context * d
    ffn = 2 * d * f
    gated = keep_rates is not None
    rates = [1.0] + (list(keep_rates) if gated else [1.0] * (cfg.num_layers - 1))
    qrates = [1.0] + list(query_rates) if query_rates is not None else rates
    router = (d * cfg.router_hidden + cfg.router_hidden) if gated else 0
    return sum(kv + q * query + r * ffn for r, q in zip(rates, qrates)) + router * (cfg.num_layers - 1) \
        + d * cfg.vocab_size


@torch.no_grad()
def generate(model: TSADecoder, prompt: list[int], max_new_tokens: int, mode: str = "hard") -> tuple[list[int], list[float]]:
    """Greedy decoding with the KV cache: prefill the prompt, then one step per token.

    Returns the generated ids and each step's keep rate (mean over routers); the parity reference
    for the exported generator (examples/tsa_generate.py)."""
    if not prompt:
        raise ValueError("empty prompt: pass at least one token")
    if len(prompt) + max_new_tokens > model.cfg.max_len:
        raise ValueError(f"prompt ({len(prompt)}) + new tokens ({max_new_tokens}) exceed the KV cache bound "
                         f"{model.cfg.max_len}")
    model.eval()
    ids = torch.tensor([prompt])
    logits, decisions, past = model(ids, mode=mode)
    out, keep = [], []
    for _ in range(max_new_tokens):
        nxt = int(logits[0, -1].argmax())
        out.append(nxt)
        keep.append(float(torch.stack([d["keep"][0, -1].float() for d in decisions]).mean()) if decisions else 1.0)
        if len(out) == max_new_tokens:
            break
        mask = torch.ones(1, past[0][0].shape[2] + 1, dtype=torch.int64)
        logits, decisions, past = model(torch.tensor([[nxt]]), mask, past=past, mode=mode)
    return out, keep
