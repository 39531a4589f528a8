"""Exporter errors. Every message is one line naming the problem and the fix."""
from adaptex.graphs.errors import AdaptexError, CheckpointError, InputError  # noqa: F401  (re-exported)


class UnsupportedLowering(AdaptexError):
    """No registered lowering accepts (op, target, variant); `reasons` says why each declined."""

    def __init__(self, op: str, target: str, variant: str, reasons: list[str]):
        self.op, self.target, self.variant, self.reasons = op, target, variant, list(reasons)
        why = "; ".join(self.reasons) or "no lowering is registered for this cell"
        super().__init__(f"cannot lower {op} to {target} ({variant}): {why}")


class ExportError(AdaptexError):
    """The export itself failed (bad output path, tracing or conversion failure)."""
