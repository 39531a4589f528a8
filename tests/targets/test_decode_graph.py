"""The decode-step graph (`adaptex export --target onnx --decode-graph on`, an elastic decoder's
default): one ONNX artifact holding the model traced for a decode step (one new token after a
non-empty cache: no router, the ops' step bodies) beside the general graph, and an If that runs the
step graph for such calls only; and the short-call graph (`--short-graph on`, likewise the
default), traced for calls of at most sink + window keys, where every head attends as dense
attention does and the routers still decide, with its masked form for longer prefills (the
streaming heads' keys beyond their reach masked). Each call runs one branch (ORT's profiler shows
which), the step and short-call graphs compute what the general graph computes, decisions exactly,
on every path of the step body (every pair SA, every pair FA, a mix masked or gathered by pairs,
left padding), an SA pair reads nothing of its cache outside its sinks and window, parity passes,
and bad requests are refused with one line and no file."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from adaptex.exporter.errors import ExportError
from adaptex.exporter.targets.onnx import dispatch, guards, programs
from adaptex.exporter.targets.onnx import bodies as fx
from adaptex.exporter.targets.onnx.bodies import EA_INPUTS, STEP_SHARED
from adaptex.graphs.ops.policy import DEFAULT
from adaptex.exporter.targets.onnx.passes import subgraphs
from adaptex.exporter.targets.onnx.passes_by_sample import by_sample_ifs
from adaptex.graphs import checkpoint
from tests.support import planted, zoo
from tests.support.ort_sessions import session as _session

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def decoders(artifacts) -> dict:
    """{file name: path}: the tiny elastic decoder exported by default (with the decode-step and the
    short-call graph) and with both off (the general graph alone), and the tiny TSA decoder with the
    decode-step graph on (its default is off) and by default (the session's shared exports)."""
    return {"eldec.onnx": artifacts("eldec"),
            "eldec-general.onnx": artifacts("eldec", decode_graph="off", short_graph="off"),
            "tsa.onnx": artifacts("tsa", decode_graph="on"), "tsa-general.onnx": artifacts("tsa")}


def _feeds(sess, batch: int, seq: int, past: int, modes="mixed", pad: int = 0, seed: int = 0) -> dict:
    """ids, a mask over the cache and the new tokens (the first `pad` columns of every row but the
    first padded), a random cache and head modes: "mixed" at random, "sa" or "fa" every pair."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for i in sess.get_inputs():
        if i.name == "input_ids":
            feeds[i.name] = rng.integers(3, 30, (batch, seq)).astype(np.int64)
        elif i.name == "attention_mask":
            mask = np.ones((batch, past + seq), np.int64)
            mask[1:, :pad] = 0
            feeds[i.name] = mask
        elif i.name.startswith("past"):
            feeds[i.name] = rng.standard_normal((batch, i.shape[1], past, i.shape[3])).astype(np.float32)
        elif i.name.startswith("head_modes."):
            shape = (batch, i.shape[1])
            feeds[i.name] = {"sa": np.ones(shape, bool), "fa": np.zeros(shape, bool)}.get(modes, rng.random(shape) < 0.5)
        else:
            raise AssertionError(f"unexpected input {i.name}")
    return feeds


def _ran(path, feeds, tmp_path) -> set[str]:
    """The innermost dispatch branch of each node the call ran: a branch's node is named
    dispatch.<tag>.<name>, nested in each enclosing branch's; a nested If and the nodes of its
    condition (dispatch.If, dispatch.<tag>_...) belong to no branch of their own."""
    sess = _session(path, tmp_path)
    sess.run(None, feeds)
    events = json.loads(open(sess.end_profiling()).read())
    innermost = (e["name"].rsplit(dispatch.RESERVED, 1)[-1].split(".")[0] for e in events if e.get("cat") == "Node")
    return {t for t in innermost if t in ("step", "short", "masked_large", "masked", "long")}


# the tiny elastic decoder: sink 2, window 8, so prefills of at most 10 tokens run the short-call graph,
# longer ones (to its 128 positions: 4 heads x 128 x 128 scores is within policy.mixed_call_masked_up_to)
# the masked short-call graph, or from batch x 4 heads x T x T = 2^22 scores (policy.by_sample_from: B64
# at T = 128) its form that attends a sample at a time, and every decode step the step graph
@pytest.mark.parametrize("batch, seq, past, branch", [
    (1, 1, 9, "step"),      # a decode step after a short cache
    (33, 1, 19, "step"),
    (5, 1, 20, "step"),     # a decode step: 21 keys
    (1, 1, 60, "step"),
    (2, 1, 0, "short"),     # a prompt of one token: the routers decide
    (2, 6, 0, "short"),     # a prompt within the streaming heads' reach
    (2, 10, 0, "short"),    # sink + window tokens: the most that SA sees whole
    (2, 11, 0, "masked"),   # one token more: the masked short-call graph
    (1, 128, 0, "masked"),  # the decoder's every position
    (64, 128, 0, "masked_large"),  # 2^22 scores: a sample at a time
    (63, 128, 0, "masked"),
    (2, 3, 5, "long"),      # three new tokens after a cache (within reach, but the routers do not run)
    (2, 4, 9, "long"),
])
def test_each_call_runs_one_branch(decoders, tmp_path, batch, seq, past, branch):
    path = decoders["eldec.onnx"]
    assert _ran(path, _feeds(_session(path), batch, seq, past), tmp_path) == {branch}


def _same(got: list, want: list, names: list) -> None:
    for name, a, b in zip(names, got, want):
        assert a.shape == b.shape, name
        if a.dtype.kind in "biu":  # decisions: exactly equal
            assert np.array_equal(a, b), name
        else:
            np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-5, err_msg=name)


@pytest.mark.parametrize("batch, past, modes, pad", [
    (1, 9, "sa", 0),      # a step after a short cache, every pair SA
    (2, 15, "mixed", 3),  # ... a mix, with left padding
    (2, 19, "fa", 0),     # ... every pair FA
    (1, 60, "mixed", 2),  # ... after a longer cache, at B1 (at most 80 batch x keys)
    (4, 25, "sa", 0),     # every pair SA: the sinks and the window only
    (3, 30, "sa", 4),     # ... with left padding in the window's reach
    (3, 30, "fa", 3),     # every pair FA
    (4, 40, "mixed", 2),  # a mix, small: every pair over every key, SA keys outside masked
    (336, 99, "mixed", 5),  # a mix past DEFAULT.mixed_step_masked_up_to floats: pairs gathered by mode
    (2, 3, "sa", 0),      # a cache shorter than the sinks and the window
])
def test_the_step_graph_computes_what_the_general_graph_does(decoders, batch, past, modes, pad):
    sess = _session(decoders["eldec.onnx"])
    feeds = _feeds(sess, batch, 1, past, modes, pad)
    if (batch, past) == (336, 99):
        heads, dim = sess.get_inputs()[2].shape[1], sess.get_inputs()[2].shape[3]
        assert batch * heads * (past + 1) * dim > DEFAULT.mixed_step_masked_up_to  # the pairs path runs
    names = [o.name for o in sess.get_outputs()]
    _same(sess.run(None, feeds), _session(decoders["eldec-general.onnx"]).run(None, feeds), names)


@pytest.mark.parametrize("batch, seq, pad", [
    (1, 10, 0),   # a prompt of sink + window tokens
    (3, 7, 3),    # left padding
    (2, 1, 0),    # one token
])
def test_the_short_call_graph_computes_what_the_general_graph_does(decoders, batch, seq, pad):
    sess = _session(decoders["eldec.onnx"])
    feeds = _feeds(sess, batch, seq, 0, "mixed", pad)
    names = [o.name for o in sess.get_outputs()]
    _same(sess.run(None, feeds), _session(decoders["eldec-general.onnx"]).run(None, feeds), names)


@pytest.mark.parametrize("batch, seq, pad, modes", [
    (1, 11, 0, None),     # one token past the reach
    (3, 40, 5, None),     # left padding
    (2, 128, 0, None),    # every position
    pytest.param(2, 60, 3, "sa", marks=pytest.mark.slow),  # every head streaming (the routers' biases set)
    pytest.param(2, 30, 0, "fa", marks=pytest.mark.slow),  # every head full
    (64, 128, 7, None),   # a sample at a time, left padding
])
def test_the_masked_short_call_graph_computes_what_the_general_graph_does(decoders, family_checkpoints, tmp_path,
                                                                          batch, seq, pad, modes):
    """Prefills past the reach: the streaming heads' keys outside their sinks and window masked, as
    the op's masked body masks them; every mode, decisions exactly. Planted routers give one mode
    everywhere (the shared export's random routers mix them). A large batch runs the form that
    attends a sample at a time, each sample's bias planes gathered in the Loop."""
    if modes is None:
        paths = decoders["eldec.onnx"], decoders["eldec-general.onnx"]
    else:
        model, info = checkpoint.load(family_checkpoints / "eldec")
        with torch.no_grad():  # every layer's SA logit 10 above or below its FA logit, whatever the keys
            for r in model.routers:
                r.router[2].weight.zero_()
                r.router[2].bias.copy_(torch.tensor([0.0, 10.0 if modes == "sa" else -10.0]))
        paths = [tmp_path / "m.onnx", tmp_path / "g.onnx"]
        zoo.export(model, info, paths[0])
        zoo.export(model, info, paths[1], decode_graph="off", short_graph="off")
    sess = _session(paths[0])
    feeds = _feeds(sess, batch, seq, 0, "mixed", pad)
    assert _ran(paths[0], feeds, tmp_path) == {"masked_large" if batch == 64 else "masked"}
    got = sess.run(None, feeds)
    names = [o.name for o in sess.get_outputs()]
    _same(got, _session(paths[1]).run(None, feeds), names)
    if modes is not None:
        assert all(np.all(v == (modes == "sa")) for n, v in zip(names, got) if n.endswith(".sa"))


@pytest.fixture(scope="module")
def longer_decoder(tmp_path_factory) -> dict:
    """The tiny elastic decoder with 320 positions, exported by default and as its general graph alone:
    past its masked short-call program's 181 tokens (4 heads x 181^2 scores a sample is within
    policy.mixed_call_masked_up_to), a prefill also runs that program where the scores masking adds over
    block-local attention, batch x 4 heads x T x (T - sink - 2 window = T - 18), are at most
    policy.prefill_masked_excess_up_to (2^18): B1 up to T = 265, B2 up to 190; a batch whose attention
    runs a sample at a time (batch x 4 x T^2 >= policy.by_sample_from = 2^22) counts as B1."""
    from adaptex.graphs.family import family_contract

    d = tmp_path_factory.mktemp("longer")
    checkpoint.save(d / "ck", zoo.tiny_elastic_decoder(max_len=320), {"description": "longer decoder"})
    model, info = checkpoint.load(d / "ck")
    paths = {"default": d / "m.onnx", "general": d / "g.onnx"}
    zoo.export(model, info, paths["default"])
    zoo.export(model, info, paths["general"], decode_graph="off", short_graph="off")
    return {**paths, "contract": family_contract(model)}


def test_the_artifact_records_where_longer_prefills_run_the_masked_program(longer_decoder):
    from adaptex.exporter.metadata import read_onnx_metadata

    meta = read_onnx_metadata(longer_decoder["default"])
    masked = next(p for p in meta["programs"] if p["name"] == "masked short-call")
    assert masked["masked"] and DEFAULT.prefill_masked_excess_up_to == 1 << 18
    assert masked["guard"] == {"all": [{"any": [
        {"axes": [["attention_mask", 1]], "op": "<=", "value": 181},
        {"axes": [["attention_mask", 0], ["attention_mask", 1], ["attention_mask", 1, 18]], "op": "<=",
         "value": DEFAULT.prefill_masked_excess_up_to, "scale": 4}]},
        {"axes": [["past_key_values.0.key", 2]], "op": "==", "value": 0}]}


@pytest.mark.parametrize("batch, seq, pad, branch", [
    (1, 265, 0, "masked"),       # 4 x 265 x 247 = 261,820 excess scores
    (1, 266, 0, "long"),         # 263,872: past the bound
    (2, 181, 3, "masked"),       # within 181 tokens at any batch
    (2, 190, 2, "masked"),       # 2 x 4 x 190 x 172 = 261,440
    (2, 191, 0, "long"),         # 264,344
    (27, 200, 5, "masked_large"),  # 27 x 4 x 200^2 >= 2^22: a sample at a time, a sample's excess
    (27, 266, 0, "long"),        # ... each sample's past the bound
    (26, 200, 0, "long"),        # below 2^22: batched, 26 x 145,600
])
def test_each_longer_prefill_runs_one_branch_and_computes_what_the_general_graph_does(
        longer_decoder, tmp_path, batch, seq, pad, branch):
    """The branch the graph takes is the one the stored guards (and so bench) name, the masked ones
    where elastic_attention.call_runs_masked says (a sample's excess where the call is large); its
    outputs are the general graph's, decisions exactly, where parity compares them (the contract's
    select: a padded position's logits and cache entries, which the gathering and the masked paths
    compute differently, mean nothing)."""
    from adaptex.exporter.metadata import read_onnx_metadata
    from adaptex.graphs.ops.elastic_attention import call_runs_masked
    from adaptex.runtimes.bench_accounting import program_entry

    path = longer_decoder["default"]
    sess = _session(path)
    feeds = _feeds(sess, batch, seq, 0, "mixed", pad)
    assert _ran(path, feeds, tmp_path) == {branch}
    names = {"masked": "masked short-call", "masked_large": "masked short-call (attention by sample)",
             "long": "general"}
    assert program_entry(read_onnx_metadata(path), feeds)["name"] == names[branch]
    large = batch > 1 and batch * 4 * seq * seq >= DEFAULT.by_sample_from
    assert call_runs_masked(1 if large else batch, 4, seq, 2, 8, DEFAULT.prefill_masked_excess_up_to) == (
        branch != "long")
    out, rows = [o.name for o in sess.get_outputs()], np.arange(batch)
    got, want = ([longer_decoder["contract"].select(n, v, feeds, {"past": 0}, rows) for n, v in zip(out, values)]
                 for values in (sess.run(None, feeds), _session(longer_decoder["general"]).run(None, feeds)))
    _same(got, want, out)


def test_the_short_call_graphs_run_no_elastic_op_and_a_long_call_does(decoders):
    """The short-call branches attend densely (no adaptex call, one causal and padding bias for
    every layer, the masked one a second for the streaming heads) and read no cache (its shape at
    most); the long one calls the op."""
    proto = onnx.load(str(decoders["eldec.onnx"]))
    short, by_sample, masked, long = (programs.program(proto, path).graph for path in (
        (False, True), (False, False, True), (False, False, False, True), (False, False, False, False)))
    for g in (short, masked, by_sample):
        assert not any(n.domain == "adaptex" for n in g.node)
        assert {n.op_type for n in g.node for i in n.input if i.startswith("past_key_values.")} <= {"Shape"}
    assert not any(n.op_type == "If" for g in (short, masked) for n in g.node)
    # the short graph routes every layer in one chain after the last (graphs.nn.elastic.route_layers);
    # the masked graph's streaming heads read their layer's choice, so each layer routes its own
    assert [len([n for n in g.node if n.op_type == "ArgMax"]) for g in (short, masked)] == [1, 2]
    # the masked graph makes the streaming heads' bias once (a Where) and picks each layer's planes
    # by its heads' modes (a GatherND in each of the two layers)
    wheres, gathers = ([len([n for n in g.node if n.op_type == op]) for g in (short, masked)]
                       for op in ("Where", "GatherND"))
    assert wheres[1] == wheres[0] + 1 and gathers[1] == gathers[0] + 2, (wheres, gathers)
    # its by-sample form: each layer's attention behind an If, a Loop that gathers a sample's planes
    # (its batched branch gathers the batch's: what a call below the threshold would run)
    assert by_sample_ifs(by_sample.node) == 2
    gathered = [n for n in by_sample.node if n.op_type == "GatherND"]
    assert len(gathered) == gathers[0]
    for n in (n for n in by_sample.node if n.op_type == "If" and by_sample_ifs([n])):
        loop = next(a.g for a in n.attribute if a.name == "then_branch").node[-1]
        assert "GatherND" in [m.op_type for m in next(a.g for a in loop.attribute if a.name == "body").node]
    assert any(n.domain == "adaptex" for n in long.node)
    from adaptex.exporter.metadata import read_onnx_metadata

    short_guard = read_onnx_metadata(decoders["eldec.onnx"])["programs"][1]["guard"]["all"][0]
    assert short_guard == {"axes": [["attention_mask", 1]], "op": "<=", "value": 10}


def _softmaxes(model: onnx.ModelProto) -> tuple[int, int]:
    """(last-axis Softmax nodes, those given passes.softmax_floor's Max) that a run of `model` may
    execute: its graph, subgraphs and the bodies of the functions it calls (the file holds every
    program's)."""
    bodies = {(f.domain, f.name, f.overload): f for f in model.functions}

    def walk(nodes, seen):
        for n in nodes:
            yield n
            for g in subgraphs(n):
                yield from walk(g.node, seen)
            key = (n.domain, n.op_type, n.overload)
            if key in bodies and key not in seen:
                seen.add(key)
                yield from walk(bodies[key].node, seen)
    nodes = list(walk(model.graph.node, set()))
    made = {o: n for n in nodes for o in n.output}
    soft = [n for n in nodes if n.op_type == "Softmax"]
    return len(soft), sum(made.get(n.input[0]) is not None and made[n.input[0]].op_type == "Max" for n in soft)


def test_the_softmax_floor_goes_where_prefills_run(decoders, artifacts):
    """passes.softmax_floor in the programs that serve prefills (the general graph, the short-call
    graphs, the sparse branch of --dense-rows and its dense branch for short prompts, a decoder's one
    graph, which serves its steps too), not in those that serve only decode steps (the step graphs, a
    decoder's dense step graph)."""
    proto = onnx.load(str(decoders["eldec.onnx"]))
    for path, floored in (((True,), False), ((False, True), True), ((False, False, True), True),
                          ((False, False, False, True), True), ((False, False, False, False), True)):
        total, with_floor = _softmaxes(programs.program(proto, path))
        assert total and with_floor == (total if floored else 0), (path, total, with_floor)
    rows = onnx.load(str(artifacts("tsa", dense_rows="8")))
    step, dense, sparse = (_softmaxes(programs.program(rows, p)) for p in ((True,), (False, True), (False, False)))
    assert step[0] and step[1] == 0 and dense[1] == dense[0] == step[0] and sparse[1] == sparse[0] > 0
    one = _softmaxes(onnx.load(str(decoders["tsa-general.onnx"])))
    assert one[1] == one[0] > 0


@pytest.mark.slow
def test_softmax_floor_off_leaves_it_out_of_every_program_and_keeps_the_outputs(artifacts, family_checkpoints):
    """--softmax-floor off (for a CPU whose Softmax takes masked scores at full speed): no program of
    the file floors a Softmax, the metadata says so, and the outputs are the floored file's (a masked
    key weighs e^-80 of the largest there, 0 here) on padded prompts and steps, with parity passing."""
    from adaptex.exporter.metadata import read_onnx_metadata
    from adaptex.runtimes.onnxruntime import OnnxRuntimeRunner
    from adaptex.runtimes.parity import check
    from adaptex.runtimes.torch_ref import TorchRunner

    on, off = artifacts("tsa", dense_rows="8"), artifacts("tsa", dense_rows="8", softmax_floor="off")
    proto = onnx.load(str(off))
    for path in ((True,), (False, True), (False, False)):
        total, floored = _softmaxes(programs.program(proto, path))
        assert total and not floored, path
    assert read_onnx_metadata(off)["softmax_floor"] is False and read_onnx_metadata(on)["softmax_floor"] is True
    a, b = _session(on), _session(off)
    names = [o.name for o in a.get_outputs()]
    for batch, seq, past, pad in ((2, 12, 0, 3), (3, 1, 12, 2)):
        feeds = _feeds(a, batch, seq, past, pad=pad)
        for name, x, y in zip(names, a.run(None, feeds), b.run(None, feeds)):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6, err_msg=name)
    model, _ = checkpoint.load(family_checkpoints / "tsa")
    report = check(OnnxRuntimeRunner(off), TorchRunner(model), samples=20, task="copy")
    assert report.passed and report.unexcused_flips == 0, report.format()


def test_every_branch_holds_its_weights_once_onnx_runtime_has_loaded_it(decoders, tmp_path):
    proto = onnx.load(str(decoders["eldec.onnx"]))
    weights = {i.name for i in proto.graph.initializer if np.prod(i.dims) > 1}
    loaded = zoo.ort_loaded(decoders["eldec.onnx"], tmp_path / "loaded.onnx")
    assert not [i.name for i in loaded.graph.initializer if np.prod(i.dims) > 1]  # no weight in the main graph

    def branches(g):
        for n in g.node:
            if n.op_type == "If" and n.name.startswith(dispatch.RESERVED):
                for a in n.attribute:
                    yield a.name, a.g
    step, general = (g for _, g in branches(loaded.graph))
    short, longer = (g for _, g in branches(general))
    by_sample, rest = (g for _, g in branches(longer))
    masked, long = (g for _, g in branches(rest))
    for g in (step, short, by_sample, masked, long):  # five graphs, each with its own folded copies
        assert not any(n.op_type == "Reshape" and ".fold." in n.name for n in g.node)
        assert len([i for i in g.initializer if np.prod(i.dims) > 1]) >= len(weights) // 2


def test_an_sa_pair_reads_nothing_of_its_cache_outside_its_sinks_and_window(decoders, family_checkpoints):
    """NaN in every cache entry an SA query does not see leaves a step whose pairs are all SA
    finite and unchanged: those entries are never read (the general graph's masking reads them)."""
    sess = _session(decoders["eldec.onnx"])
    model, _ = checkpoint.load(family_checkpoints / "eldec")
    sink, window, past = model.cfg.sink, model.cfg.window, 40
    feeds = _feeds(sess, 2, 1, past, "sa")
    clean = sess.run(None, feeds)
    unseen = slice(sink, past + 1 - window)  # the query sits at position `past`
    for name in feeds:
        if name.startswith("past_key_values."):
            feeds[name] = feeds[name].copy()
            feeds[name][:, :, unseen] = np.nan
    poisoned = sess.run(None, feeds)
    names = [o.name for o in sess.get_outputs()]
    assert np.isfinite(poisoned[0]).all()
    for name, a, b in zip(names, poisoned, clean):
        if not name.startswith("present."):  # the cache out holds the NaN it was given
            np.testing.assert_array_equal(a, b, err_msg=name)


@pytest.mark.parametrize("family", ["eldec", "tsa"])
def test_parity_passes_on_prefill_and_decode_steps(decoders, family_checkpoints, family):
    from adaptex.runtimes.onnxruntime import OnnxRuntimeRunner
    from adaptex.runtimes.parity import check
    from adaptex.runtimes.torch_ref import TorchRunner

    model, _ = checkpoint.load(family_checkpoints / family)
    report = check(OnnxRuntimeRunner(decoders[f"{family}.onnx"]), TorchRunner(model), samples=40, task="copy")
    assert report.passed, report.format()
    assert report.unexcused_flips == 0 and report.decisions_vary and report.max_abs_err < 1e-4


def test_the_tsa_step_graph_matches_its_general_graph(decoders):
    sess = _session(decoders["tsa.onnx"])
    feeds = _feeds(sess, 3, 1, 12)
    names = [o.name for o in sess.get_outputs()]
    _same(sess.run(None, feeds), _session(decoders["tsa-general.onnx"]).run(None, feeds), names)


def test_the_artifact_records_the_step_graph_which_runs_no_router(decoders):
    from adaptex.exporter.metadata import read_onnx_metadata

    meta = read_onnx_metadata(decoders["eldec.onnx"])
    assert [p["name"] for p in meta["programs"]] == ["decode-step", "short-call", "masked short-call (attention by sample)",
                                                     "masked short-call", "general"]
    assert meta["programs"][0]["guard"] == {"all": [{"axes": [["input_ids", 1]], "op": "==", "value": 1},
                                                    {"axes": [["past_key_values.0.key", 2]], "op": ">", "value": 0}]}
    assert [p["name"] for p in read_onnx_metadata(decoders["eldec-general.onnx"])["programs"]] == [
        "large-call (attention by sample)", "general"]
    proto = onnx.load(str(decoders["eldec.onnx"]))
    assert proto.graph.node[-1].op_type == "If"
    top = {a.name: a.g for a in proto.graph.node[-1].attribute}
    step, prompts = top["then_branch"], top["else_branch"]
    general = prompts
    for _ in range(3):  # short, masked by sample, masked short: each an If whose else holds the rest
        assert general.node[-1].op_type == "If"
        general = {a.name: a.g for a in general.node[-1].attribute}["else_branch"]
    # no router in the step graph; beside it, the general graph's calls after a cache are chunks of
    # several tokens, so its routers compute and select (no If a layer at a prefill)
    assert not any(n.op_type == "If" for n in step.node) and not any(n.op_type == "If" for n in general.node)
    assert any(n.op_type == "Where" for n in general.node)
    calls = [n for n in step.node if n.domain == "adaptex"]
    assert calls and all(n.overload == dispatch.STEP_OVERLOAD for n in calls)
    assert {f.overload for f in proto.functions if f.name == "ElasticAttention"} == {"", dispatch.STEP_OVERLOAD}
    # what every layer's step body reads alike (the positions an SA query reads, the padding biases)
    # is computed once in the step graph and read by every call: the body computes no position
    shared = {tuple(n.input[len(EA_INPUTS):]) for n in calls}
    assert len(calls) > 1 and len(shared) == 1 and len(next(iter(shared))) == len(STEP_SHARED)
    assert sum(n.op_type == "Range" for n in step.node) == 3  # the sinks, the window, every position
    body, = (f for f in proto.functions if f.name == "ElasticAttention" and f.overload == dispatch.STEP_OVERLOAD)
    key_mask = body.input[EA_INPUTS.index("key_mask")]
    assert not any(n.op_type == "Range" or key_mask in n.input for _, n in planted.walk(body.node))
    fused = [n for n in step.node if n.op_type == "SkipLayerNormalization"]
    assert fused and not any(n.op_type == "SkipLayerNormalization" for n in general.node)
    single = onnx.load(str(decoders["eldec-general.onnx"]))
    params = {i.name for i in single.graph.initializer
              if i.name.startswith("model.") and np.prod(i.dims) > DEFAULT.copied_up_to}
    assert params and params <= {i.name for i in proto.graph.initializer}  # the weights, stored once
    assert sum(np.prod(i.dims) for i in proto.graph.initializer) < 1.2 * sum(np.prod(i.dims) for i in single.graph.initializer)


@pytest.mark.parametrize("options, match", [
    ({"decode_graph": "maybe"}, "--decode-graph 'maybe': give on or off"),
    ({"decode_graph": "on", "variant": "dense"}, "serves the sparse lowering"),
    ({"decode_graph": "on", "dense_rows": 8}, "choose one"),
    ({"short_graph": "maybe"}, "--short-graph 'maybe': give on or off"),
    ({"short_graph": "on", "variant": "dense", "decode_graph": "off"}, "serves the sparse lowering"),
    ({"short_graph": "on", "dense_rows": 8, "decode_graph": "off"}, "choose one"),
    ({"softmax_floor": "sometimes"}, "--softmax-floor 'sometimes': give on or off"),
])
def test_bad_requests_are_refused_on_one_line(family_checkpoints, tmp_path, options, match):
    model, info = checkpoint.load(family_checkpoints / "eldec")
    with pytest.raises(ExportError, match=match) as e:
        zoo.export(model, info, tmp_path / "m.onnx", **options)
    assert "\n" not in str(e.value) and not (tmp_path / "m.onnx").exists()


def test_an_encoder_has_no_decode_steps(family_checkpoints, tmp_path):
    model, info = checkpoint.load(family_checkpoints / "bf")
    with pytest.raises(ExportError, match="for decoders") as e:
        zoo.export(model, info, tmp_path / "m.onnx", decode_graph="on")
    assert "\n" not in str(e.value) and not (tmp_path / "m.onnx").exists()
    zoo.export(model, info, tmp_path / "m.onnx", decode_graph="off")  # off asks nothing of it


@pytest.mark.parametrize("family", ["bf", "tsa"])
def test_a_model_without_a_short_call_program_refuses_the_graph(family_checkpoints, tmp_path, family):
    model, info = checkpoint.load(family_checkpoints / family)
    with pytest.raises(ExportError, match="for elastic decoders") as e:
        zoo.export(model, info, tmp_path / "m.onnx", short_graph="on")
    assert "\n" not in str(e.value) and not (tmp_path / "m.onnx").exists()


def test_cli_refuses_it_for_another_target(family_checkpoints, tmp_path):
    r = subprocess.run([sys.executable, "-m", "adaptex", "export", str(family_checkpoints / "eldec"), "--target",
                        "coreml", "-o", str(tmp_path / "m.mlpackage"), "--decode-graph", "on"],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "another target" in r.stderr, r.stderr
    assert not (tmp_path / "m.mlpackage").exists()


def test_a_constant_named_as_a_value_of_the_other_graph_is_renamed():
    """A graph merged in with its constants stored in the main graph (dispatch._share_weights): one
    of them named as a value the other graph makes inside a subgraph of its own (exporters name
    folded constants and values alike, val_N; a by-sample If's branch keeps its names) would sit
    above that value, which ONNX refuses (not SSA). It is renamed, and each branch computes what its
    graph does."""
    from onnx import TensorProto, helper, numpy_helper

    io = [helper.make_tensor_value_info("ids", TensorProto.FLOAT, ["b", "s"]),
          helper.make_tensor_value_info("past", TensorProto.FLOAT, ["b", 1, "p", 1])]
    out = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "s"])]

    def model(nodes, inits):
        return helper.make_model(helper.make_graph(nodes, "g", io, out, inits),
                                 opset_imports=[helper.make_opsetid("", 17)])

    def side(name):  # a branch that makes val_1: ids * w + w
        return helper.make_graph([helper.make_node("Mul", ["ids", "w"], ["val_1"]),
                                  helper.make_node("Add", ["val_1", "w"], [f"{name}_y"])], name, [],
                                 [helper.make_tensor_value_info(f"{name}_y", TensorProto.FLOAT, None)])
    general = model([helper.make_node("If", ["c"], ["y"], then_branch=side("a"), else_branch=side("b"))],
                    [numpy_helper.from_array(np.array([2.0], np.float32), "w"),
                     numpy_helper.from_array(np.array(True), "c")])
    short = model([helper.make_node("ReduceSum", ["val_1"], ["five"], keepdims=0),
                   helper.make_node("Add", ["ids", "five"], ["y"])],
                  [numpy_helper.from_array(np.full(100, 0.05, np.float32), "val_1")])  # stays in the main graph
    guard = guards.AllOf((guards.keys_at_most("ids", 4), guards.no_cache("past")))
    merged = dispatch.merge_short_call(short, general, guard=guard)
    onnx.checker.check_model(merged, full_check=True)
    sess = ort.InferenceSession(merged.SerializeToString(), providers=["CPUExecutionProvider"])
    for s, want in ((3, lambda x: x + 5), (5, lambda x: 2 * x + 2)):
        x = np.arange(s, dtype=np.float32)[None]
        got, = sess.run(None, {"ids": x, "past": np.zeros((1, 1, 0, 1), np.float32)})
        np.testing.assert_allclose(got, want(x), rtol=1e-6)
