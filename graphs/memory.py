"""Memory bounds: every large allocation is estimated from its shapes before it is made, and refused in
one line that names the largest value that fits when it would pass a share of the machine's memory.

The limit is SHARE of the machine's memory (its physical memory, or the container's cgroup limit when
lower); `--max-memory SIZE` (or ADAPTEX_MAX_MEMORY) sets it instead. The estimates are upper bounds of
what adaptex itself allocates (weights, optimizer state, activations kept for the backward pass,
attention scores, inputs and the lines a report keeps), not of what a runtime adds around them.
"""
from __future__ import annotations

import math
import os
import re
from typing import Callable

from adaptex.graphs.errors import AdaptexError

SHARE = 0.5
_LIMIT: list[int] = []  # set by --max-memory (the CLI), else read from the environment and the machine
_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 2**10, "m": 2**20, "mb": 2**20, "g": 2**30, "gb": 2**30, "t": 2**40,
          "tb": 2**40}


class MemoryLimit(AdaptexError):
    """An allocation that would pass the memory limit, named with the largest value that fits."""


def parse_size(text: str, what: str = "--max-memory") -> int:
    """'8G', '512M', '1.5GB', '1000000' (bytes) as bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m and _UNITS.get(m[2].lower())
    if not m or unit is None or float(m[1]) <= 0 or not math.isfinite(float(m[1])):
        raise MemoryLimit(f"{what} {text!r}: expected a size such as 8G, 512M or 1.5GB (bytes without a unit)")
    return int(float(m[1]) * unit)


def machine_bytes() -> int:
    """The machine's memory, or the container's limit (cgroup v2 or v1) where lower."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 8 * 2**30
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < total:
            total = int(text)
    return total


def set_limit(size: str | int | None) -> None:
    """The limit for this process (--max-memory); None: the default."""
    _LIMIT.clear()
    if size is not None:
        _LIMIT.append(size if isinstance(size, int) else parse_size(size))


def limit() -> int:
    if _LIMIT:
        return _LIMIT[0]
    env = os.environ.get("ADAPTEX_MAX_MEMORY")
    if env:
        return parse_size(env, "ADAPTEX_MAX_MEMORY")
    return int(SHARE * machine_bytes())


def human(n: float) -> str:
    for unit, size in (("TB", 2**40), ("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} B"


def _where() -> str:
    if _LIMIT or os.environ.get("ADAPTEX_MAX_MEMORY"):
        return "the --max-memory limit"
    return f"{SHARE:.0%} of this machine's memory"


def largest(need: Callable[[int], float], low: int, high: int) -> int:
    """The largest value in [low, high] whose need fits the limit (need grows with the value), or
    low - 1 when none does."""
    cap = limit()
    if need(low) > cap:
        return low - 1
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if need(mid) <= cap else (low, mid - 1)
    return low


def require(flag: str, value: int, need: Callable[[int], float], what: str, low: int = 1) -> None:
    """Refuse `value` of `flag` when need(value) bytes pass the limit, naming the largest that fits."""
    cap = limit()
    got = need(value)
    if got <= cap:
        return
    best = largest(need, low, max(low, value - 1))
    fix = (f"the largest {flag} that fits is {best}" if best >= low else
           f"nothing fits: even {flag} {low} needs about {human(need(low))}")
    raise MemoryLimit(f"{flag} {value}: {what} would need about {human(got)}, more than {human(cap)} "
                      f"({_where()}); {fix} (--max-memory SIZE raises the limit)")


# --- estimates from shapes ---------------------------------------------------------------------------------

def model_params(vocab: int, d: int, layers: int, d_ff: int, positions: int) -> float:
    """Parameters of a Transformer of these sizes (embeddings, attention, feed-forward, norms)."""
    return vocab * d + positions * d + layers * (4 * d * d + 2 * d * d_ff + 9 * d + d_ff)


def activation_bytes(batch: int, seq: int, d: int, heads: int, layers: int, backward: bool) -> float:
    """fp32 activations of a batch: per layer and token about 17 vectors of d (kept for the backward
    pass; 4 at inference) and 2.5 rows of attention scores per head."""
    per_token_layer = (17 if backward else 4) * d + 2.5 * heads * seq
    return 4.0 * batch * seq * max(layers, 1) * per_token_layer


def config_sizes(cfg) -> dict:
    """The sizes an estimate needs from a config (a dict or a config object), with defaults for the
    ones a family does not have."""
    get = cfg.get if isinstance(cfg, dict) else (lambda k, default=None: getattr(cfg, k, default))
    d = get("d_model") or get("hidden_size") or 256
    return {"vocab": get("vocab_size") or 0, "d": d, "layers": get("num_layers") or get("num_hidden_layers") or 1,
            "heads": get("num_heads") or get("num_attention_heads") or 1, "d_ff": get("d_ff") or 4 * d,
            "positions": get("max_len") or get("max_positions") or 0}


_SIZE_KEYS = {"vocab": ("vocab_size",), "d": ("d_model", "hidden_size"), "layers": ("num_layers", "num_hidden_layers"),
              "d_ff": ("d_ff", "intermediate_size"), "positions": ("max_len", "max_positions")}


def require_config(cfg: dict, where: str, per_param: float = 4.0) -> None:
    """Refuse a config whose weights alone (per_param bytes each) pass the limit, naming the key
    that makes them so and its largest value that fits."""
    sizes = config_sizes(cfg)
    total = per_param * model_params(sizes["vocab"], sizes["d"], sizes["layers"], sizes["d_ff"], sizes["positions"])
    if total <= limit():
        return

    def with_(field, v):
        s = dict(sizes, **{field: v})
        if field == "d" and not (cfg.get("d_ff") or cfg.get("intermediate_size")):
            s["d_ff"] = 4 * v
        return per_param * model_params(s["vocab"], s["d"], s["layers"], s["d_ff"], s["positions"])

    present = [(f, k) for f, keys in _SIZE_KEYS.items() for k in keys if isinstance(cfg.get(k), int)]
    if not present:
        return
    field, key = min(present, key=lambda fk: with_(fk[0], 1))  # the one whose size matters most
    try:
        require(key, cfg[key], lambda v: with_(field, v), "the model's weights")
    except MemoryLimit as e:
        raise MemoryLimit(f"{where}: {e}".replace("(--max-memory SIZE raises the limit)",
                                                   "(fix the config, or --max-memory SIZE raises the limit)")) \
            from None
