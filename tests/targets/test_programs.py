"""One session per program (runtimes/onnxruntime.py): an artifact whose graph begins with run-time
dispatch (an elastic decoder's decode-step and short-call graphs, --dense-rows) holds several
programs under top-level Ifs, and the runner runs the one a call takes as a session of its own
(exporter/targets/onnx/programs.program), chosen by the guards the metadata stores, the ones the
Ifs were built from (exporter/targets/onnx/guards.py). Each call takes the program the file's own
Ifs take, computes what the file in one session computes, and a program holds no dispatch If; an
artifact without dispatch runs as before; a threshold changed in the policy moves the file's If,
the runner and bench alike."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from adaptex.exporter.targets.onnx import dispatch, programs
from adaptex.exporter.targets.onnx.passes import reads, subgraphs
from adaptex.runtimes.onnxruntime import OnnxRuntimeRunner

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _feeds(path, batch: int, seq: int, past: int, seed: int = 0) -> dict:
    """Inputs of the artifact: ids in its vocabulary, a mask over the cache and the new tokens, a
    random cache and, for an elastic decoder, random head modes."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for i in ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).get_inputs():
        if i.name == "input_ids":
            feeds[i.name] = rng.integers(3, 30, (batch, seq)).astype(np.int64)
        elif i.name == "attention_mask":
            feeds[i.name] = np.ones((batch, seq + past if "past" in str(i.shape[1]) else seq), np.int64)
        elif i.name.startswith("past"):
            feeds[i.name] = rng.standard_normal((batch, i.shape[1], past, i.shape[3])).astype(np.float32)
        elif i.name.startswith("head_modes."):
            feeds[i.name] = rng.random((batch, i.shape[1])) < 0.5
        else:
            raise AssertionError(f"unexpected input {i.name}")
    return feeds


def _conditions(proto: onnx.ModelProto, feeds: dict, path: tuple[bool, ...]) -> list[bool]:
    """The value of each dispatch If's condition along `path`, as the graph computes it: the nodes
    before the If at each level, run alone in ONNX Runtime."""
    g, nodes, inits, out = proto.graph, list(proto.graph.node), list(proto.graph.initializer), []
    for then in path:
        at = next(k for k, n in enumerate(nodes) if n.op_type == "If" and n.name.endswith(f"{dispatch.RESERVED}If"))
        cond_nodes, read = nodes[:at], set(reads(nodes[:at]))
        model = helper.make_model(
            helper.make_graph(cond_nodes, "cond", list(g.input),
                              [helper.make_tensor_value_info(nodes[at].input[0], TensorProto.BOOL, [])],
                              initializer=[t for t in inits if t.name in read]),
            opset_imports=list(proto.opset_import), ir_version=proto.ir_version)
        out.append(bool(ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
                        .run(None, feeds)[0]))
        sub = next(a.g for a in nodes[at].attribute if a.name == ("then_branch" if then else "else_branch"))
        nodes, inits = list(sub.node), inits + list(sub.initializer)
    return out


NAMES = {"step": "decode-step", "short": "short-call", "masked_large": "masked short-call (attention by sample)",
         "masked": "masked short-call", "long": "general", "dense_step": "dense decode-step", "dense": "dense",
         "sparse": "general"}
PATHS = {"step": (True,), "short": (False, True), "masked_large": (False, False, True),
         "masked": (False, False, False, True), "long": (False, False, False, False), "dense_step": (True,),
         "dense": (False, True), "sparse": (False, False)}


