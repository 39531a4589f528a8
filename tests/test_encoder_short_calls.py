"""An elastic encoder's short-call programs (`--short-graph`, on by default for the shipped elastic
models): calls of at most window // 2 + 1 tokens, where a streaming head sees every key, run a graph
in which every head attends as dense attention does; calls a little longer (up to where the op's own
body attends every pair masked) run the masked short-call graph, one padding bias and one streaming
bias made once for every layer, each layer gathering a head's by its mode; large batches of those run
its form that attends a sample at a time; longer calls run the general graph. An encoder has no
cache, so the Ifs read the key count (and batch) alone. Each call runs the program the file's Ifs
take and computes what the general graph computes, decisions exactly."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

from adaptex.exporter.errors import ExportError
from adaptex.exporter.metadata import read_onnx_metadata, validate
from adaptex.exporter.targets.onnx import dispatch
from adaptex.exporter.targets.onnx.passes import by_sample_ifs
from adaptex.graphs.errors import AdaptexError
from adaptex.runtimes.bench import ran_graph
from adaptex.runtimes.onnxruntime import OnnxRuntimeRunner
from tests import zoo

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# sink 2, window 6: at most 4 keys is within every streaming head's reach; 4 heads x T x T scores are
# within MIXED_CALL_MASKED_UP_TO (2^17) to T = 181; a sample at a time from batch x 4 x T x T = 2^22
PATHS = {"short": (True,), "masked_large": (False, True), "masked": (False, False, True),
         "long": (False, False, False)}
NAMES = {"short": "short-call", "masked_large": "masked short-call (attention by sample)",
         "masked": "masked short-call", "long": "general"}  # bench's names (ran_graph)


@pytest.fixture(scope="module")
def encoders(tmp_path_factory) -> dict:
    """{name: path}: a tiny elastic encoder of 256 positions exported by default and with the
    short-call graphs off (the general graph alone)."""
    d = tmp_path_factory.mktemp("encoders")
    model = zoo.tiny_elastic(positions=256)
    zoo.export(model, None, d / "el.onnx")
    zoo.export(model, None, d / "el-general.onnx", short_graph="off")
    return {"el": d / "el.onnx", "general": d / "el-general.onnx"}


def _feeds(batch: int, seq: int, pad: int = 0, seed: int = 0) -> dict:
    """Random ids; every second row's last `pad` tokens padded."""
    rng = np.random.default_rng(seed)
    mask = np.ones((batch, seq), np.int64)
    if pad:
        mask[1::2, seq - pad:] = 0
    return {"input_ids": rng.integers(1, 64, (batch, seq)).astype(np.int64) * mask, "attention_mask": mask}


@pytest.mark.parametrize("batch, seq, pad, program", [
    (2, 1, 0, "short"),
    (3, 4, 1, "short"),          # window // 2 + 1 keys: the most every streaming head sees whole
    (3, 5, 2, "masked"),         # one key more
    (2, 64, 9, "masked"),
    (1, 181, 0, "masked"),       # 4 x 181 x 181 scores: the op's body attends it masked too
    (2, 182, 5, "long"),         # one key more: the op's body gathers the pairs by mode
    (64, 128, 7, "masked_large"),  # 2^22 scores: a sample at a time
    (63, 128, 0, "masked"),
    (1, 256, 0, "long"),
])
def test_each_call_runs_the_program_the_files_ifs_take_and_computes_what_the_general_graph_does(
        encoders, batch, seq, pad, program):
    feeds = _feeds(batch, seq, pad)
    runner = OnnxRuntimeRunner(encoders["el"], threads=1)
    got = runner.infer(feeds)
    assert list(runner.programs.sessions) == [PATHS[program]]
    assert ran_graph(runner.meta, seq, 0, batch) == NAMES[program]
    one = OnnxRuntimeRunner(encoders["el"], threads=1, programs=False).infer(feeds)  # the file's own Ifs
    want = OnnxRuntimeRunner(encoders["general"], threads=1).infer(feeds)
    assert list(got) == list(want) == list(one)
    for name in want:
        for have in (got, one):
            assert have[name].shape == want[name].shape, name
            if want[name].dtype.kind in "biu":  # decisions: exactly equal
                assert np.array_equal(have[name], want[name]), name
            else:
                np.testing.assert_allclose(have[name], want[name], atol=2e-5, rtol=1e-5, err_msg=name)
    decisions = np.stack([want[n] for n in want if n.endswith(".sa")])
    if program != "short" and batch * seq > 4:  # both modes occur, so the bias each head takes matters
        assert decisions.any() and not decisions.all()


