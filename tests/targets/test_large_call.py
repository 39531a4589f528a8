"""The large-call program (exporter/targets/onnx/dispatch.merge_large_call): a decoder's main graph,
which serves decode steps and short prompts, runs its attention batched with no If a layer (its
plain attention and its op bodies alike), and the calls large enough for attention a sample at a
time (passes.attention_by_sample, the bodies' bodies.by_sample) run a second program of the same
weights that has it. With --dense-rows the large-call If sits in the sparse branch, and the general
program keeps the main graph's If (only the op bodies leave theirs out). The tiny TSA decoder (its
first block's attention plain) reaches the real threshold (2^22 scores) only at a batch of 1024, so
these tests export it with a threshold of 4096 scores: batch x new tokens x keys x 4 heads, at least
1024 cells."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

from adaptex.exporter.targets.onnx import dispatch, guards, programs
from adaptex.exporter.targets.onnx import bodies as fx
from adaptex.exporter.targets.onnx.passes_by_sample import attends_by_sample, by_sample_ifs
from adaptex.graphs import checkpoint
from adaptex.graphs.errors import AdaptexError
from adaptex.graphs.ops.policy import DEFAULT, OrtPolicy
from adaptex.runtimes.onnxruntime import OnnxRuntimeRunner
from tests.support import zoo
from tests.targets.test_programs import _conditions, _feeds

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FROM = 4096


def _export(family_checkpoints, tmp_path_factory, **kw):
    """(the tiny TSA decoder exported with the threshold at FROM scores, its metadata)."""
    model, info = checkpoint.load(family_checkpoints / "tsa")
    path = tmp_path_factory.mktemp("large") / "tsa.onnx"
    return path, zoo.export(model, info, path, policy=OrtPolicy(by_sample_from=FROM), **kw)


@pytest.fixture(scope="module")
def large(family_checkpoints, tmp_path_factory):
    return _export(family_checkpoints, tmp_path_factory)


@pytest.fixture(scope="module")
def large_rows(family_checkpoints, tmp_path_factory):
    """The same with dense dispatch at 8 rows: the large-call If in the sparse branch."""
    return _export(family_checkpoints, tmp_path_factory, dense_rows=8)


def _runs_as_the_file(artifact, batch: int, seq: int, past: int, path: tuple[bool, ...]) -> None:
    """adaptex's runner runs a call of these sizes through the program `path`, the one the file's
    own Ifs choose, and computes what the file does in one session."""
    feeds = _feeds(artifact, batch, seq, past)
    runner = OnnxRuntimeRunner(artifact, threads=1, chunk_rows=None)  # every call whole, as the Ifs see it
    got = runner.infer(feeds)
    assert list(runner.programs.sessions) == [runner.programs.names[len(path) - 1 if path[-1] else len(path)]]
    assert _conditions(onnx.load(str(artifact)), feeds, path) == list(path)
    want = OnnxRuntimeRunner(artifact, threads=1, programs=False).infer(feeds)
    for name in want:
        if want[name].dtype.kind in "biu":
            assert np.array_equal(got[name], want[name]), name
        else:
            np.testing.assert_allclose(got[name], want[name], atol=1e-5, rtol=1e-5, err_msg=name)


def _bodies_by_sample(model: onnx.ModelProto) -> dict[str, bool]:
    """For each ConditionalAttention body in `model` (by overload), whether it attends by sample."""
    return {f.overload: attends_by_sample(helper.make_model(helper.make_graph([], "g", [], []), functions=[f]))
            for f in model.functions if f.name == "ConditionalAttention"}


def _called_overloads(nodes) -> set[str]:
    return {n.overload for n in nodes if n.op_type == "ConditionalAttention"}


def test_the_artifact_records_the_condition_and_only_the_large_program_attends_by_sample(large):
    path, meta = large
    assert meta["programs"][0] == {"name": "large-call (attention by sample)", "variant": "sparse", "guard": {"all": [
        {"axes": [["input_ids", 0]], "op": ">", "value": 1},
        {"axes": [["input_ids", 0], ["input_ids", 1], ["attention_mask", 1]], "op": ">=", "value": FROM, "scale": 4}]}}
    proto = onnx.load(str(path))
    assert [n.op_type for n in proto.graph.node][-1] == "If"
    big, general = programs.program(proto, (True,)), programs.program(proto, (False,))
    assert by_sample_ifs(big.graph.node) == 1 and by_sample_ifs(general.graph.node) == 0
    # the op bodies alike: the general program's calls read bodies with no by-sample If, the large one's
    # their own overload, which has it
    assert _bodies_by_sample(proto) == {"": False, dispatch.LARGE_OVERLOAD: True}
    assert _called_overloads(general.graph.node) == {""}
    assert _called_overloads(big.graph.node) == {dispatch.LARGE_OVERLOAD}
    stored = {t.name for t in proto.graph.initializer}
    for model in (big, general):  # the weights read from the file's initializers, no branch copies to fold
        assert not [n for n in model.graph.node if ".fold." in n.name]
        assert all(t.name in stored for t in model.graph.initializer if np.prod(t.dims) > DEFAULT.copied_up_to)


def test_under_dense_dispatch_the_sparse_branch_holds_the_large_call_if(large_rows):
    path, meta = large_rows
    assert meta["dispatch"]["dense_rows"] == 8 and meta["policy"]["by_sample_from"] == FROM
    assert [p["name"] for p in meta["programs"]] == ["dense decode-step", "dense", "large-call (attention by sample)",
                                                     "general"]
    onnx.checker.check_model(str(path), full_check=True)
    proto = onnx.load(str(path))
    dense, general, big = (programs.program(onnx.load(str(path)), p)
                           for p in ((True,), (False, False, False), (False, False, True)))
    # the general program keeps the main graph's If (the first block's plain attention), not the bodies'
    assert by_sample_ifs(general.graph.node) == 1 and by_sample_ifs(big.graph.node) == 1
    assert _called_overloads(general.graph.node) == {""}
    assert _called_overloads(big.graph.node) == {dispatch.LARGE_OVERLOAD}
    assert _bodies_by_sample(proto)[""] is False and _bodies_by_sample(proto)[dispatch.LARGE_OVERLOAD] is True
    assert _called_overloads(dense.graph.node) <= {dispatch.DENSE_OVERLOAD}


@pytest.mark.parametrize("batch, seq, past, path", [
    (2, 16, 16, (False, False, True)),   # 1024 cells: the threshold
    (2, 16, 15, (False, False, False)),
    (64, 1, 31, (False, False, True)),   # a large batch's decode step: 64 rows, 2048 cells
    (8, 1, 31, (True,)),                 # a step of 8 rows: the dense step graph
    (2, 4, 0, (False, True)),            # a prompt of 8 rows: the dense graph
    (1, 32, 0, (False, False, False)),   # one sample: nothing to split
])
def test_the_runner_takes_the_nested_program_and_computes_what_the_file_does(large_rows, batch, seq, past, path):
    from adaptex.runtimes.bench_accounting import program_entry

    artifact, meta = large_rows
    _runs_as_the_file(artifact, batch, seq, past, path)
    assert program_entry(meta, _feeds(artifact, batch, seq, past))["name"] == \
        {(True,): "dense decode-step", (False, True): "dense", (False, False, True): "large-call (attention by sample)",
         (False, False, False): "general"}[path]


@pytest.mark.parametrize("batch, seq, past, big", [
    (2, 16, 16, True),    # 2 x 16 x 32 = 1024 cells: the threshold
    (2, 16, 15, False),   # 992
    (8, 8, 8, True),
    (1, 32, 0, False),    # 1024 cells, one sample: nothing to split
    (4, 1, 31, False),    # a decode step
    (64, 1, 31, True),    # a large batch's decode step: 2048 cells
])
def test_the_runner_takes_the_program_the_files_if_takes_and_computes_the_same(large, batch, seq, past, big):
    path, _ = large
    _runs_as_the_file(path, batch, seq, past, (big,))


def test_parity_passes_on_prefill_and_decode_steps(large, family_checkpoints):
    from adaptex.runtimes.parity import check
    from adaptex.runtimes.torch_ref import TorchRunner

    path, _ = large
    model, _ = checkpoint.load(family_checkpoints / "tsa")
    report = check(OnnxRuntimeRunner(path), TorchRunner(model), samples=40, task="copy")
    assert report.passed and report.unexcused_flips == 0, report.format()


def test_bench_names_the_program_that_ran(large):
    from adaptex.runtimes.bench_accounting import program_entry

    path, meta = large
    assert program_entry(meta, _feeds(path, 2, 16, 16))["name"] == "large-call (attention by sample)"
    assert program_entry(meta, _feeds(path, 4, 1, 31))["name"] == "general"


def test_a_model_whose_calls_never_reach_the_threshold_gets_no_second_program(artifacts):
    """At the real threshold the tiny decoder would need a batch of 1024: no large-call program."""
    from adaptex.exporter.metadata import read_onnx_metadata

    meta = read_onnx_metadata(artifacts("tsa"))
    assert "programs" not in meta and DEFAULT.by_sample_from > 64 * 32 * 32 * 4


def test_merge_refuses_a_bad_threshold_and_lowerings_of_other_weights(family_checkpoints):
    from adaptex.exporter.errors import ExportError
    from adaptex.exporter.targets.onnx import lower
    from adaptex.graphs.family import family_contract

    model = checkpoint.load(family_checkpoints / "tsa")[0].eval()
    general = lower(model, family_contract(model), by_sample=False)[0]
    for what in ({"heads": -1}, {"from_scores": True}):
        kw = {"heads": 4, "from_scores": FROM, **what}
        with pytest.raises(AdaptexError, match="guard's"):
            guards.large_call("input_ids", "attention_mask", **kw)
    with pytest.raises(ExportError, match="large-call dispatch: the graph has no input 'nope'"):
        dispatch.merge_large_call(general, general, guard=guards.large_call("nope", "attention_mask", 4, FROM))
    other = onnx.ModelProto()
    other.CopyFrom(general)
    w = next(t for t in other.graph.initializer if len(t.dims) == 2)
    w.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(w) + 1, w.name))
    with pytest.raises(ExportError, match="differ in their weights"):
        dispatch.merge_large_call(other, general, guard=guards.large_call("input_ids", "attention_mask", 4, FROM))


@pytest.mark.parametrize("body", [
    lambda by_sample: fx.conditional_attention_function("sparse", dispatch=True, by_sample=by_sample),
    lambda by_sample: fx.elastic_attention_function("sparse", dispatch=True, by_sample=by_sample),
    lambda by_sample: fx.elastic_attention_function("sparse", causal_known=False, dispatch=True, fused=True,
                                                    by_sample=by_sample),
])
def test_an_op_body_leaves_its_by_sample_if_out_on_request(body):
    """The general program's bodies (by_sample=False) hold no attention-by-sample If; the default
    bodies, which serve every call of a file with no large-call program, do."""
    def model(f):
        return helper.make_model(helper.make_graph([], "g", [], []), functions=[f])
    assert attends_by_sample(model(body(True))) and not attends_by_sample(model(body(False)))
