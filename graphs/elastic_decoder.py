"""Elastic Attention on a frozen decoder: per layer, a router sends each head (each KV head under
grouped-query attention) to causal full attention (FA) or causal streaming attention (SA: the first
`sink` tokens plus the last `window`), once per sequence at prefill; decode steps reuse those modes.

The backbone is either the dense decoder adaptex trains (`graphs.tsa.TSADecoder` with
adaptive=False; `adaptex train tsa --task charlm --dense`; its weights ride in the checkpoint), or a
Hugging Face GPT-2 or LLaMA directory (graphs/hf; the checkpoint stores the routers and names the
directory by path and sha256). Both reach this model through the same steps (`embed_new`, `qkv`,
`attn_out`, `mlp`, `head`, `dense`: graphs.hf.decoders.HFDecoder and TSABackbone below), so one
family and one contract serve every decoder backbone. Its weights are frozen and only the routers
train, by distillation: loss = KL(full attention's next-token distribution || elastic's) + lambda1
(Omega - t) + lambda2 (Omega - t)^2 (docs/models/elastic.md), Gumbel-softmax with an annealed
temperature and a straight-through hard decision.

Interface (one graph for prefill and decode, the names of Optimum's decoder-with-past export plus
the head modes; Hkv = the KV heads, H for a decoder without grouped-query attention):
- inputs: input_ids, attention_mask, past_key_values.{i}.key/value (B, Hkv, P, dh), head_modes.{i}
  (B, Hkv) bool
- outputs: logits, present.{i}.key/value, decisions.layer{i}.sa (B, Hkv) bool,
  decisions.layer{i}.logits (B, Hkv, 2) [FA, SA]
At prefill (an empty cache) the routers decide and `head_modes.{i}` is ignored (pass zeros); at a
decode step (a non-empty cache) the graph uses `head_modes.{i}` as given: feed back the prefill's
`decisions.layer{i}.sa`, as `present.*` is fed back as `past_key_values.*`. A decode step runs no
router (an `If` in ONNX Runtime artifacts, so its cost is O(1) in the cache; other targets compute
both and select): its `decisions.layer{i}.logits` are the given modes one-hot, [1, 0] FA, [0, 1] SA.

Router pooling: keys of the first N and the last N real tokens of the sequence, positions counted
from the first real token (decoder batches are left-padded, as for generation). Slicing both runs
keeps a router O(N) whatever the length.
"""
from __future__ import annotations

import math
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
from adaptex.graphs.nn.elastic import given_mode_logits, route_layers
from adaptex.graphs.ops.elastic_attention import NEG, runs_masked
from adaptex.graphs.ops.policy import DEFAULT, OrtPolicy
from adaptex.graphs.tsa import TSAConfig, TSADecoder

MODES = ("soft", "hard", "hard_dense", "full")
BACKBONES = ("tsa", "hf")

# the programs the exporter traces this model for, beside the general one (None)
PROGRAMS = (None, "step", "short", "masked")


