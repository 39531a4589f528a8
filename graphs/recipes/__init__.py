"""Training recipes: what `adaptex train FAMILY` runs, callable from Python too.

A recipe takes `TrainOptions` (every field None means the recipe's default), trains, evaluates and
returns a `TrainResult`: the model (weights rounded to what the checkpoint stores), the extra fields
its checkpoint's config.json records (description, training, evaluation, tokenizer), and the
summary table. Bad options raise `TrainError` naming the option and the fix; nothing is written
(the caller saves the checkpoint).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable

from adaptex.graphs.errors import AdaptexError


class TrainError(AdaptexError):
    """Training options that cannot work, named with the fix."""


@dataclass
class TrainOptions:
    task: str | None = None
    data: str | None = None  # a JSONL (budgetformer) or text file or directory (tsa, elastic)
    eval_data: str | None = None  # held-out data (default: the hash rule on --data's lines)
    tokenizer: str | None = None  # a tokenizer.json for text data (default: characters from the data)
    backbone: str = "minilm"
    target_sparsity: float | None = None
    sink: int = 4
    window: int | None = None
    max_tokens: int | None = None
    dense: bool = False
    init: str | None = None  # a dense (or trained) checkpoint to start from, or a Hugging Face directory
    ops_saved: float | None = None  # tsa --init: the token-layer ops to save (a controlled compute penalty)
    steps: int | None = None
    batch_size: int | None = None
    lr: float | None = None
    seed: int = 0
    eval_size: int = 2000
    d_model: int | None = None
    heads: int | None = None
    layers: int | None = None
    d_ff: int | None = None
    lambda_depth: float | None = None
    max_len: int | None = None
    s_min: float = 0.25
    s_max: float = 0.375
    no_baseline: bool = False
    save_dtype: str = "float16"
    description: str | None = None

    def check(self) -> None:
        if (self.steps is not None and self.steps < 1) or (self.batch_size is not None and self.batch_size < 1) \
                or self.eval_size < 1:
            raise TrainError("--steps, --batch-size and --eval-size must be at least 1")
        if self.data is not None and self.task is not None:
            raise TrainError(f"--task {self.task} and --data {self.data}: pass one (a generated task or your file)")
        if self.data is None and (self.eval_data is not None or self.tokenizer is not None):
            raise TrainError("--eval and --tokenizer go with --data FILE; pass the training data too")


@dataclass
class TrainResult:
    model: object
    extra: dict = field(default_factory=dict)
    table: str = ""
    note: str = ""  # one line for the user after the checkpoint is written


def recipes() -> dict[str, str]:
    """Family name -> its recipe module, from the family contracts' `recipe` (graphs/family.py): the
    one table of what `adaptex train` knows. A module is imported when used (each pulls in its own
    model code)."""
    from adaptex.graphs.family import FAMILIES, load_families

    load_families()
    return {name: f"adaptex.graphs.recipes.{cls.recipe}" for name, cls in FAMILIES.items() if cls.recipe}


def train(family: str, opts: TrainOptions, say: Callable[[str], None] = lambda msg: None,
          session=None) -> TrainResult:
    """Run the recipe of `family` (budgetformer, tsa or elastic). `session`
    (graphs/recipes/session.py) carries periodic saves, resuming and progress; None: progress on
    stderr, nothing saved along the way."""
    known = recipes()
    if family not in known:
        raise TrainError(f"unknown family {family!r}; 'adaptex train' knows: {', '.join(known)}")
    opts.check()
    from adaptex.graphs.recipes.session import Session, deterministic, seed_everything

    session = session or Session(family=family, options=opts.__dict__.copy())
    with deterministic():
        # seeded before the recipe builds its model: a router's initial weights come from the global
        # generators, so the same options trained the same routers only in a fresh process (in a
        # process that had traced a model before, tests/models/test_hf.py's LLaMA routers started elsewhere)
        seed_everything(opts.seed)
        return importlib.import_module(known[family]).run(opts, say, session)
