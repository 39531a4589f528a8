"""Every large allocation is estimated from its shapes and refused before any work, in one line that
names the largest value that fits (graphs/memory.py); --max-memory moves the limit."""
from __future__ import annotations

import re
import time
import tracemalloc

import pytest

from adaptex.cli import main
from adaptex.graphs import memory


def _refused(capsys, argv, flag):
    t0 = time.perf_counter()
    assert main(argv) == 2
    took = time.perf_counter() - t0
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    m = re.search(rf"the largest {flag} that fits is (\d+)", err)
    assert m, err
    return took, int(m[1]), err


def test_check_samples_1e11_is_refused_at_once(tiny_onnx, capsys):
    took, best, err = _refused(capsys, ["check", str(tiny_onnx["sparse"]), "--samples", "1e11"], "--samples")
    assert took < 2.0 and 1 <= best < 10**11 and "50% of this machine's memory" in err
    _, more, err = _refused(capsys, ["check", str(tiny_onnx["sparse"]), "--samples", "1e11", "--max-memory", "1T"],
                            "--samples")
    assert more > best and "(the --max-memory limit)" in err


def test_train_batch_size_1e8_is_refused_at_once(tmp_path, capsys):
    took, best, _ = _refused(capsys, ["train", "budgetformer", "--task", "graded", "--batch-size", "1e8",
                                      "-o", str(tmp_path / "ck")], "--batch-size")
    assert took < 2.0 and 64 <= best < 10**8 and not (tmp_path / "ck").exists()


@pytest.mark.parametrize("flag, value", [("--d-model", "1000000"), ("--max-len", "1e12"), ("--layers", "1e7")])
def test_train_model_sizes_are_bounded(tmp_path, capsys, flag, value):
    _, best, _ = _refused(capsys, ["train", "tsa", flag, value, "-o", str(tmp_path / "ck")], flag)
    assert 1 <= best < float(value)


def test_bench_seq_1e8_is_refused_at_once(tiny_onnx, capsys):
    took, best, err = _refused(capsys, ["bench", str(tiny_onnx["sparse"]), "--seq", "1e8"], "--seq")
    assert took < 2.0 and best == 64 and "limit of 64 positions" in err


def test_bench_batch_is_bounded_by_memory(tiny_onnx, capsys):
    took, best, _ = _refused(capsys, ["bench", str(tiny_onnx["sparse"]), "--seq", "64", "--batch", "1e12"], "--batch")
    assert took < 2.0 and 1 <= best < 10**12


def test_a_config_with_an_absurd_size_is_one_line(tmp_path, capsys):
    import json

    from tests.support import zoo

    ck = tmp_path / "ck"
    zoo.save_tiny(ck)
    info = json.loads((ck / "config.json").read_text())
    info["config"]["max_len"] = 10**9
    (ck / "config.json").write_text(json.dumps(info))
    _, best, err = _refused(capsys, ["export", str(ck), "--target", "onnx", "-o", str(tmp_path / "m.onnx")], "max_len")
    assert "config.json" in err and best < 10**9 and not (tmp_path / "m.onnx").exists()


def test_max_memory_takes_sizes_and_refuses_nonsense(capsys):
    assert memory.parse_size("1.5G") == int(1.5 * 2**30) and memory.parse_size("512M") == 512 * 2**20
    assert main(["check", "x.onnx", "--max-memory", "lots"]) == 2
    assert "--max-memory 'lots': expected a size such as 8G" in capsys.readouterr().err
    memory.set_limit(None)


def test_parity_inputs_are_made_a_chunk_at_a_time():
    from adaptex.runtimes import parity

    asked = []

    class Contract:
        def parity_items(self, task, samples, seed=0):
            asked.append(samples)
            return [{"x": samples}]

    gen = parity._generated(Contract(), None, 2500, 0)
    assert asked == [1000]  # nothing more is built before it is compared
    assert [item["x"] for item in gen] == [1000, 1000, 500] and asked == [1000, 1000, 500]


def test_a_huge_single_line_is_read_in_pieces(tmp_path):
    from adaptex.graphs.data.corpus import TextFiles
    from adaptex.graphs.data.lines import PIECE

    text = ("é" * (3 * PIECE // 2)) + "\nshort line\n"
    path = tmp_path / "one-line.txt"
    path.write_text(text, encoding="utf-8")
    tracemalloc.start()
    files = TextFiles(path, eval_path=path)
    got = "".join(files.lines("train", 0))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert got == text and peak < 12 * PIECE  # pieces of PIECE bytes, never the 3 MB line whole
    assert files.index.lines == 2


def test_a_jsonl_record_longer_than_a_piece_is_one_line(tmp_path):
    from adaptex.graphs.data.lines import LineIndex, PIECE, jsonl_rule
    from adaptex.graphs.errors import DataError

    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "' + "a" * (PIECE + 10) + '", "label": "x"}\n')
    with pytest.raises(DataError, match=r"d.jsonl:1: a line longer than 1 MB"):
        LineIndex([path], jsonl_rule(True), whole_lines=True)
