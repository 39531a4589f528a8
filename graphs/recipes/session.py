"""One training run's bookkeeping: seeding and determinism, progress on stderr, periodic saves and
resuming bit for bit.

A recipe trains one or more models in turn (the adaptive model, then its baseline): each is a
*phase*, whose loop runs as

    for step in session.steps("tsa", model, opt, sched, rng, total, state):
        ...one optimiser step...
        session.show(loss=..., alpha=...)

`steps` yields 1..total. With `save_every` N it writes, after every N-th step, the checkpoint
directory (the product model's current weights, loadable and exportable like any checkpoint) with a
`training_state/` inside: every trained tensor in fp32, the optimiser's and scheduler's state, the
numpy and torch generators, the loop's own numbers (`state`, e.g. a Lagrange multiplier) and the
finished phases' weights. `resume` reads it back: finished phases restore their weights without
training, the interrupted one continues at the next step, and the run ends with the weights a run
without the interruption ends with (same seed, same thread count: tests/integration/test_train_session.py).

The state holds tensors (safetensors) and JSON, nothing that executes when read.
"""
from __future__ import annotations

import contextlib
import copy
import json
import random
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from safetensors.torch import load_file

from adaptex.graphs.errors import AdaptexError

STATE_DIR, STATE_JSON, STATE_TENSORS = "training_state", "state.json", "tensors.safetensors"
SUMMARY = "summary.json"
STATE_VERSION = 1


class ResumeError(AdaptexError):
    """--resume cannot continue the run it finds, named with the fix."""


def trained_state(model: torch.nn.Module, dp=None, whole: dict | None = None) -> dict[str, torch.Tensor]:
    """What a model trains and a checkpoint stores (a frozen backbone is left out), in fp32. A model
    sharded by dp (FSDP) is gathered (or `whole`, its state gathered already, is read): call it in
    every process; rank 0 gets the tensors, the others {}."""
    own = model.checkpoint_state() if hasattr(model, "checkpoint_state") else model.state_dict()
    if dp is not None and dp.sharded:
        whole = dp.gather(model) if whole is None else whole
        return {k: whole[k].detach().clone() for k in own if k in whole}
    return {k: v.detach().clone() for k, v in own.items()}


def _flatten(obj, prefix: str, tensors: dict):
    """A JSON skeleton of `obj` (an optimiser's or scheduler's state dict) with its tensors moved
    into `tensors` under dotted names."""
    if isinstance(obj, torch.Tensor):
        name = prefix
        tensors[name] = obj.detach().clone().contiguous()
        return {"__tensor__": name}
    if isinstance(obj, dict):
        return {"__dict__": [[_flatten(k, f"{prefix}.k{i}", tensors), _flatten(v, f"{prefix}.{i}", tensors)]
                             for i, (k, v) in enumerate(obj.items())]}
    if isinstance(obj, (list, tuple)):
        return {"__list__": [_flatten(v, f"{prefix}.{i}", tensors) for i, v in enumerate(obj)],
                "tuple": isinstance(obj, tuple)}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot store a {type(obj).__name__} in a training state")


def _unflatten(obj, tensors: dict):
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__dict__" in obj:
            return {_unflatten(k, tensors): _unflatten(v, tensors) for k, v in obj["__dict__"]}
        if "__list__" in obj:
            items = [_unflatten(v, tensors) for v in obj["__list__"]]
            return tuple(items) if obj.get("tuple") else items
    return obj


@contextlib.contextmanager
def deterministic() -> Iterator[None]:
    """torch's deterministic algorithms for the block (CPU kernels are deterministic for a given
    thread count; this makes any op that is not say so)."""
    was, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)
    torch.manual_seed(seed)