# the tiny elastic decoder: sink 2, window 8 (short calls: at most 10 keys, masked short calls to its
# 128 positions, by sample from batch x 4 heads x T x T = 2^22 scores); dense dispatch at 8 rows
@pytest.mark.parametrize("artifact, batch, seq, past, program", [
    ("eldec", 1, 1, 9, "step"),
    ("eldec", 33, 1, 19, "step"),
    ("eldec", 1, 1, 60, "step"),
    ("eldec", 2, 1, 0, "short"),   # one new token and no cache: a prompt, not a step
    ("eldec", 2, 10, 0, "short"),
    ("eldec", 2, 11, 0, "masked"),
    ("eldec", 1, 128, 0, "masked"),
    ("eldec", 64, 128, 0, "masked_large"),
    ("eldec", 64, 127, 0, "masked"),
    ("eldec", 2, 3, 5, "long"),    # new tokens after a cache
    ("tsa-rows", 8, 1, 7, "dense_step"),
    ("tsa-rows", 2, 4, 0, "dense"),  # a prompt of 8 rows: the dense graph with the softmax floor
    ("tsa-rows", 9, 1, 7, "sparse"),
    ("tsa-rows", 2, 5, 0, "sparse"),
])
def test_the_runner_takes_the_program_the_files_ifs_take_and_computes_the_same(artifacts, artifact, batch, seq,
                                                                               past, program):
    path = artifacts("eldec") if artifact == "eldec" else artifacts("tsa", dense_rows="8")
    feeds = _feeds(path, batch, seq, past)
    runner = OnnxRuntimeRunner(path, threads=1, chunk_rows=None)  # every call whole, as the file's Ifs see it
    got = runner.infer(feeds)
    assert list(runner.programs.sessions) == [NAMES[program]]
    assert _conditions(onnx.load(str(path)), feeds, PATHS[program]) == list(PATHS[program])
    assert programs.path_of(runner.programs.names.index(NAMES[program]), len(runner.programs.names)) == PATHS[program]
    one = OnnxRuntimeRunner(path, threads=1, programs=False)
    assert one.programs is None
    want = one.infer(feeds)
    assert list(got) == list(want)
    for name in want:
        assert got[name].shape == want[name].shape, name
        if want[name].dtype.kind in "biu":
            assert np.array_equal(got[name], want[name]), name
        else:
            np.testing.assert_allclose(got[name], want[name], atol=1e-6, rtol=1e-6, err_msg=name)


def test_one_runner_follows_each_calls_shapes(artifacts):
    """The runner looks a call's program up by the shapes its guards read (evaluated once for each):
    a call of other shapes takes its own program, one of shapes seen before the same program again."""
    path = artifacts("eldec")
    runner = OnnxRuntimeRunner(path, threads=1).activate()
    calls = ((2, 10, 0, "short"), (2, 11, 0, "masked"), (2, 3, 5, "long"), (1, 1, 9, "step"), (2, 10, 0, "short"),
             (2, 11, 0, "masked"), (1, 1, 60, "step"))
    for batch, seq, past, program in calls:
        feeds = _feeds(path, batch, seq, past)
        runner.infer(feeds)
        assert runner.programs.chosen(feeds) == NAMES[program]
    assert set(runner.programs.sessions) == {NAMES[p] for *_, p in calls}
    assert len(runner.programs._chosen) == 5  # the five sets of shapes, each once


def _outer_reads(nodes) -> set[str]:
    """The values `nodes` read from their graph's scope: their inputs, and what their subgraphs (an
    attention-by-sample If's branches and Loop body) read that the subgraph neither makes nor takes
    as an input."""
    out = set()
    for n in nodes:
        out |= {i for i in n.input if i}
        for g in subgraphs(n):
            inner = {o for m in g.node for o in m.output} | {i.name for i in g.input} | {t.name for t in g.initializer}
            out |= (_outer_reads(g.node) | {o.name for o in g.output}) - inner
    return out


def test_a_program_is_a_model_of_its_own_without_the_dispatch(artifacts):
    """Each program passes onnx.checker, keeps the file's inputs and outputs, holds no dispatch If
    and no metadata, and reads its weights from initializers of its own."""
    path = artifacts("eldec")
    proto = onnx.load(str(path))
    for program in ("step", "short", "masked_large", "masked", "long"):
        model = programs.program(proto, PATHS[program])
        onnx.checker.check_model(model, full_check=True)
        assert [i.name for i in model.graph.input] == [i.name for i in proto.graph.input]
        assert [o.name for o in model.graph.output] == [o.name for o in proto.graph.output]
        assert not any(n.name.endswith(f"{dispatch.RESERVED}If") for n in model.graph.node)
        assert not model.metadata_props
        made = {o for n in model.graph.node for o in n.output}
        assert _outer_reads(model.graph.node) <= made | {i.name for i in model.graph.input} | {
            t.name for t in model.graph.initializer}
    with pytest.raises(Exception, match="no run-time dispatch If"):
        programs.program(proto, (False, False, False, False, True))


