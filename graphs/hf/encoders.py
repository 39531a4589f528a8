"""Hugging Face encoders as frozen backbones: BERT (graphs/minilm.py), RoBERTa and DistilBERT.

All three are post-LN BERT blocks, so one implementation (graphs.minilm.MiniLMEncoder) computes
them; what differs is read from config.json and mapped here:
- RoBERTa: positions count the real tokens from pad_token_id + 1 (on the attention mask, where
  transformers counts tokens unequal to the pad id: the same on tokenizer output), one token type.
- DistilBERT: no token types, its own parameter names, LayerNorm eps 1e-12.
The sentence embedding is the mean of the real tokens' last states, L2-normalised (what
sentence-transformers' mean pooling computes); a directory with sentence-transformers configs must
say so (1_Pooling mean, Normalize).
"""
from __future__ import annotations

from pathlib import Path

from adaptex.graphs.errors import CheckpointError
from adaptex.graphs.hf.common import CONFIG, TOKENIZER, WEIGHTS, check_dir, need, read_config, refuse, sha256
from adaptex.graphs.minilm import (MiniLMConfig, MiniLMEncoder, MiniLMTokenizer, _check_pipeline, _hf_name,
                                   _load_weights, default_model_dir, load_minilm)

ENCODERS = ("bert", "roberta", "distilbert")

_DISTIL_LAYER = {"query": "attention.q_lin", "key": "attention.k_lin", "value": "attention.v_lin",
                 "out": "attention.out_lin", "attn_norm": "sa_layer_norm", "ffn_in": "ffn.lin1", "ffn_out": "ffn.lin2",
                 "ffn_norm": "output_layer_norm"}
_DISTIL_TOP = {"word_embeddings": "embeddings.word_embeddings", "position_embeddings": "embeddings.position_embeddings",
               "embed_norm": "embeddings.LayerNorm"}


def _distil_name(name: str) -> str:
    parts = name.split(".")
    if parts[0] == "layers":  # layers.{i}.{module}.{weight|bias}
        return f"transformer.layer.{parts[1]}.{_DISTIL_LAYER[parts[2]]}.{parts[3]}"
    return f"{_DISTIL_TOP[parts[0]]}.{parts[1]}"


def _check_arch(hf: dict, path: Path, stem: str, default: str) -> None:
    archs = hf.get("architectures") or [default]
    if not all(isinstance(a, str) and a.startswith(stem) for a in archs):
        raise CheckpointError(f"{path / CONFIG}: architectures {archs} found, expected a {stem} model "
                              f"('{default}' or a '{stem}...' head on it)")


def config_from_roberta(path: Path, hf: dict) -> MiniLMConfig:
    _check_arch(hf, path, "Roberta", "RobertaModel")
    for key, want in (("hidden_act", "gelu"), ("position_embedding_type", "absolute")):
        if hf.get(key, want) != want:
            raise refuse(path, key, hf[key], f"{key} {want!r}")
    if hf.get("is_decoder"):
        raise refuse(path, "is_decoder", True, "a bidirectional encoder")
    pad = need(hf, "pad_token_id", path)
    return MiniLMConfig(vocab_size=need(hf, "vocab_size", path), d_model=need(hf, "hidden_size", path),
                        num_heads=need(hf, "num_attention_heads", path), num_layers=need(hf, "num_hidden_layers", path),
                        d_ff=need(hf, "intermediate_size", path),
                        max_positions=need(hf, "max_position_embeddings", path),
                        type_vocab_size=need(hf, "type_vocab_size", path) if "type_vocab_size" in hf else 1,
                        layer_norm_eps=float(hf.get("layer_norm_eps", 1e-12)), pad_id=pad, positions="from_mask")


def config_from_distilbert(path: Path, hf: dict) -> MiniLMConfig:
    _check_arch(hf, path, "DistilBert", "DistilBertModel")
    if hf.get("activation", "gelu") != "gelu":
        raise refuse(path, "activation", hf["activation"], "activation 'gelu'")
    return MiniLMConfig(vocab_size=need(hf, "vocab_size", path), d_model=need(hf, "dim", path),
                        num_heads=need(hf, "n_heads", path), num_layers=need(hf, "n_layers", path),
                        d_ff=need(hf, "hidden_dim", path), max_positions=need(hf, "max_position_embeddings", path),
                        type_vocab_size=0, layer_norm_eps=1e-12, pad_id=int(hf.get("pad_token_id") or 0))


