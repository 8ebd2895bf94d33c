"""The whole model's gradient norm when its parameters are spread over stages, ranks and shards.

``torch.nn.utils.clip_grad_norm_`` sees only the gradients it is given: on a rank of a
``DistributedPipe`` that is one stage's share, so each rank would clip by its own norm. Here each
process computes its *terms* (the sum of ``|g|^p`` over the gradients it counts, or their largest
``|g|`` for the inf-norm), the terms of every process are combined in rank order (the same total
on every rank, bit for bit), and the gradients are then scaled as torch scales them,
``g * min(max_norm / (total + 1e-6), 1)``.

Every element of the model's gradient is counted exactly once: a parameter tied across ranks on
its home rank only, a data-parallel replica's copy on the first replica only, a tensor-parallel
or FSDP shard (a ``DTensor``) on every rank that holds a shard of it and, along the mesh
dimensions that replicate it, on the first rank only (:func:`counted`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from . import readout

NONFINITE_MODES = ("raise", "skip", "ignore")
REPLICA_DIMS = ("data", "shard", "tensor")  # the mesh dimensions besides the pipeline's


def check_max_norm(max_norm: object, argument: str = "max_norm") -> float:
    """A clipping threshold: a positive, finite number."""
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) \
            or not math.isfinite(max_norm) or max_norm <= 0:
        raise ValueError(f"{argument} must be a positive number (the largest gradient norm "
                         f"allowed), got {max_norm!r}")
    return float(max_norm)


def check_norm_type(norm_type: object) -> float:
    """A p-norm order: a positive number or ``inf``."""
    if isinstance(norm_type, str) and norm_type.lower() == "inf":
        return math.inf
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) \
            or math.isnan(norm_type) or norm_type <= 0:
        raise ValueError(f"norm_type must be a positive number or inf (the order of the p-norm), "
                         f"got {norm_type!r}")
    return float(norm_type)


def check_nonfinite(mode: object) -> str:
    """``train_step(nonfinite=...)``: what a non-finite loss or gradient does to the step."""
    if mode not in NONFINITE_MODES:
        raise ValueError(f"nonfinite={mode!r}; use 'raise' (stop with fastpipe.NonFiniteError "
                         f"before the optimizer step), 'skip' (skip the optimizer step on every "
                         f"rank) or 'ignore'")
    return str(mode)


@dataclass(frozen=True)
class Counted:
    """One parameter this process counts in the norm: its plain-model name, the virtual stage
    that holds it (``None`` if unknown), and the parameter."""

    name: str
    stage: Optional[int]
    parameter: nn.Parameter


def counted(named: Iterable[Tuple[str, nn.Parameter]], stage_of: Dict[int, int],
            skip: Iterable[nn.Parameter] = (),
            coordinates: Optional[Dict[str, int]] = None) -> List[Counted]:
    """The parameters whose gradients this process counts, in order, each once.

    ``stage_of``: parameter id -> virtual stage. ``skip``: copies another process counts (tied
    weights away from their home). ``coordinates``: this rank's index along the mesh's data,
    shard and tensor dimensions when the norm is combined over the whole mesh (``None`` when it
    is combined over the pipeline only, each replica then computing the same total itself)."""
    skipped = {id(p) for p in skip}
    seen: set = set()
    out = []
    for name, p in named:
        if id(p) in seen or id(p) in skipped or not p.requires_grad:
            continue
        seen.add(id(p))
        if coordinates is not None and not _first_holder(p, coordinates):
            continue
        out.append(Counted(name, stage_of.get(id(p)), p))
    return out


def _first_holder(p: torch.Tensor, coordinates: Dict[str, int]) -> bool:
    """Whether this rank counts ``p``'s gradient when every rank of the mesh adds its terms:
    along each mesh dimension that shards ``p`` every rank counts its shard; along the others
    (replicated, or not in ``p``'s mesh) only the first rank does."""
    sharded = set()
    mesh = getattr(p, "device_mesh", None)
    if mesh is not None:
        names = mesh.mesh_dim_names or ()
        for dim, placement in zip(names, p.placements):
            if placement.is_shard():
                sharded.add(dim)
    return all(coordinates.get(dim, 0) == 0 for dim in REPLICA_DIMS if dim not in sharded)


def local_gradient(grad: torch.Tensor) -> torch.Tensor:
    """The part of a gradient stored here (a ``DTensor``'s local shard)."""
    to_local = getattr(grad, "to_local", None)
    return to_local() if to_local is not None else grad


@torch.no_grad()
def terms(params: Sequence[Counted], norm_type: float
          ) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """This process's terms, unread, as 0-dim float64 tensors on the first gradient's device:
    ``sum |g|^p`` (or ``max |g|`` for ``inf``) over the counted gradients, from per-tensor
    norms computed with ``torch._foreach_norm`` (one pass over the gradients, grouped by device
    and dtype), and the index in ``params`` of the first gradient that is not finite (-1).
    ``None`` when no counted parameter has a gradient."""
    grads: List[torch.Tensor] = []
    index: List[int] = []
    for i, c in enumerate(params):
        if c.parameter.grad is not None:
            grads.append(local_gradient(c.parameter.grad))
            index.append(i)
    if not grads:
        return None
    norms = _tensor_norms(grads, norm_type)
    first = readout.first_marked(~torch.isfinite(norms), index)
    value = norms.max() if math.isinf(norm_type) else norms.pow(norm_type).sum()
    return value, first


def _tensor_norms(grads: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
    """Each gradient's p-norm (in its own dtype, as torch computes it), as float64 on the
    first gradient's device (unread)."""
    groups: Dict[Tuple[torch.device, torch.dtype], List[int]] = {}
    for i, g in enumerate(grads):
        groups.setdefault((g.device, g.dtype), []).append(i)
    home = grads[0].device
    out = torch.empty(len(grads), dtype=torch.float64, device=home)
    for (device, _), members in groups.items():
        tensors = [grads[i] for i in members]
        if device.type in ("cpu", "cuda"):
            norms = torch._foreach_norm(tensors, norm_type)
        else:
            norms = [torch.linalg.vector_norm(g, norm_type) for g in tensors]
        values = torch.stack([n.to(torch.float64) for n in norms]).to(home)
        out[torch.tensor(members).to(home)] = values
    return out


def total(values: Sequence[float], norm_type: float) -> float:
    """The norm from every process's terms, combined in the given (rank) order."""
    if math.isinf(norm_type):
        return max(values) if values else 0.0
    summed = math.fsum(values)
    if not math.isfinite(summed):
        return summed
    return summed ** (1.0 / norm_type)


def coefficient(max_norm: float, total_norm: float,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """torch's clip coefficient, ``min(max_norm / (total_norm + 1e-6), 1)``, in the dtype of
    the gradients (torch computes it in the total norm's, theirs); NaN for a NaN norm, as
    torch gives."""
    value = max_norm / (torch.tensor(total_norm, dtype=dtype) + 1e-6)
    return torch.clamp(value, max=1.0)


def grad_dtype(params: Iterable[nn.Parameter]) -> torch.dtype:
    """The dtype of the first gradient (torch's total norm, and its clip coefficient, have
    it); float32 when there is none."""
    for p in params:
        if p.grad is not None:
            return p.grad.dtype
    return torch.float32


@torch.no_grad()
def clip_(params: Iterable[nn.Parameter], factor: torch.Tensor) -> None:
    """Scale every gradient of ``params`` (all of this process's, counted or not: every copy
    of a weight is scaled alike) by ``factor`` (a :func:`coefficient`)."""
    if bool(factor >= 1.0):
        return  # times 1: nothing changes
    groups: Dict[Tuple[torch.device, torch.dtype], List[torch.Tensor]] = {}
    seen: set = set()
    for p in params:
        if p.grad is not None and id(p) not in seen:
            seen.add(id(p))
            g = local_gradient(p.grad)
            groups.setdefault((g.device, g.dtype), []).append(g)
    for (device, _), grads in groups.items():
        scale = factor.to(device)
        if device.type in ("cpu", "cuda"):
            torch._foreach_mul_(grads, scale)
        else:
            for g in grads:
                g.mul_(scale)
