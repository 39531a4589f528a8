"""bench's yardstick and accounting: the dense candidates it builds are the same weights, the fastest
is the yardstick, ratios come per block with their interval, the numbers it writes (CSV, plot,
profile) are the ones it measured, and the cache serves a second run. Timing figures themselves are
never asserted (benchmarks print numbers; tests check how they are computed)."""
from __future__ import annotations

import collections
import csv
import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from adaptex.cli import main
from adaptex.exporter.counterparts import Graph, cached_onnx_candidates, onnx_candidates
from adaptex.exporter.targets.onnx.passes import SOFTMAX_FLOOR, layernorm_rows, softmax_floor
from adaptex.exporter.targets.onnx.passes_by_sample import by_sample_ifs
from adaptex.graphs import checkpoint
from adaptex.graphs.family import family_contract
from adaptex.graphs.errors import AdaptexError
from adaptex.runtimes.bench import Bench
from adaptex.runtimes.bench_accounting import bench_report as _report
from adaptex.runtimes.timing import Timing, fit_memory, prune_slow, warm_up
from tests.support import zoo


class _Meta:
    artifact, runtime, meta, chunks = "a.onnx", "test", {"variant": "sparse", "family": "t"}, None


def _timing(name, per_block, dense=True, n=4):
    t = Timing(name, f"{name}.onnx", how=name, dense=dense)
    for b, ms in enumerate(per_block):
        t.times_ms += [ms] * n
        t.block_of += [b] * n
    return t


def test_the_fastest_dense_candidate_is_the_yardstick_and_ratios_are_per_block():
    ad = _timing("adaptive", [8.0, 9.0, 10.0], dense=False)
    slow, fast = _timing("dense", [12.0, 12.0, 12.0]), _timing("dense-legacy", [10.0, 10.0, 10.0])
    naive = _timing("naive", [11.0, 11.0, 11.0], dense=False)
    untimed = Timing("original", None, how="x", reason="stock export failed: no")
    r = _report(_Meta, [ad, slow, fast, untimed, naive], {"flop_ratio": 0.5, "executed_flop_ratio": 0.5},
                batch=1, seq=8, past=0, threads=1, warmup=1, blocks=3, profiles=None)
    assert r["dense_name"] == "dense-legacy" and r["dense_p50_ms"] == 10.0
    assert r["latency_ratio"] == pytest.approx(0.9) and r["latency_ratio_interval"] == pytest.approx([0.8, 1.0])
    # realisation per block: (1 - ratio) / (1 - FLOP ratio), then the median
    assert r["realisation"] == pytest.approx(0.2) and r["realisation_interval"] == pytest.approx([0.0, 0.4])
    assert r["naive_latency_ratio"] == pytest.approx(1.1)
    ratios = {c["name"]: c["ratio_to_fastest"] for c in r["candidates"]}
    assert ratios == {"dense": pytest.approx(1.2), "dense-legacy": 1.0, "original": None, "naive": pytest.approx(1.1)}
    assert any("reaches 1.0" in w for w in r["warnings"])  # [0.8, 1.0] touches 1: no difference established


def test_a_realisation_above_one_is_flagged_not_reported_plainly():
    ad = _timing("adaptive", [5.0, 5.0, 5.0], dense=False)
    r = _report(_Meta, [ad, _timing("dense", [10.0, 10.0, 10.0])], {"flop_ratio": 0.8, "executed_flop_ratio": 0.8},
                batch=1, seq=8, past=0, threads=1, warmup=1, blocks=3, profiles=None)
    assert r["realisation"] == pytest.approx(2.5)
    assert any("realisation above 1" in w and "--profile" in w for w in r["warnings"])


def test_no_dense_graph_timed_says_why():
    ad = _timing("adaptive", [5.0], dense=False)
    r = _report(_Meta, [ad, Timing("dense", None, reason="stock export failed: boom")], {},
                batch=1, seq=8, past=0, threads=1, warmup=1, blocks=1, profiles=None)
    assert r["latency_ratio"] is None and "boom" in r["dense_reason"]


def test_warm_up_is_interleaved_and_a_burst_of_load_does_not_prune_the_fastest():
    """A fake clock: each graph's run advances it by that graph's cost, plus a burst of load that
    lasts a few consecutive runs. Run graph by graph, the burst would fall on one graph's whole
    warm-up and prune the fastest candidate; interleaved, it slows every graph in its rounds alike."""
    now, calls = [0.0], []
    cost = {"adaptive": 1.0e-3, "fast": 1.0e-3, "slow": 1.5e-3, "close": 1.1e-3}

    def run(name):
        def fn(feeds):
            calls.append(name)
            burst = 40 <= len(calls) < 52  # twelve consecutive runs, three rounds' worth
            now[0] += cost[name] * (5.0 if burst else 1.0) + (0.5 if len(calls) <= len(cost) else 0.0)
        return fn

    live = [Timing("adaptive", "a", dense=False)] + [Timing(n, n) for n in ("slow", "fast", "close")]
    fns = {t.name: run(t.name) for t in live}
    warm = warm_up(live, fns, [{}], 20, clock=lambda: now[0])
    assert calls[:4] == ["adaptive", "slow", "fast", "close"]  # the allocating runs, alone, in order
    assert len(calls) == 80 and len(set(calls[4:8])) == 4 and calls[4:20] != calls[:4] * 4  # shuffled rounds
    # the allocating run (+500 ms here) and the burst do not count: the best of the rest is the cost
    assert warm == pytest.approx({n: c * 1e3 for n, c in cost.items()})
    kept = prune_slow(live, warm)
    assert [t.name for t in kept] == ["adaptive", "fast", "close"]  # 1.10x stays, 1.5x goes
    assert "1.50x the fastest dense candidate" in live[1].reason and live[2].reason is None


