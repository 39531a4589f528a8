"""Dense dispatch (`adaptex export --target onnx --dense-rows N`): one ONNX graph with the sparse and
the dense lowering of the same weights, running the dense one for calls of at most N token rows
(a decoder's: its steps the dense lowering without the softmax floor, its short prompts with it).
Each branch computes what the single-variant artifact computes, the If takes the branch the row
count names (ORT's profiler shows which nodes ran), parity passes on both, and bad values are
refused with one line and no file."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from adaptex.exporter.errors import ExportError
from adaptex.exporter.targets.onnx import dispatch, guards
from adaptex.graphs import checkpoint
from adaptex.graphs.errors import AdaptexError, CheckpointError
from adaptex.graphs.ops.policy import DEFAULT
from tests.support import zoo
from tests.support.ort_sessions import session as _session

pytestmark = pytest.mark.usefixtures("one_torch_thread")
ROWS = 8  # a decode step of batch <= 8 runs dense; a prompt of 2 x 5 tokens runs sparse


@pytest.fixture(scope="module")
def merged(family_checkpoints, tmp_path_factory):
    """{family: merged artifact path} for the tiny TSA decoder, BudgetFormer and the elastic decoder
    (whose main graph has If nodes of its own: the routers skip decode steps)."""
    out = {}
    for family in ("tsa", "bf", "eldec"):
        model, info = checkpoint.load(family_checkpoints / family)
        path = tmp_path_factory.mktemp("dispatch") / f"{family}.onnx"
        zoo.export(model, info, path, dense_rows=ROWS)
        out[family] = path
    return out


def _feeds(sess, batch: int, seq: int, past: int = 0, seed: int = 0) -> dict:
    """Inputs of the artifact's graph: ids in its vocabulary, a full mask, a random past cache, and
    for an elastic decoder random head modes."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for i in sess.get_inputs():
        if i.name == "input_ids":
            feeds[i.name] = rng.integers(3, 30, (batch, seq)).astype(np.int64)
        elif i.name == "attention_mask":  # a decoder's covers the cache too
            feeds[i.name] = np.ones((batch, seq + past if "past" in str(i.shape[1]) else seq), np.int64)
        elif i.name.startswith("past"):
            heads, dim = i.shape[1], i.shape[3]
            feeds[i.name] = rng.standard_normal((batch, heads, past, dim)).astype(np.float32)
        elif i.name.startswith("head_modes."):  # an elastic decoder's step: the prefill's modes, mixed
            feeds[i.name] = rng.random((batch, i.shape[1])) < 0.5
        else:
            raise AssertionError(f"unexpected input {i.name}")
    return feeds


def _ran(path, feeds, tmp_path) -> set[str]:
    """Which branches' nodes ONNX Runtime ran for `feeds` (from its profiler)."""
    sess = _session(path, tmp_path)
    sess.run(None, feeds)
    events = json.loads(open(sess.end_profiling()).read())
    return {tag for e in events if e.get("cat") == "Node"
            for tag in ("dense_step", "dense", "sparse") if f"{dispatch.RESERVED}{tag}." in e["name"]}


@pytest.mark.parametrize("family, batch, seq, past, branch", [
    ("tsa", 1, 1, 7, "dense_step"),  # a decode step: the dense lowering without the softmax floor
    ("tsa", 8, 1, 7, "dense_step"),  # 8 rows: the threshold itself
    ("tsa", 9, 1, 7, "sparse"),      # one row more
    ("tsa", 1, 8, 0, "dense"),       # a prompt of 8 rows: the dense lowering with the floor
    ("tsa", 2, 5, 0, "sparse"),      # a prompt of 10
    ("bf", 2, 4, 0, "dense"),
    ("bf", 2, 6, 0, "sparse"),
    ("eldec", 1, 1, 9, "dense_step"),
    ("eldec", 2, 4, 0, "dense"),
    ("eldec", 2, 6, 0, "sparse"),
])
def test_each_call_runs_one_branch_and_matches_that_variants_artifact(merged, artifacts, tmp_path, family, batch,
                                                                     seq, past, branch):
    path = merged[family]
    feeds = _feeds(_session(path), batch, seq, past)
    assert _ran(path, feeds, tmp_path) == {branch}
    got = _session(path).run(None, feeds)
    names = [o.name for o in _session(path).get_outputs()]
    for variant in ("sparse", "dense"):
        want = _session(artifacts(family, "onnx", variant)).run(None, feeds)
        for name, a, b in zip(names, got, want):
            assert a.shape == b.shape, name
            if a.dtype.kind in "biu":  # decisions: exactly equal
                assert np.array_equal(a, b), (variant, name)
            else:
                np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-5, err_msg=f"{variant} {name}")


