"""Tiny configurations every test reuses."""
from __future__ import annotations

import torch

from adaptex.graphs import checkpoint
from adaptex.graphs.budgetformer import BudgetFormer, BudgetFormerConfig

TINY = dict(vocab_size=64, num_classes=4, d_model=32, num_heads=4, num_layers=2, d_ff=64, max_len=64,
            router_hidden=16)


def tiny_model(seed: int = 0, spread: float = 40.0, head_scale: float = 300.0, attn_scale: float = 10.0,
               **overrides) -> BudgetFormer:
    """An untrained tiny BudgetFormer. `spread` scales the routers' last layers so that budgets and
    head preferences vary widely across inputs (an untrained router would give k = constant).
    Untrained logits are ~0.01, below what the fp16 tolerance can see and barely above the fp32 one:
    an artifact computing the wrong heads passed parity. `head_scale` scales the classifier's last
    layer (logits O(5)) and `attn_scale` the attention output projections, so that the heads weigh
    in the residual stream: computing the lowest-scored heads then moves the logits by ~0.1. The
    routers read LayerNorm'd inputs: the spread of their decisions stays as it was."""
    torch.manual_seed(seed)
    model = BudgetFormer(BudgetFormerConfig(**{**TINY, **overrides}))
    with torch.no_grad():
        for layer in model.layers:
            layer.attn.router.budget[2].weight.mul_(spread)
            layer.attn.router.scorer[2].weight.mul_(spread)
            layer.attn.out.weight.mul_(attn_scale)
        model.head[2].weight.mul_(head_scale)
    return model.eval()


def save_tiny(path, **kw):
    return checkpoint.save(path, tiny_model(**kw), {"training": {"task": "graded"}, "description": "test model"})


TINY_TSA = dict(vocab_size=32, d_model=32, num_heads=4, num_layers=3, d_ff=64, max_len=32)


def tiny_tsa(seed: int = 0, spread: float = 20.0, head_scale: float = 20.0, **overrides):
    """An untrained tiny TSA decoder whose routers are scaled so keep decisions vary across tokens,
    and whose final norm is scaled so logits are O(5), not O(0.3) (errors must show against atol)."""
    from adaptex.graphs.tsa import TSAConfig, TSADecoder

    torch.manual_seed(seed)
    model = TSADecoder(TSAConfig(**{**TINY_TSA, **overrides}))
    with torch.no_grad():
        for r in model.routers or ():  # none in a dense decoder (adaptive=False)
            r.net[0].weight.mul_(spread)
            r.net[2].weight.mul_(spread)
        model.ln_f.weight.mul_(head_scale)  # the LM head is tied to the embeddings: scale the norm before it
    return model.eval()


TINY_ELASTIC = dict(vocab_size=64, d_model=32, num_heads=4, num_layers=2, d_ff=64, max_positions=64)


def tiny_elastic(seed: int = 0, spread: float = 30.0, sink: int = 2, window: int = 6):
    """A tiny random encoder (an inline backbone: the checkpoint carries its weights) with routers
    scaled so that head modes vary across inputs."""
    from adaptex.graphs.elastic import ElasticConfig, ElasticEncoder
    from adaptex.graphs.minilm import MiniLMConfig, MiniLMEncoder

    torch.manual_seed(seed)
    bcfg = MiniLMConfig(**TINY_ELASTIC)
    cfg = ElasticConfig(backbone="inline", backbone_config=bcfg.to_dict(), num_layers=bcfg.num_layers,
                        num_heads=bcfg.num_heads, head_dim=bcfg.d_model // bcfg.num_heads, vocab_size=bcfg.vocab_size,
                        max_len=bcfg.max_positions, sink=sink, window=window, pool_tokens=8, router_hidden=16)
    model = ElasticEncoder(cfg, MiniLMEncoder(bcfg))
    # centre each router's logit gap on a batch of random inputs, then spread it, so that both modes occur
    ids = torch.randint(1, bcfg.vocab_size, (64, 24))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        for li, r in enumerate(model.routers):
            r.router[2].weight.mul_(spread)
            _, dec = model(ids, mask, mode="hard_dense")
            gap = dec[li]["logits"][..., 1] - dec[li]["logits"][..., 0]  # (B, H)
            r.router[2].bias[1] -= gap.median()
    return model.eval()


def tiny_elastic_decoder(seed: int = 0, spread: float = 30.0, sink: int = 2, window: int = 8,
                         head_scale: float = 15.0, max_len: int = 128):
    """A tiny random dense decoder (max_len 128 by default) with elastic routers centred and spread
    like tiny_elastic's, so that head modes vary across inputs, and logits O(5) (its final norm
    scaled)."""
    from adaptex.graphs.elastic_decoder import ElasticDecoder
    from adaptex.graphs.tsa import TSAConfig, TSADecoder

    torch.manual_seed(seed)
    bb = TSADecoder(TSAConfig(vocab_size=40, d_model=32, num_heads=4, num_layers=2, d_ff=64, max_len=max_len,
                              adaptive=False))
    model = ElasticDecoder.from_backbone(bb, sink=sink, window=window, pool_tokens=8, router_hidden=16)
    center_head_modes(model, torch.randint(1, 40, (64, 24)), spread)
    with torch.no_grad():
        model.backbone.ln_f.weight.mul_(head_scale)  # after routing is centred: the routers read keys only
    return model.eval()


def center_head_modes(model, ids, spread: float) -> None:
    """Scale an elastic decoder's routers by `spread` and shift each layer's SA logit so that the
    median (batch, head) of `ids` sits on the SA/FA boundary: both modes occur, decided clearly."""
    with torch.no_grad():
        for li, r in enumerate(model.routers):
            r.router[2].weight.mul_(spread)
            _, dec, _ = model(ids, mode="hard_dense")
            gap = dec[li]["logits"][..., 1] - dec[li]["logits"][..., 0]
            r.router[2].bias[1] -= gap.median()


def export(model, info: dict | None, path, target: str = "onnx", **kw) -> dict:
    """Export a loaded checkpoint's model through the public API (info: checkpoint.load's record)."""
    import adaptex

    if info is not None:
        model.adaptex_source = {**info, "name": info.get("name") or info.get("path")}
    if target == "onnx":  # the same graphs on every CPU (adaptex.export measures the floor's default here)
        kw.setdefault("softmax_floor", "on")
    return adaptex.export(model, None, path, target=target, **kw)


def ort_loaded(path, out):
    """The model ONNX Runtime runs after loading the artifact at `path` (extended optimisations: its
    fusions and constant folding), saved to the file `out` and read back."""
    import onnx
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.optimized_model_filepath = str(out)
    ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return onnx.load(str(out))