def test_fit_memory_keeps_the_artifact_then_the_fastest_dense_candidates():
    """The sessions timed together at a large point: the artifact first, then the dense candidates
    fastest first, then the graphs reported beside them; one that does not fit says so and why."""
    live = [Timing("adaptive", "a", dense=False), Timing("slow", "s"), Timing("naive", "n", dense=False),
            Timing("fast", "f"), Timing("mid", "m")]
    warm = {"adaptive": 1.0, "slow": 3.0, "naive": 0.5, "fast": 1.0, "mid": 2.0}
    need = {"adaptive": 200.0, "slow": 100.0, "naive": 100.0, "fast": 300.0, "mid": 400.0}
    kept = fit_memory(live, warm, need, 1000.0)
    assert [t.name for t in kept] == ["adaptive", "slow", "fast", "mid"]  # in the order they came
    naive = live[2]
    assert naive.reason.startswith("not timed: its session took 100 MB") and "beside the 1000 MB" in naive.reason
    assert "more than the 1000 MB" in naive.reason and all(t.reason is None for t in kept)
    with pytest.raises(AdaptexError, match="about 500 MB for the artifact and the fastest dense graph.*lower --batch"):
        fit_memory([Timing("adaptive", "a", dense=False), Timing("fast", "f")], warm, need, 450.0)


@pytest.mark.slow
def test_a_point_too_large_for_memory_warms_up_one_session_at_a_time(tiny_checkpoint, tiny_onnx, monkeypatch):
    """The memory of each session is faked (procfs readings computed from the sessions alive that
    have run): the artifact's first run grows the process enough to take the bounded way, the
    warm-up holds one session at a time, and only the artifact and the fastest dense candidate fit
    together, so the other graphs say why they were not timed."""
    from adaptex.runtimes import bench as bench_mod

    ran, alive_at_runs, real = set(), [], bench_mod.ort_runner
    per_session, base = 100.0, 1000.0

    def fake_runner(path, threads, programs=False, **kw):
        fn = real(path, threads, programs, **kw)

        def run(feeds):
            ran.add(id(run))
            alive_at_runs.append(sum(id(f) in ran for f in b._fns.values()))
            return fn(feeds)
        return run

    def fake_proc(path, field):
        if field == "MemAvailable":
            return 2.5 * per_session / bench_mod.MEMORY_SHARE  # room for two sessions and a half
        return base + per_session * sum(id(f) in ran for f in b._fns.values())

    monkeypatch.setattr(bench_mod, "ort_runner", fake_runner)
    monkeypatch.setattr(bench_mod, "proc_mb", fake_proc)
    model, info = checkpoint.load(tiny_checkpoint)
    said = []
    with Bench(tiny_onnx["sparse"], model, info, progress=said.append) as b:
        b._build()
        n_graphs = len([t for t in b.graphs if t.path and t.reason is None])
        r = b.run(seq=8, runs=10, blocks=2, warmup=3, memory=False)
    assert n_graphs >= 3 and any("warming up the" in m and "one at a time" in m for m in said), said
    k = r["distinct_inputs"]
    warm_up_runs = alive_at_runs[k:k + 3 * n_graphs]  # after the artifact's first run on each input
    assert len(warm_up_runs) == 3 * n_graphs and max(warm_up_runs) == 1  # one session alive at a time
    timed = [name for name, st in r["stats"].items() if st]
    assert len(timed) == 2 and "adaptive" in timed and r["latency_ratio"] is not None
    untimed = [c for c in r["candidates"] if c["name"] not in timed]
    assert untimed and all(c["reason"] for c in untimed) and any("took 100 MB" in c["reason"] for c in untimed)
    assert max(alive_at_runs[k + 3 * n_graphs:]) <= 2  # the timed blocks hold the two that fit


def test_the_timed_rounds_cycle_through_distinct_inputs_every_graph_the_same_one(tiny_checkpoint, tiny_onnx,
                                                                                 monkeypatch):
    """An app meets a new input each call: bench generates DISTINCT_INPUTS of them (seeds 0, 1, ...), and
    every graph in a round runs the same one, so each graph sees each input as often; the FLOP ratio is
    the mean over them. Inputs given by the caller are timed as given."""
    from adaptex.runtimes import bench as bench_mod

    seen, real = [], bench_mod.ort_runner

    def recording_runner(path, threads, programs=False, **kw):
        fn = real(path, threads, programs, **kw)

        def run(feeds):
            seen.append((path, feeds["input_ids"].tobytes()))
            return fn(feeds)
        return run

    monkeypatch.setattr(bench_mod, "ort_runner", recording_runner)
    model, info = checkpoint.load(tiny_checkpoint)
    flops = []
    with Bench(tiny_onnx["sparse"], model, info) as b:
        real_flops = b.contract.flops
        monkeypatch.setattr(b.contract, "flops", lambda out, *a, **k: flops.append(real_flops(out, *a, **k)) or flops[-1])
        r = b.run(batch=2, seq=8, runs=24, blocks=3, warmup=2, memory=False, prune=False)
        n = len([t for t in b.graphs if t.path and t.reason is None])
        assert r["distinct_inputs"] == bench_mod.DISTINCT_INPUTS == len({x for _, x in seen})
        # 3 blocks of 8 rounds (n graphs each, in a shuffled order), each block after the first opening
        # with new sessions that run once (on the first input) before its rounds
        last = seen[-26 * n:]
        timed = last[:8 * n] + last[9 * n:17 * n] + last[18 * n:]
        assert {x for _, x in last[8 * n:9 * n] + last[17 * n:18 * n]} == {seen[0][1]}
        for i in range(24):
            rnd = timed[i * n:(i + 1) * n]
            assert len({x for _, x in rnd}) == 1 and len({p for p, _ in rnd}) == n  # one input, every graph
        per_input = collections.Counter(x for _, x in timed)
        assert set(per_input.values()) == {3 * n}  # 24 rounds over 8 inputs
        assert r["flop_ratio"] == pytest.approx(np.mean([f["flop_ratio"] for f in flops]))
        assert len({round(f["flop_ratio"], 9) for f in flops}) > 1  # the inputs take different decisions
        seen.clear()
        given = b.inputs(lambda f: None, batch=2, seq=8)
        r = b.run(feeds=given, runs=6, blocks=2, warmup=1, memory=False)
        assert r["distinct_inputs"] == 1 and {x for _, x in seen} == {given["input_ids"].tobytes()}


