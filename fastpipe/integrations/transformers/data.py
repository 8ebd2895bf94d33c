"""Data across a ``DistributedPipe``'s processes, as DDP's processes would see it.

Under DDP every process is a replica: Accelerate shards each data loader over the processes and
gathers each evaluation batch's outputs from them. With a pipe, the processes of one replica
are its pipeline ranks: they read the same batches (the first stage the inputs, the last the
labels), the replicas read distinct shards, and only the last stage's rank has the outputs.
So the loaders are sharded over the replicas (Accelerate's ``prepare_data_loader``, with the
replica count and index in place of the process count and index), the last stage's outputs
are sent to the other ranks of its pipeline, and the metrics are gathered over the replicas.
Every wait is bounded by the pipe's timeout and names what it waited for.
"""
from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass
from typing import Any, Iterator, List

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from ...runtime.failure.waits import wait_work


@dataclass(frozen=True)
class Replicas:
    """Where this process is: its replica and its pipeline (one process: all trivial)."""

    replicas: int = 1
    replica: int = 0
    pipeline_ranks: int = 1
    data_group: Any = None
    pipeline_group: Any = None
    last_stage_rank: int = 0  # the global rank of this pipeline's last stage
    timeout: float = 300.0
    board: Any = None  # the pipe's failure board, read while waiting

    @property
    def distributed(self) -> bool:
        return self.pipeline_ranks * self.replicas > 1

    # ------------------------------------------------------------------ bounded collectives
    def _wait(self, work: Any, what: str) -> None:
        wait_work(work, self.timeout, f"the other ranks at {what}", self.board)

    def share_from_last_stage(self, value: Any, device: torch.device, what: str) -> Any:
        """``value`` of the last stage's rank on every rank of its pipeline (on ``device``)."""
        if self.pipeline_ranks == 1:
            return value
        mine = dist.get_rank() == self.last_stage_rank
        data = _to_bytes(pytree.tree_map(_to_cpu, value)) if mine else b""
        size = torch.tensor([len(data)], dtype=torch.int64, device=device)
        self._wait(dist.broadcast(size, self.last_stage_rank, group=self.pipeline_group,
                                  async_op=True), what)
        buffer = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
        if mine:
            buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self._wait(dist.broadcast(buffer, self.last_stage_rank, group=self.pipeline_group,
                                  async_op=True), what)
        if mine:
            return value
        shared = _from_bytes(buffer.cpu().numpy().tobytes())
        return pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t,
                               shared)

    def sum_over_replicas(self, value: float, device: torch.device, what: str) -> float:
        """``value`` summed over the replicas (the same on every rank)."""
        if self.replicas == 1:
            return value
        total = torch.tensor([value], dtype=torch.float64, device=device)
        self._wait(dist.all_reduce(total, group=self.data_group, async_op=True), what)
        return float(total.item())

    def gather_over_replicas(self, value: Any, what: str) -> Any:
        """Each tensor of ``value`` concatenated over the replicas along dim 0, in replica
        order, as Accelerate's ``gather`` concatenates over DDP's processes."""
        if self.replicas == 1:
            return value

        def gather(tensor: torch.Tensor) -> torch.Tensor:
            tensor = tensor.contiguous()
            if tensor.dim() == 0:
                tensor = tensor[None]
            parts = [torch.empty_like(tensor) for _ in range(self.replicas)]
            self._wait(dist.all_gather(parts, tensor, group=self.data_group, async_op=True),
                       what)
            return torch.cat(parts)

        return pytree.tree_map(lambda t: gather(t) if isinstance(t, torch.Tensor) else t, value)


def metrics_gatherer(replicas: Replicas, gradient_state: Any) -> Any:
    """The ``Trainer``'s ``gather_function`` for a pipe: Accelerate's ``gather_for_metrics``
    over the replicas (the last batch's padding samples dropped, as ``even_batches`` added
    them)."""

    def gather(value: Any) -> Any:
        data = replicas.gather_over_replicas(value, "the gathering of evaluation outputs")
        remainder = getattr(gradient_state, "remainder", -1)
        if getattr(gradient_state, "end_of_dataloader", False) and remainder > 0:
            data = pytree.tree_map(
                lambda t: t[:remainder] if isinstance(t, torch.Tensor) else t, data)
        return data

    return gather


class ReplicaLoaders:
    """The ``Trainer``'s accelerator, except that the data loaders it prepares are sharded over
    the pipeline's replicas instead of the processes. The ``Trainer`` builds its loaders as it
    always does (sampler, collator, workers) and hands them to ``accelerator.prepare``; only
    the sharding differs."""

    def __init__(self, accelerator: Any, replicas: Replicas) -> None:
        self._accelerator = accelerator
        self._replicas = replicas

    def __getattr__(self, name: str) -> Any:
        return getattr(self._accelerator, name)

    def prepare(self, *objects: Any, **kwargs: Any) -> Any:
        prepared = [self._loader(o) if isinstance(o, torch.utils.data.DataLoader)
                    else self._accelerator.prepare(o, **kwargs) for o in objects]
        return prepared[0] if len(prepared) == 1 else tuple(prepared)

    def _loader(self, loader: torch.utils.data.DataLoader) -> Any:
        from accelerate.data_loader import prepare_data_loader
        acc = self._accelerator
        return prepare_data_loader(
            loader, acc.device, num_processes=self._replicas.replicas,
            process_index=self._replicas.replica, split_batches=acc.split_batches,
            put_on_device=acc.device_placement, rng_types=acc.rng_types.copy(),
            dispatch_batches=acc.dispatch_batches, even_batches=acc.even_batches,
            use_seedable_sampler=acc.use_seedable_sampler,
            data_seed=acc.dataloader_config.data_seed, non_blocking=acc.non_blocking,
            use_stateful_dataloader=acc.use_stateful_dataloader)


@contextlib.contextmanager
def replica_loaders(trainer: Any, replicas: Replicas) -> Iterator[None]:
    """Inside the block the ``Trainer``'s data loaders are sharded over the replicas."""
    if not replicas.distributed:
        yield
        return
    accelerator = trainer.accelerator
    trainer.accelerator = ReplicaLoaders(accelerator, replicas)
    try:
        yield
    finally:
        trainer.accelerator = accelerator


def _to_cpu(value: Any) -> Any:
    return value.detach().cpu() if isinstance(value, torch.Tensor) else value


def _to_bytes(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _from_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)  # data only: tensors, tuples, ...


def example_features(dataset: Any, count: int) -> List[Any]:
    """The first ``count`` examples of ``dataset`` (no sampler, no random numbers drawn)."""
    if isinstance(dataset, torch.utils.data.IterableDataset):
        found: List[Any] = []
        for item in dataset:
            found.append(item)
            if len(found) == count:
                break
        return found
    return [dataset[i] for i in range(min(count, len(dataset)))]

