"""The errors a user can act on, each with a one-line message naming the flag, file or value.

A leaf: it imports nothing from the package, so every module may import it. Entry points catch these
and print `error: <message>`; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad flag, value or config file."""


class DataError(ValueError):
    """Bad training data. every_rank: every rank raised the same error, so rank 0 alone reports it."""

    def __init__(self, message: str, every_rank: bool = False):
        super().__init__(message)
        self.every_rank = every_rank


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded; the message names the path."""


class TrainingError(RuntimeError):
    """A run that cannot go on (e.g. a non-finite loss); the message names the step. every_rank: every
    rank raised it (an agreed decision), so rank 0 alone reports it."""

    def __init__(self, message: str, every_rank: bool = True):
        super().__init__(message)
        self.every_rank = every_rank


class HFError(ValueError):
    """A Hugging Face conversion that cannot be done; the message names the flag or path."""


class TrackerError(RuntimeError):
    """An experiment tracker that cannot start."""


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none), for one-line errors."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