LAYOUTS = {"roberta": (config_from_roberta, _hf_name, "RoBERTa"),
           "distilbert": (config_from_distilbert, _distil_name, "DistilBERT")}


def load_encoder(path=None) -> tuple[MiniLMEncoder, MiniLMTokenizer, dict]:
    """(encoder in eval mode, frozen; its tokenizer; info with layout, path, sha256, config) from a
    BERT, RoBERTa or DistilBERT directory; None: the packaged all-MiniLM-L6-v2."""
    if path is None:
        net, tok, info = load_minilm(None)
        return net, tok, {**info, "layout": "bert"}
    path = check_dir(path)
    hf = read_config(path)
    kind = hf.get("model_type")
    if kind == "bert":
        net, tok, info = load_minilm(path)
        return net, tok, {**info, "layout": "bert"}
    if kind not in LAYOUTS:
        raise CheckpointError(f"{path / CONFIG}: model_type {kind!r} is not an encoder adaptex loads; expected one "
                              f"of {', '.join(ENCODERS)} (or gpt2, llama for a decoder)")
    parse, name_fn, what = LAYOUTS[kind]
    try:
        cfg = parse(path, hf)
    except ValueError as e:
        raise CheckpointError(f"{path / CONFIG}: {e}") from None
    _check_pipeline(path)
    net = MiniLMEncoder(cfg)
    _load_weights(net, path / WEIGHTS, name_fn, what)
    net.eval()
    net.requires_grad_(False)
    tok = MiniLMTokenizer(path / TOKENIZER, max_positions=cfg.max_tokens, pad_id=cfg.pad_id)
    if tok.vocab_size > cfg.vocab_size:
        raise CheckpointError(f"{path / TOKENIZER}: the tokenizer has {tok.vocab_size} tokens but the word embedding "
                              f"{cfg.vocab_size} rows; use the tokenizer.json that ships with these weights")
    info = {"layout": kind, "path": str(path.absolute()), "sha256": sha256(path), "config": cfg.to_dict(),
            "pooling": "mean", "normalize": True}
    return net, tok, info


def original_encoder(path, max_positions: int):
    """The directory's own `transformers` model (AutoModel, its default attention) with the mean
    pooling and L2 normalisation the elastic encoder computes: what a user exports without adaptex.
    As graphs.family.Original, for bench's dense candidates; needs transformers."""
    import torch

    from adaptex.graphs.family import Original

    try:
        from transformers import AutoModel
    except ImportError:
        raise CheckpointError("the original model's export needs transformers (pip install transformers)") from None
    from transformers.utils import logging as hf_logging

    path = Path(path) if path else default_model_dir()
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # bench prints its own progress (and none under --quiet)
    try:
        hf = AutoModel.from_pretrained(str(path)).eval()
        # the legacy exporter with eager attention is the path ONNX Runtime's BERT optimizer fuses (Attention)
        eager = AutoModel.from_pretrained(str(path), attn_implementation="eager").eval()
    finally:
        if bar:
            hf_logging.enable_progress_bar()

    class Pooled(torch.nn.Module):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def forward(self, input_ids, attention_mask):
            states = self.net(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            m = attention_mask.unsqueeze(-1).to(states.dtype)
            pooled = (states * m).sum(1) / m.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, dim=-1)

    ids = torch.randint(5, int(hf.config.vocab_size), (2, 16))
    mask = torch.ones(2, 16, dtype=torch.int64)
    mask[-1, 8:] = 0
    batch = torch.export.Dim("batch", min=1, max=4096)
    seq = torch.export.Dim("sequence", min=1, max=max_positions)
    c = hf.config
    return Original(Pooled(hf).eval(), (ids, mask), ({0: batch, 1: seq}, {0: batch, 1: seq}),
                    ["input_ids", "attention_mask"], ["sentence_embedding"],
                    f"transformers {type(hf).__name__} from {path.name} + mean pooling",
                    model_type="bert", num_heads=int(getattr(c, "num_attention_heads", getattr(c, "n_heads", 0))),
                    hidden_size=int(getattr(c, "hidden_size", getattr(c, "dim", 0))),
                    legacy_module=Pooled(eager).eval(),
                    legacy_source=f"transformers {type(hf).__name__} (eager attention) from {path.name} + mean pooling")
