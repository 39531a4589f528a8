"""A pretrained model made adaptive in one call: `adapt(model, kind)` puts adaptex layers in place of
its attention, initialised from its own weights, so that with routing off (adaptive_mode("dense"):
every head, full attention) it computes what it computed before. Only the routers are new; every
weight the model had is frozen.

What it finds (by class, so nothing here imports transformers):
- transformers BERT, RoBERTa, DistilBERT, GPT-2 and LLaMA attention (their modules call the
  attention function that config._attn_implementation names): kind "elastic" gives each such module
  an ElasticAttention (`<module>.elastic`) that transformers calls as the model's attention function
  "adaptex", on the queries, keys and values the module made (rotary positions applied, grouped KV
  heads kept grouped); kind "budgeted" (encoders) replaces each self-attention module by a
  BudgetedSelfAttention (`<module>.attn`), whose op computes k of H heads from the hidden states.
- every torch `nn.MultiheadAttention` (self-attention): replaced by an AdaptedMultiheadAttention of
  the same call, holding a BudgetedAttention (`.attn`) or an ElasticAttention (`.elastic`).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from adaptex.graphs.nn.budgeted import BudgetedAttention
from adaptex.graphs.nn.elastic import ElasticAttention

KINDS = ("budgeted", "elastic")
IMPLEMENTATION = "adaptex"  # the attention function's name in transformers' AttentionInterface
# transformers' attention modules adapt finds, by class name: (layout, decoder)
HF_ATTENTION = {"BertSelfAttention": ("bert", False), "RobertaSelfAttention": ("roberta", False),
                "DistilBertSelfAttention": ("distilbert", False), "GPT2Attention": ("gpt2", True),
                "LlamaAttention": ("llama", True)}


def key_mask_of(mask: Tensor | None, batch: int, keys: int, device) -> Tensor:
    """(B, S) bool, True = a real key, from transformers' 4D attention mask (B|1, 1, T, S): bool
    (True = attend) or additive (0 = attend). Its last query row sees every real key, causal or not."""
    if mask is None:
        return torch.ones(batch, keys, dtype=torch.bool, device=device)
    last = mask[:, 0, -1, :]
    ok = last if last.dtype == torch.bool else last == 0
    return ok.expand(batch, keys)


def _elastic_attention_function(module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                                scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """transformers' attention-function contract: q (B, H, T, dh), k and v (B, Hkv, S, dh) ->
    ((B, T, H, dh), None), through the module's ElasticAttention."""
    elastic = getattr(module, "elastic", None)
    if elastic is None:
        raise RuntimeError(f"{type(module).__name__} has no adaptex layer; adapt every attention module of the model "
                           "(adaptex.nn.adapt(model, ...)) before calling it")
    dh = query.shape[-1]
    if scaling is not None and abs(scaling - dh ** -0.5) > 1e-12:  # ElasticAttention scales by dh^-0.5
        query = query * (scaling * dh ** 0.5)
    key_ok = key_mask_of(attention_mask, query.shape[0], key.shape[2], query.device)
    o = elastic(query, key, value, key_ok)  # (B, H, T, dh)
    return o.transpose(1, 2).contiguous(), None


def key_padding_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                     mask_function=None, attention_mask: Tensor | None = None, **kwargs) -> Tensor | None:
    """transformers' mask-function contract for the attention function "adaptex": the key padding
    alone, (B, 1, 1, S) bool (True = a real key), never skipped. The adaptex layers apply causality
    themselves (ElasticAttention's causal), so the (T, S) pattern transformers would build, and its
    ops, stay out of the graph."""
    if attention_mask is None:
        return None
    m = attention_mask.bool()
    if m.shape[-1] != kv_length:
        m = m[:, kv_offset:kv_offset + kv_length]
    return m[:, None, None, :]


