"""The targets: one table that the CLI, `inspect` and `bench` read.

A target is a `Target`: its name, the suffixes of what it writes, its precisions, its CLI options,
and the module that exports to it. Each target package registers its `Target` (and its lowerings)
when imported; `load(name)` imports a built-in one on first use, so a machine without coremltools
still exports ONNX. Adding a target is one package under this one plus its name in BUILTIN
(docs/extending.md).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from adaptex.exporter.errors import ExportError

BUILTIN = ("onnx", "coreml", "tensorrt", "openvino")


@dataclass(frozen=True)
class Option:
    """A CLI flag only this target takes (`adaptex export` refuses it for any other target)."""
    flag: str
    help: str
    default: Any = None
    action: str | None = None  # "store_true" for a switch
    variants: tuple[str, ...] | None = None  # the variants it applies to (None: every one)

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


@dataclass(frozen=True)
class Target:
    name: str
    suffixes: tuple[str, ...]  # what it writes; the first is the usual one
    precisions: tuple[str, ...]
    export: Callable  # export(model, contract, out, *, variant, precision, source, say, **options) -> metadata
    default_precision: Callable  # default_precision(contract) -> str
    description: str = ""
    options: tuple[Option, ...] = field(default_factory=tuple)
    # the files an artifact at a path brings beside it (OpenVINO IR's weights): written, checked,
    # moved and refused with it
    companions: Callable[[Path], tuple[Path, ...]] = lambda out: ()

    def check_output(self, out: str | Path, options: dict) -> None:
        """A one-line error when `out`'s suffix does not fit this target (naming the right one)."""
        suffix = Path(str(out).rstrip("/")).suffix
        if suffix not in self.suffixes:
            want = " or ".join(self.suffixes)
            raise ExportError(f"{out}: a {self.name} artifact's name must end in {want}; use -o "
                              f"{Path(str(out).rstrip('/')).with_suffix(self.suffixes[0])}")


_TABLE: dict[str, Target] = {}


def register_target(target: Target) -> Target:
    _TABLE[target.name] = target
    return target


def load(name: str) -> Target:
    """The target called `name` (its module imported, its lowerings registered)."""
    if name not in _TABLE and name in BUILTIN:
        importlib.import_module(f"adaptex.exporter.targets.{name}")
    if name not in _TABLE:
        raise ExportError(f"unknown target {name!r}; choose one of {', '.join(BUILTIN)}")
    return _TABLE[name]


def names() -> list[str]:
    """Every target an artifact may name: the built-in ones and any registered since."""
    return list(dict.fromkeys([*BUILTIN, *_TABLE]))


def load_all() -> dict[str, Target]:
    for name in BUILTIN:
        load(name)
    return dict(_TABLE)


def all_options() -> list[tuple[Option, list[str]]]:
    """Every target option with the targets that take it (for the CLI's export parser), its help
    naming them: "onnx/coreml: ..." where they mean the same, each target's own help, named, where not."""
    seen: dict[str, list[tuple[str, Option]]] = {}
    for t in load_all().values():
        for o in t.options:
            seen.setdefault(o.flag, []).append((t.name, o))
    out = []
    for takers in seen.values():
        option, names = takers[0][1], [name for name, _ in takers]
        if len({o.help for _, o in takers}) > 1:
            option = replace(option, help="; ".join(f"{name}: {o.help}" for name, o in takers))
        else:
            option = replace(option, help=f"{'/'.join(names)}: {option.help}")
        out.append((option, names))
    return out
