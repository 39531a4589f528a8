"""The TensorRT target on CPU: the TensorRT-bound ONNX of every family and variant, its parity in
ONNX Runtime, the static parser-rule checker, the engine build's refusal without a GPU, and the
builder's fp32 pinning of routing layers. Engine tests proper live in test_tensorrt_gpu.py."""
from __future__ import annotations

import hashlib
import types

import onnx
import pytest
from onnx import TensorProto, helper

from adaptex.cli import main
from adaptex.exporter.errors import ExportError
from adaptex.exporter.targets import tensorrt
from adaptex.exporter.targets.tensorrt import rules as tensorrt_rules
from adaptex.graphs import checkpoint


@pytest.fixture(scope="module")
def checkpoints(family_checkpoints):
    return family_checkpoints


@pytest.fixture(scope="module")
def bound(artifacts):
    """{(family, variant): path} of the TensorRT-bound ONNX (--onnx-only), shared with the session."""
    return {(family, variant): artifacts(family, "tensorrt", variant) for family in ("bf", "tsa")
            for variant in ("sparse", "dense")}


KEYS = [(f, v) for f in ("bf", "tsa") for v in ("sparse", "dense")]


@pytest.mark.parametrize("key", KEYS, ids=lambda k: f"{k[0]}-{k[1]}")
def test_bound_onnx_passes_the_checker_and_parity_in_onnxruntime(bound, key, capsys):
    path = bound[key]
    assert tensorrt_rules.lint(onnx.load(str(path))) == []
    assert main(["lint", str(path)]) == 0
    capsys.readouterr()
    assert main(["check", str(path), "--samples", "40", "--json"]) == 0  # fp32 1e-4, unexcused flips 0
    import json

    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and report["unexcused_flips"] == 0
    assert report["max_abs_err"] < 1e-4
    meta = onnx.load(str(path), load_external_data=False).metadata_props
    assert '"target": "tensorrt"' in next(p.value for p in meta if p.key == "adaptex")


def test_bound_onnx_keeps_one_node_per_op_and_runtime_k(bound):
    m = onnx.load(str(bound[("bf", "sparse")]))
    calls = [n for n in m.graph.node if n.domain == "adaptex"]
    assert len(calls) == 2 and {f.name for f in m.functions} == {"BudgetedAttention"}
    topk = next(n for n in m.functions[0].node if n.op_type == "TopK")
    producers = {o: n.op_type for n in m.functions[0].node for o in n.output}
    assert producers[topk.input[1]] == "ReduceMax"  # K is the batch's largest k, computed at run time
    m = onnx.load(str(bound[("tsa", "sparse")]))
    fns = {f.name: f for f in m.functions}
    assert [n.op_type for n in m.graph.node if n.domain == "adaptex"] == ["ConditionalAttention", "ConditionalFFN"] * 2
    assert {"NonZero", "ScatterND"} <= {n.op_type for n in fns["ConditionalFFN"].node}
    # the attention's kept rows come from a CumSum partition, not a TopK over the sequence axis
    ops = {n.op_type for n in fns["ConditionalAttention"].node}
    assert {"CumSum", "ScatterElements", "Slice", "ScatterND"} <= ops and "TopK" not in ops
    scatter = [n for f in fns.values() for n in f.node if n.op_type == "ScatterND"]
    assert len(scatter) == 2 and not any(n.attribute for n in scatter)  # TensorRT <= 10.8 refuses even reduction='none'


def test_routing_nodes_are_marked_and_only_routing(bound):
    m = onnx.load(str(bound[("tsa", "sparse")]))
    marked = [n for n in m.graph.node if n.name.startswith(tensorrt.ROUTE_MARK)]
    assert marked and all("routers." in str(n.metadata_props) or n.op_type in ("LessOrEqual", "Cast", "Sub", "Mul")
                          for n in marked)
    fns = {f.name: f for f in m.functions}
    body = {n.op_type for n in fns["ConditionalFFN"].node if n.name.startswith(tensorrt.ROUTE_MARK)}
    assert "NonZero" in body and not body & {"Gemm", "LayerNormalization", "Gelu", "Add"}
    body = {n.op_type for n in fns["ConditionalAttention"].node if n.name.startswith(tensorrt.ROUTE_MARK)}
    assert "CumSum" in body and not body & {"MatMul", "Softmax", "Gather", "ScatterND"}
    m = onnx.load(str(bound[("bf", "sparse")]))
    body = {n.op_type for n in m.functions[0].node if n.name.startswith(tensorrt.ROUTE_MARK)}
    assert {"Floor", "TopK", "ScatterElements"} <= body and not body & {"Softmax", "MatMul", "Gather"}
    assert sum("router" in str(n.metadata_props) for n in m.graph.node if n.name.startswith(tensorrt.ROUTE_MARK)) >= 8


