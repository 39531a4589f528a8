"""Hugging Face decoders as frozen backbones, written in plain torch: GPT-2 (GPT2LMHeadModel) and
LLaMA (LlamaForCausalLM: RMSNorm, rotary positions, SwiGLU, grouped-query attention).

Each is split into the steps the elastic decoder (graphs/elastic_decoder.py) interleaves with its
routers: `embed_new` (token embeddings and whatever positions the layers need), `qkv` (a layer's
queries (B, H, T, dh) and new keys and values (B, Hkv, T, dh), positions applied), `attn_out`
(the attention output back into the residual stream), `mlp` and `head` (the logits). `dense`
chains them with full causal attention: the backbone itself, and what matches transformers.

Positions count the real tokens (the attention mask's cumulative sum), as transformers' generate
does: a left-padded row computes what it computes unpadded. Parameter names are the checkpoint's,
so weights load by name.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from adaptex.graphs.ops.elastic_attention import elastic_attention_dense_reference

def gelu_tanh(x: Tensor) -> Tensor:
    """GPT-2's gelu_new, written out: coremltools 9 converts F.gelu(approximate="tanh") from an
    ExportedProgram as the exact (erf) gelu, 1e-4 off; the formula converts as itself everywhere."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


ACTIVATIONS = {"gelu_new": gelu_tanh, "gelu_pytorch_tanh": gelu_tanh, "gelu": F.gelu, "relu": F.relu,
               "silu": F.silu, "swish": F.silu}


@dataclass
class HFDecoderConfig:
    layout: str  # "gpt2" | "llama"
    vocab_size: int
    d_model: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    d_ff: int
    max_len: int  # position embeddings (GPT-2) or the context the model was trained for (LLaMA)
    norm_eps: float
    pad_id: int = 0
    activation: str = "gelu_new"
    rope_theta: float = 10000.0
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_embeddings: bool = True

    def __post_init__(self):
        if self.layout not in DECODERS:
            raise ValueError(f"unknown decoder layout {self.layout!r}; adaptex implements {', '.join(DECODERS)}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r} is not one adaptex computes ({', '.join(ACTIVATIONS)})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} query heads do not split into {self.num_kv_heads} KV-head groups")

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.layout == "llama" else 2  # SwiGLU: gate, up, down

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict, where: str = "config") -> "HFDecoderConfig":
        """From a JSON object, every key checked (graphs/config.py)."""
        from adaptex.graphs.config import from_dict as config_from_dict

        return config_from_dict(cls, d, where)


def mask_positions(mask: Tensor, T: int) -> Tensor:
    """(B, T) float positions of the T new tokens: the real tokens before each one (left padding
    does not shift a row; padded slots get 0). Counted in fp32 (exact below 2^24, and Core ML's
    cumsum takes floats)."""
    m = mask.to(torch.float32)
    return (m.cumsum(1) - 1).clamp(min=0)[:, mask.shape[1] - T:]


def expand_kv(t: Tensor, groups: int) -> Tensor:
    """(B, Hkv, S, dh) -> (B, Hkv * groups, S, dh): each KV head serves its group of query heads."""
    if groups == 1:
        return t
    B, Hk, S, dh = t.shape
    return t[:, :, None].expand(B, Hk, groups, S, dh).reshape(B, Hk * groups, S, dh)


class HFDecoder(nn.Module):
    """What GPT-2 and LLaMA share: the cache, and the dense forward over the steps."""

    cfg: HFDecoderConfig

    def empty_past(self, B: int, device=None) -> list[tuple[Tensor, Tensor]]:
        z = torch.zeros(B, self.cfg.num_kv_heads, 0, self.cfg.head_dim, device=device)
        return [(z, z) for _ in range(self.cfg.num_layers)]

    def dense(self, input_ids: Tensor, attention_mask: Tensor | None = None,
              past: list[tuple[Tensor, Tensor]] | None = None) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        """(logits (B, T, V), presents: per layer (key, value) (B, Hkv, P+T, dh)) with full causal attention."""
        B, T = input_ids.shape
        past = past if past is not None else self.empty_past(B, input_ids.device)
        P = past[0][0].shape[2]
        if attention_mask is None:
            attention_mask = torch.ones(B, P + T, dtype=torch.int64, device=input_ids.device)
        key_ok = attention_mask.bool()
        g = self.cfg.num_heads // self.cfg.num_kv_heads
        h, ctx = self.embed_new(input_ids, attention_mask, P)
        presents = []
        for li in range(self.cfg.num_layers):
            q, k, v = self.qkv(li, h, ctx)
            k, v = torch.cat([past[li][0], k], dim=2), torch.cat([past[li][1], v], dim=2)
            presents.append((k, v))
            fa = torch.zeros(q.shape[:2], dtype=torch.bool, device=q.device)
            o = elastic_attention_dense_reference(q, expand_kv(k, g), expand_kv(v, g), fa, key_ok, 0, 1, True)
            h = self.attn_out(li, h, o.transpose(1, 2).reshape(B, T, -1))
            h = self.mlp(li, h)
        return self.head(h), presents

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, past=None):
        return self.dense(input_ids, attention_mask, past)

    def _heads(self, x: Tensor, n: int) -> Tensor:
        """(B, T, n dh) -> (B, n, T, dh)."""
        B, T, _ = x.shape
        return x.view(B, T, n, self.cfg.head_dim).transpose(1, 2)


# --- GPT-2 -----------------------------------------------------------------------------------------

