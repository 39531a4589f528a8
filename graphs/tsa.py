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

from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from adaptex.graphs.config import from_dict as config_from_dict
from adaptex.graphs.budgetformer import sinusoids
from adaptex.graphs.decoding import DecoderContract
from adaptex.graphs.family import ADAPTIVE_MODES, RecordedOutput, register_family
from adaptex.graphs.ops.policy import DEFAULT, OrtPolicy
from adaptex.graphs.nn import CausalSelfAttention, ConditionalBlock, TokenRouter, causal_bias, causal_visibility  # noqa: F401

MODES = ("soft", "st", "hard", "hard_dense", "dense")


@dataclass
class TSAConfig:
    vocab_size: int = 32
    d_model: int = 128
    num_heads: int = 4
    num_layers: int = 6
    d_ff: int = 512
    max_len: int = 128  # positions (fixed sinusoids), hence the KV cache bound (prompt + generated tokens)
    router_hidden: int = 0  # 0: max(d/4, 16), the width of the TSA paper (arXiv:2605.05222)
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
    def from_dict(cls, d: dict, where: str = "config") -> "TSAConfig":
        """From a JSON object, every key checked (graphs/config.py)."""
        return config_from_dict(cls, d, where)


attention_mask_4d = causal_visibility  # (B, T, P+T) bool visibility of a decoder step


