"""Elastic Attention on a frozen dense decoder (backbone (a)): per layer, a router sends each head to
causal full attention (FA) or causal streaming attention (SA: the first `sink` tokens plus the last
`window`), once per sequence at prefill; decode steps reuse those modes.

The backbone is the dense decoder adaptex trains (`graphs.tsa.TSADecoder` with adaptive=False,
trained on the character LM; `adaptex train tsa --task charlm --dense`). Its weights are frozen and
only the routers train, by distillation: loss = KL(full attention's next-token distribution ||
elastic's) + lambda1 (Omega - t) + lambda2 (Omega - t)^2 (DESIGN §1), Gumbel-softmax with an annealed
temperature and a straight-through hard decision.

Interface (one graph for prefill and decode, the names of Optimum's decoder-with-past export plus
the head modes):
- inputs: input_ids, attention_mask, past_key_values.{i}.key/value, head_modes.{i} (B, H) bool
- outputs: logits, present.{i}.key/value, decisions.layer{i}.sa (B, H) bool, decisions.layer{i}.logits
  (B, H, 2) [FA, SA]
At prefill (an empty cache) the routers decide and `head_modes.{i}` is ignored (pass zeros); at a
decode step (a non-empty cache) the graph uses `head_modes.{i}` as given: feed back the prefill's
`decisions.layer{i}.sa`, as `present.*` is fed back as `past_key_values.*`.

Router pooling: keys of the first N and the last N real tokens of the sequence, positions counted
from the first real token (decoder batches are left-padded, as for generation). Slicing both runs
keeps a router O(N) whatever the length, so it costs a decode step little.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from adaptex.graphs.config import from_dict as config_from_dict
from adaptex.graphs.errors import AdaptexError, CheckpointError, InputError
from adaptex.graphs.decoding import DecoderContract
from adaptex.graphs.family import ADAPTIVE_MODES, RecordedOutput, register_family
from adaptex.graphs.nn import ElasticAttention, sparsity  # noqa: F401  (re-exported)
from adaptex.graphs.tsa import TSAConfig, TSADecoder

MODES = ("soft", "hard", "hard_dense", "full")


@dataclass
class ElasticDecoderConfig:
    backbone_config: dict = field(default_factory=dict)  # the dense TSAConfig the routers sit on
    backbone_sha256: str = ""  # of the dense checkpoint's weights the routers were trained on
    sink: int = 4
    window: int = 64
    pool_tokens: int = 100
    router_hidden: int = 64
    target_sparsity: float = 0.7
    # copied from the backbone (what exporters, parity and bench read)
    vocab_size: int = 0
    d_model: int = 0
    num_heads: int = 0
    num_layers: int = 0
    head_dim: int = 0
    max_len: int = 0
    pad_id: int = 0
    adaptive: bool = True
    family: str = field(default="elastic_decoder", init=False)

    def __post_init__(self):
        b = self.backbone_config
        if b:
            if b.get("adaptive", False):
                raise CheckpointError("the elastic decoder's backbone must be a dense decoder (adaptive=false); "
                                      "train one with 'adaptex train tsa --task charlm --dense'")
            self.vocab_size, self.d_model = b["vocab_size"], b["d_model"]
            self.num_heads, self.num_layers, self.max_len = b["num_heads"], b["num_layers"], b["max_len"]
            self.head_dim, self.pad_id = self.d_model // self.num_heads, b.get("pad_id", 0)
        if self.sink < 0 or self.window < 1:
            raise ValueError(f"sink must be >= 0 and window >= 1 (got sink={self.sink}, window={self.window})")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict, where: str = "config") -> "ElasticDecoderConfig":
        """From a JSON object, every key checked (graphs/config.py)."""
        return config_from_dict(cls, d, where)


class ElasticDecoder(nn.Module):
    """A frozen dense decoder whose causal attention each layer routes per head."""

    def __init__(self, cfg: ElasticDecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.backbone = TSADecoder(TSAConfig.from_dict(cfg.backbone_config)).eval()
        for p in self.backbone.parameters():
            p.requires_grad_(False)
        self.routers = nn.ModuleList(ElasticAttention(cfg.num_heads, cfg.head_dim, cfg.sink, cfg.window, causal=True,
                                                      router_hidden=cfg.router_hidden, pool_tokens=cfg.pool_tokens)
                                     for _ in range(cfg.num_layers))

    @classmethod
    def from_backbone(cls, backbone: TSADecoder, sha256: str = "", **kw) -> "ElasticDecoder":
        if backbone.cfg.adaptive:
            raise AdaptexError("the elastic decoder needs a dense decoder backbone (this one is a TSA model); "
                               "train one with 'adaptex train tsa --task charlm --dense'")
        cfg = ElasticDecoderConfig(backbone_config=backbone.cfg.to_dict(), backbone_sha256=sha256, **kw)
        net = cls(cfg)
        net.backbone.load_state_dict(backbone.state_dict())
        return net

    def train(self, mode: bool = True):
        super().train(mode)
        self.backbone.eval()  # frozen
        return self

    def empty_past(self, B: int, device=None):
        return self.backbone.empty_past(B, device)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                past: list[tuple[Tensor, Tensor]] | None = None, head_modes: list[Tensor] | None = None,
                mode: str = "hard", tau: float = 1.0, force_sa: list[Tensor | None] | None = None):
        """Returns logits (B, T, V), decisions (per layer {"sa": (B, H) bool, "logits": (B, H, 2) fp32,
        "g": (B, H) the SA weight used}) and presents (per layer (key, value), (B, H, P+T, dh)).

        head_modes: per layer (B, H) bool, used when the cache is non-empty (decode steps); the
        routers decide at prefill. mode: soft (Gumbel, straight-through; training), hard (the op),
        hard_dense (hard decisions, dense reference kernel), full (every head FA: the backbone)."""
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
        if mode == "full":
            logits, _, presents = self.backbone(input_ids, attention_mask, past=past, mode="dense")
            return logits, [], presents
        cfg, bb = self.cfg, self.backbone
        B, T = input_ids.shape
        past = past if past is not None else self.empty_past(B, input_ids.device)
        P = past[0][0].shape[2]
        if not torch.compiler.is_exporting() and P + T > cfg.max_len:
            raise InputError(f"{P} cached + {T} new tokens = {P + T} exceed the decoder's {cfg.max_len} positions; "
                             f"keep prompt plus generated tokens within {cfg.max_len}")
        if attention_mask is None:
            attention_mask = torch.ones(B, P + T, dtype=torch.int64, device=input_ids.device)
        key_ok = attention_mask.bool()
        # a tensor, not a Python bool, so one traced graph serves prefill and decode
        has_past = torch.ones_like(past[0][0][:1, :1, :, 0]).sum() > 0
        pos = torch.arange(T, device=input_ids.device) + P
        h = bb.tok(input_ids) + bb.pos[pos][None]
        H, dh = cfg.num_heads, cfg.head_dim
        decisions, presents = [], []
        for li, blk in enumerate(bb.blocks):
            x = blk.ln1(h)
            q, k, v = blk.attn.qkv(x).view(B, T, 3, H, dh).permute(2, 0, 3, 1, 4)
            k = torch.cat([past[li][0], k], dim=2)
            v = torch.cat([past[li][1], v], dim=2)
            presents.append((k, v))
            modes = head_modes[li] if head_modes is not None else None
            force = force_sa[li] if force_sa is not None else None
            o, dec = self.routers[li](q, k, v, key_ok, modes, has_past if modes is not None else None,
                                      mode=mode, force_sa=force, tau=tau, return_decisions=True)
            decisions.append(dec)
            h = h + blk.attn.proj(o.transpose(1, 2).reshape(B, T, cfg.d_model))
            h = h + blk.ffn(blk.ln2(h))
        logits = F.linear(bb.ln_f(h), bb.tok.weight)
        return logits, decisions, presents


def attention_flops(cfg: ElasticDecoderConfig, sa: np.ndarray, seq: int, past: int = 0) -> tuple[float, float]:
    """(elastic, full) multiply-adds of one sequence's step of `seq` new tokens after `past` cached,
    head modes sa (L, H): projections and FFN per token, attention 2 dh per visible key (FA: the
    causal context; SA: at most sink + window keys)."""
    b = cfg.backbone_config
    d, f = cfg.d_model, b.get("d_ff", 4 * cfg.d_model)
    ctx = past + np.arange(1, seq + 1)  # each new token's causal context
    fa = float(ctx.sum())
    sa_ctx = float(np.minimum(ctx, cfg.sink + cfg.window).sum())
    per_head = np.where(np.asarray(sa, bool), sa_ctx, fa) * 2 * cfg.head_dim
    linear = cfg.num_layers * seq * (4 * d * d + 2 * d * f) + seq * d * cfg.vocab_size
    return linear + float(per_head.sum()), linear + cfg.num_layers * cfg.num_heads * fa * 2 * cfg.head_dim


@torch.no_grad()
def generate(model: ElasticDecoder, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding: prefill routes the heads, each step reuses those modes (the parity reference
    for the exported generator, examples/tsa_generate.py)."""
    if not prompt:
        raise ValueError("empty prompt: pass at least one token")
    model.eval()
    logits, dec, past = model(torch.tensor([prompt]))
    modes = [d["sa"] for d in dec]
    out = []
    for _ in range(max_new_tokens):
        out.append(int(logits[0, -1].argmax()))
        if len(out) == max_new_tokens:
            break
        logits, _, past = model(torch.tensor([[out[-1]]]), past=past, head_modes=modes)
    return out