def test_engine_build_parses_the_written_file_byte_for_byte(bound, monkeypatch, tmp_path):
    seen = {}

    def fake_build(data, meta, out, **kw):
        seen["sha"] = hashlib.sha256(data).hexdigest()
        return meta

    monkeypatch.setattr(tensorrt, "require_tensorrt", lambda: None)
    monkeypatch.setattr(tensorrt, "build_engine", fake_build)
    path = bound[("bf", "sparse")]
    assert main(["export", str(path), "--target", "tensorrt", "-o", str(tmp_path / "m.plan")]) == 0
    assert seen["sha"] == hashlib.sha256(path.read_bytes()).hexdigest()


def test_bound_onnx_is_deterministic(checkpoints):
    from adaptex.exporter.metadata import source_of
    from adaptex.graphs.family import family_contract

    model, info = checkpoint.load(checkpoints / "bf")
    a, _ = tensorrt.bound_onnx(model, family_contract(model), source_of(model, info))
    b, _ = tensorrt.bound_onnx(model, family_contract(model), source_of(model, info))
    assert a == b


# --- the checker ----------------------------------------------------------------------------------

def _planted(bound, family: str, op: str, **attrs) -> onnx.ModelProto:
    m = onnx.load(str(bound[(family, "sparse")]))
    node = next(n for n in m.functions[0].node if n.op_type == op)
    for k, v in attrs.items():
        node.attribute.extend([helper.make_attribute(k, v)]) if not any(a.name == k for a in node.attribute) else \
            [a.CopyFrom(helper.make_attribute(k, v)) for a in node.attribute if a.name == k]
    return m


def test_checker_rejects_planted_topk_sorted_0(bound, tmp_path, capsys):
    m = _planted(bound, "bf", "TopK", sorted=0)
    v = tensorrt_rules.lint(m)
    assert {x.rule for x in v} == {"topk-sorted"} and len(v) == 2  # one per call of the function
    assert "in function BudgetedAttention" in v[0].where
    onnx.save(m, str(tmp_path / "bad.onnx"))
    capsys.readouterr()
    assert main(["lint", str(tmp_path / "bad.onnx")]) == 1
    assert "[topk-sorted]" in capsys.readouterr().out


def test_checker_rejects_planted_scatternd_reduction(bound):
    v = tensorrt_rules.lint(_planted(bound, "tsa", "ScatterND", reduction="add"))
    assert {x.rule for x in v} == {"scatternd-reduction", "scatternd-reduction-attr"}
    assert {x.rule for x in tensorrt_rules.lint(_planted(bound, "tsa", "ScatterND", reduction="add"), "10.9")} \
        == {"scatternd-reduction"}
    none = _planted(bound, "tsa", "ScatterND", reduction="none")  # refused up to 10.8, fixed in 10.9
    assert {x.rule for x in tensorrt_rules.lint(none, "10.8")} == {"scatternd-reduction-attr"}
    assert tensorrt_rules.lint(none, "10.9") == []


def _tiny_graph(nodes, inputs, outputs, functions=(), opset=20):
    g = helper.make_graph(nodes, "g", inputs, outputs)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("x", 1)],
                             functions=list(functions))