def test_layernorm_rows_keeps_the_values_and_stops_the_skip_layernorm_fusion(tmp_path):
    from onnx import TensorProto, helper, numpy_helper

    D = 24
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal(D).astype(np.float32), n) for n in ("g", "b", "bias")]
    inits.append(numpy_helper.from_array(rng.standard_normal((D, D)).astype(np.float32) * 0.1, "W"))
    nodes = [helper.make_node("MatMul", ["x", "W"], ["m"]), helper.make_node("Add", ["m", "bias"], ["t"]),
             helper.make_node("Add", ["t", "s"], ["u"]),
             helper.make_node("LayerNormalization", ["u", "g", "b"], ["y"], axis=-1, epsilon=1e-5)]
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["B", "T", D]) for n in ("x", "s", "y")]
    model = helper.make_model(helper.make_graph(nodes, "g", io[:2], io[2:], inits),
                              opset_imports=[helper.make_opsetid("", 17)])
    before = model.SerializeToString()
    assert layernorm_rows(model) == 1
    onnx.checker.check_model(model, full_check=True)
    feeds = {"x": rng.standard_normal((2, 7, D)).astype(np.float32), "s": rng.standard_normal((2, 7, D)).astype(np.float32)}
    fused = {}
    for name, data in (("before", before), ("after", model.SerializeToString())):
        so = ort.SessionOptions()
        so.optimized_model_filepath = str(tmp_path / f"{name}.onnx")
        fused[name] = ort.InferenceSession(data, so, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
        ops = {n.op_type for n in onnx.load(so.optimized_model_filepath).graph.node}
        assert ("SkipLayerNormalization" in ops) == (name == "before"), ops
    np.testing.assert_allclose(fused["after"], fused["before"], atol=1e-5)


def test_layernorm_rows_leaves_an_add_that_onnx_runtime_would_not_fuse():
    """A pre-norm decoder's residual Add feeds its LayerNormalization and the next residual: ONNX
    Runtime's fusion needs the Add read by the LayerNormalization alone, so the pass leaves it (its
    Reshapes would only cost a decode step)."""
    from onnx import TensorProto, helper, numpy_helper

    D = 8
    inits = [numpy_helper.from_array(np.ones(D, np.float32), n) for n in ("g", "b")]
    nodes = [helper.make_node("Add", ["x", "s"], ["u"]),
             helper.make_node("LayerNormalization", ["u", "g", "b"], ["y"], axis=-1),
             helper.make_node("Add", ["u", "y"], ["z"])]
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["B", "T", D]) for n in ("x", "s", "z")]
    model = helper.make_model(helper.make_graph(nodes, "g", io[:2], io[2:], inits),
                              opset_imports=[helper.make_opsetid("", 17)])
    assert layernorm_rows(model) == 0 and [n.op_type for n in model.graph.node] == ["Add", "LayerNormalization", "Add"]


def test_onnx_artifacts_get_the_rows_pass(tiny_onnx, tmp_path):
    """Every LayerNormalization that ONNX Runtime would fuse into SkipLayerNormalization is rewritten:
    the session's optimised artifact holds none."""
    proto = onnx.load(str(tiny_onnx["sparse"]))
    producers = {o: n for n in proto.graph.node for o in n.output}
    lns = [n for n in proto.graph.node if n.op_type == "LayerNormalization"]
    assert lns and any(producers[n.input[0]].op_type == "Reshape" for n in lns)
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "optimised.onnx")
    ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
    assert "SkipLayerNormalization" not in {n.op_type for n in onnx.load(so.optimized_model_filepath).graph.node}


def _masked_softmax_model(opset: int):
    """Softmax over x + bias (B, H, T, T) three ways: in the main graph, in an If's branch and in a
    function body; the bias NEG above the diagonal and, for the second sample, on every key."""
    from onnx import TensorProto, helper

    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["B", "H", "T", "T"]) for n in ("x", "bias")]
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["B", "H", "T", "T"]) for n in ("y", "z", "w")]
    branch = lambda tag: helper.make_graph(  # noqa: E731
        [helper.make_node("Softmax", ["s"], [f"{tag}.p"], axis=-1)], tag, [],
        [helper.make_tensor_value_info(f"{tag}.p", TensorProto.FLOAT, ["B", "H", "T", "T"])])
    f = helper.make_function("test", "MaskedSoftmax", ["a", "b"], ["p"],
                             [helper.make_node("Add", ["a", "b"], ["t"]), helper.make_node("Softmax", ["t"], ["p"])],
                             [helper.make_opsetid("", opset)])
    nodes = [helper.make_node("Add", ["x", "bias"], ["s"]), helper.make_node("Softmax", ["s"], ["y"], axis=-1),
             helper.make_node("Constant", [], ["c"], value_int=1),
             helper.make_node("Cast", ["c"], ["cond"], to=TensorProto.BOOL),
             helper.make_node("If", ["cond"], ["z"], then_branch=branch("then"), else_branch=branch("else")),
             helper.make_node("MaskedSoftmax", ["x", "bias"], ["w"], domain="test"),
             helper.make_node("Softmax", ["x"], ["unused"], axis=1)]  # not the last axis: left as it is
    return helper.make_model(helper.make_graph(nodes, "g", io, outs), functions=[f],
                             opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("test", 1)])