# --- training ---------------------------------------------------------------------------------------

@dataclass
class ElasticDecoderTrainConfig:
    steps: int = 300
    batch_size: int = 8
    context: int = 512
    lr: float = 3e-3
    lambda_lr: float = 0.05
    tau_start: float = 1.0
    tau_end: float = 0.1
    seed: int = 0


def _kl(full_logits: Tensor, logits: Tensor) -> Tensor:
    """Mean over tokens of KL(full || elastic) between next-token distributions."""
    lp_full = full_logits.log_softmax(-1)
    return (lp_full.exp() * (lp_full - logits.log_softmax(-1))).sum(-1).mean()


def train_elastic_decoder(model: ElasticDecoder, task, tc: ElasticDecoderTrainConfig, progress=None) -> ElasticDecoder:
    """Routers only, by distillation from the frozen backbone's full attention: min over the routers,
    max over lambda1, lambda2."""
    torch.manual_seed(tc.seed)
    rng = np.random.default_rng(tc.seed)
    opt = torch.optim.AdamW(model.routers.parameters(), lr=tc.lr, weight_decay=0.0)
    lam1, lam2, t = 0.0, 0.0, model.cfg.target_sparsity
    model.train()
    for step in range(1, tc.steps + 1):
        tau = tc.tau_start * (tc.tau_end / tc.tau_start) ** ((step - 1) / max(1, tc.steps - 1))
        b = task.sample(tc.batch_size, rng)
        with torch.no_grad():
            full, _, _ = model(b.input_ids, b.attention_mask, mode="full")
        logits, decisions, _ = model(b.input_ids, b.attention_mask, mode="soft", tau=tau)
        kl = _kl(full, logits)
        omega = sparsity(decisions)
        gap = omega - t
        loss = kl + lam1 * gap + lam2 * gap ** 2
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        gap = float(gap.detach())
        lam1 += tc.lambda_lr * gap
        lam2 = max(0.0, lam2 + tc.lambda_lr * gap ** 2)
        if progress and (step % 10 == 0 or step == tc.steps):
            progress(step, {"kl": kl.item(), "sa": omega.item(), "tau": tau, "lam1": lam1})
    return model.eval()


