"""fastpipe: exact pipeline-parallel training for PyTorch.

``Pipe`` splits a model (an ``nn.Sequential``, or any module it traces) into stages and runs
micro-batches through them on a chosen schedule, giving the gradients of the unsplit model;
``DistributedPipe`` does the same with one process per stage under ``torchrun``; ``GPipe`` is
torchgpipe's front door over ``Pipe``.
"""
import torch  # noqa: F401  (loads libtorch before the native library needs it)

from . import balance, distributed, memory, microbatch, nn, ops, outputs, schedule, skip, tracing
from . import checkpoint
from ._native import FastpipeNativeWarning
from .apps import models
from .apps.info import format_info, info
from .compat import GPipe
from .diagnosis.report import Diagnosis, doctor
from .distributed import DistributedPipe, init_mesh
from .errors import (LossFunctionError, NonFiniteError, PipelineAborted, PipelineError,
                     PipelineTimeout, ProcessGroupError, StageFailure)
from .frontdoor import UncertainWeighting
from .model_loss import ModelLoss, use_model_loss
from .ops import reference_transfer, transfer
from .outputs import OutputReductionError
from .pipe import Pipe
from .policies import amp, batchnorm, tied
from .policies.checkpoint import is_checkpointing, is_recomputing
from .runtime.observe.profiler_ranges import profile
from .schedule import Action, ActionKind, Schedule, ScheduleError, get_schedule
from .version import __version__

__all__ = [
    "Action", "ActionKind", "Diagnosis", "DistributedPipe", "FastpipeNativeWarning", "GPipe",
    "LossFunctionError", "ModelLoss", "NonFiniteError", "OutputReductionError", "Pipe",
    "PipelineAborted", "PipelineError", "PipelineTimeout", "ProcessGroupError", "Schedule",
    "ScheduleError", "StageFailure", "UncertainWeighting", "__version__", "amp", "balance",
    "batchnorm", "checkpoint", "distributed", "doctor", "format_info", "get_schedule", "info",
    "init_mesh", "is_checkpointing", "is_recomputing", "memory", "microbatch", "models", "nn",
    "ops", "outputs", "profile", "reference_transfer", "schedule", "skip", "tied", "tracing",
    "transfer", "use_model_loss",
]
