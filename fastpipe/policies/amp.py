"""Mixed precision in a pipeline: autocast on every stage thread, and loss scaling.

Autocast state is thread-local, so a stage running on a worker thread would not see the caller's
``torch.autocast`` region. The step runtime re-enters the caller's regions on each worker
(``StepState.ambient``), and a checkpointed forward re-enters the regions of its first run when
it is recomputed in backward (``autocast_state`` / ``autocast_regions``), on whatever thread.

Loss scaling (``torch.amp.GradScaler``): ``train_step(..., scaler=scaler)`` scales each
micro-batch's loss before its backward (``scale_loss``). ``scaler.step(optimizer)`` then finds
an inf/NaN gradient of any stage when one optimizer holds all stages' parameters (the local
pipe). When each process holds only its own stages' parameters (a distributed pipeline),
``unscale_and_sync`` makes the ranks agree, so all of them skip the same steps.
"""
from __future__ import annotations

import contextlib
import datetime
from typing import Any, Iterable, List, Optional, Tuple

import torch

from ..streams.scaler_flag import agreed_flag

AutocastState = List[Tuple[str, torch.dtype]]


def autocast_state(device_types: Iterable[str]) -> AutocastState:
    """The autocast regions active on the calling thread for ``device_types``."""
    return [(kind, torch.get_autocast_dtype(kind)) for kind in sorted(set(device_types))
            if torch.is_autocast_enabled(kind)]


def autocast_regions(state: AutocastState) -> contextlib.ExitStack:
    """A context that re-enters the regions of ``autocast_state`` (on any thread)."""
    stack = contextlib.ExitStack()
    for device_type, dtype in state:
        stack.enter_context(torch.autocast(device_type, dtype=dtype))
    return stack


def check_scaler(scaler: Any) -> Optional[Any]:
    """``scaler`` must be ``None`` or a ``torch.amp.GradScaler`` (anything with ``scale``,
    ``unscale_``, ``step`` and ``update``)."""
    if scaler is None:
        return None
    if not all(callable(getattr(scaler, name, None))
               for name in ("scale", "unscale_", "step", "update")):
        raise TypeError(f"scaler must be a torch.amp.GradScaler (or None), got {scaler!r}; "
                        f"e.g. scaler=torch.amp.GradScaler('cuda')")
    return scaler


def scale_loss(scaler: Optional[Any], loss: torch.Tensor) -> torch.Tensor:
    """The tensor a micro-batch's backward starts from: the loss, scaled when a scaler is given."""
    return loss if scaler is None else scaler.scale(loss)


def unscale_and_sync(scaler: Any, optimizer: torch.optim.Optimizer,
                     group: Optional[Any] = None, timeout: Optional[float] = None,
                     device: Optional[torch.device] = None) -> None:
    """Unscale this rank's gradients and agree with every rank of ``group`` on whether any
    gradient anywhere is inf or NaN, so ``scaler.step(optimizer)`` skips the step on every
    rank together and ``scaler.update()`` moves every rank's scale alike.

    Call after the step's backward and before ``scaler.step(optimizer)``, on every rank (it is
    a collective: an all-reduce of one flag). ``device`` is the rank's pipeline device: the
    flag is made and reduced there (:mod:`fastpipe.streams.scaler_flag`), whatever the rank's
    gradients are on, even none, so every rank reduces on the group's device backend. Without
    it, the scale's device, else the first gradient's, else the CPU (refused on an NCCL group:
    pass ``device``). Ranks whose stages never saw the loss start their scale at the
    scaler's ``init_scale``, on ``device``, like the rank that scaled it, and keep in step with
    it since every rank then sees the same verdicts. Uses ``GradScaler``'s private but
    long-stable per-optimizer state (``_per_optimizer_states``).
    """
    import torch.distributed as dist

    if not scaler.is_enabled():
        return
    home = _home(scaler, optimizer, device, group)
    if scaler._scale is None:  # only the rank with the loss called scaler.scale(loss)
        scaler._lazy_init_scale_growth_tracker(home)
    scaler.unscale_(optimizer)
    found = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]

    def reduce(flag: torch.Tensor) -> None:
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group, async_op=True)
        if timeout is None:
            work.wait()  # the process group's own timeout
        else:
            work.wait(datetime.timedelta(seconds=timeout))

    flag = agreed_flag(found.values(), home, reduce)
    for where, value in found.items():
        value.copy_(flag.to(where))
    found.setdefault(flag.device, flag)  # a rank without gradients still records the verdict


def _home(scaler: Any, optimizer: torch.optim.Optimizer, device: Optional[torch.device],
          group: Optional[Any]) -> torch.device:
    """Where the flag lives: ``device``, else the scale's device, else the first gradient's,
    else the CPU, which a group reducing on NCCL alone cannot take."""
    import torch.distributed as dist

    if device is not None:
        return torch.device(device)
    home = scaler._scale.device if scaler._scale is not None else _grad_device(optimizer)
    if home.type == "cpu" and str(dist.get_backend(group)) == "nccl":
        raise ValueError("unscale_and_sync: this rank's flag would be a CPU tensor (it has no "
                         "scale and no gradient on a GPU) on a group that reduces on NCCL; "
                         "pass device=<the rank's pipeline device>")
    return home


def _grad_device(optimizer: torch.optim.Optimizer) -> torch.device:
    """The device of the optimizer's first gradient (the CPU when it has none)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                return p.grad.device
    return torch.device("cpu")
