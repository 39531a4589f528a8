"""Tokenizer specs: what an app needs to turn text into a model's input ids, as plain JSON data.

An artifact carries its model's spec as metadata["tokenizer"], so an app in any language tokenises
from the artifact alone (examples/web/adaptex.mjs implements every kind below for the browser and
Node). A spec is data, never code. Kinds:

  ids        no text form: the inputs are token ids (the copy and sort tasks)
  chars      one id per character: itos[i] is id i's character; ids below 2 are pad and unknown
  words      words split on runs of the `separators` characters; `vocab` maps the words the task
             knows to ids, and any other word maps into the filler ids [first, last] by a 32-bit
             polynomial hash of its code points (h = (h * 31 + c) mod 2**32; id = first + h mod
             (last - first + 1)), so that unknown words look like the varied filler of training
  wordpiece  BERT WordPiece as a tokenizer.json with a BertNormalizer, a BertPreTokenizer, a WordPiece
             model and a "[CLS] $A [SEP]" template describes it, in a compact form: the vocabulary as
             a list (id i is vocab[i]), the normaliser's switches, the special tokens matched in the
             raw text, and the ids that frame a text

The tokenizers a user's data trains with (`CharTokenizer`, `JsonTokenizer`, `from_spec`) write and
read the same specs: "chars" built from the data's characters, and "tokenizer.json", a Hugging Face
tokenizer.json carried whole ({"kind": "tokenizer.json", "pad": id, "json": "<the file's text>"}).
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

from adaptex.graphs.errors import CheckpointError, DataError


def words_spec(vocab: dict[str, int], pad: int, filler: tuple[int, int], separators: str = " \t\n\r") -> dict:
    first, last = filler
    if not 0 <= first <= last:
        raise ValueError(f"filler range [{first}, {last}] is empty; pass first <= last")
    return {"kind": "words", "pad": pad, "vocab": dict(vocab), "filler": [first, last], "separators": separators}


def encode_words(spec: dict, text: str) -> list[int]:
    """A `words` spec applied to `text` (the reference the JavaScript encoder is tested against)."""
    first, last = spec["filler"]
    ids = []
    for word in re.split("[" + re.escape(spec["separators"]) + "]+", text):
        if not word:
            continue
        if word in spec["vocab"]:
            ids.append(spec["vocab"][word])
            continue
        h = 0
        for ch in word:
            h = (h * 31 + ord(ch)) & 0xFFFFFFFF
        ids.append(first + h % (last - first + 1))
    return ids


class UnsupportedTokenizer(CheckpointError):
    """A tokenizer.json that uses a feature the compact wordpiece spec does not describe."""


def wordpiece_spec(path: str | os.PathLike) -> dict:
    """The compact `wordpiece` spec of a BERT tokenizer.json; UnsupportedTokenizer names the first
    feature it cannot describe (an app would tokenise differently from the model's own tokenizer)."""
    path = Path(path)
    try:
        tj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not a readable tokenizer.json ({type(e).__name__}); pass the "
                              "tokenizer.json that ships with the weights") from None

    def need(ok: bool, what: str) -> None:
        if not ok:
            raise UnsupportedTokenizer(f"{path}: {what}; apps can only tokenise a BERT WordPiece tokenizer.json "
                                       "(BertNormalizer, BertPreTokenizer, WordPiece, [CLS] $A [SEP])")

    model, norm, pre = tj.get("model") or {}, tj.get("normalizer") or {}, tj.get("pre_tokenizer") or {}
    need(model.get("type") == "WordPiece", f"its model is {model.get('type')!r}, not WordPiece")
    need(norm.get("type") == "BertNormalizer", f"its normalizer is {norm.get('type')!r}, not BertNormalizer")
    need(pre.get("type") == "BertPreTokenizer", f"its pre-tokenizer is {pre.get('type')!r}, not BertPreTokenizer")
    vocab = model.get("vocab") or {}
    itos = [None] * len(vocab)
    for token, i in vocab.items():
        need(isinstance(i, int) and 0 <= i < len(itos) and itos[i] is None, f"vocabulary id {i!r} is not in 0..{len(itos) - 1} or repeats")
        itos[i] = token
    need(model.get("unk_token") in vocab, f"its unknown token {model.get('unk_token')!r} is not in the vocabulary")
    special = {}
    for t in tj.get("added_tokens") or []:
        need(not (t.get("normalized") or t.get("lstrip") or t.get("rstrip") or t.get("single_word")),
             f"added token {t.get('content')!r} is normalised, stripped or whole-word")
        special[t["content"]] = t["id"]
    frame = _template_frame(tj.get("post_processor") or {}, vocab)
    need(frame is not None, "its post-processor is not the template [CLS] $A [SEP]")
    lowercase = bool(norm.get("lowercase", True))
    strip = norm.get("strip_accents")
    return {
        "kind": "wordpiece", "vocab": itos, "unk": vocab[model["unk_token"]],
        "prefix": model.get("continuing_subword_prefix", "##"),
        "max_input_chars_per_word": int(model.get("max_input_chars_per_word", 100)),
        # BertNormalizer: strip_accents null means "follow lowercase"
        "clean_text": bool(norm.get("clean_text", True)), "handle_chinese_chars": bool(norm.get("handle_chinese_chars", True)),
        "strip_accents": lowercase if strip is None else bool(strip), "lowercase": lowercase,
        "special": special, "cls": frame[0], "sep": frame[1],
        "pad": vocab.get("[PAD]", 0),
    }