@dataclass
class Session:
    """What `adaptex train` passes a recipe beyond its options. The default (no output, no saves,
    progress on stderr) is what a recipe called from Python gets."""
    out: Path | None = None
    save_every: int | None = None
    resume: bool = False
    quiet: bool = False
    options: dict = field(default_factory=dict)  # the run's options, compared on resume
    family: str = ""
    save_dtype: str = "float16"
    stream: object = None
    dp: object = None  # the data-parallel group (recipes/parallel.py); one process when None
    # filled as the run goes
    checkpoint_extra: dict = field(default_factory=dict)  # description, tokenizer: what a saved checkpoint carries
    done: dict = field(default_factory=dict)  # phase -> its final trained state (fp32)
    product: torch.nn.Module | None = None  # the model the checkpoint holds: the first phase's
    _loaded: dict | None = None
    _bar: object = None

    def __post_init__(self):
        if self.dp is None:
            from adaptex.graphs.recipes.parallel import DataParallel

            self.dp = DataParallel()
        if self.out is not None:
            self.out = Path(self.out)
        if self.resume:
            self._loaded = self._read_state()

    # --- what a checkpoint records ---------------------------------------------------------------
    def record(self) -> dict:
        """Seed, threads, torch and adaptex versions: every checkpoint's training section holds them."""
        try:  # the installed distribution's version, read here: graphs/ imports nothing from above it
            version = metadata.version("adaptex")
        except metadata.PackageNotFoundError:  # a source tree that was never installed
            version = "0+source"
        rec = {"seed": self.options.get("seed", 0), "threads": torch.get_num_threads(), "torch": torch.__version__,
               "adaptex": version, "deterministic": True}
        if self.dp.world > 1:
            rec["processes"] = self.dp.world
        return rec

    # --- the loop --------------------------------------------------------------------------------
    def steps(self, name: str, model: torch.nn.Module, opt, sched, rng: np.random.Generator, total: int,
              state: dict | None = None, desc: str | None = None) -> Iterator[int]:
        """Yield the steps 1..total of phase `name` still to run (none when a resumed run had finished
        it: its weights are restored), saving every `save_every` steps."""
        if self.product is None:
            self.product = model
        state = state if state is not None else {}
        start = 1
        loaded = self._loaded
        if loaded is not None and name in loaded["done"]:
            self._load_weights(model, loaded["tensors"], f"done.{name}.")
            self.done[name] = trained_state(model, self.dp)
            return
        if loaded is not None and loaded["current"] and loaded["current"]["name"] == name:
            cur = loaded["current"]
            if cur["steps"] != total:
                raise ResumeError(f"{self.out}: the interrupted phase {name} runs {cur['steps']} steps, this run "
                                  f"{total}; pass the options of the interrupted run")
            self._load_weights(model, loaded["tensors"], "model.")
            t = loaded["tensors"]
            if opt is not None:
                self.dp.load_optimizer(model, opt, _unflatten(cur["opt"], t))
            if sched is not None and cur.get("sched") is not None:
                sched.load_state_dict(_unflatten(cur["sched"], t))
            rng.bit_generator.state = cur["numpy_rng"]
            torch.set_rng_state(t["torch_rng"])
            random.setstate(_unflatten(cur["python_rng"], t))
            state.clear()
            state.update(cur["state"])
            start = cur["step"] + 1
            self._loaded = None  # from here on the run goes on as if never stopped
        bar = self._open_bar(total, start - 1, desc or name)
        try:
            for step in range(start, total + 1):
                yield step
                if bar is not None:
                    bar.update(1)
                if self.save_every and step % self.save_every == 0 and step < total:
                    self.save_state(name, model, opt, sched, rng, step, total, state)
        finally:
            if bar is not None:
                bar.close()
            self._bar = None
        self.done[name] = trained_state(model, self.dp)

    def show(self, **fields) -> None:
        """Numbers beside the progress bar (loss, keep rate...)."""
        if self._bar is not None:
            self._bar.set_postfix({k: (f"{v:.3f}" if isinstance(v, float) else v) for k, v in fields.items()},
                                  refresh=False)

    def _open_bar(self, total: int, initial: int, desc: str):
        if self.quiet or not self.dp.main:  # progress on rank 0 only
            return None
        from tqdm.auto import tqdm

        stream = self.stream or sys.stderr
        tty = hasattr(stream, "isatty") and stream.isatty()
        # a log file gets a line every 30 s, a terminal a live bar
        self._bar = tqdm(total=total, initial=initial, desc=desc.strip(), file=stream, dynamic_ncols=tty,
                         mininterval=0.5 if tty else 30.0, leave=True, ascii=not tty)
        return self._bar

    # --- saving and loading ----------------------------------------------------------------------
    def save_state(self, name, model, opt, sched, rng, step, total, state) -> None:
        """The checkpoint directory with the state to resume from, atomically (graphs/files.py)."""
        from adaptex.graphs import checkpoint

        dp = self.dp
        if self.out is None or not (dp.main or dp.sharded):  # rank 0 writes; every rank holds the same state
            return
        # a sharded model's state is gathered by every process, then written by rank 0
        product = dp.gather(self.product) if dp.sharded else None  # the first phase's: often `model` itself
        weights = trained_state(model, dp, product if self.product is model else None)
        opt_state = dp.optimizer_state(model, opt) if opt is not None else None
        if not dp.main:
            return
        tensors: dict[str, torch.Tensor] = {}
        for phase, done in self.done.items():
            tensors.update({f"done.{phase}.{k}": v for k, v in done.items()})
        tensors.update({f"model.{k}": v for k, v in weights.items()})
        tensors["torch_rng"] = torch.get_rng_state()
        current = {"name": name, "step": step, "steps": total,
                   "opt": _flatten(opt_state, "opt", tensors) if opt is not None else None,
                   "sched": _flatten(sched.state_dict(), "sched", tensors) if sched is not None else None,
                   "numpy_rng": rng.bit_generator.state, "python_rng": _flatten(random.getstate(), "py", tensors),
                   "state": dict(state)}
        meta = {"version": STATE_VERSION, "family": self.family, "options": self.options, "record": self.record(),
                "done": list(self.done), "current": current}
        if product is None:
            snapshot = copy.deepcopy(self.product)  # rounded for the checkpoint; training goes on in fp32
            checkpoint.round_weights(snapshot, self.save_dtype)
        else:  # the sharded model stays as it is; its gathered weights are what gets written
            snapshot = self.product
            if self.save_dtype == "float16":
                product = {k: v.half().float() if v.is_floating_point() else v for k, v in product.items()}
        extra = {**self.checkpoint_extra,
                 "training": {**(self.checkpoint_extra.get("training") or {}), **self.record(),
                              "status": f"in progress: phase {name}, step {step} of {total}"}}
        summary = {"status": "in progress", "phase": name, "step": step, "steps": total, **self.summary_base()}
        self.out.absolute().parent.mkdir(parents=True, exist_ok=True)
        checkpoint.save(self.out, snapshot, extra, dtype=self.save_dtype, state=product,
                        texts={SUMMARY: json.dumps(summary, indent=2) + "\n",
                               f"{STATE_DIR}/{STATE_JSON}": json.dumps(meta) + "\n"},
                        tensors={f"{STATE_DIR}/{STATE_TENSORS}": tensors})

    def summary_base(self) -> dict:
        return {"family": self.family, **self.record(), "options": self.options}

    def _read_state(self) -> dict:
        out = self.out
        d = out / STATE_DIR if out is not None else None
        if d is None or not (d / STATE_JSON).is_file():
            why = "it does not exist" if out is None or not out.exists() else \
                "it holds no training state (a finished run, or one without --save-every)"
            raise ResumeError(f"--resume: nothing to resume at {out} ({why}); run without --resume, with "
                              "--save-every N so that an interrupted run can be resumed")
        try:
            meta = json.loads((d / STATE_JSON).read_text())
            tensors = load_file(str(d / STATE_TENSORS))
        except Exception as e:
            raise ResumeError(f"{d}: unreadable training state ({type(e).__name__}); start afresh without "
                              "--resume") from None
        if meta.get("version") != STATE_VERSION or meta.get("family") != self.family:
            raise ResumeError(f"{d}: a training state of {meta.get('family')!r} (version {meta.get('version')}); "
                              f"this run trains {self.family!r}; pass the same family, or start afresh")
        diff = [k for k in sorted(set(meta["options"]) | set(self.options))
                if meta["options"].get(k) != self.options.get(k)]
        if diff:
            k, shown = diff[0], (lambda v: "(not given)" if v is None else repr(v))
            raise ResumeError(f"--resume: --{k.replace('_', '-')} {shown(self.options.get(k))} differs from the "
                              f"interrupted run's {shown(meta['options'].get(k))}; pass the interrupted run's options (its "
                              f"{SUMMARY} lists them)")
        threads = meta["record"]["threads"]
        if threads != torch.get_num_threads():
            raise ResumeError(f"--resume: this run has {torch.get_num_threads()} threads, the interrupted one had "
                              f"{threads}; pass --threads {threads} (results are bit for bit for a thread count)")
        meta["tensors"] = tensors
        return meta

    def _load_weights(self, model: torch.nn.Module, tensors: dict, prefix: str) -> None:
        own = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        missing, unexpected = self.dp.load(model, own)
        if hasattr(model, "checkpoint_state"):
            missing = [k for k in missing if k in model.checkpoint_state()]
        if missing or unexpected:
            raise ResumeError(f"the training state's weights do not fit the model (missing {missing[:2]}, "
                              f"unexpected {unexpected[:2]}); pass the interrupted run's options")
