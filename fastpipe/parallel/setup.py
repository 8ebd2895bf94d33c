"""The checked 3-D layout of one ``DistributedPipe``: which groups, which plan, which engine.

:func:`resolve` checks every argument before any work (a wrong one raises a typed error naming
it and the fix, with the model untouched) and returns a :class:`Parallel` that the front door
applies to each stage it builds (:meth:`Parallel.apply`) and hands to the pipeline driver
(:meth:`Parallel.hooks`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import torch.distributed as dist
from torch import nn

from . import boundary, fsdp, tensor
from .mesh import Mesh

MODES = ("replicate", "fsdp")


@dataclass
class Parallel:
    """What a pipe's stages are: their pipeline group, their data-parallel reduction, their
    tensor-parallel plan."""

    pipeline_group: Any
    data_group: Optional[Any]  # the ranks on other batch slices: the loss is averaged over them
    replicate: bool  # gradients all-reduced over data_group by the driver (else FSDP or none)
    mesh: Optional[Mesh] = None
    plan: Optional[tensor.Plan] = None
    fsdp_mesh: Optional[Any] = None
    roots: Dict[int, nn.Module] = field(default_factory=dict)
    boundaries: Dict[int, boundary.Boundary] = field(default_factory=dict)
    sharded_stages: Optional[fsdp.ShardedStages] = None

    @property
    def sharded(self) -> bool:
        return self.fsdp_mesh is not None

    @property
    def active(self) -> bool:
        return self.plan is not None or self.sharded

    def apply(self, index: int, stage_module: nn.Module) -> nn.Module:
        """Tensor parallelism, then FSDP, on one of this rank's stages (in place)."""
        if self.plan is not None:
            assert self.mesh is not None
            tensor.apply(self.plan, stage_module, self.mesh["tensor"])
        if self.sharded:
            fsdp.shard(stage_module, self.fsdp_mesh)
            self.roots[index] = stage_module
        return stage_module

    def wire(self, stages: Sequence[Any], owner: Sequence[int], rank: int,
             timeout: float) -> None:
        """Send-once stage boundaries (``fastpipe.parallel.boundary``) for this rank's stages,
        when stages are tensor-parallel: a stage scatters its output when the next stage is on
        another rank; every stage gathers a scattered input. Call before wiring skips."""
        if self.plan is None or self.mesh is None or self.mesh.size("tensor") == 1:
            return
        group = self.mesh.group("tensor")
        for k, stage in enumerate(stages):
            if owner[k] != rank:
                continue
            sends = k + 1 < len(owner) and owner[k + 1] != rank
            stage.call = boundary.Boundary(stage.call, group, sends, timeout)
            self.boundaries[k] = stage.call

    def closing(self) -> Dict[str, Any]:
        """Where a step's reports are gathered (``PerRankDriver``'s ``closing_group`` and
        ``coordinates``): over the whole mesh when gradients are sharded (tensor parallel,
        FSDP), so the shards' norms add up, each replicated copy counted on the first replica
        of the mesh only; else over the pipeline group (every data-parallel replica then holds
        the same averaged gradients and computes the same norm)."""
        if not self.active or self.mesh is None:
            return {}
        return {"closing_group": dist.group.WORLD, "coordinates": dict(self.mesh.coordinates)}

    def report(self) -> Dict[int, Dict[str, Any]]:
        """Per local stage: whether its output was found replicated (and so sent in slices),
        and the floats its forward messages held, against the whole outputs'."""
        return {k: b.report() for k, b in self.boundaries.items()}

    def hooks(self) -> Optional[fsdp.ShardedStages]:
        """The driver's per-step hooks (FSDP's deferred reduction), if any; also kept as
        ``self.sharded_stages`` (``pipe.parallel.sharded_stages.set_keep_gathered(False)``
        switches to FSDP2's own per-micro-batch policy)."""
        if self.sharded and self.sharded_stages is None:
            self.sharded_stages = fsdp.ShardedStages(self.roots)
        return self.sharded_stages


def resolve(module: Any, *, mesh: Optional[Any], process_group: Optional[Any],
            data_parallel_group: Optional[Any], tensor_parallel: Optional[tensor.Plan],
            data_parallel: str, schedule: str, traced: bool, tied: Sequence[Any]) -> Parallel:
    """The checked layout (raises before any work)."""
    if data_parallel not in MODES:
        raise ValueError(f"data_parallel={data_parallel!r}: choose 'replicate' (all-reduce "
                         f"the gradients, today's default) or 'fsdp' (FSDP2 shards)")
    if mesh is None:
        return _without_mesh(process_group, data_parallel_group, tensor_parallel, data_parallel)
    _check_mesh(mesh, process_group, data_parallel_group, tensor_parallel, data_parallel)
    sharded = data_parallel == "fsdp"
    _check_engines(module, sharded, tensor_parallel, schedule, traced, tied)
    tensor.check_plan(tensor_parallel, module, mesh.size("tensor"))
    if tensor_parallel is not None and isinstance(module, nn.Module):
        _no_tied_in_plan(module, tensor_parallel, tied)
    data_group = mesh.batch_group if mesh.replicas > 1 else None
    fsdp_mesh = None
    if sharded:
        dims = tuple(d for d in ("data", "shard") if mesh.size(d) > 1) or ("shard",)
        fsdp_mesh = mesh[dims if len(dims) > 1 else dims[0]]
    return Parallel(mesh.group("pipeline"), data_group, replicate=not sharded and
                    data_group is not None, mesh=mesh, plan=tensor_parallel, fsdp_mesh=fsdp_mesh)


