"""bench's OpenVINO graphs: an OpenVINO artifact (.xml, or an .onnx run with runtime openvino)
against the dense candidates of the same weights, each run in OpenVINO at the artifact's precision
(f32, or bf16 for a bf16 artifact: the candidates then run wholly in bf16, the artifact with its
routing in f32). The candidates are bench's ONNX ones (the stock exports, the original checkpoint's export;
exporter/counterparts.py), without the softmax floor (an ONNX Runtime remedy); one that OpenVINO
cannot load (an ONNX Runtime optimizer's contrib ops) is listed with the reason, not timed."""
from __future__ import annotations

from adaptex.runtimes.timing import Timing


def openvino_graphs(model, contract, tmp, say, cache: bool = True, precision: str = "f32") -> tuple[list[Timing], str]:
    """(the dense candidates and the naive export as timings, runtime description)."""
    import openvino as ov

    from adaptex.exporter.counterparts import cached_onnx_candidates

    cands = cached_onnx_candidates(model, contract, tmp, say, cache=cache, floor=False)
    out = []
    for g in cands:
        reason = g.reason
        if g.path and reason is None:
            try:
                ov.Core().read_model(g.path)
            except Exception as e:
                reason = f"OpenVINO cannot read it: {str(e).strip().splitlines()[-1][:160]}"
        out.append(Timing(g.name, g.path if reason is None else None, how=f"{g.how}, in OpenVINO", dense=g.dense,
                          reason=reason))
    return out, f"openvino {ov.__version__.split('-')[0]} (CPU, {precision} inference precision)"


def openvino_runner(path: str, threads: int, precision: str = "f32"):
    """A callable from feeds to outputs by name: the file compiled for OpenVINO's CPU device with
    `threads` threads (an .onnx file's adaptex functions inlined first), one inference request."""
    from pathlib import Path

    import numpy as np
    import openvino as ov

    from adaptex.runtimes.openvino import _inlined_onnx

    core = ov.Core()
    model = core.read_model(_inlined_onnx(Path(path)), b"") if path.endswith(".onnx") else core.read_model(path)
    config = {"INFERENCE_PRECISION_HINT": precision}
    if threads:
        config["INFERENCE_NUM_THREADS"] = threads
    compiled = core.compile_model(model, "CPU", config)
    request = compiled.create_infer_request()
    takes = {i.get_any_name() for i in compiled.inputs}  # a dense graph takes no decisions

    def run(feeds: dict) -> dict:
        result = request.infer({k: np.ascontiguousarray(v) for k, v in feeds.items() if k in takes})
        return {o.get_any_name(): result[o] for o in compiled.outputs}
    return run
