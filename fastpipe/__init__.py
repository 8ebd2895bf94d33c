"""fastpipe: exact pipeline-parallel training for PyTorch.

``Pipe`` splits an ``nn.Sequential`` into stages and runs micro-batches through them on a chosen
schedule, giving the gradients of the unsplit model.
"""
import torch  # noqa: F401  (loads libtorch before the native library needs it)

from . import balance, microbatch, ops, schedule, schedules, skip, tied
from . import amp, batchnorm, memory
from ._native import FastpipeNativeWarning
from .checkpoint import is_checkpointing, is_recomputing
from .errors import (PipelineAborted, PipelineError, PipelineTimeout, StageFailure)
from .info import format_info, info
from .ops import reference_transfer, transfer
from .pipe import Pipe
from .schedule import Action, ActionKind, Schedule, ScheduleError, get_schedule

__version__ = "0.1.0"

__all__ = [
    "amp", "batchnorm", "memory",
    "Action", "ActionKind", "FastpipeNativeWarning", "Pipe", "PipelineAborted", "PipelineError",
    "PipelineTimeout", "Schedule", "ScheduleError", "StageFailure", "balance", "format_info", "get_schedule",
    "info", "is_checkpointing", "is_recomputing", "microbatch", "ops", "reference_transfer",
    "schedule", "schedules", "skip", "tied", "transfer",
]