def test_checker_rules_on_small_graphs():
    f32 = lambda n, s: helper.make_tensor_value_info(n, TensorProto.FLOAT, s)  # noqa: E731
    # runtime K: fine on 10.x, refused before 8.6; K over a dynamic axis cannot be bounded
    k_in = helper.make_tensor_value_info("k", TensorProto.INT64, [1])
    topk = helper.make_node("TopK", ["x", "k"], ["v", "i"], axis=-1)
    m = _tiny_graph([topk], [f32("x", [2, 8]), k_in], [f32("v", [2, None])])
    assert tensorrt_rules.lint(m, "10.0") == []
    assert {v.rule for v in tensorrt_rules.lint(m, "8.5")} == {"topk-k-initializer"}
    m = _tiny_graph([topk], [f32("x", [2, "n"]), k_in], [f32("v", [2, None])])
    assert {v.rule for v in tensorrt_rules.lint(m)} == {"topk-k-limit"}
    # unsupported operator; custom op without a body; If branches of different rank
    m = _tiny_graph([helper.make_node("Unique", ["x"], ["y"])], [f32("x", [4])], [f32("y", [None])])
    assert {v.rule for v in tensorrt_rules.lint(m)} == {"operator-table"}
    m = _tiny_graph([helper.make_node("Mystery", ["x"], ["y"], domain="x")], [f32("x", [4])], [f32("y", [4])])
    assert {v.rule for v in tensorrt_rules.lint(m)} == {"custom-op-body"}
    assert tensorrt_rules.lint(m, plugins=("Mystery",)) == []
    then_g = helper.make_graph([helper.make_node("Identity", ["x"], ["a"])], "t", [], [f32("a", [4])])
    else_g = helper.make_graph([helper.make_node("Unsqueeze", ["x", "ax"], ["b"])], "e", [], [f32("b", [1, 4])],
                               initializer=[helper.make_tensor("ax", TensorProto.INT64, [1], [0])])
    cond = helper.make_tensor_value_info("c", TensorProto.BOOL, [])
    m = _tiny_graph([helper.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g)],
                    [cond, f32("x", [4])], [f32("y", None)])
    assert {v.rule for v in tensorrt_rules.lint(m)} == {"if-branches"}


def test_checker_rejects_another_runtimes_contrib_op_inside_a_body(artifacts):
    """ONNX Runtime's encoder body of ElasticAttention calls com.microsoft.MultiHeadAttention, which
    TensorRT has no operator for: lint refuses that artifact for TensorRT (naming the op and the
    fix), and passes the TensorRT-bound export of the same model, whose bodies have none."""
    ort_bodies = tensorrt_rules.lint(onnx.load(artifacts("el", "onnx", "sparse")))
    contrib = [v for v in ort_bodies if v.rule == "custom-op-body"]
    assert contrib and all("com.microsoft.MultiHeadAttention" in v.message and "--target tensorrt" in v.message
                           for v in contrib), contrib
    assert tensorrt_rules.lint(onnx.load(artifacts("el", "tensorrt", "sparse"))) == []
    assert tensorrt_rules.lint(onnx.load(artifacts("el", "onnx", "sparse")), plugins=("MultiHeadAttention",)) \
        == [v for v in ort_bodies if v.rule != "custom-op-body"]


def test_rule_table_in_the_docs_is_current():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "tensorrt.md").read_text()
    assert tensorrt_rules.rules_table() in doc, "regenerate the table: python -m exporter.targets.tensorrt_rules"


def test_lint_cli_errors(tmp_path, capsys):
    assert main(["lint", str(tmp_path / "nope.onnx")]) == 2
    (tmp_path / "junk.onnx").write_bytes(b"\x00junk")
    assert main(["lint", str(tmp_path / "junk.onnx")]) == 2
    err = capsys.readouterr().err
    assert "no such file" in err and "not a readable ONNX model" in err


# --- profiles and the builder's pinning ------------------------------------------------------------

def _meta(bound, family):
    from adaptex.exporter.metadata import read_onnx_metadata

    return read_onnx_metadata(bound[(family, "sparse")])


def test_profiles_defaults_and_errors(bound):
    from adaptex.exporter.targets.tensorrt.plan import input_shapes, parse_shapes, profile

    bf, tsa = _meta(bound, "bf"), _meta(bound, "tsa")
    p = profile(bf, {}, {"batch": 8}, {})
    assert p["opt"] == {"batch": 8, "sequence": 64} and p["max"] == {"batch": 64, "sequence": 64}
    p = profile(tsa, {}, {}, {})
    assert p["min"]["past_sequence"] == 0 and p["max"]["past_sequence"] == tsa["max_sequence"] - 1
    with pytest.raises(ExportError, match="min <= opt <= max"):
        profile(bf, {"batch": 4}, {"batch": 2}, {})
    with pytest.raises(ExportError, match="has no axis 'past_sequence'"):
        profile(bf, {}, {}, {"past_sequence": 3})
    with pytest.raises(ExportError, match="exceeds the model's maximum"):
        profile(bf, {}, {}, {"sequence": 65})
    with pytest.raises(ExportError, match="expected AXIS=N"):
        parse_shapes("batch:1", "--min-shapes", ["batch", "sequence"])
    meta = {"inputs": {"input_ids": {"shape": ["batch", "sequence"]},
                       "attention_mask": {"shape": ["batch", "past_sequence + sequence"]},
                       "past_key_values.0.key": {"shape": ["batch", 4, "past_sequence", 8]}}, "max_sequence": 32}
    shapes = input_shapes(meta, {"batch": 2, "sequence": 32, "past_sequence": 31})
    # the mask is past + new at every corner of the profile: self-consistent (TensorRT checks it)
    assert shapes == {"input_ids": (2, 32), "attention_mask": (2, 63), "past_key_values.0.key": (2, 4, 31, 8)}