@pytest.mark.parametrize("family", ["tsa", "eldec"])
def test_parity_passes_on_prefill_and_decode_steps(merged, family_checkpoints, family):
    """A decoder's check runs prompts (sparse branch) and decode steps (dense branch)."""
    from adaptex.runtimes.onnxruntime import OnnxRuntimeRunner
    from adaptex.runtimes.parity import check
    from adaptex.runtimes.torch_ref import TorchRunner

    model, _ = checkpoint.load(family_checkpoints / family)
    report = check(OnnxRuntimeRunner(merged[family]), TorchRunner(model), samples=40, task="copy")
    assert report.passed, report.format()
    assert report.unexcused_flips == 0 and report.decisions_vary and report.max_abs_err < 1e-4


def _dense_branches(proto: onnx.ModelProto) -> list[onnx.GraphProto]:
    """The dense lowering's graphs: the then branch of the merged graph's If (its last node), and
    where that If is a decoder's dense step one (dispatch.merge_dense_step), its else branch's
    then branch too (the dense lowering with the softmax floor)."""
    def then(g: onnx.GraphProto, side: str = "then_branch") -> onnx.GraphProto:
        return next(a.g for a in g.node[-1].attribute if a.name == side)
    first = then(proto.graph)
    return [first, then(then(proto.graph, "else_branch"))] if first.name == f"{dispatch.RESERVED}dense_step" \
        else [first]


def test_the_artifact_records_the_threshold_and_holds_the_weights_once(merged, artifacts):
    from adaptex.exporter.metadata import read_onnx_metadata

    meta = read_onnx_metadata(merged["tsa"])
    assert meta["variant"] == "sparse"
    assert meta["dispatch"]["dense_rows"] == ROWS and meta["dispatch"]["rows_input"] == "input_ids"
    assert [p["name"] for p in meta["programs"]] == ["dense decode-step", "dense", "general"]
    assert [p["variant"] for p in meta["programs"]] == ["dense", "dense", "sparse"]
    assert set(meta["dispatch"]["dense_lowerings"].values()) == {"conditional_attention_onnx_dense",
                                                                 "conditional_ffn_onnx_dense"}
    proto = onnx.load(str(merged["tsa"]))
    assert meta["programs"][1]["guard"] == {"axes": [["input_ids", 0], ["input_ids", 1]], "op": "<=", "value": ROWS}
    assert [n.op_type for n in proto.graph.node][-1] == "If"
    single = onnx.load(str(artifacts("tsa", "onnx", "sparse")))
    # the weights once in the main graph (the small tensors each branch copies), and the thresholds
    big = {i.name for i in single.graph.initializer if np.prod(i.dims) > DEFAULT.copied_up_to}
    thresholds = {i.name for i in proto.graph.initializer if i.name.startswith(f"{dispatch.RESERVED}guard.")}
    assert big and thresholds and {i.name for i in proto.graph.initializer} == big | thresholds
    # the functions are the sparse lowering's; the dense branch holds its bodies inlined
    assert {(f.name, f.overload) for f in proto.functions if f.domain == "adaptex"} == {
        ("ConditionalAttention", ""), ("ConditionalFFN", "")}
    assert all(not [n for n in g.node if n.domain == "adaptex"] for g in _dense_branches(proto))