def _template_frame(post: dict, vocab: dict) -> tuple[int, int] | None:
    """(first id, last id) of a single-sequence template "X $A Y"; None for any other processor."""
    single = post.get("single") if post.get("type") == "TemplateProcessing" else None
    if not single or len(single) != 3 or "Sequence" not in single[1]:
        return None
    ends = []
    for piece in (single[0], single[2]):
        name = (piece.get("SpecialToken") or {}).get("id")
        ids = ((post.get("special_tokens") or {}).get(name) or {}).get("ids")
        if not ids or len(ids) != 1:
            return None
        ends.append(ids[0])
    return ends[0], ends[1]


def for_checkpoint(info: dict, model) -> dict | None:
    """The spec a checkpoint's artifacts should carry when its config.json records none: a shipped
    classifier's task knows its vocabulary, and an elastic encoder's comes from its backbone's
    tokenizer.json (too large to copy into every config.json). None when there is no text form."""
    cfg = getattr(model, "cfg", None)
    if info.get("family") == "elastic" and getattr(cfg, "backbone", None) == "minilm":
        from adaptex.graphs.minilm import TOKENIZER, default_model_dir

        try:
            return wordpiece_spec(Path(cfg.backbone_path or default_model_dir()) / TOKENIZER)
        except UnsupportedTokenizer:
            return None  # the model still loads and exports; apps then feed ids themselves
    if info.get("family") == "budgetformer" and (info.get("training") or {}).get("task") == "graded":
        from adaptex.graphs.tasks import GradedCues

        return GradedCues(num_classes=cfg.num_classes, vocab_size=cfg.vocab_size).tokenizer()
    return None


