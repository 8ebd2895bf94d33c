"""``PipelineArguments``: how a ``Trainer``'s model is pipelined, beside its ``TrainingArguments``.

The fields are the front doors' own options (``fastpipe.Pipe``, ``fastpipe.DistributedPipe``),
checked by them when the pipe is built. Which front door: one process (``python train.py``, or
``torchrun`` with one process) builds a ``Pipe`` over ``devices``; several processes (``torchrun``
or ``accelerate launch``) build a ``DistributedPipe`` with ``world_size // data_parallel``
pipeline ranks and ``data_parallel`` replicas (``fastpipe.init_mesh``).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Dict, Optional, Sequence, Union


@dataclass
class PipelineArguments:
    """The pipeline of a ``PipelineTrainer``.

    Args:
        split_points: submodule names, each beginning a stage, or ``'auto'`` (the model's
            largest list of repeated blocks cut into one stage per device or rank); see
            *Your model as it is* in the README.
        layout: a Megatron-core layout string (``'E,t*2|t*2,L'``) instead of ``split_points``.
        chunks: micro-batches per batch of the Trainer (``per_device_train_batch_size``).
        schedule: the schedule's name (``'1f1b'``, ``'gpipe'``, ``'interleaved'``, ...).
        checkpoint: the activation checkpointing mode (``'never'``, ``'except_last'``,
            ``'always'``, ``'offload'``, ``'selective'``): the Trainer's own
            ``activation_checkpointing`` is refused, this is its pipelined counterpart.
        virtual_stages: model chunks per device or rank (interleaved and V schedules).
        devices: a ``Pipe``'s devices, one per stage (``['cpu', 'cpu']``, ``['cuda:0',
            'cuda:1']``); not with several processes.
        data_parallel: replicas of the pipeline when several processes run (each reads its
            own shard of the data, as DDP's processes do); the rest of the world are pipeline
            ranks.
        timeout: seconds any wait of the pipe may last before it fails naming the rank, the
            stage, the action and the micro-batch.
        output_reduction: how the model's output leaves combine over micro-batches, for a loss
            fastpipe does not know (``fastpipe.outputs``).
        compile: ``torch.compile`` of each stage (``True`` or options); the Trainer's own
            ``torch_compile`` is refused.
        example_inputs: the batch the model is traced on; by default the first
            ``per_device_train_batch_size`` examples of the train (else eval) dataset, collated
            by the Trainer's data collator, labels included.
    """

    split_points: Any = "auto"
    layout: Optional[str] = None
    chunks: Union[int, str] = 1
    schedule: str = "1f1b"
    checkpoint: str = "except_last"
    virtual_stages: Optional[int] = None
    devices: Optional[Sequence[Any]] = None
    data_parallel: int = 1
    timeout: float = 300.0
    output_reduction: Optional[Dict[str, Any]] = None
    compile: Union[bool, Dict[str, Any]] = False
    example_inputs: Any = None

    @classmethod
    def of(cls, value: Any) -> "PipelineArguments":
        """``PipelineArguments`` from itself or a dict of its fields (checked)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(value) - known)
            if unknown:
                raise TypeError(f"pipeline= has unknown settings {unknown}; the settings are "
                                f"{sorted(known)}")
            return cls(**value)
        raise TypeError(f"pipeline= must be PipelineArguments(...) or a dict of its fields "
                        f"(split_points, chunks, schedule, ...), got {type(value).__name__}")

    def pipeline_ranks(self, world_size: int) -> int:
        """Pipeline ranks of one replica in a world of ``world_size`` processes (checked)."""
        replicas = self.data_parallel
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise ValueError(f"PipelineArguments(data_parallel={replicas!r}): give the number "
                             f"of pipeline replicas, a positive integer")
        if world_size % replicas:
            raise ValueError(f"PipelineArguments(data_parallel={replicas}) does not divide the "
                             f"{world_size} processes: launch a multiple of {replicas} processes "
                             f"or change data_parallel")
        if world_size == 1 and self.devices is None:
            raise ValueError("PipelineArguments(devices=...) is needed in one process: a Pipe "
                             "runs a stage per device (e.g. devices=['cpu', 'cpu'] or "
                             "['cuda:0', 'cuda:1']); with several processes (torchrun) each "
                             "rank is a stage")
        if world_size > 1 and self.devices is not None:
            raise ValueError(f"PipelineArguments(devices={list(self.devices)!r}) is for one "
                             f"process; with {world_size} processes each rank runs its stage "
                             f"on the Trainer's device: leave devices=None")
        return world_size // replicas

    def front_door_options(self) -> Dict[str, Any]:
        """The options both front doors take, as they name them."""
        layout = self.layout is not None
        return dict(chunks=self.chunks, schedule=self.schedule, checkpoint=self.checkpoint,
                    virtual_stages=self.virtual_stages, timeout=self.timeout,
                    split_points=None if layout else self.split_points, layout=self.layout,
                    output_reduction=self.output_reduction, compile=self.compile)