def _repeats(nodes) -> list[str]:
    """The nodes that compute what an earlier one of `nodes` computes: the same op, inputs and
    attributes (a Constant's by its value, whatever the tensor's name)."""
    def attr(a):
        v = onnx.helper.get_attribute_value(a)
        if isinstance(v, onnx.TensorProto):
            v = onnx.numpy_helper.to_array(v)
            return (a.name, str(v.dtype), v.shape, v.tobytes())
        return (a.name, repr(v))

    seen, out = set(), []
    for n in nodes:
        key = (n.domain, n.op_type, tuple(n.input), tuple(attr(a) for a in n.attribute))
        if key in seen:
            out.append(n.name or n.op_type)
        seen.add(key)
    return out


def test_the_dense_branch_computes_each_value_once(merged, artifacts):
    """ONNX Runtime merges the common subexpressions of a main graph's inlined calls at load but not
    inside an If branch: the export merges the dense branch's (a TSA layer's attention and FFN bodies
    both mask the router's gate; docs/benchmarking.md#never-slower-than-dense)."""
    import onnx.inliner

    alone = onnx.inliner.inline_local_functions(onnx.load(str(artifacts("tsa", "onnx", "dense"))))
    assert _repeats(alone.graph.node)  # what there is to merge
    proto = onnx.load(str(merged["tsa"]))
    wheres = [n for n in alone.graph.node if n.op_type == "Where"]
    for then in _dense_branches(proto):  # the step's and the short prompts'
        assert not _repeats(then.node), _repeats(then.node)[:5]
        gates = [n for n in then.node if n.op_type == "Where"]
        assert 0 < len(gates) < len(wheres), (len(gates), len(wheres))
        # the router masks its gate by keep and no body masks it again (passes.masks_once)
        made = {o: n for n in then.node for o in n.output}
        again = [n.name for n in gates if made.get(n.input[1]) is not None and made[n.input[1]].op_type == "Where"
                 and made[n.input[1]].input[0] == n.input[0]]
        assert not again, again


def test_masks_once_drops_a_where_that_masks_by_its_own_condition_again():
    from onnx import TensorProto, helper, numpy_helper

    from adaptex.exporter.targets.onnx.passes import masks_once

    nodes = [helper.make_node("Constant", [], ["zb"], value=numpy_helper.from_array(np.array(0.0, np.float32))),
             helper.make_node("Where", ["c", "x", "z"], ["m"]),  # the router's masked gate
             helper.make_node("Where", ["c", "m", "zb"], ["again"]),  # a body masks it again: goes, its zero too
             helper.make_node("Mul", ["again", "x"], ["y1"]),
             helper.make_node("Where", ["d", "m", "z"], ["y2"]),  # another condition: stays
             helper.make_node("Where", ["c", "m", "one"], ["y3"]),  # not a zero: stays
             helper.make_node("Where", ["c", "m", "z"], ["y4"])]  # a graph output: stays
    io = [helper.make_tensor_value_info(n, TensorProto.BOOL if n in "cd" else TensorProto.FLOAT, ["B", "T"])
          for n in ("c", "d", "x", "y1", "y2", "y3", "y4")]
    inits = [numpy_helper.from_array(np.array(v, np.float32), n) for v, n in ((1.0, "one"), (0.0, "z"))]
    model = helper.make_model(helper.make_graph(nodes, "g", io[:3], io[3:], inits),
                              opset_imports=[helper.make_opsetid("", 17)])
    before = model.SerializeToString()
    assert masks_once(model) == 1
    onnx.checker.check_model(model, full_check=True)
    assert [n.output[0] for n in model.graph.node] == ["m", "y1", "y2", "y3", "y4"]
    assert [t.name for t in model.graph.initializer] == ["one", "z"]
    rng = np.random.default_rng(0)
    feeds = {"c": rng.random((2, 5)) < 0.5, "d": rng.random((2, 5)) < 0.5,
             "x": rng.standard_normal((2, 5)).astype(np.float32)}
    runs = [ort.InferenceSession(m, providers=["CPUExecutionProvider"]).run(None, feeds)
            for m in (before, model.SerializeToString())]
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("family", ["tsa", "eldec"])
def test_each_branch_holds_its_weights_once_onnx_runtime_has_loaded_it(merged, tmp_path, family):
    """The file stores the weights once, in the main graph; each branch reads them through Reshape
    pairs that ONNX Runtime folds at load into initializers of the branch (an If branch reading the
    main graph's initializers pays for each on every call: docs/benchmarking.md). The elastic
    decoder's sparse branch is itself an If (its large-call program and its general one), whose
    branches fold their own."""
    proto = onnx.load(str(merged[family]))
    weights = {i.name for i in proto.graph.initializer if not i.name.startswith(dispatch.RESERVED)}  # not the conditions'

    def held(g) -> int:  # initializers of a branch, its own dispatch If's branches included
        return len(g.initializer) + sum(held(a.g) for n in g.node if n.name.endswith(f"{dispatch.RESERVED}If")
                                        for a in n.attribute)
    branch = {a.name: a.g for a in proto.graph.node[-1].attribute}
    for g in branch.values():
        direct = {i for n in g.node if ".fold." not in n.name for i in n.input} & weights
        assert not direct, sorted(direct)[:3]
    loaded = zoo.ort_loaded(merged[family], tmp_path / "loaded.onnx")
    left = [i.name for i in loaded.graph.initializer if np.prod(i.dims) > 1]
    assert not left, left[:3]  # the main graph keeps no weight: each branch has its own
    if_node = next(n for n in loaded.graph.node if n.op_type == "If")
    for a in if_node.attribute:
        assert not any(n.op_type == "Reshape" and ".fold." in n.name for n in a.g.node), a.name
        assert held(a.g) >= len(weights) // 2, (a.name, held(a.g))