def _register_with_transformers() -> None:
    """The attention function "adaptex" and its mask function, in transformers' registries."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(IMPLEMENTATION, _elastic_attention_function)
    ALL_MASK_ATTENTION_FUNCTIONS.register(IMPLEMENTATION, key_padding_mask)


class BudgetedSelfAttention(nn.Module):
    """A transformers encoder's self-attention module, budgeted: forward(hidden_states,
    attention_mask, ...) -> (y, None) as the module it replaces returns. With `projects=True` y has
    the output projection applied (DistilBERT's module owns it); otherwise the caller's output
    dense (BERT's and RoBERTa's BertSelfOutput) is the identity and the op applies it."""

    def __init__(self, attn: BudgetedAttention):
        super().__init__()
        self.attn = attn

    def forward(self, hidden_states: Tensor, attention_mask: Tensor | None = None, *args, **kwargs):
        B, T, _ = hidden_states.shape
        return self.attn(hidden_states, key_mask_of(attention_mask, B, T, hidden_states.device)), None


class AdaptedMultiheadAttention(nn.Module):
    """An nn.MultiheadAttention's call (query, key, value, key_padding_mask, need_weights, attn_mask,
    ..., is_causal) -> (output, None), self-attention through an adaptex layer: `attn` (budgeted) or
    `elastic` with the original in- and output projections. key_padding_mask: True (or -inf) = padding,
    as torch takes it. Attention weights are not returned (None)."""

    # torch's Transformer fast path reads these, and takes another path when the projection is not fused
    _qkv_same_embed_dim = False
    in_proj_bias = None

    def __init__(self, mha: nn.MultiheadAttention, kind: str, causal: bool, **options):
        super().__init__()
        self.batch_first, self.num_heads, self.embed_dim = mha.batch_first, mha.num_heads, mha.embed_dim
        self.causal = causal
        d, H = mha.embed_dim, mha.num_heads
        bias = mha.in_proj_bias if mha.in_proj_bias is not None else torch.zeros(3 * d)
        if kind == "budgeted":
            self.attn = _budgeted(d, H, mha.in_proj_weight, bias, mha.out_proj.weight, mha.out_proj.bias, **options)
        else:
            self.in_proj = nn.Linear(d, 3 * d)
            self.out_proj = nn.Linear(d, d, bias=mha.out_proj.bias is not None)
            with torch.no_grad():
                self.in_proj.weight.copy_(mha.in_proj_weight)
                self.in_proj.bias.copy_(bias)
                self.out_proj.load_state_dict(mha.out_proj.state_dict())
            self.elastic = _elastic(H, d // H, causal, **options)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Tensor | None = None,
                need_weights: bool = True, attn_mask: Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False):
        if key is not query or value is not query:
            raise ValueError("an adapted nn.MultiheadAttention computes self-attention: call it with query, key and "
                             "value the same tensor")
        if attn_mask is not None and not self.causal:
            raise ValueError("an adapted nn.MultiheadAttention takes key_padding_mask, not attn_mask; adapt it with "
                             "causal=True for a causal mask (the layer applies it itself)")
        x = query if self.batch_first else query.transpose(0, 1)  # (B, T, d)
        B, T, d = x.shape
        if key_padding_mask is None:
            key_ok = torch.ones(B, T, dtype=torch.bool, device=x.device)
        else:
            key_ok = ~key_padding_mask if key_padding_mask.dtype == torch.bool else key_padding_mask == 0
        if hasattr(self, "attn"):
            y = self.attn(x, key_ok)
        else:
            H = self.num_heads
            q, k, v = self.in_proj(x).view(B, T, 3, H, d // H).permute(2, 0, 3, 1, 4)  # (B, H, T, dh) each
            y = self.out_proj(self.elastic(q, k, v, key_ok).transpose(1, 2).reshape(B, T, d))
        return (y if self.batch_first else y.transpose(0, 1)), None


def _budgeted(d: int, H: int, w_qkv: Tensor, b_qkv: Tensor, w_o: Tensor, b_o: Tensor | None, *,
              router_hidden: int = 64, tau: float = 0.5, **_) -> BudgetedAttention:
    """A BudgetedAttention whose projections are copies of the given weights (rows [q | k | v])."""
    attn = BudgetedAttention(d, H, router_hidden=router_hidden, tau=tau)
    with torch.no_grad():
        attn.qkv.weight.copy_(w_qkv)
        attn.qkv.bias.copy_(b_qkv)
        attn.out.weight.copy_(w_o)
        attn.out.bias.copy_(b_o if b_o is not None else torch.zeros(d))
    for p in (*attn.qkv.parameters(), *attn.out.parameters()):
        p.requires_grad_(False)
    return attn


def _elastic(num_kv_heads: int, head_dim: int, causal: bool, *, sink: int = 4, window: int = 32,
             router_hidden: int = 64, pool_tokens: int = 100, kv_groups: int = 1, **_) -> ElasticAttention:
    return ElasticAttention(num_kv_heads, head_dim, sink=sink, window=window, causal=causal,
                            router_hidden=router_hidden, pool_tokens=pool_tokens, kv_groups=kv_groups)


def _linear(m: nn.Module) -> tuple[Tensor, Tensor]:
    """(weight (out, in), bias (out,)) of an nn.Linear or GPT-2's Conv1D (weight stored (in, out))."""
    if isinstance(m, nn.Linear):
        return m.weight, m.bias if m.bias is not None else torch.zeros(m.out_features)
    return m.weight.t(), m.bias


