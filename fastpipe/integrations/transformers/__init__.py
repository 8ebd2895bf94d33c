"""Hugging Face's ``Trainer`` (and TRL's ``SFTTrainer``) training a model as a pipe.

``PipelineTrainer`` is the ``Trainer`` with a ``pipeline=PipelineArguments(...)`` argument;
``PipelineTrainerMixin`` makes any ``Trainer`` subclass pipelined (put it first in the bases:
``class PipelineSFTTrainer(PipelineTrainerMixin, SFTTrainer)``). The same script runs in one
process (a ``Pipe`` over ``devices``) and under ``torchrun`` or ``accelerate launch`` (a
``DistributedPipe`` per process, ``data_parallel`` replicas). A ``Trainer`` option whose
meaning the pipe cannot keep raises ``UnsupportedTrainerOption`` at construction.

Needs ``pip install 'fastpipe[transformers]'`` (``[trl]`` for ``SFTTrainer``).
"""
from .. import require

require("transformers", "transformers")
require("accelerate", "transformers")

from .arguments import PipelineArguments  # noqa: E402
from .options import UnsupportedTrainerOption  # noqa: E402
from .trainer import PIPELINE_STATE, PipelineTrainer, PipelineTrainerMixin  # noqa: E402

__all__ = ["PIPELINE_STATE", "PipelineArguments", "PipelineTrainer", "PipelineTrainerMixin",
           "UnsupportedTrainerOption"]