def _loaded_ops(path, tmp_path) -> dict:
    """{graph: op type counts} of the model ONNX Runtime runs after loading `path` (its main graph,
    "then" and "else" for a top-level If's branches)."""
    import collections

    g = zoo.ort_loaded(path, tmp_path / f"{path.stem}.loaded.onnx").graph
    out = {"main": collections.Counter(n.op_type for n in g.node)}
    for n in g.node:
        if n.op_type == "If" and n.name == f"{dispatch.RESERVED}If":
            for a in n.attribute:
                out[a.name.split("_")[0]] = collections.Counter(m.op_type for m in a.g.node)
    return out


def test_each_branch_carries_its_shapes_and_loads_as_its_graph_alone(merged, artifacts, tmp_path):
    """A branch keeps the exporter's shapes of its values (renamed with it): ONNX Runtime's fusions
    that check a shape then fire in the branch as in the graph alone (without them the dense branch
    kept the Slices of each split projection where its graph alone runs one Split: 2.6% of a B1
    decode step of tsa-charlm, docs/benchmarking.md)."""
    proto = onnx.load(str(merged["tsa"]))
    dense = onnx.load(str(artifacts("tsa", "onnx", "dense")))
    made = {o for n in dense.graph.node for o in n.output}
    for then, tag in zip(_dense_branches(proto), ("dense_step", "dense")):
        shapes = {v.name: v.type for v in then.value_info}
        for vi in [v for v in dense.graph.value_info if v.name in made]:
            assert shapes.get(f"{dispatch.RESERVED}{tag}.{vi.name}") == vi.type, (tag, vi.name)
    alone = _loaded_ops(artifacts("tsa", "onnx", "dense"), tmp_path)["main"]
    branch = _loaded_ops(merged["tsa"], tmp_path)["then"]
    assert alone["Split"] > 0 and branch["Split"] == alone["Split"], (branch, alone)
    assert branch["Slice"] == alone["Slice"], (branch, alone)


def _with_export_default(family_checkpoints, tmp_path, export, family: str = "tsa") -> str:
    """A copy of a tiny checkpoint (default TSA) whose config.json records `export`."""
    import shutil

    ck = tmp_path / family
    shutil.copytree(family_checkpoints / family, ck)
    cfg = json.loads((ck / "config.json").read_text())
    (ck / "config.json").write_text(json.dumps({**cfg, "export": export}))
    return str(ck)


