"""Tensor parallelism inside pipeline stages, with PyTorch's DTensor (``parallelize_module``).

A plan is what ``torch.distributed.tensor.parallel.parallelize_module`` takes: a dict from
submodule names of the plain model (``'3.mlp.0'``, or patterns such as ``'*.mlp.0'``, matched one
dotted part at a time with ``fnmatch`` as ``parallelize_module`` does) to a ``ParallelStyle``
(``ColwiseParallel()``, ``RowwiseParallel()``, ``SequenceParallel()``, ...), or a function
``(stage_module, tp_mesh) -> None`` that parallelizes one stage itself. Each stage applies the
entries that name its own submodules; every name must exist somewhere in the model, and the
dimension a style shards must divide by the tensor-parallel size; both are checked before any
work (:func:`check_plan`).

Stage boundaries: with the default styles (``use_local_output=True``) a stage's output is a plain
tensor, replicated across the tensor-parallel group after a ``RowwiseParallel`` layer, or this
rank's shard after a ``ColwiseParallel`` one. The pipeline group of a rank joins the ranks with
its tensor coordinate, so each tensor-parallel rank exchanges messages with the same
tensor-parallel rank of the neighbouring stages; a replicated output crosses the boundary once
per group, in slices (``fastpipe.parallel.boundary``), a sharded one as each rank's shard.
"""
from __future__ import annotations

import difflib
from fnmatch import fnmatch
from typing import Any, Callable, Dict, List, Optional, Union

from torch import nn

Plan = Union[Dict[str, Any], Callable[[nn.Module, Any], None]]


def matches(pattern: str, name: str) -> bool:
    """Whether a plan key names a submodule (dotted parts matched one by one with fnmatch)."""
    atoms, parts = pattern.split("."), name.split(".")
    return len(atoms) == len(parts) and all(fnmatch(p, a) for a, p in zip(atoms, parts))


def check_plan(plan: Optional[Plan], module: Any, tensor: int) -> None:
    """Raise, before any work, for a plan that is not a dict of styles or a function, names a
    submodule the model lacks, or shards a dimension ``tensor`` does not divide. ``module``: the
    plain model (an ``nn.Sequential``, possibly on the meta device) or layer factories (whose
    names are checked when each rank builds its layers, by :func:`apply`)."""
    if plan is None:
        return
    if callable(plan) and not isinstance(plan, dict):
        return
    if not isinstance(plan, dict) or not plan:
        raise TypeError(f"tensor_parallel must be a non-empty dict of submodule name -> "
                        f"ParallelStyle (ColwiseParallel(), RowwiseParallel(), ...) or a function "
                        f"(stage_module, tp_mesh) -> None, got {type(plan).__name__}")
    from torch.distributed.tensor.parallel import ParallelStyle
    for key, style in plan.items():
        if not isinstance(key, str) or not isinstance(style, ParallelStyle):
            raise TypeError(f"tensor_parallel[{key!r}] = {style!r}: give submodule names (str) "
                            f"mapped to ParallelStyle objects such as ColwiseParallel()")
    if not isinstance(module, nn.Module):
        return
    modules = dict(module.named_modules())
    for key, style in plan.items():
        found = [name for name in modules if name and matches(key, name)]
        if not found:
            close = difflib.get_close_matches(key, list(modules), n=3)
            hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
            raise ValueError(f"tensor_parallel names {key!r}, which is not a submodule of the "
                             f"model{hint}; use the plain model's names, as in "
                             f"model.named_modules()")
        for name in found:
            check_width(name, modules[name], style, tensor)


def check_width(name: str, module: nn.Module, style: Any, tensor: int) -> None:
    """The dimension ``style`` shards must divide by ``tensor`` (DTensor would shard unevenly,
    which ``ColwiseParallel`` and ``RowwiseParallel`` layers cannot compute with)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    if isinstance(module, nn.Linear):
        widths = {ColwiseParallel: ("out_features", module.out_features),
                  RowwiseParallel: ("in_features", module.in_features)}
    elif isinstance(module, nn.Embedding):
        widths = {ColwiseParallel: ("embedding_dim", module.embedding_dim),
                  RowwiseParallel: ("num_embeddings", module.num_embeddings)}
    else:
        return
    for kind, (what, width) in widths.items():
        if type(style) is kind and width % tensor:
            raise ValueError(f"tensor_parallel[{name!r}] = {kind.__name__}() shards "
                             f"{what}={width} across tensor={tensor} ranks, which does not "
                             f"divide it; choose a tensor size that divides {width} or leave "
                             f"{name!r} out of the plan")


def apply(plan: Plan, stage_module: nn.Module, tp_mesh: Any) -> List[str]:
    """Parallelize one stage (an ``nn.Sequential`` whose submodules have their plain names) in
    place; the plan keys it applied (a function plan: ``['<function>']``)."""
    if callable(plan) and not isinstance(plan, dict):
        plan(stage_module, tp_mesh)
        return ["<function>"]
    from torch.distributed.tensor.parallel import parallelize_module
    modules = dict(stage_module.named_modules())
    tensor = tp_mesh.size()
    mine = {}
    for key, style in plan.items():
        found = [name for name in modules if name and matches(key, name)]
        for name in found:  # layer factories: first seen here
            check_width(name, modules[name], style, tensor)
        if found:
            mine[key] = style
    if mine:
        parallelize_module(stage_module, tp_mesh, mine)
    return sorted(mine)


def parameters_of(plan: Optional[Plan], module: nn.Module) -> List[str]:
    """Names of the parameters the modules a dict plan names own (for the tied-weight check)."""
    if not isinstance(plan, dict):
        return []
    names = []
    for name, sub in module.named_modules():
        if name and any(matches(key, name) for key in plan):
            names += [f"{name}.{p}" for p, _ in sub.named_parameters()]
    return names