@dataclass
class ElasticDecoderConfig:
    backbone_config: dict = field(default_factory=dict)  # tsa: the dense TSAConfig; hf: graphs.hf.HFDecoderConfig
    backbone_sha256: str = ""  # of the backbone weights the routers were trained on
    backbone: str = "tsa"  # "tsa": adaptex's dense decoder, inline; "hf": a Hugging Face directory
    backbone_path: str = ""  # hf: the directory
    sink: int = 4
    window: int = 64
    pool_tokens: int = 100
    router_hidden: int = 64
    target_sparsity: float = 0.7
    # copied from the backbone (what exporters, parity and bench read)
    vocab_size: int = 0
    d_model: int = 0
    num_heads: int = 0
    num_kv_heads: int = 0  # the routed heads (grouped-query attention: fewer than num_heads)
    num_layers: int = 0
    head_dim: int = 0
    max_len: int = 0
    pad_id: int = 0
    adaptive: bool = True
    family: str = field(default="elastic_decoder", init=False)

    def __post_init__(self):
        b = self.backbone_config
        if self.backbone not in BACKBONES:
            raise CheckpointError(f"unknown elastic decoder backbone {self.backbone!r}; adaptex knows 'tsa' (a dense "
                                  "adaptex decoder) and 'hf' (a GPT-2 or LLaMA directory)")
        if b and self.backbone == "tsa":
            if b.get("adaptive", False):
                raise CheckpointError("the elastic decoder's backbone must be a dense decoder (adaptive=false); "
                                      "train one with 'adaptex train tsa --task charlm --dense'")
            self.vocab_size, self.d_model = b["vocab_size"], b["d_model"]
            self.num_heads, self.num_layers, self.max_len = b["num_heads"], b["num_layers"], b["max_len"]
            self.head_dim, self.pad_id = self.d_model // self.num_heads, b.get("pad_id", 0)
            self.num_kv_heads = self.num_heads
        elif b:
            from adaptex.graphs.hf.decoders import HFDecoderConfig

            hb = config_from_dict(HFDecoderConfig, b, "the elastic decoder's backbone_config")
            for k in ("vocab_size", "d_model", "num_heads", "num_kv_heads", "num_layers", "head_dim", "max_len",
                      "pad_id"):
                setattr(self, k, getattr(hb, k))
        if self.sink < 0 or self.window < 1:
            raise ValueError(f"sink must be >= 0 and window >= 1 (got sink={self.sink}, window={self.window})")

    @property
    def kv_groups(self) -> int:
        return self.num_heads // (self.num_kv_heads or self.num_heads)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict, where: str = "config") -> "ElasticDecoderConfig":
        """From a JSON object, every key checked (graphs/config.py)."""
        return config_from_dict(cls, d, where)


class TSABackbone(TSADecoder):
    """adaptex's dense decoder in the steps the elastic decoder runs (graphs.hf.decoders.HFDecoder
    has the same): absolute positions, pre-LN blocks, tied output embedding."""

    def embed_new(self, input_ids: Tensor, attention_mask: Tensor, P: int):
        pos = torch.arange(input_ids.shape[1], device=input_ids.device) + P
        pe = self.pos_emb(pos) if self.cfg.positions == "learned" else self.pos[pos]
        return self.tok(input_ids) + pe[None], None

    def qkv(self, li: int, h: Tensor, ctx):
        B, T, _ = h.shape
        H = self.cfg.num_heads
        q, k, v = self.blocks[li].attn.qkv(self.blocks[li].ln1(h)).view(B, T, 3, H, -1).permute(2, 0, 3, 1, 4)
        return q, k, v

    def attn_out(self, li: int, h: Tensor, o: Tensor) -> Tensor:
        return h + self.blocks[li].attn.proj(o)

    def mlp(self, li: int, h: Tensor) -> Tensor:
        blk = self.blocks[li]
        return h + blk.ffn(blk.ln2(h))

    def head(self, h: Tensor) -> Tensor:
        return F.linear(self.ln_f(h), self.tok.weight)

    def dense(self, input_ids: Tensor, attention_mask: Tensor | None = None, past=None):
        logits, _, presents = self(input_ids, attention_mask, past=past, mode="dense")
        return logits, presents