class TSADecoder(nn.Module):
    def __init__(self, cfg: TSAConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        if cfg.positions == "learned":
            self.pos_emb = nn.Embedding(cfg.max_len, cfg.d_model)
        else:
            self.register_buffer("pos", sinusoids(cfg.max_len, cfg.d_model), persistent=False)  # (max_len, d)
        self.blocks = nn.ModuleList(ConditionalBlock(cfg.d_model, cfg.num_heads, cfg.d_ff, cfg.ln_eps)
                                    for _ in range(cfg.num_layers))
        self.routers = nn.ModuleList(TokenRouter(cfg.d_model, cfg.router_hidden, cfg.threshold)
                                     for _ in range(cfg.num_layers - 1)) if cfg.adaptive else None
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
        bias = causal_bias(attention_mask, P, T)  # (B, 1, T, P+T)
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
        keep = gate = None  # the previous router's decisions for this block; None: ungated
        for li, blk in enumerate(self.blocks):
            h, kv = blk(h, bias, past[li], keep, gate, mode="dense" if not adaptive else mode)
            presents.append(kv)
            if adaptive and li < cfg.num_layers - 1:
                fk = force_keep[li] if force_keep is not None else None
                keep, gate, p = self.routers[li](h, mode=mode, force_keep=fk, return_p=True)
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


# --- the family contract -------------------------------------------------------------------------------

@register_family
class TSAFamily(DecoderContract):
    """TSA decoders' artifacts: Optimum's decoder-with-past I/O, then per gated block l = 1..L-1
    decisions.layer{l}.keep (B, T) bool (the token ran block l's query side and FFN) and .p (B, T)."""

    family = "tsa"
    config_cls, model_cls = TSAConfig, TSADecoder
    recipe = "tsa"
    counterpart_modes = {"dense": "dense", "naive": "hard_dense"}
    coreml_fp32_roles = ("residual_stream",)

    def recorded(self, mode: str = "hard") -> list[RecordedOutput]:
        if not self.cfg.adaptive or mode not in ADAPTIVE_MODES:
            return []
        return [RecordedOutput(f"decisions.layer{li + 1}.{f}", f"routers.{li}", f)
                for li in range(self.cfg.num_layers - 1) for f in ("keep", "p")]

    def call(self, model, inputs, mode):
        ids, mask, past, _ = self.split_inputs(inputs)
        logits, _, presents = model(ids, mask, past=past, mode=mode)
        return (logits, *[t for kv in presents for t in kv])

    def routing_meta(self) -> dict:
        return {"keep_threshold": self.cfg.threshold, "kv_cache_bound": self.cfg.max_len}

    def io_descriptions(self) -> dict[str, str]:
        cfg = self.cfg
        d = decoder_descriptions(cfg)
        for li in range(1, cfg.num_layers):
            d[f"decisions.layer{li}.keep"] = (f"block {li}: 1 where the token ran the block's query side and FFN "
                                              f"(p <= {cfg.threshold}), 0 where it skipped [batch, sequence]")
            d[f"decisions.layer{li}.p"] = f"block {li}: the router's skip probability p [batch, sequence]"
        return d

    def flops(self, outputs: dict, variant: str, seq: int, past: int = 0, target: str = "onnx",
              policy: OrtPolicy = DEFAULT) -> dict:
        """The FFN and the query side of attention of each gated block scale with its keep rate (keys and
        values are computed for every token); the mean attention context of a step is past + (seq + 1) / 2.
        The sparse graph runs each block's FFN on exactly its kept tokens but its queries on the batch's
        largest per-sample kept count in every sample: at least one row on TensorRT-bound graphs. ONNX
        Runtime's bodies dispatch (exporter/targets/onnx/bodies/): no query side for a block with
        no kept token, every row where that count reaches policy.dense_query_share of T, and each sample's
        own kept rows where the call attends a sample at a time (B > 1, policy.by_sample_from scores)."""
        cfg = self.cfg
        if not cfg.adaptive:  # a dense decoder (no routers): every token runs every block
            return {"flop_ratio": 1.0, "executed_flop_ratio": 1.0}
        keeps = [np.asarray(outputs[f"decisions.layer{li}.keep"]).reshape(-1, seq) for li in range(1, cfg.num_layers)]
        rates = [float(k.mean()) for k in keeps]
        ctx = past + (seq + 1) / 2
        dense = flops_per_token(cfg, ctx, None)
        if variant == "dense":
            executed = flops_per_token(cfg, ctx, [1.0] * len(rates))
        else:
            shares = [self._query_share(k, seq, past, target, policy or DEFAULT) for k in keeps]
            executed = flops_per_token(cfg, ctx, rates, shares)
        return {"flop_ratio": flops_per_token(cfg, ctx, rates) / dense, "executed_flop_ratio": executed / dense,
                "keep_rate_per_block": rates}


    def _query_share(self, keep: np.ndarray, seq: int, past: int, target: str, policy: OrtPolicy) -> float:
        """The share of a block's (B, seq) query rows its sparse body runs (see flops)."""
        B, n = keep.shape[0], float(keep.sum(1).max())
        if target != "onnx":  # TensorRT-bound: a step whose every token skips still attends one (ungated) row
            return max(1.0, n) / seq
        if n >= policy.dense_query_share * seq:
            return 1.0
        if B > 1 and B * self.cfg.num_heads * n * (past + seq) >= policy.by_sample_from:
            return float(keep.mean())
        return n / seq


def decoder_descriptions(cfg) -> dict[str, str]:
    """Descriptions of a decoder's cache I/O (shared by the TSA and elastic decoder contracts)."""
    # the cache holds the KV heads (fewer than the query heads under grouped-query attention)
    H = getattr(cfg, "num_kv_heads", 0) or cfg.num_heads
    dh, L = getattr(cfg, "head_dim", 0) or cfg.d_model // cfg.num_heads, cfg.max_len
    d = {"input_ids": f"token ids [batch, sequence], the new tokens of this step; past + sequence <= {L}",
         "attention_mask": ("1 for real tokens, 0 for padding [batch, past_sequence + sequence]: the previous "
                            "step's mask extended by the new tokens"),
         "logits": f"next-token scores [batch, sequence, {cfg.vocab_size}]"}
    for i in range(cfg.num_layers):
        for kv in ("key", "value"):
            d[f"past_key_values.{i}.{kv}"] = (f"block {i} attention {kv}s of the cached tokens [batch, {H}, "
                                              f"past_sequence, {dh}], past_sequence 0..{L - 1}: the previous "
                                              f"step's present.{i}.{kv} (a prefill passes past_sequence 0)")
            d[f"present.{i}.{kv}"] = (f"block {i} attention {kv}s of past and new tokens [batch, {H}, "
                                      f"past_sequence + sequence, {dh}]: the next step's past")
    return d