@pytest.mark.parametrize("opset", [17, 18])
def test_softmax_floor_keeps_the_values_in_every_body(opset):
    """Main graph, If branch and function body: each last-axis Softmax rewritten (ReduceMax's axes an
    attribute before opset 18, an input from it), the values those of the plain Softmax to float32
    resolution (a masked key weighs at most e^-80, 1.8e-35, where it weighed 0); a row whose every
    key is masked comes out uniform."""
    model = _masked_softmax_model(opset)
    before = model.SerializeToString()
    assert softmax_floor(model) == 4
    onnx.checker.check_model(model, full_check=True)
    assert sum(n.op_type == "Max" for n in model.functions[0].node) == 1
    rng = np.random.default_rng(0)
    T = 16
    bias = np.where(np.triu(np.ones((T, T)), 1) > 0, np.float32(-1e30), np.float32(0)) * np.ones((2, 3, 1, 1), np.float32)
    bias[1, 0] = -1e30  # sample 1, head 0: every key masked
    feeds = {"x": rng.standard_normal((2, 3, T, T)).astype(np.float32) * 4, "bias": bias.astype(np.float32)}
    run = lambda m: ort.InferenceSession(m, providers=["CPUExecutionProvider"]).run(None, feeds)  # noqa: E731
    for want, got in zip(run(before)[:3], run(model.SerializeToString())[:3]):
        np.testing.assert_allclose(got, want, atol=1e-30, rtol=1e-6)
        np.testing.assert_allclose(got[1, 0], 1.0 / T, rtol=1e-6)
        assert (got[0] <= np.exp(-SOFTMAX_FLOOR) * 1.01 + want[0]).all()


@pytest.fixture(scope="module")
def candidates(tiny_checkpoint, tmp_path_factory):
    """The tiny model's candidates, their attention by sample at any size (policy.by_sample_from = 1), so
    that the values test below runs the passes' Loop in the `+rows` graphs."""
    from adaptex.graphs.ops.policy import OrtPolicy

    model, _ = checkpoint.load(tiny_checkpoint)
    return model, onnx_candidates(model, family_contract(model), tmp_path_factory.mktemp("cands"),
                                  policy=OrtPolicy(by_sample_from=1))


def test_every_dense_candidate_computes_the_dense_model(candidates):
    """The yardstick must be the same weights: each dense candidate's output is the model's dense mode."""
    model, graphs = candidates
    names = {g.name for g in graphs}
    assert {"dense", "dense-legacy", "dense+rows", "dense+rows-batched", "naive"} <= names
    assert {g.name for g in graphs if "+ortopt" in g.name} == {
        "dense+ortopt", "dense-legacy+ortopt", "dense+ortopt+rows", "dense-legacy+ortopt+rows",
        "dense+ortopt+rows-batched", "dense-legacy+ortopt+rows-batched"}
    rows = [g for g in graphs if "+ortopt+rows" in g.name and g.path]
    assert len(rows) == 4, [(g.name, g.reason) for g in graphs]  # the optimizer's fusions, Add + LayerNormalization
    for g in rows:
        ops = {n.op_type for n in onnx.load(g.path).graph.node}
        assert "SkipLayerNormalization" not in ops and "LayerNormalization" in ops, (g.name, ops)
    # the artifact's attention by sample, and each +rows graph's twin without it (its attention batched)
    built = {g.name: onnx.load(g.path).graph.node for g in graphs if "+rows" in g.name and g.path}
    assert {n for n in built if n.endswith("-batched")} == {f"{n}-batched" for n in built if n.endswith("+rows")}
    for name, nodes in built.items():
        assert bool(by_sample_ifs(nodes)) != name.endswith("-batched"), name
    rng = np.random.default_rng(0)
    ids = rng.integers(1, model.cfg.vocab_size, size=(3, 20)).astype(np.int64)
    mask = np.ones_like(ids)
    mask[2, 12:] = 0
    with torch.no_grad():
        want, _ = model(torch.from_numpy(ids), torch.from_numpy(mask), mode="dense")
    timed = 0
    for g in graphs:
        if g.path is None:
            assert g.reason, g.name  # every candidate that is not there says why
            continue
        if not g.dense:
            continue
        sess = ort.InferenceSession(g.path, providers=["CPUExecutionProvider"])
        got = sess.run(None, {"input_ids": ids, "attention_mask": mask})[0]
        np.testing.assert_allclose(got, want.numpy(), atol=1e-4, err_msg=g.name)
        timed += 1
    assert timed >= 3


def _weights_made_per_call(path: str, tmp_path: Path) -> list[str]:
    """The product nodes of the graph ONNX Runtime runs (saved after its optimisations), `If` and
    `Loop` bodies included, whose weight operand it computes at every call: derived from initializers
    and input shapes alone (no input's values), so a fixed tensor that failed to fold, as a weight
    sliced at a `Shape` does; a body reads its enclosing graphs' values as they are there."""
    def scan(graph, outer_inits: set, outer_data: set, where: str) -> list[str]:
        inits = outer_inits | {i.name for i in graph.initializer}
        data = {i.name for i in graph.input} | outer_data
        for n in graph.node:  # topological order; the values that follow the inputs' values (not sizes)
            if n.op_type not in ("Shape", "Size") and any(x in data for x in n.input):
                data.update(n.output)
        found = [f"{where}{n.op_type} {n.name} reads {x}" for n in graph.node
                 if n.op_type in ("MatMul", "Gemm", "FusedGemm", "FusedMatMul", "MatMulInteger")
                 for x in n.input[1:2] if x not in data and x not in inits]
        return found + [f for n in graph.node for a in n.attribute if a.type == onnx.AttributeProto.GRAPH
                        for f in scan(a.g, inits, data, f"{where}{n.name}.{a.name}/")]
    return scan(zoo.ort_loaded(path, tmp_path / f"loaded-{Path(path).name}").graph, set(), set(), "")