@torch.no_grad()
def evaluate_elastic_decoder(model: ElasticDecoder, task, n: int = 64, context: int = 512, seed: int = 1,
                             batch_size: int = 8, delta: float = 0.0) -> dict:
    """Held-out next-character loss of full attention and of the hard elastic model (SA logits
    shifted by -delta), the SA fraction, and the mean KL between them, on `n` windows of `context`."""
    rng = np.random.default_rng(seed)
    data = task.val
    lf, le, kl, sa = [], [], [], []
    for start in range(0, n, batch_size):
        bsz = min(batch_size, n - start)
        s = rng.integers(0, len(data) - context - 1, size=bsz)
        seq = torch.from_numpy(np.stack([data[i:i + context + 1] for i in s]).astype(np.int64))
        ids, tgt = seq[:, :-1], seq[:, 1:]
        full, _, _ = model(ids, mode="full")
        force = None
        if delta:
            _, dec, _ = model(ids, mode="hard")
            force = [(d["logits"][..., 1] - delta) > d["logits"][..., 0] for d in dec]
        el, dec, _ = model(ids, mode="hard", force_sa=force)
        lf.append(F.cross_entropy(full.reshape(-1, full.shape[-1]), tgt.reshape(-1)))
        le.append(F.cross_entropy(el.reshape(-1, el.shape[-1]), tgt.reshape(-1)))
        kl.append(_kl(full, el))
        sa.append(torch.stack([d["sa"].float() for d in dec], 1))  # (B, L, H)
    sa = torch.cat(sa)
    full_loss, el_loss = float(torch.stack(lf).mean()), float(torch.stack(le).mean())
    return {"full_loss": full_loss, "elastic_loss": el_loss, "loss_increase": el_loss / full_loss - 1,
            "kl": float(torch.stack(kl).mean()), "sa_fraction": float(sa.mean()),
            "sa_fraction_per_layer": [float(x) for x in sa.mean((0, 2))], "n": n, "context": context}


