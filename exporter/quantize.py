"""The quantize option every target reads: a scheme's name, its bits and whether the routers are
quantized too. Each target names the schemes it writes (onnx: int8, int4; coreml: int8, palettize4,
palettize6) and does the quantizing itself (exporter/targets/<target>/quantize.py)."""
from __future__ import annotations

from dataclasses import dataclass

from adaptex.exporter.errors import ExportError

BITS = {"int8": 8, "int4": 4, "palettize4": 4, "palettize6": 6}


@dataclass
class Scheme:
    """What a quantized artifact stores: `name` (a key of BITS) and whether the routers are quantized."""
    name: str
    routers: bool = False

    @property
    def bits(self) -> int:
        return BITS[self.name]


def scheme_option(value, routers, target: str, schemes: tuple[str, ...]) -> Scheme | None:
    """The quantize option as a Scheme (None: not quantized); a one-line error for a bad value."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "off", "none")):
        if routers:
            raise ExportError("--quantize-routers quantizes the routers of a quantized artifact; give --quantize "
                              f"{' or '.join(schemes)} too")
        return None
    name = str(value).strip().lower()
    if name not in schemes:
        raise ExportError(f"--quantize {value!r}: the {target} target quantizes to {' or '.join(schemes)}; "
                          "choose one (or leave it out for full precision)")
    return Scheme(name, bool(routers))