@pytest.mark.parametrize("family", ["bf"] + [pytest.param(f, marks=pytest.mark.slow) for f in ("tsa", "el", "eldec")])
def test_no_dense_export_prepares_its_weights_at_every_call(family, artifacts, tmp_path):
    """The yardstick is the fastest dense graph a user could ship: a dense export that re-slices or
    rescales its weights at every call (the legacy exporter keeps a Shape where the model reads a
    size from an input, and ONNX Runtime cannot fold what follows) is slower than that graph, and
    every ratio against it would flatter the artifact."""
    from adaptex.exporter.counterparts import _export_both

    model = artifacts.model(family)
    contract = family_contract(model)
    mode = contract.counterpart_modes["dense"]
    graphs, _ = _export_both(contract.wrapper(model, mode), contract.example_inputs(mode),
                             contract.dynamic_shapes(mode), contract.input_names(mode),
                             contract.output_names(mode), tmp_path / "dense", ("dense", "dense-legacy"), "dense")
    assert [g.name for g in graphs if g.path] == ["dense", "dense-legacy"], [(g.name, g.reason) for g in graphs]
    for g in graphs:
        assert _weights_made_per_call(g.path, tmp_path) == [], g.name


@pytest.mark.parametrize("family", ["bf", "tsa", "el", "eldec"])
def test_no_artifact_prepares_its_weights_at_every_call(family, artifacts, tmp_path):
    """The same of the artifacts, every branch: a weight an op body transposes or scales (the score
    scale in the query weights, the copies a dispatch branch makes) folds at load."""
    assert _weights_made_per_call(artifacts(family, "onnx"), tmp_path) == []


def test_the_rows_candidates_leave_the_floor_out_where_the_cpu_does_not_want_it(candidates, tmp_path):
    """On a CPU where the softmax floor costs (runtimes/cpu.py), bench builds the `+rows` candidates
    without it, as `--softmax-floor off` exports an artifact: the same passes otherwise and the same
    outputs; the cache keeps the two kinds apart."""
    from adaptex.exporter.counterparts import Graph, _cache_key, _rows
    from adaptex.runtimes.cpu import floor_probe

    model, graphs = candidates
    dense = next(g for g in graphs if g.name == "dense")
    copy = tmp_path / "dense.onnx"
    copy.write_bytes(Path(dense.path).read_bytes())
    floored, plain = (_rows(Graph("dense", str(copy), "the dense graph"), floor=f) for f in (True, False))
    assert "softmax_floor" in floored.how and "softmax_floor" not in plain.how
    from adaptex.exporter.targets.onnx.passes import subgraphs

    def floors(nodes) -> int:  # the floor's Max nodes, in If branches and Loop bodies too
        return sum(n.op_type == "Max" and n.name.endswith(".floor.Max") for n in nodes) + \
            sum(floors(g.node) for n in nodes for g in subgraphs(n))
    maxes = [floors(onnx.load(g.path).graph.node) for g in (next(g for g in graphs if g.name == "dense+rows"), plain)]
    assert maxes[0] > 0 and maxes[1] == 0, maxes
    ids = np.random.default_rng(0).integers(1, model.cfg.vocab_size, size=(2, 20)).astype(np.int64)
    mask = np.ones_like(ids)
    mask[1, 14:] = 0
    run = lambda p: ort.InferenceSession(p, providers=["CPUExecutionProvider"]).run(  # noqa: E731
        None, {"input_ids": ids, "attention_mask": mask})[0]
    np.testing.assert_allclose(run(plain.path), run(next(g for g in graphs if g.name == "dense+rows").path),
                               atol=1e-5)
    contract = family_contract(model)
    assert _cache_key(model, contract, "onnx") != _cache_key(model, contract, "onnx, no softmax floor")
    probe = floor_probe(rounds=4)
    assert probe["shape"] == [1, 4, 256, 256] and probe["plain_ms"] > 0 and probe["floored_ms"] > 0
    assert probe["pays"] == (probe["floored_ms"] < probe["plain_ms"])


def test_a_graph_with_no_attention_to_batch_gets_no_batched_twin(tmp_path):
    """+rows-batched is built only where attention_by_sample rewrites something; otherwise it would
    time the +rows graph twice, and says so."""
    from onnx import TensorProto, helper, numpy_helper

    from adaptex.exporter.counterparts import Graph, _rows

    x, w = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8]), numpy_helper.from_array(
        np.ones(8, np.float32), "w")
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8])
    graph = helper.make_graph([helper.make_node("Add", ["x", "x"], ["h"]),
                               helper.make_node("LayerNormalization", ["h", "w", "w"], ["y"], axis=-1)],
                              "g", [x], [y], initializer=[w])
    path = tmp_path / "g.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    twin = _rows(Graph("g", str(path), "a graph"), batched=True)
    assert twin.name == "g+rows-batched" and twin.path is None and "the same graph as +rows" in twin.reason