def test_a_checkpoint_records_its_threshold_and_off_or_another_variant_leaves_it_out(family_checkpoints, tmp_path):
    """config.json's "export" gives adaptex export its default (tsa-charlm records 64: the apps' tests
    run that artifact); --dense-rows off, a threshold given, or --variant dense override it. On the
    tiny BudgetFormer, which exports faster than the tiny TSA: the precedence is the exporter's,
    whatever the family."""
    from adaptex.exporter.metadata import read_onnx_metadata

    ck = _with_export_default(family_checkpoints, tmp_path, {"onnx": {"dense_rows": 8}}, family="bf")
    model, info = checkpoint.load(ck)
    for name, options, want in (("off", {"dense_rows": "off"}, None), ("given", {"dense_rows": 3}, 3),
                                ("dense", {"variant": "dense"}, None)):
        zoo.export(model, info, tmp_path / f"{name}.onnx", **options)
        meta = read_onnx_metadata(tmp_path / f"{name}.onnx")
        assert (meta.get("dispatch") or {}).get("dense_rows") == want, name
    r = subprocess.run([sys.executable, "-m", "adaptex", "export", ck, "--target", "onnx", "-o",
                        str(tmp_path / "cli.onnx")], capture_output=True, text=True)  # the default
    assert r.returncode == 0, r.stderr
    assert "records --dense-rows 8 for onnx exports (--dense-rows off leaves it out)" in r.stderr, r.stderr
    assert "calls of at most 8 token rows run the dense lowering" in r.stderr, r.stderr
    assert read_onnx_metadata(tmp_path / "cli.onnx")["dispatch"]["dense_rows"] == 8


@pytest.mark.parametrize("export, error, match", [
    ({"onnx": {"dense_rows": [8]}}, CheckpointError, "'export' maps a target to its options"),
    ({"onnx": 8}, CheckpointError, "'export' maps a target to its options"),
    ({"onnx": {"rows": 8}}, ExportError, "gives onnx the option 'rows', which it does not take"),
    ({"onnx": {"dense_rows": "many"}}, ExportError, "--dense-rows 'many': give a whole number"),
])
def test_a_malformed_export_default_is_refused_on_one_line(family_checkpoints, tmp_path, export, error, match):
    ck = _with_export_default(family_checkpoints, tmp_path, export)
    with pytest.raises(error, match=match) as e:
        model, info = checkpoint.load(ck)
        zoo.export(model, info, tmp_path / "m.onnx")
    assert "\n" not in str(e.value) and not (tmp_path / "m.onnx").exists()


@pytest.mark.parametrize("value", ["abc", "0", "-3", "2.5", ""])
def test_a_bad_threshold_is_refused(family_checkpoints, tmp_path, value):
    model, info = checkpoint.load(family_checkpoints / "bf")
    with pytest.raises(ExportError, match="--dense-rows .*whole number") as e:
        zoo.export(model, info, tmp_path / "m.onnx", dense_rows=value)
    assert "\n" not in str(e.value) and not (tmp_path / "m.onnx").exists()


def test_the_dense_variant_does_not_take_a_threshold(family_checkpoints, tmp_path):
    model, info = checkpoint.load(family_checkpoints / "bf")
    with pytest.raises(ExportError, match="needs --variant sparse"):
        zoo.export(model, info, tmp_path / "m.onnx", variant="dense", dense_rows=8)
    assert not (tmp_path / "m.onnx").exists()


def test_cli_refuses_a_bad_threshold_and_another_targets_use(family_checkpoints, tmp_path):
    out = tmp_path / "m.onnx"
    for args, want in ((["--target", "onnx", "-o", str(out), "--dense-rows", "many"], "whole number"),
                       (["--target", "coreml", "-o", str(tmp_path / "m.mlpackage"), "--dense-rows", "8"],
                        "another target")):
        r = subprocess.run([sys.executable, "-m", "adaptex", "export", str(family_checkpoints / "bf"), *args],
                           capture_output=True, text=True)
        assert r.returncode != 0 and want in r.stderr, r.stderr
        errors = [line for line in r.stderr.splitlines() if "error" in line.lower()]
        assert len(errors) == 1 and errors[0].startswith("adaptex: error:"), r.stderr
    assert not out.exists() and not (tmp_path / "m.mlpackage").exists()


