"""docs/extending.md, followed: a toy op and a toy target added from a module of their own, outside
adaptex's tree, and a model that uses the op exported to the target.

The module is written to a temp directory and run in a subprocess, so that the op it registers
(torch's op table is process-wide) and the target and lowering it adds stay out of every other test.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

TOY = textwrap.dedent('''
    """A toy op (adaptex::toy_gate: the rows whose gate is above 0.5 scaled, the rest as they are) and
    a toy target ("toy": the lowered nodes as JSON), added as docs/extending.md says."""
    import json
    import sys
    from pathlib import Path

    import torch
    from torch import Tensor

    import adaptex
    from adaptex.exporter.registry import lookup, lowering
    from adaptex.exporter.targets import Target, register_target
    from adaptex.exporter.trace import adaptex_nodes, op_name, trace
    from adaptex.graphs.nn import AdaptiveLayer
    from adaptex.graphs.ops.facts import Margin, OpFacts, decision_kinds, margins, register, routing_inputs
    from adaptex.runtimes.report import MARGINS

    # 1. the op: custom_op, eager kernel, fake kernel, and its facts
    OP_NAME = "adaptex::toy_gate"


    @torch.library.custom_op(OP_NAME, mutates_args=())
    def toy_gate(x: Tensor, keep: Tensor, scale: float) -> Tensor:
        """x (B, T, d), keep (B, T) bool: x * scale where keep, x elsewhere."""
        return torch.where(keep.unsqueeze(-1), x * scale, x)


    @toy_gate.register_fake
    def _(x, keep, scale):
        return torch.empty_like(x)


    FACTS = register(OpFacts(op=OP_NAME, function="ToyGate", routing_inputs=("keep",),
                             decisions={"keep": "keep"}, margins={"keep": Margin(1e-4, 1e-2, "|p - threshold|")}))


    # 2. a layer that calls it and records its decision
    class ToyGate(torch.nn.Module, AdaptiveLayer):
        def __init__(self, d: int):
            super().__init__()
            self.router = torch.nn.Linear(d, 1)

        def forward(self, x):
            p = torch.sigmoid(self.router(x)).squeeze(-1)  # (B, T)
            keep = p > 0.5
            self.record({"keep": keep}, margins={"keep": (p - 0.5).abs()})
            return torch.ops.adaptex.toy_gate(x, keep, 2.0)


    class Toy(torch.nn.Module):
        def __init__(self, d: int = 8):
            super().__init__()
            self.proj, self.gate = torch.nn.Linear(d, d), ToyGate(d)

        def forward(self, x):
            return self.gate(self.proj(x))


    # 3. the toy target and its lowering of the toy op
    @lowering(OP_NAME, target="toy", variant="sparse")
    def toy_gate_toy(ctx, node):
        """The node as the toy target writes it."""
        return {"op": "ToyGate", "scale": node.args[2]}


    def export_toy(model, contract, out: Path, *, variant, precision, source, say=None, tokenizer=None, **options):
        ep = trace(model, contract, "hard")
        nodes = [lookup(op_name(n), "toy", variant, n).fn(None, n) for n in adaptex_nodes(ep)]
        meta = {"target": "toy", "variant": variant, "precision": precision, "nodes": nodes,
                "decisions": [[d.name, d.kind] for d in contract.decisions("hard")]}
        out.write_text(json.dumps(meta))
        return meta


    register_target(Target("toy", (".toy.json",), ("fp32",), export_toy, lambda contract: "fp32",
                           description="the nodes as JSON"))

    if __name__ == "__main__":
        torch.manual_seed(0)
        model = Toy()
        meta = adaptex.export(model, (torch.randn(2, 5, 8),), sys.argv[1], target="toy")
        try:  # a target with no cell for the op: one clear refusal naming the op and the target
            adaptex.export(model, (torch.randn(2, 5, 8),), str(Path(sys.argv[1]).with_suffix(".onnx")), target="onnx")
            refusal = None
        except Exception as e:  # noqa: BLE001  (the type and message are what the test reads)
            refusal = f"{type(e).__name__}: {e}"
        print(json.dumps({"meta": meta, "refusal": refusal, "routing": routing_inputs().get("ToyGate"),
                          "kind": decision_kinds().get("keep"), "margins": margins(), "report_margins": MARGINS}))
''')


def test_a_toy_op_and_a_toy_target_added_as_the_guide_says_export_a_model(tmp_path):
    (tmp_path / "toy_ext.py").write_text(TOY)
    out = tmp_path / "toy.toy.json"
    r = subprocess.run([sys.executable, str(tmp_path / "toy_ext.py"), str(out)], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    meta = got["meta"]
    assert meta["target"] == "toy" and meta["nodes"] == [{"op": "ToyGate", "scale": 2.0}], meta
    assert meta["decisions"] == [["decisions.gate.keep", "keep"]], meta  # the layer's decision, of the op's kind
    assert json.loads(out.read_text()) == meta
    # the op's facts reach the layers that read them: TensorRT's routing pins, parity's margins
    assert got["routing"] == ["keep"] and got["kind"] == "keep"
    # (the report adds the quantized schemes' margins, which reuse fp32's)
    assert {k: got["report_margins"][k] for k in got["margins"]} == got["margins"]
    assert got["margins"]["fp16"]["keep"] == 1e-2
    # the onnx target has no cell for the op: UnsupportedLowering names the op and the target
    assert got["refusal"] and "adaptex::toy_gate" in got["refusal"] and "onnx" in got["refusal"], got["refusal"]
