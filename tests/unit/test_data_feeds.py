"""What each training data pipeline feeds the model, by value: a language model's targets are its
inputs shifted by one on real positions, masks sit exactly where padding is, a classification label
belongs to its own row, and nothing is dropped at the end of a file (a last line without a newline)
or of an evaluation pass (a last partial batch)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from adaptex.graphs.data import CharTokenizer, JsonlClassification, JsonTokenizer, TextCorpus, TextFiles
from adaptex.graphs.lm_tasks import SequenceTransduction, StdlibChars
from adaptex.graphs.tasks import GradedCues, StdlibSource
from tests.support import hf_dirs


def _assert_lm_batch(b, pad_id: int) -> None:
    """Targets shifted by one wherever the next input is real; left padding only, under mask 0 and
    the pad id; the loss only on real (input, target) pairs."""
    ids, tgt, mask, loss = (b.input_ids.numpy(), b.targets.numpy(), b.attention_mask.numpy(), b.loss_mask.numpy())
    assert ids.shape == tgt.shape == mask.shape == loss.shape
    real_next = mask[:, 1:] == 1
    assert real_next.any()
    assert np.array_equal(tgt[:, :-1][real_next], ids[:, 1:][real_next])
    assert (np.diff(mask, axis=1) >= 0).all(), "padding is on the left, one run per row"
    assert (ids[mask == 0] == pad_id).all()
    assert not (loss & (mask == 0)).any(), "a padded position counts in the loss"


@pytest.mark.parametrize("name", ["copy", "sort"])
def test_copy_and_sort_targets_are_the_next_tokens_and_the_loss_is_the_answer(name):
    task = SequenceTransduction(name, length=6, vocab_size=16)
    b = task.sample(32, np.random.default_rng(0))
    _assert_lm_batch(b, task.PAD)
    ids, tgt, loss = b.input_ids.numpy(), b.targets.numpy(), b.loss_mask.numpy()
    x = ids[:, 1:7]
    assert (ids[:, 0] == task.BOS).all() and (ids[:, 7] == task.SEP).all()
    answer = np.sort(x, axis=-1) if name == "sort" else x
    assert (tgt[:, 6] == task.SEP).all() and np.array_equal(tgt[:, 7:], answer), "the answer, in order, after SEP"
    assert np.array_equal(loss, np.arange(ids.shape[1])[None, :].repeat(32, 0) >= 6)  # targets from SEP on


def test_the_character_lm_targets_are_the_next_characters():
    """charlm's windows (its sampling on a short stand-in text: reading CPython's sources takes seconds)."""
    task = object.__new__(StdlibChars)
    task.seq_len = 32
    task.train, task.val = np.arange(2, 402) % 97 + 2, np.arange(2, 202) % 89 + 2
    for split, data in (("train", task.train), ("val", task.val)):
        b = task.sample(8, np.random.default_rng(1), split=split)
        _assert_lm_batch(b, 0)
        assert b.loss_mask.all() and b.attention_mask.all()
        for ids, tgt in zip(b.input_ids.numpy(), b.targets.numpy()):
            window = np.concatenate([ids, tgt[-1:]])
            assert any(np.array_equal(data[i:i + 33], window) for i in range(len(data) - 32)), "not a run of the text"


def _corpus_file(path, lines: list[str], last_newline: bool = True):
    path.write_text("\n".join(lines) + ("\n" if last_newline else ""))
    return path


@pytest.mark.parametrize("tokenizer", ["chars", "tokenizer.json"])
def test_text_file_windows_are_the_file_shifted_by_one(tmp_path, tokenizer):
    """Every window of a text file reads the file's own token stream (its lines in order, across the
    last line, which has no newline, and back to the first), its targets one token on."""
    words = hf_dirs.WORDS[:-2]
    lines = [" ".join(words[(7 * i + j) % len(words)] for j in range(3 + i % 5)) for i in range(40)]
    data = _corpus_file(tmp_path / "c.txt", lines, last_newline=False)
    files = TextFiles(data, data, collect_chars=True)  # --eval the same file: every line in each split
    assert files.count("train") == files.count("val") == 40
    if tokenizer == "chars":
        tok = CharTokenizer.from_chars(files.chars)
    else:
        hf_dirs.tokenizer(["<pad>", "<unk>"]).save(str(tmp_path / "tokenizer.json"))
        tok = JsonTokenizer.from_file(tmp_path / "tokenizer.json")
    corpus = TextCorpus(files, tok, context=16)
    raw = data.read_text().splitlines(keepends=True)  # the lines as the file holds them, the last without "\n"
    stream = [t for line in raw + raw for t in tok.encode(line)]
    seen_last = False
    for seed in range(12):
        b = corpus.sample(4, np.random.default_rng(seed), split="train" if seed % 2 else "val")
        _assert_lm_batch(b, tok.pad_id)
        assert b.attention_mask.all() and b.loss_mask.all()
        for row in range(4):
            window = b.input_ids[row].tolist() + b.targets[row, -1:].tolist()
            at = [i for i in range(len(stream) - 16) if stream[i:i + 17] == window]
            assert at, f"window {window} is not a run of the file's tokens"
            seen_last |= any(i + 17 > sum(len(tok.encode(x)) for x in raw[:-1]) for i in at)
    assert seen_last, "no window reached the file's last line"


def test_a_short_text_split_is_left_padded_and_its_padding_out_of_the_loss(tmp_path):
    data = _corpus_file(tmp_path / "t.txt", ["abc de"], last_newline=False)
    files = TextFiles(data, data, collect_chars=True)
    tok = CharTokenizer.from_chars(files.chars)
    b = TextCorpus(files, tok, context=10).sample(3, np.random.default_rng(0))
    _assert_lm_batch(b, tok.pad_id)
    n = len("abc de")
    assert b.attention_mask[0].tolist() == [0] * (11 - n) + [1] * (n - 1)
    assert tok.decode(b.input_ids[0, 11 - n:].tolist()) + tok.decode(b.targets[0, -1:].tolist()) == "abc de"
    assert b.loss_mask[0].tolist() == b.attention_mask[0].bool().tolist()


@pytest.mark.parametrize("kind", ["text", "ids"])
def test_jsonl_rows_carry_their_own_label_and_mask_and_the_last_line_counts(tmp_path, kind):
    """Each row's label is its line's (the cue word it carries), the mask covers exactly its tokens
    (right padding, pad id under mask 0), and a last line without a newline is read."""
    path = hf_dirs.jsonl(tmp_path / "d.jsonl", lines=120, ids=kind == "ids")
    raw = path.read_bytes().rstrip(b"\n")
    path.write_bytes(raw)  # the last line has no newline
    last = json.loads(raw.splitlines()[-1])
    task = JsonlClassification(path, path)  # --eval the same file: every line in each split
    assert task.index.splits["train"].count == task.eval_count == 120
    assert task.labels == ["dense", "sparse", "stream"]
    cue = {hf_dirs.WORDS.index(w) + 4: w for w in task.labels} if kind == "ids" else None
    for b in (task.sample(64, np.random.default_rng(0)), task.held_out().sample(64, np.random.default_rng(1))):
        ids, mask = b.input_ids.numpy(), b.attention_mask.numpy()
        assert (np.diff(mask, axis=1) <= 0).all() and mask[:, 0].all(), "right padding, one run per row"
        assert (ids[mask == 0] == task.pad_id).all()
        for row, m, label in zip(ids, mask, b.labels.tolist()):
            real = row[: int(m.sum())].tolist()
            words = {cue[t] for t in real if t in cue} if kind == "ids" else set(task.tokenizer.decode(real).split())
            assert task.labels[label] in words, f"row {real} labelled {task.labels[label]}"
    last_ids = [*task._example(raw.splitlines()[-1], "last line")]
    got = task._batch(task.index, "train", [119])
    assert got.labels.tolist() == [task.label_index[last["label"]]] and got.input_ids[0].tolist() == last_ids[0]


def _graded_label(task: GradedCues, seq: list[int], level: int) -> int:
    """The label of a GradedCues row, recomputed from its tokens."""
    C, V0 = task.num_classes, task.VALUE0
    if level == 0:
        return next(t - V0 for t in seq if V0 <= t < V0 + C)
    after = {m: [seq[i + 1] - V0 for i in range(len(seq) - 1) if seq[i] == m] for m in (task.MARK_A, task.MARK_B)}
    a, b = after[task.MARK_A], after[task.MARK_B]
    return {1: a[0], 2: sum(a) % C, 3: (a[0] - (b[0] if b else 0)) % C}[level]


def test_generated_classification_labels_belong_to_their_rows():
    task = GradedCues()
    b = task.sample(64, np.random.default_rng(0))
    mask = b.attention_mask.numpy()
    assert (b.input_ids.numpy()[mask == 0] == task.PAD).all() and (np.diff(mask, axis=1) <= 0).all()
    for row, m, label, level in zip(b.input_ids.tolist(), mask, b.labels.tolist(), b.difficulty.tolist()):
        seq = row[: int(m.sum())]
        assert task.PAD not in seq and _graded_label(task, seq, level) == label
    src = StdlibSource()
    b = src.sample(16, np.random.default_rng(0), levels=[2] * 16)
    for row, label in zip(b.input_ids.tolist(), b.labels.tolist()):
        if 1 not in row:  # ids map to characters one to one where none is the unknown id
            assert "".join(map(chr, row)) in src.texts[label]


class _Counting:
    """A task wrapper counting the rows an evaluation draws."""

    def __init__(self, task):
        self.task, self.rows = task, 0
        self.splits = getattr(task, "splits", False)

    def __getattr__(self, name):
        return getattr(self.task, name)

    def sample(self, n, rng, **kw):
        self.rows += n
        return self.task.sample(n, rng, **kw)


def test_an_evaluation_pass_keeps_its_last_partial_batch():
    from adaptex.graphs.recipes.budgetformer import evaluate
    from adaptex.graphs.recipes.tsa import evaluate_tsa
    from tests.support import zoo

    torch.set_num_threads(1)
    lm = _Counting(SequenceTransduction("copy", length=4, vocab_size=zoo.tiny_tsa().cfg.vocab_size))
    evaluate_tsa(zoo.tiny_tsa(), lm, n=45, batch_size=20, mode="soft")  # soft: hard mode's first call takes seconds
    assert lm.rows == 45
    bf = zoo.tiny_model()
    graded = _Counting(GradedCues(num_classes=bf.cfg.num_classes, vocab_size=bf.cfg.vocab_size, max_len=12))
    evaluate(bf, graded, n=260)
    assert graded.rows == 260
