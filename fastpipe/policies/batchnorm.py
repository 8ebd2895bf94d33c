"""Deferred batch norm: per-micro-batch normalisation, running statistics of the whole mini-batch.

In a pipeline every micro-batch goes through a ``BatchNorm`` on its own, so a plain module would
update its running mean and variance once per micro-batch, from small samples. With deferral
(torchgpipe's ``deferred_batch_norm``) each micro-batch is still normalised with its own
statistics, but the running statistics are updated once per mini-batch, from the statistics of
all its micro-batches together: the running buffers then equal the plain model's (exactly, up to
rounding, for a batch norm whose input does not pass through an earlier batch norm).

The batch-norm modules are left as they are (same class, same buffers, same ``state_dict``
keys). While a stage runs a training forward, ``DeferredNorms.deferring`` hides their running
buffers (so ``F.batch_norm`` uses batch statistics and updates nothing) and records the
per-channel count, mean and variance of each micro-batch's input; ``commit`` folds them into the
running buffers once the mini-batch is done. Recomputations of checkpointed forwards record
nothing, so no micro-batch is counted twice. Front doors (local or distributed) call
``commit`` on each stage after a successful step and ``discard`` before one.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator, List, Tuple

import torch
from torch import nn

from .checkpoint import is_recomputing

_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


def tracked_norms(module: nn.Module) -> List[nn.modules.batchnorm._BatchNorm]:
    """The batch norms of ``module`` that keep running statistics (the ones deferral affects)."""
    return [m for m in module.modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats
            and m.running_mean is not None]


class _Moments:
    """Per-channel statistics of the micro-batches one batch norm saw in the current mini-batch."""

    def __init__(self) -> None:
        self.parts: List[Tuple[int, torch.Tensor, torch.Tensor]] = []  # (count, mean, biased var)

    def record(self, x: torch.Tensor, dtype: torch.dtype) -> None:
        """Remember the count, mean and biased variance (per channel, dim 1) of an input."""
        x = x.detach()
        dims = [d for d in range(x.dim()) if d != 1]
        count = x.numel() // x.shape[1]
        var, mean = torch.var_mean(x.to(dtype), dim=dims, correction=0)
        self.parts.append((count, mean, var))

    def combined(self) -> Tuple[int, torch.Tensor, torch.Tensor]:
        """Count, mean and unbiased variance of all recorded micro-batches together (Chan's
        parallel formula: numerically stable, no sum of squares)."""
        total = sum(n for n, _, _ in self.parts)
        mean = sum(mean * (n / total) for n, mean, _ in self.parts)
        m2 = sum((var + (m - mean) ** 2) * n for n, m, var in self.parts)
        return total, mean, m2 / max(total - 1, 1)


class DeferredNorms:
    """The tracked batch norms of one stage, with running-statistics updates deferred to
    ``commit`` (once per mini-batch)."""

    def __init__(self, module: nn.Module) -> None:
        self.norms = tracked_norms(module)
        self._moments = [_Moments() for _ in self.norms]

    def __bool__(self) -> bool:
        return bool(self.norms)

    @contextlib.contextmanager
    def deferring(self) -> Iterator[None]:
        """Run a forward in which the training batch norms normalise each micro-batch with its
        own statistics, leave their running buffers alone, and record the micro-batch's
        statistics (unless this forward is a recomputation)."""
        active = [(m, s) for m, s in zip(self.norms, self._moments) if m.training]
        if not active:
            yield
            return
        record = not is_recomputing()
        hidden, hooks = [], []
        try:
            for norm, moments in active:
                if record:
                    hooks.append(norm.register_forward_pre_hook(
                        lambda _, args, moments=moments, dtype=norm.running_mean.dtype:
                        moments.record(args[0], dtype)))
                hidden.append((norm, [getattr(norm, name) for name in _BUFFERS]))
                for name in _BUFFERS:
                    setattr(norm, name, None)
            yield
        finally:
            for hook in hooks:
                hook.remove()
            for norm, buffers in hidden:
                for name, buffer in zip(_BUFFERS, buffers):
                    setattr(norm, name, buffer)

    def commit(self) -> None:
        """Update each batch norm's running statistics once, from every micro-batch recorded
        since the last commit, as the plain module would from the whole mini-batch."""
        with torch.no_grad():
            for norm, moments in zip(self.norms, self._moments):
                if moments.parts:
                    _update(norm, *moments.combined())
                moments.parts.clear()

    def discard(self) -> None:
        """Forget recorded statistics (a step that failed must not update the buffers)."""
        for moments in self._moments:
            moments.parts.clear()


def _update(norm: nn.modules.batchnorm._BatchNorm, count: int, mean: torch.Tensor,
            var: torch.Tensor) -> None:
    """One running-statistics update, with ``_BatchNorm.forward``'s momentum rules."""
    if norm.num_batches_tracked is not None:
        norm.num_batches_tracked.add_(1)
    if norm.momentum is None:  # cumulative moving average
        factor = 1.0 / float(norm.num_batches_tracked)
    else:
        factor = norm.momentum
    norm.running_mean.mul_(1 - factor).add_(mean, alpha=factor)
    norm.running_var.mul_(1 - factor).add_(var, alpha=factor)


def commit(stages: Iterable[Any]) -> None:
    """After a successful step (or a training forward): update the running statistics of every
    stage that defers them. ``stages`` are ``runtime.stage.Stage`` objects (their ``deferred``)."""
    for stage in stages:
        if stage.deferred:
            stage.deferred.commit()


def discard(stages: Iterable[Any]) -> None:
    """Before a step: drop statistics left by a step that failed part-way."""
    for stage in stages:
        if stage.deferred:
            stage.deferred.discard()