def test_the_cache_serves_a_second_bench_and_rebuilds_a_damaged_entry(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("ADAPTEX_CACHE_DIR", str(tmp_path / "cache"))
    model, _ = checkpoint.load(tiny_checkpoint)
    contract = family_contract(model)
    said = []
    first = cached_onnx_candidates(model, contract, tmp_path, said.append)
    assert not any("from the cache" in m for m in said)
    said.clear()
    second = cached_onnx_candidates(model, contract, tmp_path, said.append)
    assert any("from the cache" in m for m in said)
    assert [(g.name, g.path) for g in first] == [(g.name, g.path) for g in second]
    victim = next(g.path for g in second if g.path)
    __import__("os").remove(victim)
    said.clear()
    third = cached_onnx_candidates(model, contract, tmp_path, said.append)
    assert not any("from the cache" in m for m in said) and all(isinstance(g, Graph) for g in third)
    assert __import__("os").path.isfile(victim)


def test_a_bench_waits_for_the_entry_another_process_is_building(tiny_checkpoint, tmp_path, monkeypatch):
    """Two benches of one model (two shells, two test workers): the second waits on the entry's lock
    while the first builds it, then reads what the first wrote instead of exporting again."""
    import subprocess
    import sys
    import threading
    import time

    from adaptex.exporter import counterparts

    monkeypatch.setenv("ADAPTEX_CACHE_DIR", str(tmp_path / "cache"))
    model, _ = checkpoint.load(tiny_checkpoint)
    contract = family_contract(model)
    entry = counterparts.cache_root() / "counterparts" / counterparts._cache_key(model, contract, "onnx")
    held, go = tmp_path / "held", tmp_path / "go"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time, pathlib\nfrom adaptex.graphs import files\n"
        "with files.exclusive(sys.argv[1]):\n"
        "    pathlib.Path(sys.argv[2]).touch()\n"
        "    while not pathlib.Path(sys.argv[3]).exists(): time.sleep(0.02)\n"),
        f"{entry}.lock", str(held), str(go)])
    try:
        while not held.exists():
            assert holder.poll() is None, "the lock holder exited early"
            time.sleep(0.02)
        built, got = [], []
        monkeypatch.setattr(counterparts, "onnx_candidates", lambda *a, **k: built.append(1) or [])
        waiter = threading.Thread(target=lambda: got.append(cached_onnx_candidates(model, contract, tmp_path)))
        waiter.start()
        waiter.join(1.0)
        assert waiter.is_alive() and not built  # waiting on the lock, not building
        entry.mkdir(parents=True)  # what the holder's bench wrote meanwhile
        (entry / "dense.onnx").write_bytes(b"graph")
        (entry / "graphs.json").write_text(json.dumps([{"name": "dense", "path": "dense.onnx", "how": "stock"}]))
        go.touch()
        waiter.join(60)
        assert not waiter.is_alive() and not built
        assert [(g.name, g.path) for g in got[0]] == [("dense", str(entry / "dense.onnx"))]
    finally:
        go.touch()
        holder.wait(60)


def test_the_cache_key_follows_the_code_that_makes_the_graphs(tiny_checkpoint, monkeypatch):
    """A change to the graphs or exporter sources (a pass, a lowering of the naive graph) is a new
    cache entry, although the package version stays the same in a development install."""
    from adaptex.exporter import counterparts

    model, _ = checkpoint.load(tiny_checkpoint)
    contract = family_contract(model)
    before = counterparts._cache_key(model, contract, "onnx")
    monkeypatch.setattr(counterparts, "_code_hash", lambda: "other code")
    assert counterparts._cache_key(model, contract, "onnx") != before


def test_bench_grid_csv_plot_and_profile(tiny_onnx, tmp_path, capsys):
    out_csv, out_png = tmp_path / "b.csv", tmp_path / "b.png"
    code = main(["bench", str(tiny_onnx["sparse"]), "--seq", "8,16", "--threads", "1,2", "--runs", "10", "--warmup", "3",
                 "--blocks", "2", "--no-memory", "--csv", str(out_csv), "--plot", str(out_png), "--json"])
    text = capsys.readouterr().out
    assert code == 0
    rows = json.loads(text)["sweep"]
    assert [(r["threads"], r["seq"]) for r in rows] == [(1, 8), (1, 16), (2, 8), (2, 16)]
    for r in rows:
        assert r["blocks"] == 2 and len(r["latency_ratio_interval"]) == 2
        lo, hi = r["latency_ratio_interval"]
        assert lo <= r["latency_ratio"] <= hi
        timed = [c for c in r["candidates"] if c["dense"] and c["p50_ms"] is not None]
        assert r["dense_p50_ms"] == min(c["p50_ms"] for c in timed)
    table = list(csv.DictReader(out_csv.open()))
    assert len(table) == sum(sum(1 for s in r["stats"].values() if s) for r in rows)
    assert {t["model"] for t in table} == {tiny_onnx["sparse"].name}  # which artifact each row times
    yard = [t for t in table if t["yardstick"] == "True"]
    assert len(yard) == len(rows) and all(float(t["ratio_to_yardstick"]) == 1.0 for t in yard)
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    code = main(["bench", str(tiny_onnx["sparse"]), "--seq", "16", "--runs", "5", "--warmup", "1", "--no-memory",
                 "--profile", "--json"])
    prof = json.loads(capsys.readouterr().out)["profile"]
    assert code == 0 and prof["adaptive"]["adaptive_ms"] > 0  # the BudgetedAttention nodes, found by name
    dense = next(k for k in prof if k != "adaptive")
    assert prof[dense]["adaptive_ms"] == 0 and prof[dense]["rest_ms"] > 0
    assert any(k.endswith("(adaptive)") for k in prof["adaptive"]["by_op_ms"])