def test_axis_expressions_are_parsed_never_evaluated():
    from adaptex.exporter.targets.tensorrt.plan import input_shapes

    for evil in ("().__class__.__base__.__subclasses__()", "batch * 2", "__import__('os')", "batch+", "s53"):
        meta = {"inputs": {"x": {"shape": ["batch", evil]}}}
        with pytest.raises(ExportError, match="axis"):
            input_shapes(meta, {"batch": 1})


class _FakeTensor:
    def __init__(self, name, dtype):
        self.name, self.dtype = name, dtype


class _FakeLayer:
    def __init__(self, name, inputs, outputs, type_="ELEMENTWISE"):
        self.name, self._ins, self._outs, self.type = name, inputs, outputs, type_
        self.precision, self.out_types = None, {}

    num_inputs = property(lambda self: len(self._ins))
    num_outputs = property(lambda self: len(self._outs))

    def get_input(self, j):
        return self._ins[j]

    def get_output(self, j):
        return self._outs[j]

    def set_output_type(self, j, dtype):
        self.out_types[j] = dtype


def test_pin_routing_pins_float_routing_layers_only():
    from adaptex.exporter.targets.tensorrt.engine import pin_routing
    from adaptex.exporter.targets.tensorrt.plan import ROUTE_MARK, PinPlan

    trt = types.SimpleNamespace(float32="f32", float16="f16", bfloat16="bf16",
                                LayerType=types.SimpleNamespace(CONSTANT="C", SHAPE="S"))
    f, i64, b = (lambda n: _FakeTensor(n, "f32")), (lambda n: _FakeTensor(n, "i64")), (lambda n: _FakeTensor(n, "bool"))
    layers = [_FakeLayer("adaptex_route/node_linear_4", [f("h")], [f("t1")]),  # a router layer
              _FakeLayer("BudgetedAttention/adaptex_route/TopK_10", [f("p")], [f("t2"), i64("i")]),
              _FakeLayer("(Unnamed Layer* 7) [Shuffle]", [f("x")], [f("le_7")]),  # a parser helper: a routing value
              _FakeLayer("adaptex_route/const", [], [f("c")], type_="C"),
              _FakeLayer("adaptex_route/node_Identity_9", [i64("k")], [i64("k2")]),  # int only: never pinned
              _FakeLayer("adaptex_route/node_Not_3", [b("m")], [b("m2")]),  # bool only: never pinned
              _FakeLayer("node_MatMul_24", [f("a")], [f("h")])]  # body
    net = types.SimpleNamespace(num_layers=len(layers), get_layer=lambda i: layers[i])
    plan = PinPlan(frozenset({"adaptex_route/node_linear_4"}), frozenset({"le_7"}), frozenset())
    assert pin_routing(net, plan, ROUTE_MARK, trt) == 3
    assert [lay.precision for lay in layers] == ["f32", "f32", "f32", None, None, None, None]
    assert layers[1].out_types == {0: "f32"}  # the int64 indices keep their type


def test_checker_flags_int64_cumsum_before_10_8_and_int16_tensors():
    from onnx import TensorProto, helper

    def model(dtype, op="CumSum"):
        x = helper.make_tensor_value_info("x", dtype, [2, 3])
        y = helper.make_tensor_value_info("y", dtype, [2, 3])
        axis = helper.make_tensor("axis", TensorProto.INT64, [], [1])
        node = helper.make_node(op, ["x", "axis"] if op == "CumSum" else ["x"], ["y"])
        g = helper.make_graph([node], "g", [x], [y], initializer=[axis] if op == "CumSum" else [])
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])

    assert {v.rule for v in tensorrt_rules.lint(model(TensorProto.INT64), "10.0")} == {"cumsum-float"}
    assert tensorrt_rules.lint(model(TensorProto.INT64), "10.8") == []
    assert tensorrt_rules.lint(model(TensorProto.FLOAT), "10.0") == []
    assert "tensor-dtype" in {v.rule for v in tensorrt_rules.lint(model(TensorProto.INT16, "Identity"), "10.8")}


