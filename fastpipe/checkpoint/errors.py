"""The typed errors and the warning of ``fastpipe.checkpoint``."""
from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint that cannot be saved or loaded as asked; raised on every rank alike, before
    the model, the optimizer or the directory change."""


class IncompleteCheckpointError(CheckpointError):
    """The directory is not a complete checkpoint: a save that did not finish (a crash) or a
    directory that no save wrote."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint does not fit the model or optimizer given: names it lacks or has in
    excess, other shapes, no optimizer or scheduler state, other parameter groups."""


class RngNotRestoredWarning(UserWarning):
    """The checkpoint was saved at another layout: the random number generators keep their
    state (dropout cannot continue as it would have); everything else is restored exactly."""