def test_bench_refuses_profile_for_other_targets_and_bad_lists(tiny_onnx, capsys):
    assert main(["bench", str(tiny_onnx["sparse"]), "--threads", "1,x"]) == 2
    assert "--threads '1,x'" in capsys.readouterr().err
    assert main(["bench", str(tiny_onnx["sparse"]), "--batch", "0"]) == 2
    assert "at least 1" in capsys.readouterr().err


def test_bench_prints_candidates_and_the_yardstick(tiny_onnx, capsys):
    assert main(["bench", str(tiny_onnx["sparse"]), "--seq", "16", "--runs", "5", "--warmup", "1", "--no-memory"]) == 0
    text = capsys.readouterr().out
    assert "<- yardstick" in text and "yardstick:" in text and "dense-legacy" in text
    assert "median [min, max] over blocks" in text
    assert " logical cores\n" in text.split("bench: ", 1)[1]  # the CPU in the first line: the figures are its
    floor = next(line for line in text.splitlines() if line.startswith("  softmax floor: in this artifact; "))
    assert "Softmax in " in floor
    assert " pays here (keep it)" in floor or "costs here (export with --softmax-floor off" in floor, floor


@pytest.mark.slow
def test_the_original_checkpoint_is_a_candidate_and_computes_the_same_embedding(tmp_path):
    """An elastic encoder on a Hugging Face directory: the directory's own transformers model,
    exported both ways, is timed beside the dense graphs, and it is the same function."""
    from adaptex.graphs.elastic import ElasticConfig, ElasticEncoder
    from adaptex.graphs.hf import load_encoder
    from tests.support import hf_dirs

    path = hf_dirs.make("roberta", tmp_path)
    backbone, _, info = load_encoder(path)
    b = backbone.cfg
    cfg = ElasticConfig(backbone="hf", backbone_sha256=info["sha256"], backbone_path=str(path),
                        num_layers=b.num_layers, num_heads=b.num_heads, head_dim=b.d_model // b.num_heads,
                        vocab_size=b.vocab_size, max_len=b.max_tokens, sink=2, window=6, pool_tokens=8,
                        router_hidden=8, backbone_config=b.to_dict())
    model = ElasticEncoder(cfg, backbone).eval()
    graphs = {g.name: g for g in onnx_candidates(model, family_contract(model), tmp_path / "c")}
    assert graphs["original"].path and graphs["original-legacy"].path, graphs
    assert "eager attention" in graphs["original-legacy"].how
    ids = np.random.default_rng(1).integers(4, hf_dirs.VOCAB, size=(2, 12)).astype(np.int64)
    mask = np.ones_like(ids)
    mask[1, 9:] = 0
    with torch.no_grad():
        want = model(torch.from_numpy(ids), torch.from_numpy(mask), mode="full")[0].numpy()
    for name in ("original", "original-legacy", "dense"):
        got = ort.InferenceSession(graphs[name].path, providers=["CPUExecutionProvider"]).run(
            None, {"input_ids": ids, "attention_mask": mask})[0]
        np.testing.assert_allclose(got, want, atol=1e-4, err_msg=name)


def test_bench_object_reuses_its_graphs_across_points(tiny_checkpoint, tiny_onnx):
    model, info = checkpoint.load(tiny_checkpoint)
    said = []
    with Bench(tiny_onnx["sparse"], model, info, progress=said.append) as b:
        r1 = b.run(seq=8, runs=5, warmup=1, memory=False)
        r2 = b.run(seq=16, runs=5, warmup=1, memory=False)
    assert sum("exporting the dense graph" in m or "from the cache" in m for m in said) == 1
    assert r1["seq"] == 8 and r2["seq"] == 16 and r1["runs"] == r2["runs"] == 5


def test_each_block_creates_its_sessions_in_a_rotated_order(tiny_checkpoint, tiny_onnx, monkeypatch):
    """ONNX Runtime sessions created later in a process run faster (runtimes/bench.py:
    _fresh_sessions), so no graph keeps the first place: each block makes new sessions, the order
    rotated by one place a block, and every block is timed."""
    from adaptex.runtimes import bench as bench_mod

    created, real = [], bench_mod.ort_runner

    def recording(path, threads, programs=False, **kw):
        created.append(path)
        return real(path, threads, programs, **kw)
    monkeypatch.setattr(bench_mod, "ort_runner", recording)
    model, info = checkpoint.load(tiny_checkpoint)
    with Bench(tiny_onnx["sparse"], model, info) as b:
        r = b.run(seq=8, runs=15, blocks=3, warmup=1, memory=False)
    timed = [name for name, st in r["stats"].items() if st]
    n = len(timed)
    assert r["blocks"] == 3 and n >= 3 and len(created) == 3 * n, created
    first, *later = created[:n], created[n:2 * n], created[2 * n:]
    assert first[0] == str(tiny_onnx["sparse"])  # the adaptive artifact, created first in block 0 ...
    for k, order in enumerate(later, start=1):
        assert order == first[k:] + first[:k]  # ... and later in the next blocks
    assert [o.index(str(tiny_onnx["sparse"])) for o in (first, *later)] == [0, n - 1, n - 2]
    assert r["latency_ratio_interval"] is not None and r["runs"] == 15  # every block timed


