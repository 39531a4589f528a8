"""Reading a Hugging Face model directory offline: config.json, model.safetensors, tokenizer.json.

Only data is read: the config is JSON, the weights safetensors; nothing from the directory is
imported or evaluated, and `transformers` is not needed. A value the implementation here does not
compute (another activation, a RoPE scaling, ...) is a one-line CheckpointError naming the key.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from adaptex.graphs.errors import CheckpointError
from adaptex.graphs.minilm import CONFIG, TOKENIZER, WEIGHTS, check_model_dir  # noqa: F401 (re-exported)

LAYOUTS = "BERT, RoBERTa, DistilBERT (encoders), GPT-2, LLaMA (decoders)"


def check_dir(path) -> Path:
    return check_model_dir(path, "a Hugging Face model directory", "a directory")


def read_config(path: Path) -> dict:
    try:
        hf = json.loads((path / CONFIG).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path / CONFIG}: unreadable JSON ({type(e).__name__}: {e}); restore the file") from None
    if not isinstance(hf, dict):
        raise CheckpointError(f"{path / CONFIG}: expected a JSON object, found {type(hf).__name__}")
    return hf


def model_type(path) -> str:
    return str(read_config(check_dir(path)).get("model_type"))


def need(hf: dict, key: str, where: Path, kind=int):
    """A required config value of type `kind`, or a one-line error naming the key."""
    if key not in hf or hf[key] is None:
        raise CheckpointError(f"{where / CONFIG}: no {key!r}; the config that transformers saved with the weights has it")
    try:
        v = hf[key]
        if kind is int and (isinstance(v, bool) or float(v) != int(v)):
            raise ValueError
        return kind(v)
    except (TypeError, ValueError):
        raise CheckpointError(f"{where / CONFIG}: {key!r} is {hf[key]!r}, expected a {kind.__name__}") from None


def refuse(where: Path, key: str, value, supported: str) -> CheckpointError:
    return CheckpointError(f"{where / CONFIG}: {key} = {json.dumps(value)} is not supported (adaptex computes "
                           f"{supported}); use a checkpoint with the standard setting")


def load_state(path: Path, what: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        state = load_file(str(path / WEIGHTS))
    except Exception as e:  # safetensors raises several types (SafetensorError, OSError, ...)
        raise CheckpointError(f"{path / WEIGHTS}: corrupt weights ({str(e).splitlines()[0]}); restore the file") from None
    return state


def strip_prefix(state: dict, anchor: str, path: Path, what: str) -> tuple[str, dict]:
    """The tensors under the prefix that `anchor` sits at ('' for a bare model, 'model.' or
    'transformer.' under a head), with the prefix removed."""
    prefix = next((k[: -len(anchor)] for k in state if k.endswith(anchor)), None)
    if prefix is None:
        raise CheckpointError(f"{path / WEIGHTS}: no {anchor} tensor found (keys start {sorted(state)[:3]}); "
                              f"expected {what} weights as transformers saves them")
    return prefix, {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def fill(net: torch.nn.Module, tensors: dict, path: Path, prefix: str, what: str) -> None:
    """Copy `tensors` (our parameter name -> tensor) into `net`: every parameter must be there, in
    its shape; fp16/bf16 weights become fp32."""
    mapped = {}
    for name, param in net.named_parameters():
        src = tensors.get(name)
        if src is None:
            raise CheckpointError(f"{path / WEIGHTS}: {prefix}{name} is missing; expected a complete {what} state")
        if tuple(src.shape) != tuple(param.shape):
            raise CheckpointError(f"{path / WEIGHTS}: {prefix}{name} has shape {list(src.shape)}, config.json implies "
                                  f"{list(param.shape)}; the two files come from different models")
        mapped[name] = src.float()
    net.load_state_dict(mapped, strict=False)


def sha256(path: Path) -> str:
    from adaptex.graphs.checkpoint import file_hash

    return file_hash(path / WEIGHTS)