@torch.no_grad()
def calibrate_decoder(model: ElasticDecoder, task, min_sparsity: float, deltas=(0.0, 0.25, 0.5, 1.0, 1.5),
                      n: int = 32, context: int = 512) -> dict:
    """The SA-logit shift (on training text) with the lowest loss whose SA fraction stays >=
    min_sparsity, baked into the routers' output bias (see graphs.elastic.calibrate)."""
    class _Train:  # evaluate on training text: the held-out split stays held out
        val = task.train
    best = None
    for delta in deltas:
        r = evaluate_elastic_decoder(model, _Train, n=n, context=context, seed=7, delta=delta)
        if r["sa_fraction"] >= min_sparsity and (best is None or r["elastic_loss"] < best["elastic_loss"]):
            best = {**r, "delta": delta}
    best = best or {"delta": 0.0}
    for router in model.routers:
        router.router[2].bias[1] -= best["delta"]
    return {"delta": best["delta"], "sa_fraction": best.get("sa_fraction"), "elastic_loss": best.get("elastic_loss"),
            "min_sparsity": min_sparsity, "windows": n, "split": "train"}


def summary_table_decoder(r: dict, cfg: ElasticDecoderConfig) -> str:
    per_layer = ", ".join(f"{x:.2f}" for x in r["sa_fraction_per_layer"])
    return "\n".join([
        f"Elastic decoder on the dense charlm decoder (sink {cfg.sink}, window {cfg.window}, "
        f"target SA fraction {cfg.target_sparsity:.2f})",
        f"held-out windows: {r['n']} x {r['context']} characters (json, email packages)",
        f"SA heads: {100 * r['sa_fraction']:.1f}% (per layer: {per_layer})",
        f"next-character loss: full attention {r['full_loss']:.4f}, elastic {r['elastic_loss']:.4f} "
        f"({100 * r['loss_increase']:+.2f}%); KL(full || elastic) {r['kl']:.4f} nats/char",
    ])


# --- the family contract -------------------------------------------------------------------------------