def test_checker_flags_function_names_that_shadow_outer_tensors_before_10_8(bound):
    m = onnx.load(str(bound[("bf", "sparse")]))
    assert tensorrt_rules.lint(m, "10.0") == []  # adaptex's bodies name their parameters privately
    f = m.functions[0]
    outer = m.graph.input[0].name
    f.input[0] = outer  # a body whose first parameter has the name of a model input
    for n in f.node:
        n.input[:] = [outer if i == "BudgetedAttention.x" else i for i in n.input]
    assert {v.rule for v in tensorrt_rules.lint(m, "10.0")} == {"function-names-private"}
    assert tensorrt_rules.lint(m, "10.8") == []


# charlm-dense has no adaptive op, so its variants are one graph
SHIPPED = [(m, v) for m in ("budgetformer-graded", "tsa-charlm", "elastic-minilm", "elastic-charlm")
           for v in ("sparse", "dense")] + [("charlm-dense", "sparse")]


@pytest.mark.parametrize("name, variant", [(m, v) if v == "sparse" and m != "charlm-dense" else pytest.param(
    m, v, marks=pytest.mark.slow) for m, v in SHIPPED], ids=[f"{m}-{v}" for m, v in SHIPPED])
def test_engine_plan_of_every_shipped_model(name, variant):
    """What an engine build of each shipped model is made of, decided without TensorRT: the profile's
    shapes at each corner (the decoders' mask is past + new), and the layers an fp16 build pins, each
    with a float input or output (an int or bool layer's precision must be its own type)."""
    import onnx.inliner

    import adaptex
    from adaptex.exporter.metadata import source_of
    from adaptex.exporter.targets.tensorrt.plan import (FLOAT_TYPES, ROUTE_MARK, input_shapes, pin_plan,
                                                        simulate_pinning, value_types)
    from adaptex.graphs.family import family_contract

    model = adaptex.load(name)
    data, meta = tensorrt.bound_onnx(model, family_contract(model), source_of(model, model.adaptex_source),
                                     variant=variant)
    proto = onnx.load_from_string(data)
    assert tensorrt_rules.lint(proto) == []
    prof = meta["tensorrt"]["profile"]
    shapes = {k: input_shapes(meta, prof[k]) for k in ("min", "opt", "max")}
    for k in ("min", "opt", "max"):
        if "past_sequence" in prof[k]:  # the mask spans past + new at every corner: a self-consistent profile
            assert shapes[k]["attention_mask"][1] == prof[k]["past_sequence"] + prof[k]["sequence"]
            assert shapes[k]["past_key_values.0.key"][2] == prof[k]["past_sequence"]
    plan = pin_plan(proto)
    assert set(meta["tensorrt"]["pin_nodes"]) == set(plan.nodes)
    pinned, left = simulate_pinning(proto, plan)
    inlined = onnx.inliner.inline_local_functions(proto)
    types, nodes = value_types(inlined), {n.name: n for n in inlined.graph.node}
    adaptive = bool(meta["decisions"])
    assert bool(pinned) == adaptive  # an adaptive model has routing to pin; a dense one none
    for layer in pinned:
        n = nodes[layer]
        assert any(types.get(v) in FLOAT_TYPES for v in list(n.input) + list(n.output)), layer
    for layer in left:  # the routing layers left alone touch only integers and bools
        n = nodes[layer]
        assert ROUTE_MARK in layer and not any(types.get(v) in FLOAT_TYPES for v in list(n.input) + list(n.output))


def test_trt_run_example_builds_valid_feeds_for_every_family(bound, checkpoints, artifacts, tmp_path):
    """examples/trt_run.py's feeds come from the engine's metadata alone; an engine's inputs are its
    TensorRT-bound ONNX's, so ONNX Runtime accepts them for every family."""
    from adaptex.exporter.metadata import read_onnx_metadata
    from adaptex.runtimes.onnxruntime import OnnxRuntimeRunner
    from examples.trt_run import example_feeds

    paths = [bound[("bf", "sparse")], bound[("tsa", "sparse")], artifacts("el", "tensorrt")]
    path = tmp_path / "eldec.onnx"  # the CLI's --onnx-only writer, once
    assert main(["export", str(checkpoints / "eldec"), "--target", "tensorrt", "--onnx-only", "-o", str(path)]) == 0
    paths.append(path)
    for path in paths:
        meta = read_onnx_metadata(path)
        out = OnnxRuntimeRunner(path).infer(example_feeds(meta))
        assert all(name in out for name in meta["decisions"])
