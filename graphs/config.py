"""Configs are data: every key checked for presence, type and range before a model is built from it.

`from_dict(cls, d, where)` builds a config dataclass from a JSON object and raises a one-line
ConfigError naming the key and the fix for a missing, unknown, mistyped or out-of-range key: a
checkpoint whose config.json lost `max_len` must not export with a default cache bound.
"""
from __future__ import annotations

import dataclasses
import math

from adaptex.graphs import memory
from adaptex.graphs.errors import CheckpointError


class ConfigError(CheckpointError):
    """A config that is not what its model needs, named by key."""


# sizes that must be at least 1; any other int must be at least 0
POSITIVE = {"vocab_size", "d_model", "num_heads", "num_layers", "d_ff", "max_len", "num_classes", "head_dim",
            "window", "pool_tokens", "max_positions", "type_vocab_size"}
_TYPES = {"int": int, "float": (int, float), "bool": bool, "str": str, "dict": dict, "list": list}


def from_dict(cls, d, where: str = "config"):
    """cls(**d), after checking every key of `d` against cls's fields."""
    name = cls.__name__
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: is a {type(d).__name__}, expected an object with the {name} fields; "
                          "re-write it with 'adaptex train' (or restore it from the checkpoint it came from)")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    d = {k: v for k, v in d.items() if not (k == "family" and "family" in fields and not fields[k].init)}
    unknown = sorted(set(d) - set(fields))
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r} for {name}; remove it (known keys: "
                          f"{', '.join(sorted(fields))})")
    missing = [n for n, f in fields.items() if f.init and n not in d]
    if missing:
        raise ConfigError(f"{where}: missing key {missing[0]!r} for {name}; a config lists every key "
                          "(adaptex writes them all), so restore it rather than rely on a default")
    for key, value in d.items():
        _check(key, value, fields[key].type, where, name)
    memory.require_config(d, where)  # max_len 10**9 is refused here, not by a failed allocation
    try:
        return cls(**{k: v for k, v in d.items() if fields[k].init})
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{where}: {e}; fix the config's values") from None


def _check(key: str, value, annotation, where: str, name: str) -> None:
    kind = str(annotation).split("|")[0].strip()
    want = _TYPES.get(kind)
    if want is None:
        return
    ok = isinstance(value, want) and not (kind in ("int", "float") and isinstance(value, bool))
    if not ok:
        raise ConfigError(f"{where}: {key} is {value!r} ({type(value).__name__}), expected {kind} for {name}")
    if kind == "float" and not math.isfinite(value):
        raise ConfigError(f"{where}: {key} is {value!r}, expected a finite number")
    if kind == "int":
        low = 1 if key in POSITIVE else 0
        if value < low:
            raise ConfigError(f"{where}: {key} is {value}, expected at least {low}")