@register_family
class ElasticDecoderFamily(DecoderContract):
    """Elastic decoders' artifacts: the decoder I/O plus head_modes.{i} (B, H) bool inputs (used at
    decode steps: feed back the prefill's decisions), then per layer decisions.layer{i}.sa and .logits.
    Core ML packages take and give the head modes as float32 0/1 (it has no bool features)."""

    family = "elastic_decoder"
    config_cls, model_cls = ElasticDecoderConfig, ElasticDecoder
    counterpart_modes = {"dense": "full", "naive": "hard_dense"}

    def extra_inputs(self, mode: str = "hard") -> list[str]:
        adaptive = self.cfg.adaptive and mode in ADAPTIVE_MODES
        return [f"head_modes.{i}" for i in range(self.cfg.num_layers)] if adaptive else []

    def extra_example(self, batch: int, mode: str) -> list[Tensor]:
        return [torch.rand(batch, self.cfg.num_heads) < 0.5 for _ in self.extra_inputs(mode)]

    def recorded(self, mode: str = "hard") -> list[RecordedOutput]:
        if not self.cfg.adaptive or mode not in ADAPTIVE_MODES:
            return []
        return [RecordedOutput(f"decisions.layer{i}.{f}", f"routers.{i}", f)
                for i in range(self.cfg.num_layers) for f in ("sa", "logits")]

    def call(self, model, inputs, mode):
        ids, mask, past, modes = self.split_inputs(inputs)
        logits, _, presents = model(ids, mask, past=past, head_modes=modes or None, mode=mode)
        return (logits, *[t for kv in presents for t in kv])

    def routing_meta(self) -> dict:
        cfg = self.cfg
        return {"sink": cfg.sink, "window": cfg.window, "backbone": "dense decoder",
                "backbone_sha256": cfg.backbone_sha256, "kv_cache_bound": cfg.max_len,
                "head_modes": "routed at prefill (empty cache); decode steps take head_modes.{i} = the prefill's "
                              "decisions.layer{i}.sa"}

    def io_descriptions(self) -> dict[str, str]:
        from adaptex.graphs.elastic import head_mode_descriptions
        from adaptex.graphs.tsa import decoder_descriptions

        cfg = self.cfg
        d = head_mode_descriptions(cfg, decoder_descriptions(cfg))
        for i in range(cfg.num_layers):
            d[f"head_modes.{i}"] = (f"layer {i}: the head modes a decode step uses [batch, {cfg.num_heads}]: the "
                                    f"prefill's decisions.layer{i}.sa (ignored at prefill: pass zeros)")
        return d

    def parity_cap(self) -> int:
        # positions reach far (4096) but parity needs lengths past the window, not quadratic
        # full-attention references at the bound
        return min(self.cfg.max_len, 600)

    def initial_extra(self, B: int) -> dict:
        return {f"head_modes.{i}": np.zeros((B, self.cfg.num_heads), bool) for i in range(self.cfg.num_layers)}

    def next_extra(self, outputs: dict, P: int, extra: dict) -> dict:
        if P:  # decode steps reuse the prefill's head modes
            return extra
        return {f"head_modes.{i}": np.asarray(outputs[f"decisions.layer{i}.sa"]) > 0.5 for i in range(self.cfg.num_layers)}

    def flops(self, outputs: dict, variant: str, seq: int, past: int = 0) -> dict:
        cfg = self.cfg
        sa = np.stack([np.asarray(outputs[f"decisions.layer{i}.sa"]) for i in range(cfg.num_layers)], axis=1) > 0.5
        f = np.array([attention_flops(cfg, row, seq, past) for row in sa])  # (B, 2): elastic, full
        ratio = float(f[:, 0].mean() / f[:, 1].mean())
        return {"flop_ratio": ratio, "executed_flop_ratio": 1.0 if variant == "dense" else ratio,
                "sa_fraction": float(sa.mean()), "sa_fraction_per_layer": [float(x) for x in sa.mean(axis=(0, 2))]}
