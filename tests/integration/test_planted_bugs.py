"""`adaptex check` fails an artifact that is wrong, for every family and every checker that runs here.

Bugs are planted in copies of real exports (tests/support/planted.py), as a reviewer would plant them:
- values: the decisions reported right but computed wrong (the weights of the lowest-scored heads
  gathered, the FFN run on the skipped tokens, SA heads attended as FA), in the last adaptive layer
  so that no later routing changes: 0 unexcused flips, and the values fail by far more than the
  tolerance (the tiny models' outputs are O(1-10), tests/support/zoo.py);
- decisions: k off by one, a shifted keep threshold, inverted head modes, a decode step that routes
  afresh instead of taking head_modes: unexcused flips, and the CLI exits 1.
ONNX Runtime checks the ONNX and the TensorRT-bound ONNX; the MIL evaluator checks Core ML packages
(there the wrong decision is planted in the evaluation of the routing op)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from adaptex.cli import main
from adaptex.runtimes import coreml_mil
from adaptex.runtimes.report import TOLERANCES
from tests.support import planted

MAIN_OUTPUT = {"bf": "logits", "tsa": "logits", "el": "sentence_embedding", "eldec": "logits"}
SAMPLES = {"bf": 8, "tsa": 6, "el": 8, "eldec": 6}

# The TensorRT-bound ONNX shares the ONNX target's bodies and routing but for conditional_attention's
# (a CumSum partition): the cases on it are that body and one routing bug of each decoder family.
VALUE_BUGS = [("bf", "onnx", "BudgetedAttention", planted.lowest_heads),
              ("tsa", "onnx", "ConditionalFFN", planted.ffn_on_skipped_tokens),
              ("tsa", "onnx", "ConditionalAttention", planted.queries_of_skipped_tokens),
              ("tsa", "tensorrt", "ConditionalAttention", planted.queries_of_skipped_tokens),
              ("el", "onnx", "ElasticAttention", planted.sa_heads_as_fa),
              ("eldec", "onnx", "ElasticAttention", planted.sa_heads_as_fa)]

DECISION_BUGS = [("bf", "onnx", planted.k_off_by_one, "decisions.layer0.k"),
                 ("tsa", "onnx", planted.shifted_keep_threshold, "decisions.layer1.keep"),
                 ("tsa", "tensorrt", planted.shifted_keep_threshold, "decisions.layer1.keep"),
                 ("el", "onnx", planted.inverted_head_modes, "decisions.layer0.sa"),
                 ("eldec", "onnx", planted.inverted_head_modes, "decisions.layer0.sa"),
                 ("eldec", "onnx", planted.decode_ignores_head_modes, "decisions.layer0.sa"),
                 ("eldec", "tensorrt", planted.decode_ignores_head_modes, "decisions.layer0.sa")]


def _check(capsys, path, family) -> tuple[int, dict]:
    capsys.readouterr()
    code = main(["check", str(path), "--samples", str(SAMPLES[family]), "--json"])
    return code, json.loads(capsys.readouterr().out)


def _artifact(artifacts, family: str, target: str):
    """The export a bug is planted in: an elastic decoder's general graph alone (the bugs are planted
    in its main graph; tests/targets/test_decode_graph.py plants them in the decode-step graph): its file
    holds a large-call graph too, which planted.general leaves out."""
    alone = {"decode_graph": "off", "short_graph": "off"}
    return artifacts(family, target, **(alone if (family, target) == ("eldec", "onnx") else {}))


@pytest.mark.parametrize("family, target, fname, bug", VALUE_BUGS,
                         ids=[f"{f}-{t}-{b.__name__}" for f, t, _, b in VALUE_BUGS])
def test_right_decisions_computed_wrong_fail_on_values(artifacts, family, target, fname, bug, tmp_path, capsys):
    clean = _artifact(artifacts, family, target)
    proto = planted.in_last_call(planted.general(clean), fname, bug)
    code, r = _check(capsys, planted.save(proto, tmp_path / "planted.onnx"), family)
    assert code == 1 and not r["passed"]
    assert r["unexcused_flips"] == 0 and r["excused_flips"] == 0 and r["decisions_vary"]
    main_out = MAIN_OUTPUT[family]
    atol = TOLERANCES["fp32"]["atol"]
    assert r["outputs"][main_out]["needed_atol"] > 50 * atol, r["outputs"][main_out]
    assert any(f.startswith(f"{main_out}: error") for f in r["failures"])
    code, r = _check(capsys, clean, family)  # the same artifact unplanted passes: the failure is the bug's
    assert code == 0 and r["outputs"][main_out]["needed_atol"] < atol


@pytest.mark.parametrize("family, target, bug, decision", DECISION_BUGS,
                         ids=[f"{f}-{t}-{b.__name__}" for f, t, b, _ in DECISION_BUGS])
def test_a_wrong_decision_fails_with_unexcused_flips(artifacts, family, target, bug, decision, tmp_path, capsys):
    proto = bug(planted.general(_artifact(artifacts, family, target)))
    code, r = _check(capsys, planted.save(proto, tmp_path / "planted.onnx"), family)
    assert code == 1 and not r["passed"]
    assert r["decisions"][decision]["unexcused"] > 0, r["decisions"][decision]
    assert any(f.startswith(f"{decision}: unexcused flip") for f in r["failures"])


def _ceil(x):
    return np.ceil(x)


def _argmin(real):  # an elastic router's choice read off the smaller logit
    return lambda x, axis=-1, keep_dims=False, output_dtype="int32": real(-x, axis, keep_dims, output_dtype)


MIL_BUGS = {  # a routing op evaluated wrong: the decision the package would take if it were built so
    "bf": ("floor", lambda real: _ceil, "decisions.layer0.k"),
    "el": ("reduce_argmax", _argmin, "decisions.layer0.sa"),
    "eldec": ("reduce_argmax", _argmin, "decisions.layer0.sa"),
}


@pytest.mark.parametrize("family", sorted(MIL_BUGS))
def test_the_mil_checker_fails_a_wrong_decision(artifacts, family, capsys, monkeypatch):
    op, wrong, decision = MIL_BUGS[family]
    path = artifacts(family, "coreml", "sparse", "fp32")
    monkeypatch.setitem(coreml_mil.EVAL, op, wrong(coreml_mil.EVAL[op]))
    code, r = _check(capsys, path, family)
    assert code == 1 and r["decisions"][decision]["unexcused"] > 0
    assert "MIL reference" in r["runtime"]
    monkeypatch.undo()
    code, r = _check(capsys, path, family)
    assert code == 0 and r["unexcused_flips"] == 0


def test_every_planted_mutation_of_make_mutate_still_finds_its_text():
    """Each mutant of `make mutate` (tests/mutate.py) edits text that occurs exactly once in its file,
    and names test files that exist: a refactor that moved the text would otherwise leave the mutant
    stale, reported but never run."""
    from tests.mutate import MUTANTS, ROOT

    for m in MUTANTS:
        assert (ROOT / m.path).read_text().count(m.old) == 1, f"{m.name}: its text is not once in {m.path}"
        assert m.old != m.new and all((ROOT / t).is_file() for t in m.tests), m.name
