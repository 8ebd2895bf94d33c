"""fastpipe: exact pipeline-parallel training for PyTorch.

``Pipe`` splits an ``nn.Sequential`` into stages and runs micro-batches through them on a chosen
schedule, giving the gradients of the unsplit model; ``DistributedPipe`` does the same with one
process per stage under ``torchrun``; ``GPipe`` is torchgpipe's front door over ``Pipe``.
"""
import torch  # noqa: F401  (loads libtorch before the native library needs it)

from . import amp, balance, batchnorm, memory, microbatch, ops, schedule, schedules, skip, tied
from . import distributed, models, nn, tracing
from ._native import FastpipeNativeWarning
from .checkpoint import is_checkpointing, is_recomputing
from .distributed import DistributedPipe, init_mesh
from .doctor_report import Diagnosis, doctor
from .errors import (LossFunctionError, PipelineAborted, PipelineError, PipelineTimeout,
                     ProcessGroupError, StageFailure)
from .frontdoor import UncertainWeighting
from .info import format_info, info
from .ops import reference_transfer, transfer
from .pipe import Pipe
from .compat import GPipe  # after .pipe: GPipe is a front over Pipe
from .runtime.labels import profile
from .schedule import Action, ActionKind, Schedule, ScheduleError, get_schedule

__version__ = "0.1.0"

__all__ = [
    "Action", "ActionKind", "Diagnosis", "DistributedPipe", "FastpipeNativeWarning", "GPipe",
    "LossFunctionError", "Pipe", "PipelineAborted", "PipelineError", "PipelineTimeout",
    "ProcessGroupError", "Schedule", "ScheduleError", "StageFailure", "UncertainWeighting",
    "amp", "balance",
    "batchnorm", "distributed", "doctor", "format_info", "get_schedule", "info", "init_mesh",
    "is_checkpointing", "is_recomputing", "memory", "microbatch", "models", "nn", "ops",
    "profile", "reference_transfer", "schedule", "schedules", "skip", "tied", "tracing",
    "transfer",
]
