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


# the largest shapes each family's recipe uses by default (its presets' maxima), and the bytes a
# parameter costs in training (fp32 weights, gradients, Adam's two moments; budgetformer and tsa train a
# baseline beside the model; an elastic backbone is frozen): what a bound estimates
_SHAPES = {"budgetformer": dict(d=256, heads=8, layers=2, d_ff=1024, seq=256, vocab=4096, batch=64, per_param=32),
           "tsa": dict(d=128, heads=4, layers=6, d_ff=512, seq=512, vocab=4096, batch=64, per_param=32),
           "elastic": dict(d=768, heads=12, layers=12, d_ff=3072, seq=512, vocab=50257, batch=8, per_param=4)}


def bound_training(family: str, opts: TrainOptions) -> None:
    """Refuse, before any work, sizes whose weights, optimizer state and one batch's activations would
    pass the memory limit (--d-model, --max-len, --batch-size ...), naming the flag that makes them
    so and its largest value that fits."""
    from adaptex.graphs import memory

    shape = _SHAPES.get(family, _SHAPES["tsa"])  # a family without its own entry: a decoder's shapes
    given = {k: v for k, v in (("d", opts.d_model), ("heads", opts.heads), ("layers", opts.layers),
                               ("d_ff", opts.d_ff), ("batch", opts.batch_size), ("positions", opts.max_len),
                               ("seq", opts.max_tokens)) if v}

    def need(**change):
        v = {**shape, "positions": shape["seq"], **given, **change}
        d_ff = v["d_ff"] if "d_ff" in given or "d" not in {**given, **change} else 4 * v["d"]
        seq = min(v["seq"], v["positions"]) if "positions" in {**given, **change} else v["seq"]
        params = memory.model_params(v["vocab"], v["d"], v["layers"], d_ff, v["positions"])
        return v["per_param"] * params + memory.activation_bytes(v["batch"], seq, v["d"], v["heads"], v["layers"],
                                                                 backward=True)
    if need() <= memory.limit():
        return
    flags = {"d": "--d-model", "heads": "--heads", "layers": "--layers", "d_ff": "--d-ff", "batch": "--batch-size",
             "positions": "--max-len", "seq": "--max-tokens"}
    # the flag given whose reduction to its default (or 1) frees the most
    key = min(given or {"batch": shape["batch"]}, key=lambda k: need(**{k: shape.get(k, 1)}))
    value = {**shape, **given}[key]
    memory.require(flags[key], value, lambda x: need(**{key: x}), "training")


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
    bound_training(family, opts)
    from adaptex.graphs.recipes.session import Session, deterministic, seed_everything

    session = session or Session(family=family, options=opts.__dict__.copy())
    with deterministic():
        # seeded before the recipe builds its model: a router's initial weights come from the global
        # generators, so the same options trained the same routers only in a fresh process (in a
        # process that had traced a model before, tests/models/test_hf.py's LLaMA routers started elsewhere)
        seed_everything(opts.seed)
        return importlib.import_module(known[family]).run(opts, say, session)
