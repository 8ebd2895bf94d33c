"""Where ``PipelineStrategy``'s processes and stages run: Lightning's launch settings checked
against the pipeline's layout, the ranks' devices, the process group and the pipeline's groups.

With ``stage_devices`` every stage runs in this one process (``Trainer(devices=1)``). Else one
process per rank, started by torchrun or a cluster's launcher that starts them all (Lightning's
own launcher is not used), as many as ``Trainer(devices=N, num_nodes=M)`` says; rank ``r`` is a
stage of replica ``r % data_parallel_size`` (``fastpipe.init_mesh``'s order).
"""
from __future__ import annotations

import datetime
import os
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from ...distributed import init_mesh, init_process_group
from .options import StrategyOptions


class Launch:
    """``PipelineStrategy``'s ranks, devices and groups (mixed into the strategy, a Lightning
    ``ParallelStrategy``)."""

    _options: StrategyOptions
    _num_nodes: int
    _backend: Optional[str]
    _pg_timeout: datetime.timedelta
    _mesh: Any
    _pipeline_group: Any
    _data_group: Any

    @property
    def root_device(self) -> torch.device:
        if self._options.in_process:
            return torch.device((self._options.stage_devices or ("cpu",))[0])
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        """Lightning gives a distributed run's data loaders a ``DistributedSampler``: here one
        per replica, the same on every rank of a pipeline."""
        return not self._options.in_process

    @property
    def distributed_sampler_kwargs(self) -> Dict[str, int]:
        replicas = self._options.data_parallel_size
        return {"num_replicas": replicas, "rank": self.global_rank % replicas}

    def set_world_ranks(self) -> None:
        """Lightning's launch settings (at ``Trainer(...)``): the ranks, checked against the
        pipeline's layout and the launcher."""
        # ParallelStrategy's private `_layer_sync`, which the Trainer sets for
        # sync_batchnorm=True (no public hook says so; tested on the installed Lightning)
        if self._layer_sync is not None:
            raise ValueError("Trainer(sync_batchnorm=True) is not supported by "
                             "PipelineStrategy; leave it False")
        world = self.num_nodes * self.num_processes
        env = self.cluster_environment
        if env is not None:
            env.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            env.set_world_size(world)
        rank_zero_only.rank = self.global_rank
        if self._options.in_process and world != 1:
            raise ValueError(f"PipelineStrategy(stage_devices=...) runs every stage in one "
                             f"process, but Trainer(devices=..., num_nodes=...) asks for "
                             f"{world}; use Trainer(devices=1)")
        if not self._options.in_process:
            self._check_launch(world)

    def _check_launch(self, world: int) -> None:
        replicas = self._options.data_parallel_size
        if world % replicas:
            raise ValueError(f"data_parallel_size={replicas} does not divide the "
                             f"{world} processes of Trainer(devices=..., num_nodes=...)")
        env = self.cluster_environment
        if world > 1 and (env is None or not env.creates_processes_externally):
            raise RuntimeError(f"PipelineStrategy runs one process per rank, started by "
                               f"torchrun (or another launcher that starts them all): run "
                               f"`torchrun --nproc_per_node={self.num_processes} script.py` "
                               f"with Trainer(devices={self.num_processes}, "
                               f"num_nodes={self.num_nodes})")
        if env is not None and env.creates_processes_externally:
            env.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)

    def setup_environment(self) -> None:
        super().setup_environment()  # type: ignore[misc]
        if not self._options.in_process:
            self._connect()

    def _connect(self) -> None:
        """The process group (unless the script made one) and the pipeline's groups."""
        if not dist.is_initialized():
            env = self.cluster_environment
            assert env is not None
            os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = \
                env.main_address, str(env.main_port)
            backend = self._backend or ("gloo" if self.root_device.type == "cpu" else None)
            init_process_group(backend, timeout=self._pg_timeout, rank=self.global_rank,
                               world_size=self.world_size)
        replicas = self._options.data_parallel_size
        if replicas == 1:
            self._mesh, self._pipeline_group, self._data_group = None, dist.group.WORLD, None
            return
        self._mesh = init_mesh(pipeline=dist.get_world_size() // replicas, data=replicas,
                               device_type=self.root_device.type,
                               timeout=self._options.pipe_options.get("timeout", 300.0))
        self._pipeline_group = self._mesh.group("pipeline")
        self._data_group = self._mesh.group("data")