class ElasticDecoder(nn.Module):
    """A frozen decoder whose causal attention each layer routes per (KV) head."""

    def __init__(self, cfg: ElasticDecoderConfig, backbone: nn.Module | None = None):
        super().__init__()
        self.cfg = cfg
        if backbone is None:
            if cfg.backbone != "tsa":
                raise CheckpointError("an elastic decoder on a Hugging Face backbone loads it from its directory: "
                                      "use ElasticDecoder.from_config")
            backbone = TSABackbone(TSAConfig.from_dict(cfg.backbone_config))
        self.backbone = backbone.eval()
        for p in self.backbone.parameters():
            p.requires_grad_(False)
        self.routers = nn.ModuleList(ElasticAttention(cfg.num_kv_heads, cfg.head_dim, cfg.sink, cfg.window, causal=True,
                                                      router_hidden=cfg.router_hidden, pool_tokens=cfg.pool_tokens,
                                                      kv_groups=cfg.kv_groups)
                                     for _ in range(cfg.num_layers))

    @classmethod
    def from_config(cls, cfg: ElasticDecoderConfig) -> "ElasticDecoder":
        """The backbone from where the config names it (a Hugging Face directory, checked against the
        sha256 the routers were trained on; or inline), plus fresh routers (a checkpoint loads theirs)."""
        if cfg.backbone == "tsa":
            return cls(cfg)
        from adaptex.graphs.hf import load_decoder

        backbone, _, info = load_decoder(cfg.backbone_path)
        if cfg.backbone_sha256 and info["sha256"] != cfg.backbone_sha256:
            raise CheckpointError(f"{cfg.backbone_path}: its weights (sha256 {info['sha256'][:12]}) are not the ones "
                                  f"these routers were trained on ({cfg.backbone_sha256[:12]}); restore that checkpoint "
                                  "or retrain with 'adaptex train elastic --backbone DIR'")
        if info["config"] != cfg.backbone_config:
            raise CheckpointError(f"{cfg.backbone_path}: its config.json changed since the routers were trained; "
                                  "restore it or retrain with 'adaptex train elastic --backbone DIR'")
        return cls(cfg, backbone)

    @classmethod
    def from_backbone(cls, backbone: nn.Module, sha256: str = "", path: str = "", **kw) -> "ElasticDecoder":
        """Routers on a trained dense TSADecoder (its weights copied in) or a loaded graphs.hf decoder."""
        from adaptex.graphs.hf import HFDecoder

        if isinstance(backbone, HFDecoder):
            cfg = ElasticDecoderConfig(backbone_config=backbone.cfg.to_dict(), backbone_sha256=sha256, backbone="hf",
                                       backbone_path=path, **kw)
            return cls(cfg, backbone)
        if backbone.cfg.adaptive:
            raise AdaptexError("the elastic decoder needs a dense decoder backbone (this one is a TSA model); "
                               "train one with 'adaptex train tsa --task charlm --dense'")
        cfg = ElasticDecoderConfig(backbone_config=backbone.cfg.to_dict(), backbone_sha256=sha256, **kw)
        net = cls(cfg)
        net.backbone.load_state_dict(backbone.state_dict())
        return net

    def checkpoint_state(self) -> dict:
        """What a checkpoint stores: everything for an inline backbone, the routers for a Hugging Face one."""
        state = self.state_dict()
        return state if self.cfg.backbone == "tsa" else {k: v for k, v in state.items() if k.startswith("routers.")}

    def train(self, mode: bool = True):
        super().train(mode)
        self.backbone.eval()  # frozen
        return self

    def empty_past(self, B: int, device=None):
        z = torch.zeros(B, self.cfg.num_kv_heads, 0, self.cfg.head_dim, device=device)
        return [(z, z) for _ in range(self.cfg.num_layers)]

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                past: list[tuple[Tensor, Tensor]] | None = None, head_modes: list[Tensor] | None = None,
                mode: str = "hard", tau: float = 1.0, force_sa: list[Tensor | None] | None = None,
                program: str | None = None):
        """Returns logits (B, T, V), decisions (per layer {"sa": (B, Hkv) bool, "logits": (B, Hkv, 2) fp32,
        "g": (B, Hkv) the SA weight used}) and presents (per layer (key, value), (B, Hkv, P+T, dh)).

        head_modes: per layer (B, Hkv) bool, used when the cache is non-empty (decode steps); the
        routers decide at prefill. mode: soft (Gumbel, straight-through; training), hard (the op),
        hard_dense (hard decisions, dense reference kernel), full (every head FA: the backbone).

        program: the call this forward is traced for when the exporter traces one of its programs
        (its contract's PROGRAMS): "step", a decode step (one new token after a non-empty cache:
        the given modes, no router); "short", a prefill within the streaming heads' reach (dense
        attention, one bias for every layer); "masked", a prefill a little longer (a second bias hides
        the keys outside the streaming heads' reach). None: any call."""
        if program not in PROGRAMS:
            raise ValueError(f"unknown program {program!r}; choose one of {', '.join(map(str, PROGRAMS))}")
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
        if mode == "full":
            logits, presents = self.backbone.dense(input_ids, attention_mask, past)
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
        # a tensor, not a Python bool, so one traced graph serves prefill and decode; counted on the
        # mask (P + T columns), never on the cache, whose slices are empty at prefill (Core ML may
        # refuse a zero-size tensor). A decode-step program (traced for calls after a non-empty
        # cache) traces no choice: the given modes, and no router at all
        step_program, short_program = program == "step", program in ("short", "masked")
        has_past = None if step_program or short_program else torch.ones_like(attention_mask[:1]).sum() > T
        h, ctx = bb.embed_new(input_ids, attention_mask, P)
        # a short-call program (traced for prefills of at most sink + window tokens, where every
        # head's streaming attention is its full attention) attends as the dense decoder does,
        # through one padding and causal bias for every layer; the routers still decide. Its masked
        # form (prefills a little longer: ElasticDecoderFamily.masked_call_keys) gives the streaming
        # heads a second bias, the first plus the keys outside their sinks and window, also made once
        # (both in one tensor, from which each layer gathers a head's by its mode)
        if short_program:  # the cache is empty there: the mask's columns are the new tokens'
            key_ok = key_ok[:, -T:]
        bias = _dense_bias(key_ok, T) if short_program else None
        far = torch.cat([bias, bias + _outside_reach(T, cfg.sink, cfg.window, key_ok.device)], 1) \
            if program == "masked" else None
        modes_of, logits_of = _given_decisions(head_modes) if step_program and head_modes else (head_modes, None)
        # within the reach no decision changes the output: the routers run after the last layer, at once
        route_after = bias is not None and far is None
        decisions, presents = [], []
        for li in range(cfg.num_layers):
            q, k, v = bb.qkv(li, h, ctx)  # (B, H, T, dh), (B, Hkv, T, dh) x 2
            if not short_program:  # (the short-call program serves empty caches only)
                k = torch.cat([past[li][0], k], dim=2)
                v = torch.cat([past[li][1], v], dim=2)
            presents.append((k, v))
            modes = modes_of[li] if modes_of is not None else None
            force = force_sa[li] if force_sa is not None else None
            if route_after:
                o, dec = self.routers[li].attend_biased(q, k, v, bias), None
            elif bias is not None:  # a prefill: the routers decide (the given modes serve steps)
                o, dec = self.routers[li].attend_within_reach(q, k, v, key_ok, bias, far)
            else:
                o, dec = self.routers[li](q, k, v, key_ok, modes, has_past, mode=mode, force_sa=force, tau=tau,
                                          return_decisions=True,
                                          given_logits=logits_of[li] if logits_of is not None else None)
            decisions.append(dec)
            h = bb.attn_out(li, h, o.transpose(1, 2).reshape(B, T, cfg.num_heads * cfg.head_dim))
            h = bb.mlp(li, h)
        if route_after:
            routed = route_layers(self.routers, [k for k, _ in presents], key_ok)
            decisions = [router.routed(*r) for router, r in zip(self.routers, routed)]
        return bb.head(h), decisions, presents


