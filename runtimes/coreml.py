"""Core ML runtime runner (macOS only): MLModel.predict with a choice of compute units.

On Linux coremltools converts but cannot load a model for prediction; there `open_artifact` gives the
MIL reference evaluator (runtimes/coreml_mil.py) instead, and this module is never imported.
"""
from __future__ import annotations

import platform
from pathlib import Path

import numpy as np

from adaptex.graphs.errors import AdaptexError
from adaptex.runtimes.base import IOSpec, Runner, limits_of

COMPUTE_UNITS = {"cpu_only": "CPU_ONLY", "cpu_and_gpu": "CPU_AND_GPU", "cpu_and_ne": "CPU_AND_NE", "all": "ALL"}


def available() -> bool:
    return platform.system() == "Darwin"


def _typed(feeds: dict) -> dict:
    """Core ML packages take int32 ids and masks and float32 caches."""
    return {k: np.asarray(v).astype(np.int32 if k in ("input_ids", "attention_mask") else np.float32)
            for k, v in feeds.items()}


def load_predictor(path: str | Path, compute_units: str = "all"):
    """A package without adaptex metadata (bench's stock counterparts) as a feeds -> outputs callable;
    feeds and outputs by canonical (dotted) name, as the package's feature names have underscores."""
    import coremltools as ct

    m = ct.models.MLModel(str(path), compute_units=getattr(ct.ComputeUnit, COMPUTE_UNITS[compute_units]))
    return lambda feeds: {k: v for k, v in m.predict({n.replace(".", "_"): a for n, a in _typed(feeds).items()}).items()}


class CoreMLRunner(Runner):
    name = "Core ML runtime"

    def __init__(self, path: str | Path, compute_units: str = "all"):
        if not available():
            raise AdaptexError("the Core ML runtime needs macOS; on this machine 'adaptex check' uses the MIL "
                               "reference evaluation of the package instead")
        if compute_units not in COMPUTE_UNITS:
            raise AdaptexError(f"unknown --compute-units {compute_units!r}; choose one of {', '.join(COMPUTE_UNITS)}")
        import coremltools as ct

        self.path, self.compute_units = Path(path), compute_units
        self.name = f"Core ML runtime ({compute_units})"
        self._ct = ct
        from adaptex.exporter.targets.coreml.package import read_package_meta

        self.meta = read_package_meta(self.path)
        super().__init__(limits_of(self.meta))
        self.model = None

    def _activate(self):
        ct = self._ct
        self.model = ct.models.MLModel(str(self.path), compute_units=getattr(ct.ComputeUnit, COMPUTE_UNITS[self.compute_units]))

    def _deactivate(self):
        self.model = None

    def input_metadata(self) -> dict[str, IOSpec]:
        from adaptex.runtimes.coreml_mil import input_specs

        return input_specs(self.meta)

    def _infer(self, feeds):
        from adaptex.runtimes.coreml_mil import canonical_outputs, coreml_feeds

        return canonical_outputs(self.meta, self.model.predict(coreml_feeds(self.meta, _typed(feeds))))
