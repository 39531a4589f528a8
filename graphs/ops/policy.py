"""ONNX Runtime's tuning policy: every threshold by which an ONNX Runtime artifact's op bodies and
programs choose a path, in one object.

Export takes a policy (adaptex.export(..., policy=OrtPolicy(...)); the default is `OrtPolicy()`) and
stores it in the artifact's metadata, and the families' executed-FLOP models read the artifact's
policy, so they count what that artifact runs. It lives here, below the exporter, because those
models (graphs/) read it too. How each value was measured is in docs/ops.md and git history, with
the command that measured it; a value changes no result, only which kernels compute it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from adaptex.graphs.errors import AdaptexError


@dataclass(frozen=True)
class OrtPolicy:
    # ConditionalAttention: every query row masked, not the kept ones gathered, once the batch's largest
    # kept count reaches this share of T (the gathered rows would be nearly all of them, plus the gathers)
    dense_query_share: float = 0.97
    # attention runs a sample at a time (a Loop) where batch x heads x queries x keys reaches this and
    # batch > 1: each sample's scores then stay in cache between the kernels that read them
    by_sample_from: int = 1 << 22
    # ElasticAttention: a call of T > 1 attends every pair over every key, SA keys masked, while a sample
    # has at most this many scores (H T S): below it, gathering pairs by mode costs more kernels than it saves
    mixed_call_masked_up_to: int = 1 << 17
    # ... or (no cache) while the scores masking adds over block-local SA, B H T (T - sink - 2 window),
    # are at most this many: there gathering's own kernels cost more than the masked keys
    masked_excess_up_to: int = 3 << 16
    # ... a decoder's prefill (its masked short-call program), whose gathering path costs more
    prefill_masked_excess_up_to: int = 1 << 18
    # a decode step's mixed layer attends every pair masked while the cache holds at most this many
    # floats (B H S dh); past it each mode's pairs read only their own keys
    mixed_step_masked_up_to: int = 1 << 20
    # BudgetedAttention: a batch runs every sample on every head some sample chose where that wastes at
    # most this many token rows (a few batched kernels beat a chain of about 20 a head)
    active_heads_waste_rows: int = 512
    # a decoder's main graph gets a large-call program only where a call of at most this many sequences
    # of its longest length reaches by_sample_from (below, the program would never run)
    large_call_batch: int = 64
    # a main-graph constant of at most this many elements is copied into each program's branch, not
    # folded there: ONNX Runtime's fusions that want a constant input run before the folding
    copied_up_to: int = 64

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d, where: str = "policy") -> "OrtPolicy":
        """A policy read back from an artifact's metadata, each value checked; a key this version
        does not know is refused, a key it lacks takes the default."""
        if not isinstance(d, dict):
            raise AdaptexError(f"{where}: a policy is a JSON object, got {type(d).__name__}")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(d) - set(known))
        if unknown:
            raise AdaptexError(f"{where}: unknown policy field(s) {', '.join(unknown)}; re-export the artifact")
        for k, v in d.items():
            want = float if known[k].type in ("float", float) else int
            ok = isinstance(v, (int, float)) if want is float else isinstance(v, int)
            if isinstance(v, bool) or not ok or v < 0:
                raise AdaptexError(f"{where}: {k} must be a non-negative {want.__name__}, got {v!r}")
        return cls(**d)


DEFAULT = OrtPolicy()
