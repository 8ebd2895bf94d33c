"""Checkpoints that resume exactly, at any layout: ``save``, ``load``, ``latest``.

``save(directory, pipe, optimizer, scheduler, extra)`` writes the model, the optimizer state,
an LR scheduler's state, a picklable ``extra`` dict and every rank's RNG states with
``torch.distributed.checkpoint``, keyed by the plain model's names: a checkpoint saved at one
layout (pipeline ranks, data / tensor / shard sizes, virtual stages, schedule) loads at any
other, into the plain model, and back. A save counts only once every rank has written it
(``directory``); ``latest(root)`` finds the last complete one, so a training script resumes
after a crash with ``load(latest(root), pipe, optimizer, scheduler)``. The same calls serve a
``Pipe`` in one process and a ``DistributedPipe`` on every rank.
"""
from ..parallel.optimizer_names import OptimizerStateError
from .api import load, save
from .directory import MARKER, is_complete, latest
from .errors import (CheckpointError, CheckpointMismatchError, IncompleteCheckpointError,
                     RngNotRestoredWarning)

__all__ = ["CheckpointError", "CheckpointMismatchError", "IncompleteCheckpointError", "MARKER",
           "OptimizerStateError", "RngNotRestoredWarning", "is_complete", "latest", "load",
           "save"]
