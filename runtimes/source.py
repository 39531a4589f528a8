"""Finding the eager model an artifact was exported from (parity and bench need it)."""
from __future__ import annotations

from adaptex.graphs import checkpoint
from adaptex.graphs.errors import AdaptexError


def load_source_model(meta: dict, model_arg: str | None):
    """The checkpoint named by --model, else the one recorded in the artifact; hashes must match."""
    recorded = (meta.get("source") or {}).get("checkpoint")
    want_sha = (meta.get("source") or {}).get("sha256")
    name = model_arg or recorded
    if not name:
        raise AdaptexError("the artifact does not name its source checkpoint; pass --model CHECKPOINT")
    try:
        model, info = checkpoint.load(name)
    except AdaptexError as e:
        if model_arg:
            raise
        raise AdaptexError(f"the artifact's source checkpoint cannot be loaded ({e}); "
                           "pass --model with the checkpoint it was exported from") from None
    if want_sha and info["sha256"] != want_sha:
        raise AdaptexError(f"checkpoint {name} (sha256 {info['sha256'][:12]}) is not the one this artifact "
                           f"was exported from (sha256 {want_sha[:12]}); pass --model with the source checkpoint")
    return model, info