def _given_decisions(head_modes: list[Tensor]) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
    """Every layer's given modes and their one-hot logits, made at once for a decode-step program
    (its decisions echo the modes): one Concat, Split and a logits chain for all the layers, where
    a layer at a time costs each layer an Identity and the chain (on elastic-charlm's B1 step, 5
    kernels against 18)."""
    H, modes = head_modes[0].shape[1], torch.cat([m.bool() for m in head_modes], dim=1)  # (B, L * Hkv)
    return modes.split(H, dim=1), given_mode_logits(modes).split(H, dim=1)


def _dense_bias(key_ok: Tensor, T: int) -> Tensor:
    """(B, 1, T, S) additive mask of a causal call of T new tokens over S = cache + T keys: NEG on a
    padded key plus NEG on a key after its query, as the op's bodies add them (a padded query's row,
    which nothing real reads, then comes out the same too)."""
    S = key_ok.shape[1]
    j = torch.arange(S, device=key_ok.device)
    a = torch.arange(T, device=key_ok.device) + (S - T)  # the queries' positions
    pad = torch.where(key_ok, 0.0, NEG)[:, None, None, :]  # (B, 1, 1, S)
    return pad + torch.where(j[None, :] > a[:, None], NEG, 0.0)  # + (T, S)


def _outside_reach(T: int, sink: int, window: int, device=None) -> Tensor:
    """(T, T) additive bias of a causal prefill's streaming heads: NEG on a key outside the query's
    sinks and window that causality leaves visible, 0 elsewhere (the op's masked body hides the
    same keys; a key after its query is the causal bias's)."""
    a = torch.arange(T, device=device)[:, None]
    j = torch.arange(T, device=device)[None, :]
    return torch.where((j < sink) | (a - j < window), 0.0, NEG)