def test_profile_counts_kernels_inside_dispatch_branches_as_adaptive(artifacts, tmp_path):
    """TSA's ONNX lowerings put their FFN and query work inside If branches: the profile tags those
    kernels as the adaptive op's and leaves out the If itself (its time is its branch's kernels)."""
    from adaptex.graphs.family import family_contract
    from adaptex.runtimes.profile import profile_onnx

    model = artifacts.model("tsa")
    feeds = family_contract(model).bench_feeds(None, 1, 16)
    prof = profile_onnx(str(artifacts("tsa")), feeds, threads=1, workdir=tmp_path, runs=5)
    ops = prof["by_op_ms"]
    assert not any(k.split()[0] in ("If", "Loop", "Scan") for k in ops), sorted(ops)
    # the FFN's and the query side's MatMuls are in the op's branches; the routers' Gemms (the first
    # Linear fused with its ReLU) are in the main graph, outside any op
    assert ops.get("MatMul (adaptive)", 0) > 0, sorted(ops)
    assert "FusedGemm" in ops and "FusedGemm (adaptive)" not in ops, sorted(ops)
    assert prof["total_ms"] == pytest.approx(sum(ops.values()))
    # kernels counted per run: one FusedGemm a router (its first Linear), and the run's time beyond them
    from adaptex.graphs.nn.tsa import TokenRouter

    assert prof["by_op_kernels"]["FusedGemm"] == sum(isinstance(m, TokenRouter) for m in model.modules()) > 0
    assert prof["kernels"] == sum(prof["by_op_kernels"].values()) > prof["by_op_kernels"]["FusedGemm"]
    assert prof["run_ms"] > prof["total_ms"] and prof["outside_ms"] == pytest.approx(prof["run_ms"] - prof["total_ms"])


def test_sample_chunks_split_only_a_large_batch_into_whole_samples():
    from adaptex.runtimes.chunks import run_in_chunks, sample_chunks

    ids = {"ids": np.zeros((10, 8), np.int64)}
    assert sample_chunks(ids, "ids", None) is None and sample_chunks(ids, "ids", 80) is None  # off; 80 rows
    assert sample_chunks({"ids": np.zeros((1, 4096), np.int64)}, "ids", 512) is None  # one sample: whole
    assert sample_chunks(ids, "ids", 32) == [slice(0, 4), slice(4, 8), slice(8, 12)]  # 4 samples of 8 rows
    assert sample_chunks(ids, "ids", 5) == [slice(i, i + 1) for i in range(10)]  # at least one sample
    feeds = {"ids": np.arange(30).reshape(10, 3), "mask": np.ones((10, 3))}
    calls = []

    def run(f):
        calls.append(len(f["ids"]))
        return [f["ids"] * 2, f["mask"].sum(1)]
    got = run_in_chunks(run, feeds, sample_chunks(feeds, "ids", 12))
    assert calls == [4, 4, 2] and np.array_equal(got[0], feeds["ids"] * 2) and np.array_equal(got[1], np.full(10, 3.0))


def test_the_runner_runs_a_large_call_in_chunks_and_computes_what_the_whole_call_does(tiny_onnx, monkeypatch):
    from adaptex.runtimes import chunks
    from adaptex.runtimes.onnxruntime import OnnxRuntimeRunner

    path = tiny_onnx["sparse"]
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 60, (6, 16)).astype(np.int64)
    mask = np.ones_like(ids)
    mask[1, 9:] = 0  # a padded row
    feeds = {"input_ids": ids, "attention_mask": mask}
    seen, real = [], chunks.run_in_chunks

    def recording(run, f, c):
        seen.append(c)
        return real(run, f, c)
    monkeypatch.setattr("adaptex.runtimes.onnxruntime.run_in_chunks", recording)
    got = OnnxRuntimeRunner(path, threads=1, chunk_rows=32).infer(feeds)  # 2 samples of 16 tokens a call
    whole = OnnxRuntimeRunner(path, threads=1, programs=False).infer(feeds)  # the app's way: whole
    assert seen == [[slice(0, 2), slice(2, 4), slice(4, 6)], None]
    assert got.keys() == whole.keys()
    for name, want in whole.items():
        if want.dtype.kind in "biu":
            assert np.array_equal(got[name], want), name
        else:
            np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-6, err_msg=name)


def test_bench_runs_every_graph_of_a_large_point_in_the_same_chunks(tiny_checkpoint, tiny_onnx, monkeypatch, tmp_path):
    """What the runner does to the artifact bench does to every dense candidate too, so the yardstick
    is not timed the slower way; the report says so, and off runs every call whole."""
    from adaptex.runtimes import bench_candidates

    sizes, real = set(), bench_candidates.run_in_chunks

    def counting(run, feeds, c):
        def one(f):
            sizes.add(len(next(iter(f.values()))))
            return run(f)
        return real(one, feeds, c)
    monkeypatch.setattr(bench_candidates, "run_in_chunks", counting)
    model, info = checkpoint.load(tiny_checkpoint)
    with Bench(tiny_onnx["sparse"], model, info, chunk_rows=16) as b:
        r = b.run(batch=4, seq=8, runs=5, warmup=1, memory=False, prune=False)
    timed = [name for name, st in r["stats"].items() if st and name != "adaptive"]
    assert timed and r["chunk_samples"] == 2 and r["chunk_rows"] == 16
    assert sizes == {2}  # every dense call held 2 samples (the artifact's go through the runner)
    with Bench(tiny_onnx["sparse"], model, info, chunk_rows=None) as b:
        whole = b.run(batch=4, seq=8, runs=5, warmup=1, memory=False)
    assert whole["chunk_samples"] is None and whole["chunk_rows"] is None
    from adaptex.runtimes.bench_report import format_bench

    assert "in calls of at most 2 samples (16 token rows" in format_bench(r)
    assert "in calls of at most" not in format_bench(whole)
    npz = tmp_path / "inputs.npz"  # the peak-memory worker runs the call in the same chunks
    np.savez(npz, input_ids=np.ones((4, 8), np.int64), attention_mask=np.ones((4, 8), np.int64))
    peak = bench_candidates.peak_rss(str(tiny_onnx["sparse"]), str(npz), 1, "all", ("input_ids", 16))
    assert isinstance(peak, float) and peak > 0
