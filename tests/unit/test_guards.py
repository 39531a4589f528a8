"""Guards (exporter/targets/onnx/guards.py): one object builds a program's If condition and answers
the same question in Python, and round-trips through the metadata as data."""
from __future__ import annotations

import itertools

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from adaptex.exporter.targets.onnx import guards
from adaptex.graphs.errors import AdaptexError

# every kind of guard the exporter builds, combined as the masked short-call programs' are
GUARDS = [
    guards.rows_at_most("ids", 8),
    guards.decode_step("ids", "past"),
    guards.AllOf((guards.one_new_token("ids"), guards.rows_at_most("ids", 8))),
    guards.AllOf((guards.AnyOf((guards.keys_at_most("mask", 12), guards.excess_at_most("mask", 4, 6, 700))),
                  guards.no_cache("past"))),
    guards.AllOf((guards.excess_at_most("mask", 4, 6, 500, batch=False), guards.large_call("mask", "mask", 4, 2000))),
]


def _graph_answer(guard, shapes: dict) -> bool:
    nodes, consts, out = guards.nodes(guard, "g.")
    ins = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in shapes]
    model = helper.make_model(helper.make_graph(nodes, "guard", ins, [helper.make_tensor_value_info(
        out, TensorProto.BOOL, [])], initializer=consts), opset_imports=[helper.make_opsetid("", 20)])
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return bool(sess.run(None, {n: np.zeros(s, np.float32) for n, s in shapes.items()})[0])


@pytest.mark.parametrize("guard", GUARDS, ids=lambda g: type(g).__name__)
def test_the_graph_and_python_answer_alike_and_the_guard_round_trips(guard):
    assert guards.from_dict(guard.to_dict()) == guard
    answers = set()
    for b, t, s, p in itertools.product((1, 2, 5), (1, 3, 9), (4, 9, 14), (0, 2)):
        shapes = {"ids": (b, t), "mask": (b, s), "past": (b, 2, p, 4)}
        want = guard.holds(shapes)
        assert _graph_answer(guard, shapes) == want, shapes
        answers.add(want)
    assert answers == {True, False}  # the grid crosses every guard's bound


def test_the_decision_list_takes_the_first_program_whose_guard_holds():
    meta = {"programs": [{"name": "step", "guard": guards.decode_step("ids", "past").to_dict()},
                         {"name": "small", "guard": guards.rows_at_most("ids", 8).to_dict()},
                         {"name": "general", "guard": None}]}
    programs = guards.read_programs(meta)
    pick = lambda b, t, p: programs[guards.chosen(programs, {"ids": (b, t), "past": (b, 2, p, 4)})][0]  # noqa: E731
    assert (pick(4, 1, 3), pick(2, 4, 0), pick(3, 3, 0), pick(1, 1, 0)) == ("step", "small", "general", "small")


@pytest.mark.parametrize("bad, what", [
    ({"axes": [["ids", 0]], "op": "<", "value": 1}, "op"), ({"axes": [["ids", -1]], "op": "<=", "value": 1}, "axis"),
    ({"axes": [["ids"]], "op": "<=", "value": 1}, "axis"), ({"axes": [["ids", 0]], "op": "<=", "value": "1"}, "value"),
    ({"axes": [["ids", 0]], "op": "<=", "value": 1, "code": "x"}, "comparison"), ({"any": []}, "non-empty"),
    ([1], "JSON object"),
])
def test_a_malformed_stored_guard_is_refused_in_one_line(bad, what):
    with pytest.raises(AdaptexError, match=what):
        guards.from_dict(bad)
