"""BudgetFormer: an encoder classifier whose attention layers pick k of H heads per input.

Per layer, from the mask-aware mean of the layer input h:
  s = sigmoid(f_theta(h))             budget: the fraction of heads to use
  p = softmax(g_phi(h) / tau)         head preferences
  w_i = s * H * p_i                   head i's output scale
Training ("soft") computes every head; inference ("hard") computes only the top-k heads by p with
k = clamp(floor(s*H), 1, H), through the custom op `adaptex::budgeted_attention`.

`adaptive=False` gives the standard Transformer of the same size (every head, unscaled): the
accuracy baseline, and (with a BudgetFormer's weights) the dense counterpart that latency is
measured against.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.nn as nn
from torch import Tensor

from adaptex.graphs.config import from_dict as config_from_dict
from adaptex.graphs.family import ADAPTIVE_MODES, Contract, RecordedOutput, register_family
from adaptex.graphs.nn import BudgetedAttention, RoutingSchedule, masked_mean  # noqa: F401  (re-exported)
from adaptex.graphs.ops.budgeted_attention import onnx_body
from adaptex.graphs.ops.policy import DEFAULT

MODES = ("soft", "hard", "naive", "eager", "dense")


@dataclass
class BudgetFormerConfig:
    vocab_size: int = 64
    num_classes: int = 4
    d_model: int = 256
    num_heads: int = 8
    num_layers: int = 2
    d_ff: int = 1024
    max_len: int = 256
    router_hidden: int = 64
    pad_id: int = 0
    adaptive: bool = True
    s_min: float = 0.25  # budget target interval: the hinge loss is zero inside [s_min, s_max]
    s_max: float = 0.375
    tau_infer: float = 0.5  # softmax temperature of the head scores at inference (= end of training)
    labels: list = field(default_factory=list)  # class i's label, when trained on a file (apps map logits by it)
    family: str = field(default="budgetformer", init=False)

    def __post_init__(self):
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}")
        if not 0.0 < self.s_min <= self.s_max < 1.0:
            raise ValueError(f"budget range [{self.s_min}, {self.s_max}] must lie in (0, 1)")
        if self.labels and len(self.labels) != self.num_classes:
            raise ValueError(f"{len(self.labels)} labels for num_classes={self.num_classes}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict, where: str = "config") -> "BudgetFormerConfig":
        """From a JSON object, every key checked (graphs/config.py)."""
        return config_from_dict(cls, d, where)


def sinusoids(n: int, d: int) -> Tensor:
    """(n, d) fixed positional encodings: sin on even channels, cos on odd, geometric wavelengths."""
    pos = torch.arange(n, dtype=torch.float32)[:, None]
    freq = torch.exp(-math.log(10000.0) * torch.arange(0, d, 2, dtype=torch.float32) / d)
    pe = torch.zeros(n, d)
    pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * freq), torch.cos(pos * freq)
    return pe


def masked_max(x: Tensor, mask: Tensor) -> Tensor:
    """Max over the real tokens only: (B, T, d), (B, T) bool -> (B, d). The classifier pools this
    way: one decisive token's features survive it, where a mean would dilute them by the length."""
    return x.masked_fill(~mask.unsqueeze(-1), float("-inf")).amax(1)


