"""Checkpoints: a directory holding config.json and model.safetensors, written atomically.

Shipped models live in graphs/zoo/<name>/ and are addressed by name.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from adaptex.graphs import files, parallel
from adaptex.graphs.errors import CheckpointError
from adaptex.graphs.family import FAMILIES, load_families

ZOO = Path(__file__).parent / "zoo"
DEFAULT_MODEL = "budgetformer-graded"
CONFIG, WEIGHTS = "config.json", "model.safetensors"


def shipped_models() -> dict[str, Path]:
    return {p.name: p for p in sorted(ZOO.iterdir()) if (p / CONFIG).is_file()} if ZOO.is_dir() else {}


def resolve(model: str | os.PathLike | None) -> Path:
    """A checkpoint directory, or the name of a shipped model (None: the default model)."""
    if model is None:
        model = DEFAULT_MODEL
    path = Path(model)
    if path.is_dir():
        return path
    zoo = shipped_models()
    if str(model) in zoo:
        return zoo[str(model)]
    if path.exists():
        raise CheckpointError(f"{model}: not a checkpoint directory; pass a directory written by "
                              "'adaptex train' or a shipped model name ('adaptex models' lists them)")
    raise CheckpointError(f"{model}: no such checkpoint directory or shipped model; "
                          f"shipped models: {', '.join(zoo) or 'none'}")


def file_hash(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load(model: str | os.PathLike | None = None) -> tuple[torch.nn.Module, dict]:
    """Load a checkpoint; returns (model in eval mode, info dict with config, training and hash)."""
    path = resolve(model)
    cfg_path, w_path = path / CONFIG, path / WEIGHTS
    for f in (cfg_path, w_path):
        if f.is_symlink():  # as in a Core ML package: what a checkpoint holds is read from inside it only
            raise CheckpointError(f"{path}: {f.name} is a link (to {os.readlink(f)}); adaptex reads no checkpoint "
                                  "or package file through a link: copy the real file into the checkpoint")
        if not f.is_file():
            raise CheckpointError(f"{path}: {f.name} is missing; a checkpoint holds {CONFIG} and "
                                  f"{WEIGHTS} as written by 'adaptex train'")
    load_families()
    try:
        info = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg_path}: not valid JSON ({e}); re-run 'adaptex train' to write a fresh "
                              "checkpoint") from None
    if not isinstance(info, dict) or "family" not in info or "config" not in info:
        raise CheckpointError(f"{cfg_path}: a checkpoint config is an object with 'family' and 'config' keys; "
                              "re-run 'adaptex train' to write a fresh checkpoint")
    contract = FAMILIES.get(info["family"]) if isinstance(info["family"], str) else None
    if contract is None:
        raise CheckpointError(f"{cfg_path}: unknown family {info['family']!r}; adaptex loads "
                              f"{', '.join(sorted(FAMILIES))}")
    _check_export_defaults(info.get("export"), cfg_path)
    cfg_cls, model_cls = contract.config_cls, contract.model_cls
    cfg = cfg_cls.from_dict(info["config"], where=f"{cfg_path} 'config'")
    try:
        state = load_file(str(w_path))
    except Exception as e:  # safetensors raises several types (SafetensorError, OSError, ...)
        raise CheckpointError(f"{w_path}: corrupt weights ({str(e).splitlines()[0]}); "
                              "re-run 'adaptex train' to write a fresh checkpoint") from None
    # a family on a pretrained backbone builds it from its own source and stores only what it trains
    net = model_cls.from_config(cfg) if hasattr(model_cls, "from_config") else model_cls(cfg)
    state = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
    try:
        missing, unexpected = net.load_state_dict(state, strict=False)
        if hasattr(net, "checkpoint_state"):
            missing = [k for k in missing if k in net.checkpoint_state()]
    except RuntimeError as e:  # shape mismatches
        raise CheckpointError(f"{w_path}: weights do not match config.json ({str(e).splitlines()[-1].strip()}); "
                              "the two files come from different runs") from None
    if missing or unexpected:
        raise CheckpointError(f"{w_path}: weights do not match config.json (missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]}); the two files come from different runs")
    net.eval()
    if "tokenizer" in info:  # copied into every artifact: checked here, once
        from adaptex.graphs.tokenizers import check_spec

        check_spec(info["tokenizer"], getattr(cfg, "vocab_size", None), str(cfg_path))
    if "tokenizer" not in info:  # derived for apps, so that every artifact of it can tokenise text
        from adaptex.graphs.tokenizers import for_checkpoint

        spec = for_checkpoint(info, net)
        if spec is not None:
            info["tokenizer"] = spec
    info["path"] = str(path.absolute())
    info["sha256"] = file_hash(w_path)
    info["config_sha256"] = file_hash(cfg_path)
    return net, info


def _check_export_defaults(value, cfg_path: Path) -> None:
    """config.json may record export options measured for this checkpoint, {"export": {target:
    {option: value}}}, which `adaptex export` applies unless told otherwise. Here the shape is
    checked (a name and a whole number or a word per option); the exporter checks the names."""
    if value is None:
        return
    ok = isinstance(value, dict) and all(
        isinstance(target, str) and isinstance(opts, dict) and all(
            isinstance(k, str) and isinstance(v, (int, str)) and not isinstance(v, bool) for k, v in opts.items())
        for target, opts in value.items())
    if not ok:
        raise CheckpointError(f"{cfg_path}: 'export' maps a target to its options, e.g. "
                              '{"onnx": {"dense_rows": 64}}; fix or remove it')


SUMMARY, STATE_DIR = "summary.json", "training_state"  # beside them: what adaptex train writes


def is_checkpoint_dir(path: Path) -> bool:
    return path.is_dir() and {p.name for p in path.iterdir()} <= {CONFIG, WEIGHTS, SUMMARY, STATE_DIR}


def round_weights(net: torch.nn.Module, dtype: str) -> torch.nn.Module:
    """Round the parameters to what a `dtype` checkpoint stores, in place (evaluate after this)."""
    if dtype == "float16":
        parallel.reshard(net)  # a sharded model: its shards are its weights
        with torch.no_grad():
            for t in net.state_dict().values():
                if t.is_floating_point():
                    t.copy_(t.half().float())
    return net


def save(path: str | os.PathLike, net: torch.nn.Module, extra: dict | None = None,
         dtype: str = "float32", texts: dict[str, str] | None = None,
         tensors: dict[str, dict] | None = None, state: dict[str, torch.Tensor] | None = None) -> Path:
    """Write config.json + model.safetensors into `path` atomically (temp dir, then rename), with
    `files` (relative path -> text) and `tensors` (relative path -> a safetensors file's tensors)
    beside them: the training summary and state. `state`: the weights, when not the net's own (a
    sharded model's, gathered whole); the net gives the config and which of them a checkpoint holds.

    dtype="float16" stores the weights at half size; they load back as float32 (round_weights
    first, so that what was evaluated is exactly what is stored)."""
    if dtype not in ("float32", "float16"):
        raise CheckpointError(f"checkpoint dtype {dtype!r} is not supported; use float32 or float16")
    path = Path(path).absolute()
    parent = path.parent
    if path.exists() and not is_checkpoint_dir(path):
        raise CheckpointError(f"{path}: exists and is not a checkpoint directory; choose a new -o "
                              "(adaptex only replaces a directory holding config.json and model.safetensors)")
    if not parent.is_dir():
        raise CheckpointError(f"{path}: parent directory {parent} does not exist; create it first")
    try:
        with files.atomic_directory(path) as tmp:
            tmp.mkdir()
            info = {"family": net.cfg.family, "config": net.cfg.to_dict(), "weights_dtype": dtype, **(extra or {})}
            (tmp / CONFIG).write_text(json.dumps(info, indent=2) + "\n")
            cast = torch.float16 if dtype == "float16" else torch.float32
            own = net.checkpoint_state() if hasattr(net, "checkpoint_state") else net.state_dict()
            whole = own if state is None else {k: state[k] for k in own}
            weights = {k: (v.to(cast) if v.is_floating_point() else v).detach().contiguous() for k, v in whole.items()}
            save_file(weights, str(tmp / WEIGHTS))
            written = [CONFIG, WEIGHTS]
            for rel, text in (texts or {}).items():
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                (tmp / rel).write_text(text)
                written.append(rel)
            for rel, ts in (tensors or {}).items():
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                save_file(ts, str(tmp / rel))
                written.append(rel)
            for f in written:
                os.chmod(tmp / f, 0o644)
                if (tmp / f).parent != tmp:
                    os.chmod((tmp / f).parent, 0o755)
    except OSError as e:
        raise CheckpointError(f"{path}: writing the checkpoint failed ({e.strerror or e}); free space or choose "
                              "another -o; the previous checkpoint, if any, is untouched") from None
    except Exception as e:
        if type(e).__name__ == "SafetensorError":  # a full disk while writing the weights
            raise CheckpointError(f"{path}: writing the weights failed ({str(e).splitlines()[0][:120]}); free "
                                  "space or choose another -o; the previous checkpoint, if any, is untouched") from None
        raise
    return path


def describe_shipped() -> list[dict]:
    """One row per shipped model: name, family, task, layers, heads, width, description, default."""
    rows = []
    for name, path in shipped_models().items():
        info = json.loads((path / CONFIG).read_text())
        cfg = info["config"]
        rows.append({"name": name, "family": info["family"], "task": (info.get("training") or {}).get("task", "?"),
                     "num_layers": cfg["num_layers"], "num_heads": cfg["num_heads"],
                     # elastic: the backbone's width
                     "d_model": cfg.get("d_model") or cfg["num_heads"] * cfg["head_dim"],
                     "description": info.get("description", ""), "default": name == DEFAULT_MODEL,
                     "path": str(path)})
    return rows
