"""Training data from files: the line index reads back exactly the lines of each split, the split
is a rule on each line (not on order or seed), JSONL and text read through their tokenizers, and
bad data is one line naming the file, the line and the fix."""
from __future__ import annotations

import json
import zlib

import numpy as np
import pytest

from adaptex.cli import main
from adaptex.graphs.data import CharTokenizer, JsonlClassification, TextCorpus, TextFiles, TextPassages, from_spec
from adaptex.graphs.data.lines import BLOCK, LineIndex, jsonl_rule, text_rule
from adaptex.graphs.errors import DataError
from tests.support import hf_dirs


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _held(line: str) -> bool:
    return zlib.crc32(line.strip().encode()) % 10 == 0


def test_the_index_reads_back_each_split_in_order_across_files(tmp_path):
    (tmp_path / "d").mkdir()
    a = _write(tmp_path / "d" / "a.txt", [f"alpha {i}" for i in range(150)] + ["", "tail of a"])
    b = _write(tmp_path / "d" / "b.txt", [f"beta {i}" for i in range(90)])
    _write(tmp_path / "d" / ".hidden", ["never read"])
    index = LineIndex([a, b], text_rule(holdout=True))
    lines = (a.read_text() + b.read_text()).splitlines(keepends=True)
    want = {"train": [], "val": []}
    prev = None
    for line in lines:
        split = (prev or "train") if not line.strip() else ("val" if _held(line) else "train")
        want[split].append(line)
        prev = split
    for split in ("train", "val"):
        got = [raw.decode() for raw, _ in index.lines_from(split, 0)]
        assert got == want[split] and index.splits[split].count == len(want[split])
        assert len(index.splits[split].blocks) == -(-len(want[split]) // BLOCK)  # a few offsets, not every line
    k = index.splits["train"].count - 3  # reading wraps to the first line after the last
    assert [r.decode() for r, _ in index.lines_from("train", k, 5)] == want["train"][k:] + want["train"][:2]
    assert TextFiles(tmp_path / "d").index.files == [a, b]


def test_the_split_depends_on_each_line_only(tmp_path):
    lines = [json.dumps({"text": f"example number {i}", "label": "ab"[i % 2]}) for i in range(300)]
    one = LineIndex([_write(tmp_path / "a.jsonl", lines)], jsonl_rule(True))
    two = LineIndex([_write(tmp_path / "b.jsonl", lines[::-1])], jsonl_rule(True))
    held_one = sorted(r for r, _ in one.lines_from("val", 0))
    assert held_one == sorted(r for r, _ in two.lines_from("val", 0)) and 10 < len(held_one) < 60
    assert all(_held(r.decode()) for r in held_one)


def test_jsonl_text_batches_and_labels(tmp_path):
    data = hf_dirs.jsonl(tmp_path / "train.jsonl", lines=200)
    task = JsonlClassification(data, max_len=8)
    assert task.labels == ["dense", "sparse", "stream"] and task.kind == "text"
    b = task.sample(16, np.random.default_rng(0))
    assert b.input_ids.shape[0] == 16 and b.input_ids.shape[1] <= 8 and b.labels.max() < 3
    tok = from_spec(task.tokenizer_spec())  # the spec a checkpoint carries decodes what was trained on
    assert isinstance(tok, CharTokenizer) and tok.decode(tok.encode("sparse data")) == "sparse data"
    again = JsonlClassification(data, max_len=8).sample(16, np.random.default_rng(0))
    assert (again.input_ids == b.input_ids).all()  # seeded: the same batches
    held = task.held_out().sample(64, np.random.default_rng(1))
    assert held.labels.shape == (64,) and task.eval_count < 40


def test_jsonl_ids_and_a_tokenizer_json(tmp_path):
    data = hf_dirs.jsonl(tmp_path / "ids.jsonl", lines=120, ids=True)
    task = JsonlClassification(data)
    assert task.kind == "ids" and task.tokenizer_spec() == {"kind": "ids", "pad": 0, "vocab_size": task.vocab_size}
    tok_path = tmp_path / "tokenizer.json"
    hf_dirs.tokenizer(["[PAD]", "[UNK]"], unk="[UNK]").save(str(tok_path))
    text = JsonlClassification(hf_dirs.jsonl(tmp_path / "t.jsonl", lines=120), tokenizer=tok_path)
    assert text.tokenizer_spec()["kind"] == "tokenizer.json" and text.vocab_size == 2 + len(hf_dirs.WORDS)
    b = text.sample(4, np.random.default_rng(0))
    assert int(b.input_ids.max()) < text.vocab_size and int(b.input_ids[b.attention_mask.bool()].min()) >= 2
    with pytest.raises(DataError, match="holds token ids, not text"):
        JsonlClassification(data, tokenizer=tok_path)


def test_text_windows_and_passages_come_from_their_split(tmp_path):
    lines = [f"line{i:03d} " + "x" * (i % 7) for i in range(200)]
    files = TextFiles(_write(tmp_path / "c.txt", lines), collect_chars=True)
    tok = CharTokenizer.from_chars(files.chars)
    corpus = TextCorpus(files, tok, context=24)
    rng = np.random.default_rng(0)
    b = corpus.sample(6, rng, split="val")
    assert b.input_ids.shape == (6, 24) and bool(b.loss_mask.all())
    held = {ln for ln in lines if _held(ln)}
    for row in b.input_ids:  # every line a held-out window touches is a held-out line
        text = tok.decode(row.tolist())
        names = {w[:7] for w in text.split() if w.startswith("line") and len(w) >= 7}
        assert names and names <= {h[:7] for h in held}
    passages = TextPassages(files, min_chars=40).sample(3, rng, split="train")
    assert all(len(p) >= 40 for p in passages)
    tiny = TextFiles(_write(tmp_path / "t.txt", ["ab"]), tmp_path / "t.txt", collect_chars=True)
    short = TextCorpus(tiny, CharTokenizer.from_chars(tiny.chars), context=8).sample(2, rng)
    # a split shorter than a window: left-padded, the padding out of the loss and the mask
    assert short.attention_mask[0].tolist() == [0] * 6 + [1, 1] and short.loss_mask[0].sum() == 2


@pytest.mark.parametrize("lines, eval_lines, expect", [
    (['{"text": "a b", "label": "x"}', '{"text": "c", "label": "y"', ""], None, ":2: not valid JSON"),
    (['{"text": "a", "label": "x"}', '["text", "label"]'], None, ":2: a JSON list, not an object"),
    (['{"text": "a", "label": "x"}', '{"text": "b"}'], None, ':2: no "label" key'),
    (['{"text": "a", "label": "x"}', '{"text": "b", "ids": [1], "label": "y"}'], None, ':2: both "text" and "ids"'),
    (['{"text": "a", "label": "x"}', '{"ids": [1, 2], "label": "y"}'], None, 'a line with "ids" where the earlier'),
    (['{"text": "a", "label": "x"}', '{"text": "b", "label": 3}'], None, "label 3 is a int, the earlier labels are str"),
    (['{"ids": [1, -2], "label": "x"}'], None, "non-negative integers"),
    (["", "  "], None, "empty (no examples)"),
    ([json.dumps({"text": f"t{i}", "label": "a"}) for i in range(30)], None, "needs at least two labels"),
    ([json.dumps({"text": f"t{i}", "label": "ab"[i % 2]}) for i in range(30)],
     ['{"text": "q", "label": "a"}', '{"text": "r", "label": "zebra"}'], 'eval.jsonl:2: label "zebra" is in no training line'),
])
def test_bad_jsonl_is_one_line_naming_file_and_line(tmp_path, lines, eval_lines, expect):
    data = _write(tmp_path / "train.jsonl", lines)
    ev = _write(tmp_path / "eval.jsonl", eval_lines) if eval_lines else None
    with pytest.raises(DataError) as e:
        JsonlClassification(data, ev)
    msg = str(e.value)
    assert expect in msg and "\n" not in msg and str(ev or data) in msg, msg


def test_held_out_label_unknown_and_bad_text(tmp_path):
    lines = [json.dumps({"text": f"row {i}", "label": "ab"[i % 2]}) for i in range(200)]
    odd = next(i for i in range(1000) if _held(json.dumps({"text": f"odd {i}", "label": "c"})))
    lines.insert(7, json.dumps({"text": f"odd {odd}", "label": "c"}))  # held out by the rule, label c seen nowhere else
    with pytest.raises(DataError, match=r'train\.jsonl:8: label "c" is in no training line'):
        JsonlClassification(_write(tmp_path / "train.jsonl", lines))
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("ok\n".encode() * 3 + "caf\xe9\n".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1\.txt:4: not UTF-8 text .*convert the file to UTF-8"):
        TextFiles(bad)
    with pytest.raises(DataError, match="no such file or directory"):
        TextFiles(tmp_path / "missing.txt")
    few = _write(tmp_path / "few.txt", ["one", "two", "three"])
    with pytest.raises(DataError, match="fell in the held-out split.*pass --eval FILE"):
        TextFiles(few)


def test_cli_refuses_bad_data_and_writes_nothing(tmp_path, capsys):
    bad = _write(tmp_path / "bad.jsonl", ['{"text": "a", "label": "x"}', "not json"])
    out = tmp_path / "runs" / "bf"
    assert main(["train", "budgetformer", "--data", str(bad), "--steps", "1", "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("adaptex: error: ") and f"{bad}:2: not valid JSON" in err and "\n" not in err
    assert not (tmp_path / "runs").exists()  # -o's parents are created only once a checkpoint is written
    assert main(["train", "tsa", "--task", "copy", "--data", str(bad), "-o", str(out)]) == 2
    assert "pass one" in capsys.readouterr().err
    assert main(["train", "tsa", "--eval", str(bad), "-o", str(out)]) == 2
    assert "go with --data" in capsys.readouterr().err
