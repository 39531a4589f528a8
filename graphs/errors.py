"""Errors that reach the user as one line: what is wrong and what to do about it."""


class AdaptexError(Exception):
    """Base class: the CLI prints str(error) on one line and exits non-zero."""


class CheckpointError(AdaptexError):
    """A checkpoint is missing, corrupt or inconsistent."""


class InputError(AdaptexError):
    """Runner inputs of the wrong name, dtype, rank or size."""


class DataError(AdaptexError):
    """A data file (or tokenizer file) that cannot be read as training data, named with its line."""