def _hf_budgeted(parent: nn.Module, module: nn.Module, layout: str, options: dict) -> nn.Module:
    if layout == "distilbert":
        q, k, v, out = module.q_lin, module.k_lin, module.v_lin, module.out_lin
        H = module.n_heads
    else:
        q, k, v, out = module.query, module.key, module.value, parent.output.dense
        H = module.num_attention_heads
    (wq, bq), (wk, bk), (wv, bv), (wo, bo) = (_linear(m) for m in (q, k, v, out))
    attn = _budgeted(wq.shape[1], H, torch.cat([wq, wk, wv]), torch.cat([bq, bk, bv]), wo, bo, **options)
    if layout != "distilbert":
        parent.output.dense = nn.Identity()  # the op applies the output projection
    return BudgetedSelfAttention(attn)


def _hf_elastic(module: nn.Module, options: dict) -> None:
    cfg = module.config
    H = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", None) or cfg.n_heads
    Hkv = getattr(cfg, "num_key_value_heads", None) or H
    d = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", None) or cfg.dim
    dh = getattr(module, "head_dim", None) or getattr(module, "attention_head_size", None) or d // H
    module.elastic = _elastic(Hkv, dh, bool(getattr(module, "is_causal", False)), kv_groups=H // Hkv, **options)


def adapt(model: nn.Module, kind: str = "budgeted", *, causal: bool = False, sink: int = 4, window: int = 32,
          router_hidden: int = 64, pool_tokens: int = 100, tau: float = 0.5) -> nn.Module:
    """Make `model` adaptive in place and return it: every attention of a transformers BERT, RoBERTa,
    DistilBERT, GPT-2 or LLaMA model, or every nn.MultiheadAttention, becomes an adaptex layer of
    `kind` initialised from its weights: "budgeted" (k of H heads per input; encoders) or "elastic"
    (each head full or streaming attention with `sink` and `window`). The model's own weights are
    frozen; the routers (router_hidden wide) are new and trainable. causal: the nn.MultiheadAttention
    layers take a causal mask (elastic only). With adaptive_mode("dense") the model computes what it
    computed before."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; choose one of {', '.join(KINDS)}")
    if causal and kind == "budgeted":
        raise ValueError("budgeted heads serve bidirectional (encoder) attention; use kind='elastic' for a causal "
                         "model")
    options = dict(sink=sink, window=window, router_hidden=router_hidden, pool_tokens=pool_tokens, tau=tau)
    model.requires_grad_(False)
    found = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.MultiheadAttention):
                _check_mha(child)
                setattr(parent, name, AdaptedMultiheadAttention(child, kind, causal, **options))
                found += 1
            elif type(child).__name__ in HF_ATTENTION and hasattr(getattr(child, "config", None),
                                                                  "_attn_implementation"):
                layout, decoder = HF_ATTENTION[type(child).__name__]
                if kind == "budgeted" and (decoder or getattr(child, "is_causal", False)):
                    raise ValueError(f"{type(child).__name__}: budgeted heads serve encoders (bidirectional "
                                     "attention); use kind='elastic' for GPT-2, LLaMA or a causal model")
                if kind == "budgeted":
                    setattr(parent, name, _hf_budgeted(parent, child, layout, options))
                else:
                    _hf_elastic(child, options)
                found += 1
    if not found:
        raise ValueError(f"{type(model).__name__} has no attention adapt knows: it adapts transformers BERT, RoBERTa, "
                         "DistilBERT, GPT-2 and LLaMA models and every nn.MultiheadAttention")
    if kind == "elastic" or any(isinstance(m, BudgetedSelfAttention) for m in model.modules()):
        _register_with_transformers_if_used(model)
    for m in model.modules():
        if isinstance(m, nn.TransformerEncoder):
            m.use_nested_tensor = False  # torch's nested-tensor path would bypass the adapted layers
    return model


def _register_with_transformers_if_used(model: nn.Module) -> None:
    """Point every transformers config in the model at the attention function "adaptex"."""
    configs = {id(m.config): m.config for m in model.modules()
               if hasattr(getattr(m, "config", None), "_attn_implementation")}
    if not configs:
        return
    _register_with_transformers()
    for cfg in configs.values():
        cfg._attn_implementation = IMPLEMENTATION


def _check_mha(mha: nn.MultiheadAttention) -> None:
    if not mha._qkv_same_embed_dim or mha.bias_k is not None or mha.add_zero_attn:
        raise ValueError("adapt takes nn.MultiheadAttention with one embedding width for queries, keys and values and "
                         "no add_bias_kv or add_zero_attn")