def test_the_short_call_graphs_attend_densely_and_a_long_call_calls_the_op(encoders):
    """No adaptex call in the short-call graphs, no If in the short and masked ones, the masked
    graph's streaming bias made once (a Where more than the short graph's) and each layer's planes
    picked by its heads' modes (a GatherND in each of the two layers); its by-sample form gathers a
    sample's planes in each layer's Loop; the general graph calls the op."""
    proto = onnx.load(str(encoders["el"]))
    short, by_sample, masked, long = (dispatch.program(proto, PATHS[p]).graph
                                      for p in ("short", "masked_large", "masked", "long"))
    for g in (short, masked, by_sample):
        assert not any(n.domain == "adaptex" for n in g.node)
    assert not any(n.op_type == "If" for g in (short, masked) for n in g.node)
    wheres, gathers = ([len([n for n in g.node if n.op_type == op]) for g in (short, masked)]
                       for op in ("Where", "GatherND"))
    assert wheres[1] == wheres[0] + 1 and gathers[1] == gathers[0] + 2, (wheres, gathers)
    assert by_sample_ifs(by_sample.node) == 2
    for n in (n for n in by_sample.node if n.op_type == "If" and by_sample_ifs([n])):
        loop = next(a.g for a in n.attribute if a.name == "then_branch").node[-1]
        assert "GatherND" in [m.op_type for m in next(a.g for a in loop.attribute if a.name == "body").node]
    assert any(n.domain == "adaptex" for n in long.node)
    assert dispatch.short_keys_of(proto) == 4


def test_the_metadata_records_no_cache_and_refuses_one(encoders):
    meta = read_onnx_metadata(encoders["el"])
    within = meta["short_call"]
    assert within == {"keys_input": "attention_mask", "max_keys": 4, "masked_keys": 181,
                      "masked_large_call": {"heads": 4, "from_scores": 1 << 22}}
    assert "short_call" not in read_onnx_metadata(encoders["general"])
    with pytest.raises(AdaptexError, match="for a decoder only, cache_input"):
        validate({**meta, "short_call": {**within, "cache_input": "attention_mask"}}, "m.onnx")
    with pytest.raises(AdaptexError, match="for a decoder only, cache_input"):  # a decoder's needs its cache
        validate({**meta, "decoder": True, "short_call": within}, "m.onnx")


def test_merging_without_a_cache_needs_the_key_input(encoders):
    proto = onnx.load(str(encoders["general"]))
    with pytest.raises(ExportError, match="no input 'nope'"):
        dispatch.merge_short_call(proto, proto, keys_input="nope", cache_input=None, max_keys=4)


def test_one_runner_follows_each_calls_shapes(encoders):
    """The runner looks a call's program up by the shapes its Ifs read: a call of other shapes takes
    its own program, and one of shapes seen before the same program again."""
    runner = OnnxRuntimeRunner(encoders["el"], threads=1)
    for seq, program in ((4, "short"), (5, "masked"), (200, "long"), (4, "short"), (5, "masked")):
        runner.infer(_feeds(2, seq))
        assert runner.programs.taken(_feeds(2, seq)) == PATHS[program]
    assert set(runner.programs.sessions) == {PATHS["short"], PATHS["masked"], PATHS["long"]}