class EncoderLayer(nn.Module):
    def __init__(self, cfg: BudgetFormerConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = BudgetedAttention(cfg.d_model, cfg.num_heads, cfg.router_hidden, cfg.tau_infer, cfg.adaptive)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.ffn = nn.Sequential(nn.Linear(cfg.d_model, cfg.d_ff), nn.GELU(), nn.Linear(cfg.d_ff, cfg.d_model))

    def forward(self, x, mask, mode, sched, force_mask=None):
        a, dec = self.attn(self.ln1(x), mask, mode=mode, sched=sched, force_mask=force_mask, return_decisions=True)
        x = x + a
        x = x + self.ffn(self.ln2(x))
        return x, dec


class BudgetFormer(nn.Module):
    def __init__(self, cfg: BudgetFormerConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        # Fixed sinusoidal positions: relative offsets are a linear map of them, so binding a token
        # to its neighbour (what the graded task needs) is learned in hundreds of steps, not thousands.
        self.register_buffer("pos", sinusoids(cfg.max_len, cfg.d_model), persistent=False)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        # A two-layer head: classes that compose several cues (sums, differences) are not linear
        # in the pooled features.
        self.head = nn.Sequential(nn.Linear(cfg.d_model, cfg.d_model), nn.GELU(),
                                  nn.Linear(cfg.d_model, cfg.num_classes))
        self.apply(self._init)

    @staticmethod
    def _init(m):
        # Token embeddings keep unit scale, comparable to the sinusoids (a 0.02 init would drown
        # token identity under position).
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, mode: str = "hard",
                sched: RoutingSchedule | None = None,
                force_masks: list[Tensor] | None = None) -> tuple[Tensor, list[dict]]:
        """(B, T) ids and mask -> logits (B, C) and per-layer decisions.

        mode: "soft" (training), "hard" (inference through the custom op), "naive" (inference with
        every head computed and masked: what a stock exporter sees), "eager" (the op's skipping
        kernel as plain Python: what tracers bake), "dense" (no routing at all).
        force_masks: per-layer (B, H) head masks to replay a given routing (parity uses it).
        """
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}: expected one of {MODES}")
        sched = sched or RoutingSchedule()
        B, T = input_ids.shape
        mask = attention_mask.bool()  # (B, T)
        x = self.tok(input_ids) + self.pos[:T][None]  # (B, T, d)
        decisions = []
        for i, layer in enumerate(self.layers):
            fm = None if force_masks is None else force_masks[i]
            x, dec = layer(x, mask, mode, sched, fm)
            decisions.append(dec)
        logits = self.head(masked_max(self.ln_f(x), mask))  # (B, C)
        return logits, decisions


def flops_per_sample(cfg: BudgetFormerConfig, seq_len: int, heads_per_layer: list[float] | None) -> float:
    """Multiply-adds x2 of one forward pass at length T; heads_per_layer=None means every head.

    Counts projections, attention and FFN (what the heads budget changes, plus the fixed cost);
    router cost is included for adaptive models since it is real work the dense model does not do.
    """
    d, H, T, f = cfg.d_model, cfg.num_heads, seq_len, cfg.d_ff
    dh = d // H
    total = 0.0
    for layer in range(cfg.num_layers):
        k = H if heads_per_layer is None else heads_per_layer[layer]
        total += 2 * T * d * 3 * dh * k  # QKV projection of k heads
        total += 2 * 2 * T * T * dh * k  # scores and weighted values
        total += 2 * T * k * dh * d  # output projection
        total += 2 * 2 * T * d * f  # FFN
        if cfg.adaptive and heads_per_layer is not None:
            total += 2 * 2 * (d * cfg.router_hidden) + 2 * cfg.router_hidden * (1 + H)
    total += 2 * d * d + 2 * d * cfg.num_classes  # classifier head
    return total


# --- the family contract -------------------------------------------------------------------------------

