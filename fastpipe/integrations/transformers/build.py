"""The pipe a ``PipelineTrainer`` trains: a ``Pipe`` in one process, a ``DistributedPipe`` on
every process of a ``torchrun`` or ``accelerate launch`` job, traced on an example batch."""
from __future__ import annotations

from typing import Any, Mapping, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from ...distributed import DistributedPipe, init_mesh
from ...frontdoor import FrontDoor
from ...pipe import Pipe
from .arguments import PipelineArguments
from .data import Replicas


def world_size() -> int:
    """The processes of the job (1 without ``torch.distributed``)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def build(model: nn.Module, settings: PipelineArguments, example: Any,
          device: torch.device) -> Tuple[FrontDoor, Replicas]:
    """The pipe of ``model`` (``example``: the batch it is traced on) and where this process
    is in it."""
    options = settings.front_door_options()
    world = world_size()
    pipeline_ranks = settings.pipeline_ranks(world)
    example = pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t,
                              example)
    if world == 1:
        pipe = Pipe(model, devices=settings.devices, example_inputs=example, **options)
        return pipe, Replicas(timeout=settings.timeout)
    mesh = init_mesh(pipeline=pipeline_ranks, data=settings.data_parallel,
                     device_type=device.type, timeout=settings.timeout)
    pipe = DistributedPipe(model, mesh=mesh, device=device, example_inputs=example, **options)
    ranks = dist.get_process_group_ranks(mesh.group("pipeline"))
    return pipe, Replicas(replicas=mesh.replicas, replica=mesh.replica,
                          pipeline_ranks=pipeline_ranks, data_group=mesh.group("data"),
                          pipeline_group=mesh.group("pipeline"),
                          last_stage_rank=ranks[_last_stage(pipe)],
                          timeout=settings.timeout, board=pipe._driver.board)


def _last_stage(pipe: FrontDoor) -> int:
    """The physical stage (pipeline rank) holding the model's last layers."""
    last = len(pipe.balance) - 1
    return next(s for s, held in enumerate(pipe.plan().placement) if last in held)


def example_batch(features: Sequence[Any], collator: Any, columns: Any) -> Any:
    """The collated example batch, keeping the columns the model takes (``columns``; all when
    ``None``), as the ``Trainer``'s loaders collate."""
    if not features:
        raise ValueError("the dataset is empty: the pipe is traced on an example batch; give "
                         "PipelineArguments(example_inputs=...) or a non-empty dataset")
    if columns is not None and isinstance(features[0], Mapping):
        features = [{k: v for k, v in f.items() if k in columns} for f in features]
    batch = collator(features)
    return dict(batch) if isinstance(batch, Mapping) else batch