def test_an_artifact_without_dispatch_runs_in_one_session(artifacts):
    # (the tiny TSA decoder: its calls never reach attention by sample's threshold, so no large-call program)
    runner = OnnxRuntimeRunner(artifacts("tsa"), threads=1)
    runner.activate()
    assert runner.programs is None and runner.session is not None


@pytest.mark.slow
def test_bench_times_the_runners_way_and_the_file_in_one_session(artifacts, family_checkpoints, tmp_path):
    """bench's adaptive row is the runner's (a session per program); the file in one session, what an
    app that loads it itself runs, is timed beside it and reported against it."""
    from adaptex.graphs import checkpoint
    from adaptex.runtimes.bench import ONE_SESSION, Bench
    from adaptex.runtimes.bench_report import format_bench

    model, info = checkpoint.load(family_checkpoints / "eldec")
    with Bench(artifacts("eldec"), model, info) as b:
        r = b.run(seq=1, past=9, runs=10, blocks=2, warmup=1, memory=False)
    assert r["stats"]["adaptive"] and r["stats"][ONE_SESSION] and r["one_session_ratio"] > 0
    assert next(c for c in r["candidates"] if c["name"] == ONE_SESSION)["dense"] is False
    assert r["dense_name"] != ONE_SESSION
    assert "the artifact in one session" in format_bench(r)


def test_check_runs_the_file_in_one_session_on_request(artifacts, tmp_path):
    """`adaptex check --one-session` checks what an app that loads the file itself runs (the Ifs
    choosing the graph); the flag is refused for another kind of artifact."""
    import subprocess
    import sys

    from adaptex.graphs.errors import AdaptexError
    from adaptex.runtimes.open import open_artifact

    path = artifacts("eldec")
    r = subprocess.run([sys.executable, "-m", "adaptex", "check", str(path), "--one-session", "--samples", "6",
                        "--quiet"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "onnxruntime (one session)" in r.stdout and "PASSED" in r.stdout
    assert open_artifact(path, one_session=True).programs is None
    (tmp_path / "m.mlpackage").mkdir()
    with pytest.raises(AdaptexError, match="--one-session applies to ONNX artifacts"):
        open_artifact(tmp_path / "m.mlpackage", one_session=True)


def test_a_threshold_changed_in_the_policy_moves_the_file_the_runner_and_bench(artifacts, family_checkpoints,
                                                                                tmp_path):
    """One guard per program: the tiny TSA decoder's large-call program (attention by sample) takes
    B x T x S x heads >= policy.by_sample_from. With the threshold lowered to 2^12, a call of 2 x 16 x 16
    x 4 = 2^11 scores stays in the general program and one of 2 x 32 x 32 x 4 = 2^13 moves to the
    large-call program: in the file's If (evaluated by a plain ONNX Runtime session of the whole
    file), in the runner and in bench, all reading the one stored guard."""
    import adaptex
    from adaptex.exporter.metadata import read_onnx_metadata
    from adaptex.graphs import checkpoint
    from adaptex.graphs.ops.policy import OrtPolicy
    from adaptex.runtimes.bench import Bench

    model, info = checkpoint.load(family_checkpoints / "tsa")
    path = tmp_path / "low.onnx"
    adaptex.export(model, None, path, policy=OrtPolicy(by_sample_from=1 << 12, large_call_batch=64))
    meta = read_onnx_metadata(path)
    assert [p["name"] for p in meta["programs"]] == ["large-call (attention by sample)", "general"]
    assert meta["programs"][0]["guard"]["all"][1]["value"] == 1 << 12 and meta["policy"]["by_sample_from"] == 1 << 12
    proto = onnx.load(str(path))
    runner = OnnxRuntimeRunner(path, threads=1, chunk_rows=None)
    with Bench(path, model, info, chunk_rows=None) as bench:
        for batch, seq, want in ((2, 16, "general"), (2, 32, "large-call (attention by sample)")):
            feeds = _feeds(path, batch, seq, 0)
            runner.infer(feeds)
            assert runner.programs.chosen(feeds) == want
            taken = want != "general"
            assert _conditions(proto, feeds, (taken,)) == [taken]  # the file's own If
            r = bench.run(batch=batch, seq=seq, runs=5, blocks=1, warmup=1, memory=False, prune=False)
            assert r["program"] == want