def attention_flops(cfg: ElasticDecoderConfig, sa: np.ndarray, seq: int, past: int = 0) -> tuple[float, float]:
    """(elastic, full) multiply-adds of one sequence's step of `seq` new tokens after `past` cached,
    head modes sa (L, Hkv): projections and MLP per token, attention 2 dh per visible key and query
    head (FA: the causal context; SA: at most sink + window keys); a KV head's mode covers its group."""
    b = cfg.backbone_config
    d, f = cfg.d_model, b.get("d_ff", 4 * cfg.d_model)
    qo, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    mlp = 3 if b.get("layout") == "llama" else 2  # SwiGLU: gate, up, down
    ctx = past + np.arange(1, seq + 1)  # each new token's causal context
    fa = float(ctx.sum())
    sa_ctx = float(np.minimum(ctx, cfg.sink + cfg.window).sum())
    per_head = np.where(np.asarray(sa, bool), sa_ctx, fa) * 2 * cfg.head_dim * cfg.kv_groups
    linear = cfg.num_layers * seq * (2 * d * qo + 2 * d * kv + mlp * d * f) + seq * d * cfg.vocab_size
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


# --- the family contract -------------------------------------------------------------------------------

@register_family
class ElasticDecoderFamily(DecoderContract):
    """Elastic decoders' artifacts: the decoder I/O plus head_modes.{i} (B, Hkv) bool inputs (used at
    decode steps: feed back the prefill's decisions), then per layer decisions.layer{i}.sa and .logits.
    Core ML packages take and give the head modes as float32 0/1 (it has no bool features)."""

    family = "elastic_decoder"
    config_cls, model_cls = ElasticDecoderConfig, ElasticDecoder
    decode_graph = True  # ONNX Runtime: a decode-step graph beside the general one (no router, the step's bodies)
    traced_programs = PROGRAMS[1:]  # ElasticDecoder.forward's program=
    counterpart_modes = {"dense": "full", "naive": "hard_dense"}

    @property
    def heads_dims(self) -> tuple[int, int]:
        return self.cfg.num_kv_heads, self.cfg.head_dim  # the cache holds the KV heads

    def extra_inputs(self, mode: str = "hard") -> list[str]:
        adaptive = self.cfg.adaptive and mode in ADAPTIVE_MODES
        return [f"head_modes.{i}" for i in range(self.cfg.num_layers)] if adaptive else []

    def extra_example(self, batch: int, mode: str) -> list[Tensor]:
        return [torch.rand(batch, self.cfg.num_kv_heads) < 0.5 for _ in self.extra_inputs(mode)]

    def recorded(self, mode: str = "hard") -> list[RecordedOutput]:
        if not self.cfg.adaptive or mode not in ADAPTIVE_MODES:
            return []
        return [RecordedOutput(f"decisions.layer{i}.{f}", f"routers.{i}", f)
                for i in range(self.cfg.num_layers) for f in ("sa", "logits")]

    def call(self, model, inputs, mode, program: str | None = None):
        ids, mask, past, modes = self.split_inputs(inputs)
        logits, _, presents = model(ids, mask, past=past, head_modes=modes or None, mode=mode, program=program)
        return (logits, *[t for kv in presents for t in kv])

    def short_call_keys(self) -> int | None:
        # within sink + window keys every streaming head sees what a full head sees (causal)
        return self.cfg.sink + self.cfg.window if self.cfg.adaptive else None

    def masked_call_keys(self, policy: OrtPolicy = DEFAULT) -> int | None:
        # the longest prefill whose every (query head, query, key) score the op's general body
        # attends masked (runs_masked): up to there the masked program computes the same without
        # the body's per-layer If and masks; None where that is within the reach
        reach = self.short_call_keys()
        longest = min(math.isqrt(policy.mixed_call_masked_up_to // self.cfg.num_heads), self.cfg.max_len)
        return longest if reach is not None and longest > reach else None

    def masked_call_excess(self, policy: OrtPolicy = DEFAULT) -> dict | None:
        # longer prefills too, where the scores masking adds over block-local attention are few
        # (elastic_attention.call_runs_masked with policy.prefill_masked_excess_up_to)
        cfg = self.cfg
        if (self.masked_call_keys(policy) or cfg.max_len) >= cfg.max_len:  # none, or every prefill masked already
            return None
        return {"heads": cfg.num_heads, "beyond": cfg.sink + 2 * cfg.window, "up_to": policy.prefill_masked_excess_up_to}

    def routing_meta(self) -> dict:
        cfg = self.cfg
        meta = {"sink": cfg.sink, "window": cfg.window, "backbone_sha256": cfg.backbone_sha256,
                "backbone": "dense decoder" if cfg.backbone == "tsa" else cfg.backbone_config["layout"],
                "kv_cache_bound": cfg.max_len,
                "head_modes": "routed at prefill (empty cache); decode steps take head_modes.{i} = the prefill's "
                              "decisions.layer{i}.sa"}
        if cfg.kv_groups > 1:
            meta["routing"] = (f"per KV head: each of the {cfg.num_kv_heads} KV heads' mode covers its "
                               f"{cfg.kv_groups} query heads")
        return meta

    def io_descriptions(self) -> dict[str, str]:
        from adaptex.graphs.elastic import head_mode_descriptions
        from adaptex.graphs.tsa import decoder_descriptions

        cfg = self.cfg
        d = head_mode_descriptions(cfg, decoder_descriptions(cfg))
        for i in range(cfg.num_layers):
            d[f"head_modes.{i}"] = (f"layer {i}: the head modes a decode step uses [batch, {cfg.num_kv_heads}]: the "
                                    f"prefill's decisions.layer{i}.sa (ignored at prefill: pass zeros)")
        return d

    def parity_cap(self) -> int:
        # positions reach far (4096) but parity needs lengths past the window, not quadratic
        # full-attention references at the bound
        return min(self.cfg.max_len, 600)

    def initial_extra(self, B: int) -> dict:
        return {f"head_modes.{i}": np.zeros((B, self.cfg.num_kv_heads), bool) for i in range(self.cfg.num_layers)}

    def next_extra(self, outputs: dict, P: int, extra: dict) -> dict:
        if P:  # decode steps reuse the prefill's head modes
            return extra
        return {f"head_modes.{i}": np.asarray(outputs[f"decisions.layer{i}.sa"]) > 0.5 for i in range(self.cfg.num_layers)}

    def flops(self, outputs: dict, variant: str, seq: int, past: int = 0, target: str = "onnx",
              masked_program: bool = False, policy: OrtPolicy = DEFAULT) -> dict:
        """masked_program: the call ran a program of the artifact's that attends every key, masked (a
        masked short-call program: the metadata's programs say which a call runs)."""
        cfg = self.cfg
        sa = np.stack([np.asarray(outputs[f"decisions.layer{i}.sa"]) for i in range(cfg.num_layers)], axis=1) > 0.5
        f = np.array([attention_flops(cfg, row, seq, past) for row in sa])  # (B, 2): elastic, full
        ratio = float(f[:, 0].mean() / f[:, 1].mean())
        masked = masked_program or runs_masked(sa.shape[-1], seq, past + seq, policy or DEFAULT)
        every_key = variant == "dense" or (target == "onnx" and masked)
        return {"flop_ratio": ratio, "executed_flop_ratio": 1.0 if every_key else ratio,
                "sa_fraction": float(sa.mean()), "sa_fraction_per_layer": [float(x) for x in sa.mean(axis=(0, 2))]}
