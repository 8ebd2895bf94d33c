"""The rank grid of 3-D parallelism: ``init_mesh(pipeline=P, data=D, tensor=T, shard=S)``.

Ranks are laid out as Megatron-LM does, pipeline outermost and tensor innermost::

    rank = ((p * D + d) * S + s) * T + t

so the ranks of one tensor-parallel group are adjacent (one node: its traffic, the heaviest,
stays on the node's links), then the data-parallel replicas (replicated ``data`` and sharded
``shard``), and the pipeline stages are the farthest apart (their traffic is point-to-point
activations, the lightest). The grid is a ``torch.distributed.device_mesh.DeviceMesh`` with
named dimensions ``("pipeline", "data", "shard", "tensor")``; :class:`Mesh` wraps it and still
unpacks into ``(pipeline group, data group)`` for code written for the two-group form.
"""
from __future__ import annotations

import datetime
import itertools
from typing import Any, Dict, Iterator, Optional, Tuple

import torch.distributed as dist

DIMS = ("pipeline", "data", "shard", "tensor")


class Mesh:
    """This rank's place in a (pipeline, data, shard, tensor) grid and the groups it belongs to.

    ``mesh.device_mesh`` is the ``DeviceMesh``; ``mesh["tensor"]`` (or any dimension names) its
    sub-mesh; ``mesh.group("pipeline")`` a dimension's process group; ``mesh.size("data")``,
    ``mesh.coordinate("data")`` this rank's extent and index along a dimension;
    ``pp, dp = mesh`` the pipeline group and the (replicated) data-parallel group.
    """

    def __init__(self, device_mesh: Any, batch_group: Any) -> None:
        self.device_mesh = device_mesh
        self._batch_group = batch_group
        self.shape: Dict[str, int] = dict(zip(DIMS, device_mesh.mesh.shape))
        coordinates = device_mesh.get_coordinate()
        assert coordinates is not None, "this rank is not in its own mesh"
        self.coordinates: Dict[str, int] = dict(zip(DIMS, coordinates))

    def __iter__(self) -> Iterator[Any]:
        """``pp, dp = init_mesh(pipeline=P, data=D)``: the two-group form."""
        return iter((self.group("pipeline"), self.group("data")))

    def __getitem__(self, names: Any) -> Any:
        return self.device_mesh[names]

    def group(self, dim: str) -> Any:
        """The process group of the ranks that differ from this one along ``dim`` only."""
        _check_dim(dim)
        return self.device_mesh.get_group(dim)

    def size(self, dim: Optional[str] = None) -> int:
        """The extent of ``dim`` (the number of ranks, without ``dim``)."""
        if dim is None:
            return self.device_mesh.size()
        _check_dim(dim)
        return self.shape[dim]

    def coordinate(self, dim: str) -> int:
        """This rank's index along ``dim`` (its stage, its replica, its shard, its TP index)."""
        _check_dim(dim)
        return self.coordinates[dim]

    @property
    def replicas(self) -> int:
        """How many slices of the global batch are processed side by side (data x shard)."""
        return self.shape["data"] * self.shape["shard"]

    @property
    def replica(self) -> int:
        """Which slice of the global batch this rank's pipeline reads (0 .. replicas - 1)."""
        return self.coordinates["data"] * self.shape["shard"] + self.coordinates["shard"]

    @property
    def batch_group(self) -> Any:
        """The ranks holding the same stage and TP index on other batch slices (data x shard):
        the loss is averaged over them."""
        return self._batch_group

    def __repr__(self) -> str:
        sizes = ", ".join(f"{d}={self.shape[d]}" for d in DIMS)
        return f"Mesh({sizes}; rank {dist.get_rank()} at {self.coordinates})"


def _check_dim(dim: str) -> None:
    if dim not in DIMS:
        raise KeyError(f"unknown mesh dimension {dim!r}; the dimensions are {DIMS}")


def init_mesh(pipeline: int, data: int = 1, tensor: int = 1, shard: int = 1,
              device_type: str = "cpu", timeout: Optional[float] = 300.0) -> Mesh:
    """The (pipeline, data, shard, tensor) grid over the whole world; see the module docstring
    for which rank sits where. ``timeout``: seconds any collective of the grid's gloo groups
    may wait (DTensor's and FSDP's collectives block; a rank whose tensor-parallel peer failed
    stops after this long at most); ``None``: the process group's default."""
    sizes = {"pipeline": pipeline, "data": data, "shard": shard, "tensor": tensor}
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"init_mesh({name}={value!r}): give a positive whole number")
    world = dist.get_world_size()
    if pipeline * data * shard * tensor != world:
        raise ValueError(f"init_mesh: pipeline={pipeline} x data={data} x shard={shard} x "
                         f"tensor={tensor} = {pipeline * data * shard * tensor} ranks, but the "
                         f"world has {world}; make the product equal the world size")
    from torch.distributed.device_mesh import init_device_mesh
    override = None
    if timeout is not None and device_type == "cpu":
        override = {d: _options(timeout) for d in DIMS}
    device_mesh = init_device_mesh(device_type, (pipeline, data, shard, tensor),
                                   mesh_dim_names=DIMS, backend_override=override)
    return Mesh(device_mesh, _batch_group(device_mesh, pipeline, data, shard, tensor, timeout,
                                          device_type))


def _options(timeout: float) -> Tuple[str, Any]:
    options = dist.ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=timeout)
    return ("gloo", options)


def _batch_group(device_mesh: Any, pipeline: int, data: int, shard: int, tensor: int,
                 timeout: Optional[float], device_type: str) -> Any:
    """The data x shard group of this rank: one dimension's group when the other is 1, else a
    new group per (pipeline, tensor) pair (every rank creates them all, in the same order)."""
    if shard == 1:
        return device_mesh.get_group("data")
    if data == 1:
        return device_mesh.get_group("shard")
    grid = device_mesh.mesh  # (pipeline, data, shard, tensor) -> rank
    mine = None
    kwargs = ({} if timeout is None or device_type != "cpu"
              else {"timeout": datetime.timedelta(seconds=timeout)})
    for p, t in itertools.product(range(pipeline), range(tensor)):
        ranks = grid[p, :, :, t].flatten().tolist()
        group = dist.new_group(ranks, **kwargs)
        if dist.get_rank() in ranks:
            mine = group
    return mine
