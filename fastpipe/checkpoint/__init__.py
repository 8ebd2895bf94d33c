"""Checkpoints that resume exactly, at any layout: ``save``, ``load``, ``latest``.

``save(directory, pipe, optimizer, scheduler, extra)`` writes the model, the optimizer state,
an LR scheduler's state, an ``extra`` dict of data and every rank's RNG states with
``torch.distributed.checkpoint``, keyed by the plain model's names: a checkpoint saved at one
layout (pipeline ranks, data / tensor / shard sizes, virtual stages, schedule) loads at any
other, into the plain model, and back. A save counts only once every rank has written it
(``directory``); ``latest(root)`` finds the last complete one, so a training script resumes
after a crash with ``load(latest(root), pipe, optimizer, scheduler)``. The same calls serve a
``Pipe`` in one process and a ``DistributedPipe`` on every rank. ``save_pretrained(directory,
pipe, model)`` writes the model in the Hugging Face format (every rank's share gathered:
``full_state_dict``), and ``hf_format.convert`` a checkpoint of ``save``, offline. A load
reads the checkpoint as data (``data_only``): nothing in its files runs, unless the caller
passes ``trust_pickled=True``.
"""
from ..parallel.optimizer_loads import OptimizerStateError
from .api import load, save
from .data_only import UnsafeCheckpointError
from .directory import MARKER, is_complete, latest
from .errors import (CheckpointError, CheckpointMismatchError, IncompleteCheckpointError,
                     RngNotRestoredWarning)
from .gather import full_state_dict
from .hf_format import save_pretrained

__all__ = ["CheckpointError", "CheckpointMismatchError", "IncompleteCheckpointError", "MARKER",
           "OptimizerStateError", "RngNotRestoredWarning", "UnsafeCheckpointError",
           "full_state_dict", "is_complete", "latest", "load", "save", "save_pretrained"]