@register_family
class BudgetFormerFamily(Contract):
    """BudgetFormer's artifacts: (input_ids, attention_mask) -> logits, then per layer i
    decisions.layer{i}.k (B,) int64, .head_mask (B, H) bool and .s (B,) float32."""

    family = "budgetformer"
    config_cls, model_cls = BudgetFormerConfig, BudgetFormer
    recipe = "budgetformer"
    # fp32 by default: under fp16 arithmetic throughout (the fp16 audit, runtimes/audit.py) the shipped
    # budgetformer-graded's fp16 package keeps every decision (0 unexcused flips, nothing past 65504
    # once its LayerNorms are fp32) but its logits drift 0.055, needing atol 0.034 > 0.01
    coreml_default_precision = "fp32"
    counterpart_modes = {"dense": "dense", "naive": "naive"}
    coreml_fp32_roles = ("classifier_tail",)

    def input_names(self, mode: str = "hard") -> list[str]:
        return ["input_ids", "attention_mask"]

    def model_output_names(self, mode: str = "hard") -> list[str]:
        return ["logits"]

    def recorded(self, mode: str = "hard") -> list[RecordedOutput]:
        if not self.cfg.adaptive or mode not in ADAPTIVE_MODES:
            return []
        return [RecordedOutput(f"decisions.layer{i}.{f}", f"layers.{i}.attn", f)
                for i in range(self.cfg.num_layers) for f in ("k", "head_mask", "s")]

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
        return {"budget_range": [self.cfg.s_min, self.cfg.s_max]}

    def io_descriptions(self) -> dict[str, str]:
        cfg = self.cfg
        d = {"input_ids": f"token ids [batch, sequence], sequence 1..{cfg.max_len}",
             "attention_mask": "1 for real tokens, 0 for padding [batch, sequence]",
             "logits": f"class scores [batch, {cfg.num_classes}]"}
        for i in range(cfg.num_layers):
            d[f"decisions.layer{i}.k"] = f"layer {i}: heads computed per sample, clamp(floor(s*H), 1, H)"
            d[f"decisions.layer{i}.head_mask"] = f"layer {i}: 1 for the heads computed, 0 otherwise [batch, {cfg.num_heads}]"
            d[f"decisions.layer{i}.s"] = f"layer {i}: budget s in (0, 1) per sample"
        return d

    def parity_items(self, task: str | None, samples: int, seed: int = 0) -> list[dict]:
        """Batches totalling `samples` sequences: varied batch sizes, lengths (1 to the maximum),
        padded rows, the task's difficulty levels (so every budget occurs) and random token soup."""
        from adaptex.graphs.tasks import get_task

        cfg = self.cfg
        rng = np.random.default_rng(seed)
        try:
            task_obj = get_task(task) if task else None
        except Exception:  # an unknown or unavailable task: random tokens
            task_obj = None
        batch_sizes = [1, 2, 3, 4, 8, 16]
        feeds, total, i = [], 0, 0
        while total < samples:
            B = min(batch_sizes[i % len(batch_sizes)], samples - total)
            if task_obj is not None and i % 4 in (0, 1):  # task inputs at every difficulty level
                levels = [int(x) for x in rng.integers(0, len(task_obj.levels), size=B)]
                b = task_obj.sample(B, rng, levels=levels)
                ids, mask = b.input_ids.numpy()[:, : cfg.max_len], b.attention_mask.numpy()[:, : cfg.max_len]
            else:  # random tokens: lengths from 1 to the maximum, padded rows
                T = int(rng.choice([1, 2, 7, 33, 64, cfg.max_len, int(rng.integers(1, cfg.max_len + 1))]))
                T = min(T, cfg.max_len)
                ids = rng.integers(1, cfg.vocab_size, size=(B, T)).astype(np.int64)
                lengths = rng.integers(1, T + 1, size=B)
                lengths[0] = T
                mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.int64)
                ids = np.where(mask == 1, ids, cfg.pad_id)
            feeds.append({"input_ids": np.ascontiguousarray(ids), "attention_mask": np.ascontiguousarray(mask)})
            total += B
            i += 1
        return feeds

    def bench_feeds(self, task: str | None, batch: int, seq: int, past: int = 0, seed: int = 0) -> dict:
        """Task inputs at the requested length where the task can make them, else random tokens."""
        from adaptex.graphs.tasks import get_task

        rng = np.random.default_rng(seed)
        try:
            task_obj = get_task(task) if task else None
            b = task_obj.sample(batch, rng, length=seq) if task_obj else None
        except Exception:  # an unknown or unavailable task: random tokens
            b = None
        if b is not None and b.input_ids.shape[1] == seq:
            return {"input_ids": b.input_ids.numpy(), "attention_mask": b.attention_mask.numpy()}
        ids = rng.integers(1, self.cfg.vocab_size, size=(batch, seq)).astype(np.int64)
        return {"input_ids": ids, "attention_mask": np.ones((batch, seq), dtype=np.int64)}

    def flops(self, outputs: dict, variant: str, seq: int, past: int = 0, target: str = "onnx",
              policy=None) -> dict:
        """The decisions' FLOP ratio per sample, and the executed one: the dense variant computes every
        head; the sparse one, in a batch, the batch's largest k for every sample, except on ONNX
        Runtime, whose body (budgeted_attention.onnx_body) computes every head some sample selected
        for every sample (active heads) or each sample's own k (by head) where it chooses those."""
        cfg = self.cfg
        L, H = cfg.num_layers, cfg.num_heads
        dense = flops_per_sample(cfg, seq, None)
        ks = np.stack([np.asarray(outputs[f"decisions.layer{i}.k"]) for i in range(L)], axis=1)  # (B, L)
        ratio = float(np.mean([flops_per_sample(cfg, seq, list(map(float, row))) for row in ks]) / dense)
        if variant == "dense":
            executed = [float(H)] * L
        else:
            executed = []
            for i, c in enumerate(ks.T):
                mask = np.asarray(outputs[f"decisions.layer{i}.head_mask"]).astype(bool)
                body = onnx_body(c, mask, seq, policy or DEFAULT) if target == "onnx" else "per_sample"
                executed.append(float(mask.any(axis=0).sum() if body == "active_heads"
                                      else c.mean() if body == "by_head" else c.max()))
        return {"flop_ratio": ratio, "executed_flop_ratio": flops_per_sample(cfg, seq, executed) / dense,
                "mean_k_per_layer": [float(x) for x in ks.mean(axis=0)]}