def test_metadata_with_a_malformed_threshold_is_refused(merged):
    from adaptex.exporter.metadata import read_onnx_metadata, validate

    meta = read_onnx_metadata(merged["bf"])
    for bad in ({"dense_rows": "8", "rows_input": "input_ids"}, {"dense_rows": 0, "rows_input": "input_ids"},
                {"dense_rows": 8}, {"dense_rows": 8, "rows_input": "nope"}, "8"):
        with pytest.raises(AdaptexError, match="dispatch"):
            validate({**meta, "dispatch": bad}, "m.onnx")


def test_metadata_with_a_malformed_guard_is_refused(merged):
    """A program's guard is data, checked when read and never evaluated: an unknown comparison, an
    axis that is not [input, axis], an input the artifact does not take, a guard on the last
    program or none on another are each refused in one line."""
    from adaptex.exporter.metadata import read_onnx_metadata, validate

    meta = read_onnx_metadata(merged["bf"])
    good = meta["programs"]
    rows = good[0]["guard"]
    for bad, what in (({**rows, "op": "__import__('os')"}, "op"), ({**rows, "axes": [["input_ids", "0"]]}, "axis"),
                      ({**rows, "axes": [["nope", 0]]}, "not an input"), ({**rows, "value": True}, "value"),
                      ({"all": []}, "non-empty"), ("rows <= 8", "JSON object")):
        with pytest.raises(AdaptexError, match=what):
            validate({**meta, "programs": [{**good[0], "guard": bad}] + good[1:]}, "m.onnx")
    with pytest.raises(AdaptexError, match="only the last program"):
        validate({**meta, "programs": [{**good[0], "guard": None}] + good[1:]}, "m.onnx")
    with pytest.raises(AdaptexError, match="only the last program"):
        validate({**meta, "programs": good[:-1] + [{**good[-1], "guard": rows}]}, "m.onnx")


def test_merge_refuses_lowerings_of_other_weights(artifacts, family_checkpoints, tmp_path):
    sparse = onnx.load(str(artifacts("bf", "onnx", "sparse")))
    model, info = checkpoint.load(family_checkpoints / "bf")
    for p in model.parameters():
        p.data.add_(0.5)
        break
    zoo.export(model, info, tmp_path / "other.onnx", variant="dense")
    with pytest.raises(ExportError, match="differ in their weights"):
        dispatch.merge(sparse, onnx.load(str(tmp_path / "other.onnx")), guard=guards.rows_at_most("input_ids", 8))


def test_bench_counts_the_flops_of_the_branch_that_ran(merged):
    """bench reads the program a call runs, and its variant, from the stored guards."""
    from adaptex.exporter.metadata import read_onnx_metadata
    from adaptex.runtimes.bench_accounting import program_entry

    meta = read_onnx_metadata(merged["tsa"])
    ids = lambda b, t: {"input_ids": np.zeros((b, t), np.int64)}  # noqa: E731
    assert program_entry(meta, ids(1, 8))["variant"] == "dense" and program_entry(meta, ids(2, 5))["variant"] == "sparse"
    assert program_entry(meta, ids(8, 1))["name"] == "dense decode-step"
    assert program_entry({"variant": "sparse"}, ids(1, 1)) is None


def test_the_profile_counts_the_dense_branchs_op_kernels_as_adaptive(merged, tmp_path):
    """A decode step runs the dense branch, whose op calls the export inlined: their nodes keep names
    that mark them as the ops' (passes.name_op_nodes), so `adaptex bench --profile` does not count
    the step's attention and FFN as the rest of the graph."""
    from adaptex.runtimes.profile import profile_onnx

    feeds = _feeds(_session(merged["tsa"]), batch=1, seq=1, past=7)
    assert _ran(merged["tsa"], feeds, tmp_path) == {"dense_step"}
    ops = profile_onnx(str(merged["tsa"]), feeds, threads=1, workdir=tmp_path, runs=3)["by_op_ms"]
    assert ops.get("MatMul (adaptive)", 0) > 0, sorted(ops)  # the query side's and the FFN's
    assert "FusedGemm" in ops and "FusedGemm (adaptive)" not in ops, sorted(ops)  # the routers: no op's