def check_spec(spec, vocab_size: int | None, where: str) -> None:
    """A checkpoint's tokenizer spec, checked before any artifact carries it: a known kind, its fields
    of the right types, its ids inside the model's vocabulary (CheckpointError naming the field)."""
    def bad(what: str):
        return CheckpointError(f"{where}: tokenizer {what}; restore the checkpoint's config.json as 'adaptex train' "
                               "wrote it (or remove 'tokenizer' to derive it again)")

    def an_id(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0 and (vocab_size is None or v < vocab_size)

    if not isinstance(spec, dict):
        raise bad(f"is a {type(spec).__name__}, not an object")
    kind = spec.get("kind")
    if kind not in ("ids", "chars", "words", "wordpiece", "tokenizer.json"):
        raise bad(f"kind {str(kind)[:40]!r} is not one of ids, chars, words, wordpiece, tokenizer.json")
    if kind == "tokenizer.json" and not isinstance(spec.get("json"), str):
        raise bad("'json' must hold the tokenizer.json file's text")
    for key in ("pad", "unk"):
        if key in spec and not an_id(spec[key]):
            raise bad(f"{key} {str(spec[key])[:40]} is not an id of the vocabulary (0..{(vocab_size or 0) - 1})")
    if kind == "chars":
        itos = spec.get("itos")
        if not isinstance(itos, (list, str)) or not all(isinstance(c, str) for c in itos) \
                or (vocab_size is not None and len(itos) > vocab_size):
            raise bad(f"'itos' must list at most {vocab_size} characters")
    if kind == "words":
        vocab, filler = spec.get("vocab"), spec.get("filler")
        if not isinstance(vocab, dict) or not all(isinstance(w, str) and an_id(i) for w, i in vocab.items()):
            raise bad("'vocab' must map words to ids of the vocabulary")
        if not (isinstance(filler, list) and len(filler) == 2 and all(an_id(i) for i in filler)
                and filler[0] <= filler[1]):
            raise bad("'filler' must be [first, last], ids of the vocabulary with first <= last")
        if not isinstance(spec.get("separators"), str) or not spec["separators"]:
            raise bad("'separators' must be a non-empty string")
    if kind == "wordpiece":
        vocab = spec.get("vocab")
        if not isinstance(vocab, list) or not all(isinstance(w, str) for w in vocab) \
                or (vocab_size is not None and len(vocab) > vocab_size):
            raise bad(f"'vocab' must list at most {vocab_size} word pieces")


# --- the tokenizers a user's data trains with ---------------------------------------------------

PAD, UNK = 0, 1
PAD_TOKENS = ("<pad>", "[PAD]", "<|pad|>", "<|endoftext|>", "</s>")


class CharTokenizer:
    """Character level: ids 0 pad, 1 unknown, then the characters seen in the data, sorted."""

    kind = "chars"

    def __init__(self, itos: list[str]):
        if len(itos) < 3 or itos[0] != "<pad>" or itos[1] != "<unk>":
            raise DataError("a chars tokenizer needs itos = ['<pad>', '<unk>', characters...]")
        self.itos = list(itos)
        self.stoi = {c: i for i, c in enumerate(self.itos) if i >= 2}
        self.pad_id, self.unk_id = PAD, UNK

    @classmethod
    def from_chars(cls, chars) -> "CharTokenizer":
        return cls(["<pad>", "<unk>"] + sorted(set(chars)))

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def encode(self, text: str, special: bool = False) -> list[int]:
        return [self.stoi.get(c, UNK) for c in text]

    def decode(self, ids) -> str:
        return "".join(self.itos[i] if i >= 2 else ("" if i == 0 else "?") for i in ids)

    def spec(self) -> dict:
        return {"kind": self.kind, "pad": PAD, "unk": UNK, "itos": self.itos}


class JsonTokenizer:
    """A `tokenizers` tokenizer.json. Padding and truncation it may configure are switched off:
    the data readers pad and cut themselves."""

    kind = "tokenizer.json"

    def __init__(self, text: str, where: str = "tokenizer.json", pad_id: int | None = None):
        from tokenizers import Tokenizer

        try:
            self._tok = Tokenizer.from_str(text)
        except Exception as e:  # tokenizers raises a bare Exception for unreadable files
            raise DataError(f"{where}: not a readable tokenizer.json ({str(e).splitlines()[0][:200]}); pass a "
                            "tokenizer.json written by the tokenizers library (Tokenizer.save)") from None
        self._tok.no_padding()
        self._tok.no_truncation()
        self.text, self.where = text, where
        self.pad_id = pad_id if pad_id is not None else self._find_pad()
        self.unk_id = self.pad_id

    @classmethod
    def from_file(cls, path: str | os.PathLike, pad_id: int | None = None) -> "JsonTokenizer":
        p = Path(path)
        if not p.is_file():
            raise DataError(f"--tokenizer {p}: no such file; pass a tokenizer.json, or leave --tokenizer out for "
                            "a character-level tokenizer built from the data")
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise DataError(f"{p}: unreadable ({type(e).__name__}); pass a tokenizer.json") from None
        return cls(text, str(p), pad_id)

    def _find_pad(self) -> int:
        padding = json.loads(self.text).get("padding") or {}
        if isinstance(padding.get("pad_id"), int):
            return padding["pad_id"]
        for t in PAD_TOKENS:
            i = self._tok.token_to_id(t)
            if i is not None:
                return i
        return 0

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, special: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=special).ids

    def encode_batch(self, texts: list[str], special: bool = True) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=special)]

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids))

    def spec(self) -> dict:
        return {"kind": self.kind, "pad": self.pad_id, "json": self.text}


def from_spec(spec: dict, where: str = "the checkpoint"):
    """The tokenizer a checkpoint's (or an artifact's) spec describes."""
    kind = spec.get("kind") if isinstance(spec, dict) else None
    if kind == "chars":
        return CharTokenizer(spec["itos"])
    if kind == "tokenizer.json":
        return JsonTokenizer(spec["json"], where, spec.get("pad"))
    raise DataError(f"{where}: its tokenizer is {kind!r}, which cannot encode text (chars or tokenizer.json can); "
                    "train on token ids, or on a checkpoint trained with a text tokenizer")
