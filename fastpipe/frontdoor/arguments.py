"""``train_step``'s arguments, checked before any work, and how micro-batch losses weigh.

Every rank of a ``DistributedPipe`` checks the same arguments alike, so a wrong one raises the
same typed error everywhere before any message is sent.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

from ..runtime.gradients import grad_norm
from ..runtime.weight_versions import check_optimizer_argument

LOSS_REDUCTIONS = ("mean", "sum")


def check_step_arguments(loss_fn: Any, loss_reduction: Any, optimizer: Any,
                         asynchronous: bool, scaler: Any) -> None:
    """``train_step``'s arguments, checked before any work."""
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(output, target), got {loss_fn!r}")
    if loss_reduction not in LOSS_REDUCTIONS:
        raise ValueError(f"loss_reduction={loss_reduction!r}; use 'mean' (losses averaged over "
                         f"the batch) or 'sum' (losses summed over the batch)")
    check_optimizer_argument(optimizer, asynchronous, scaler)


@dataclass(frozen=True)
class StepEnding:
    """How a training step ends once its gradients are final (checked arguments)."""

    optimizer: Optional[Any]
    scaler: Optional[Any]
    max_norm: Optional[float]
    nonfinite: str
    asynchronous: bool
    sync: bool  # False inside no_sync(): the gradients are not final yet

    @property
    def norm_type(self) -> Optional[float]:
        """The norm to measure (2), or ``None`` when nothing needs the gradients scanned:
        no clipping, and non-finite gradients not looked for (``'ignore'``, a scaler's own
        check, PipeDream's per-update check, or gradients not final yet)."""
        if not self.sync:
            return None
        looks = self.nonfinite != "ignore" and self.scaler is None and not self.asynchronous
        return 2.0 if self.max_norm is not None or looks else None


def check_ending(optimizer: Any, scaler: Any, max_grad_norm: Any, nonfinite: Any,
                 asynchronous: bool, sync: bool) -> StepEnding:
    """``train_step``'s ``max_grad_norm`` and ``nonfinite``, checked with the arguments they
    combine with, before any work."""
    nonfinite = grad_norm.check_nonfinite(nonfinite)
    max_norm = (None if max_grad_norm is None
                else grad_norm.check_max_norm(max_grad_norm, "max_grad_norm"))
    if not sync and (optimizer is not None or max_norm is not None):
        raise ValueError("optimizer= and max_grad_norm= inside pipe.no_sync(): the gradients "
                         "are final only after the first call outside the block; pass them "
                         "to that call")
    if asynchronous and max_norm is not None:
        raise NotImplementedError("max_grad_norm with schedule='pipedream': each stage updates "
                                  "its weights after every micro-batch, so there is no whole "
                                  "gradient to clip; use a flushed schedule such as '1f1b'")
    if nonfinite == "skip" and asynchronous:
        raise NotImplementedError("nonfinite='skip' with schedule='pipedream': its updates "
                                  "happen stage by stage inside the step and cannot be skipped "
                                  "together; use 'raise' (each stage checks before it updates)")
    if nonfinite == "skip" and optimizer is None and sync:
        raise ValueError("nonfinite='skip' skips the optimizer step, so it needs optimizer=...; "
                         "without it, use nonfinite='raise' and catch fastpipe.NonFiniteError")
    if max_norm is not None and scaler is not None and optimizer is None:
        raise ValueError("max_grad_norm with scaler= needs optimizer=...: the gradients must be "
                         "unscaled before they are clipped (scaler.unscale_(optimizer))")
    return StepEnding(optimizer, scaler, max_norm, nonfinite, asynchronous, sync)


def loss_weights(sizes: Sequence[int], loss_reduction: str) -> List[float]:
    """Each micro-batch loss's weight: its share of the batch (``'mean'``) or 1 (``'sum'``)."""
    total = sum(sizes)
    return [s / total for s in sizes] if loss_reduction == "mean" else [1.0] * len(sizes)


def warn_uneven_mean(sizes: Sequence[int]) -> None:
    """Once per process: a mean loss over micro-batches of different sizes is weighted by
    size, exact for a mean over samples but not for a mean over tokens (padding excluded)."""
    warnings.warn("micro-batches of different sizes with a mean loss: each micro-batch's loss "
                  "is weighted by its share of the samples, which is exact for a mean over "
                  "samples; for a mean over tokens (padding excluded) return (loss_sum, "
                  "token_count) from loss_fn instead", UncertainWeighting, stacklevel=4)


class UncertainWeighting(UserWarning):
    """A mean loss over micro-batches of different sizes (see ``warn_uneven_mean``)."""
