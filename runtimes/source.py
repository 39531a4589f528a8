"""The eager model an artifact was exported from, and its contract (parity and bench need both)."""
from __future__ import annotations

from adaptex.exporter.metadata import state_hash
from adaptex.graphs import checkpoint
from adaptex.graphs.errors import AdaptexError
from adaptex.graphs.family import FAMILIES, Contract, GenericContract, load_families, family_contract
from adaptex.graphs.user_io import Call


def load_source_model(meta: dict, model_arg: str | None):
    """The checkpoint named by --model, else the one recorded in the artifact; its hashes (weights and
    config) must match the artifact's."""
    src = meta.get("source") or {}
    recorded = src.get("checkpoint")
    name = model_arg or recorded
    if not name:
        raise AdaptexError("the artifact was exported from a model of your own, not a checkpoint; check it from "
                           "Python with adaptex.check(path, model, inputs=...)" if "state_sha256" in src else
                           "the artifact does not name its source checkpoint; pass --model CHECKPOINT")
    try:
        model, info = checkpoint.load(name)
    except AdaptexError as e:
        if model_arg:
            raise
        raise AdaptexError(f"the artifact's source checkpoint cannot be loaded ({e}); "
                           "pass --model with the checkpoint it was exported from") from None
    check_source(meta, info=info, name=str(name))
    model.adaptex_source = info
    return model, info


def check_source(meta: dict, *, info: dict | None = None, model=None, name: str = "the model") -> None:
    """Refuse a reference that is not the artifact's source: a checkpoint's weights or config hash, or
    a model's state-dict hash, differs from the one recorded (or none was recorded)."""
    src = meta.get("source") or {}
    fix = ("pass the model it was exported from, or re-export the artifact from this one")
    if info is not None:
        if not src.get("sha256"):
            raise AdaptexError(f"the artifact records no sha256 of its source's weights, so {name} cannot be "
                               f"verified as its source; re-export it with this adaptex")
        if info["sha256"] != src["sha256"]:
            raise AdaptexError(f"checkpoint {name} (weights sha256 {info['sha256'][:12]}) is not the one this artifact "
                               f"was exported from (sha256 {src['sha256'][:12]}); {fix}")
        if src.get("config_sha256") and info.get("config_sha256") != src["config_sha256"]:
            raise AdaptexError(f"checkpoint {name}: its config.json changed since the export (sha256 "
                               f"{str(info.get('config_sha256'))[:12]}, recorded {src['config_sha256'][:12]}); {fix}")
        return
    want = src.get("state_sha256")
    if want is None:
        if src.get("sha256") and getattr(model, "adaptex_source", None):
            return check_source(meta, info=model.adaptex_source, name=name)
        if src.get("sha256"):  # a checkpoint's artifact, a model that is not loaded from a checkpoint
            where = f" ({src['checkpoint']})" if src.get("checkpoint") else ""
            raise AdaptexError(f"the artifact was exported from a checkpoint{where} (weights sha256 "
                               f"{src['sha256'][:12]}), and {name} is a model built in Python with no checkpoint "
                               "to compare; pass that checkpoint (--model, or adaptex.load(...) in Python), or "
                               "re-export the artifact from this model")
        raise AdaptexError("the artifact records no hash of its source model, so this model cannot be verified "
                           f"as its source; {fix}")
    got = state_hash(model)
    if got != want:
        raise AdaptexError(f"{name}'s weights (state sha256 {got[:12]}) are not the ones this artifact was exported "
                           f"from ({want[:12]}); {fix}")


def contract_of(meta: dict, model, example: tuple | None = None) -> Contract:
    """The reference's contract: the artifact's family's, or the generic one of a model of your own
    (derived from the model and one of its inputs)."""
    load_families()
    if FAMILIES.get(meta.get("family")) is not None:
        return family_contract(model)
    if example is None:
        raise AdaptexError("a model of your own needs its inputs to be checked: pass inputs=[...] "
                           "(or --inputs FILE.npz)")
    names = list(meta["inputs"])
    return GenericContract.from_model(model, example, call=Call.from_meta(names, meta))