def _without_mesh(process_group: Optional[Any], data_parallel_group: Optional[Any],
                  tensor_parallel: Optional[tensor.Plan], data_parallel: str) -> Parallel:
    """The layout of a pipe given its groups (or the whole world): no tensor parallelism, no
    FSDP, which need a mesh."""
    if tensor_parallel is not None:
        raise ValueError("tensor_parallel=... needs mesh=fastpipe.init_mesh(pipeline=P, "
                         "tensor=T, ...): the mesh says which ranks form a tensor-parallel "
                         "group")
    if data_parallel == "fsdp":
        raise ValueError("data_parallel='fsdp' needs mesh=fastpipe.init_mesh(pipeline=P, "
                         "shard=S) (or data=D): FSDP shards over a mesh dimension")
    group = process_group if process_group is not None else dist.group.WORLD
    return Parallel(group, data_parallel_group, data_parallel_group is not None)


def _check_mesh(mesh: Any, process_group: Optional[Any], data_parallel_group: Optional[Any],
                tensor_parallel: Optional[tensor.Plan], data_parallel: str) -> None:
    """A mesh from ``init_mesh``, of the whole world, alone, with the plan and mode its
    dimensions call for."""
    if process_group is not None or data_parallel_group is not None:
        raise ValueError("mesh=... gives the pipeline and data-parallel groups: pass either "
                         "mesh= or process_group=/data_parallel_group=, not both")
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must come from fastpipe.init_mesh(pipeline=P, data=D, tensor=T, "
                        f"shard=S), got {type(mesh).__name__}")
    world = dist.get_world_size()
    if mesh.size() != world:
        raise ValueError(f"mesh has {mesh.size()} ranks ({mesh.shape}) but the world has "
                         f"{world}; build it with init_mesh so that pipeline x data x shard x "
                         f"tensor = {world}")
    t = mesh.size("tensor")
    if t > 1 and tensor_parallel is None:
        raise ValueError(f"the mesh has tensor={t} but tensor_parallel is None: give a plan "
                         f"(submodule name -> ColwiseParallel() / RowwiseParallel()), or build "
                         f"the mesh with tensor=1")
    if mesh.size("shard") > 1 and data_parallel != "fsdp":
        raise ValueError(f"the mesh has shard={mesh.size('shard')}: pass data_parallel='fsdp' "
                         f"(or build the mesh with data=... for replicated data parallelism)")


def _check_engines(module: Any, sharded: bool, tensor_parallel: Optional[tensor.Plan],
                   schedule: str, traced: bool, tied: Sequence[Any]) -> None:
    """What tensor parallelism and FSDP cannot run with: a traced model, PipeDream, ties."""
    if (sharded or tensor_parallel is not None) and traced:
        raise NotImplementedError("tensor_parallel= and data_parallel='fsdp' need the model as "
                                  "an nn.Sequential (or layer factories); a module traced at "
                                  "split_points is not supported with them yet")
    if sharded and schedule == "pipedream":
        raise NotImplementedError("data_parallel='fsdp' with schedule='pipedream' cannot work: "
                                  "PipeDream steps the optimizer after every micro-batch, with "
                                  "weight versions FSDP does not keep; use a flushed schedule "
                                  "('1f1b', 'zb-h1', ...) or data_parallel='replicate'")
    if sharded and (tied or _shares_parameters(module)):
        raise NotImplementedError("data_parallel='fsdp' with tied (shared) parameters is not "
                                  "supported yet (FSDP would shard each use's copy separately); "
                                  "untie them or use data_parallel='replicate'")


def _shares_parameters(module: Any) -> bool:
    if not isinstance(module, nn.Module):
        return False
    seen = [id(p) for _, p in module.named_parameters(remove_duplicate=False)]
    return len(seen) != len(set(seen))


def _no_tied_in_plan(module: nn.Module, plan: tensor.Plan, tied: Sequence[Any]) -> None:
    """A parameter shared by several layers (or named in ``tied``) cannot be sharded by a plan:
    ``parallelize_module`` would give one of its uses a new, sharded copy."""
    counts: Dict[int, List[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        counts.setdefault(id(p), []).append(name)
    shared = {n for names in counts.values() if len(names) > 1 for n in names}
    shared |= {str(n) for group in tied for n in group}
    wrong = sorted(shared & set(tensor.parameters_of(plan, module)))
    if wrong:
        raise NotImplementedError(f"tensor_parallel shards {wrong[:3]}, which is tied to another "
                                  f"parameter; leave the tied layers out of the plan (they stay "
                                  f"replicated across the tensor-parallel group)")