class Conv1D(nn.Module):
    """GPT-2's linear layer: the weight stored (in, out)."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.weight + self.bias


class _GPT2Attention(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.c_attn, self.c_proj = Conv1D(d, 3 * d), Conv1D(d, d)


class _GPT2MLP(nn.Module):
    def __init__(self, d: int, f: int):
        super().__init__()
        self.c_fc, self.c_proj = Conv1D(d, f), Conv1D(f, d)


class _GPT2Block(nn.Module):
    def __init__(self, cfg: HFDecoderConfig):
        super().__init__()
        d = cfg.d_model
        self.ln_1, self.ln_2 = nn.LayerNorm(d, eps=cfg.norm_eps), nn.LayerNorm(d, eps=cfg.norm_eps)
        self.attn, self.mlp = _GPT2Attention(d), _GPT2MLP(d, cfg.d_ff)


class GPT2Decoder(HFDecoder):
    """GPT-2: learned positions, pre-LN blocks, fused QKV, tied output embedding (unless the config
    unties it)."""

    anchor = "wte.weight"

    def __init__(self, cfg: HFDecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.max_len, cfg.d_model)
        self.h = nn.ModuleList(_GPT2Block(cfg) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.act = ACTIVATIONS[cfg.activation]

    def embed_new(self, input_ids: Tensor, attention_mask: Tensor, P: int):
        pos = mask_positions(attention_mask, input_ids.shape[1]).long()
        return self.wte(input_ids) + self.wpe(pos), None

    def qkv(self, li: int, h: Tensor, ctx) -> tuple[Tensor, Tensor, Tensor]:
        blk, H = self.h[li], self.cfg.num_heads
        q, k, v = blk.attn.c_attn(blk.ln_1(h)).split(self.cfg.d_model, dim=-1)
        return self._heads(q, H), self._heads(k, H), self._heads(v, H)

    def attn_out(self, li: int, h: Tensor, o: Tensor) -> Tensor:
        return h + self.h[li].attn.c_proj(o)

    def mlp(self, li: int, h: Tensor) -> Tensor:
        blk = self.h[li]
        return h + blk.mlp.c_proj(self.act(blk.mlp.c_fc(blk.ln_2(h))))

    def head(self, h: Tensor) -> Tensor:
        h = self.ln_f(h)
        return self.lm_head(h) if self.lm_head is not None else F.linear(h, self.wte.weight)


# --- LLaMA -----------------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x: Tensor) -> Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rotate_half(x: Tensor) -> Tensor:
    """(x1, x2) -> (-x2, x1) over the two halves of the last axis: multiplying by i in the
    half-split complex layout LLaMA checkpoints use."""
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class _LlamaAttention(nn.Module):
    def __init__(self, cfg: HFDecoderConfig):
        super().__init__()
        d, H, Hk, dh, b = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.attention_bias
        self.q_proj, self.o_proj = nn.Linear(d, H * dh, bias=b), nn.Linear(H * dh, d, bias=b)
        self.k_proj, self.v_proj = nn.Linear(d, Hk * dh, bias=b), nn.Linear(d, Hk * dh, bias=b)


class _LlamaMLP(nn.Module):
    def __init__(self, cfg: HFDecoderConfig):
        super().__init__()
        d, f, b = cfg.d_model, cfg.d_ff, cfg.mlp_bias
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(d, f, bias=b), nn.Linear(d, f, bias=b), nn.Linear(f, d, bias=b)


class _LlamaLayer(nn.Module):
    def __init__(self, cfg: HFDecoderConfig):
        super().__init__()
        self.self_attn, self.mlp = _LlamaAttention(cfg), _LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)


class LlamaDecoder(HFDecoder):
    """LLaMA: RMSNorm pre-norm blocks, rotary positions on queries and keys, SwiGLU MLP, and
    grouped-query attention (num_kv_heads key/value heads, each shared by num_heads/num_kv_heads
    query heads; the cache holds the KV heads only)."""

    anchor = "embed_tokens.weight"

    def __init__(self, cfg: HFDecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(_LlamaLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        dh = cfg.head_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dh, 2, dtype=torch.float32) / dh))
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # (dh/2,)

    def embed_new(self, input_ids: Tensor, attention_mask: Tensor, P: int):
        pos = mask_positions(attention_mask, input_ids.shape[1])  # (B, T)
        freqs = pos[..., None] * self.inv_freq  # (B, T, dh/2)
        angles = torch.cat([freqs, freqs], dim=-1)[:, None]  # (B, 1, T, dh): broadcast over heads
        return self.embed_tokens(input_ids), (angles.cos(), angles.sin())

    def qkv(self, li: int, h: Tensor, ctx) -> tuple[Tensor, Tensor, Tensor]:
        cfg, a = self.cfg, self.layers[li].self_attn
        x = self.layers[li].input_layernorm(h)
        q = self._heads(a.q_proj(x), cfg.num_heads)
        k = self._heads(a.k_proj(x), cfg.num_kv_heads)
        cos, sin = ctx
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        return q, k, self._heads(a.v_proj(x), cfg.num_kv_heads)

    def attn_out(self, li: int, h: Tensor, o: Tensor) -> Tensor:
        return h + self.layers[li].self_attn.o_proj(o)

    def mlp(self, li: int, h: Tensor) -> Tensor:
        layer = self.layers[li]
        x = layer.post_attention_layernorm(h)
        m = layer.mlp
        return h + m.down_proj(F.silu(m.gate_proj(x)) * m.up_proj(x))

    def head(self, h: Tensor) -> Tensor:
        h = self.norm(h)
        return self.lm_head(h) if self.lm_head is not None else F.linear(h, self.embed_tokens.weight)


DECODERS = {"gpt2": GPT2Decoder, "llama": LlamaDecoder}
