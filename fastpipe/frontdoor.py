"""What the two front doors, ``Pipe`` and ``DistributedPipe``, share.

The read-only description of the layout (balance, chunks, schedule, checkpoint, virtual stages),
the validated schedule the layout runs, the plain module's names for parameters, buffers and
state, and the checks of a training step's arguments. A front door sets ``_balance``,
``_chunks``, ``_checkpoint``, ``_schedule_name``, ``_virtual`` and ``module`` (its layers under
their plain names), and says how many physical stages it has.
"""
from __future__ import annotations

import functools
import warnings
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from . import microbatch
from .policies import selective
from .policies.checkpoint import check_mode
from .runtime import adaptive
from .runtime.weight_versions import check_optimizer_argument
from .runtime.vitals import StepStats
from .schedule import Schedule, get_schedule

LOSS_REDUCTIONS = ("mean", "sum")


@functools.lru_cache(maxsize=64)
def validated_schedule(name: str, num_stages: int, num_microbatches: int,
                       virtual_stages: int) -> Schedule:
    """The named schedule for a layout, validated once (cached) for buffered sends: both
    executors buffer every send (mailboxes, non-blocking p2p)."""
    schedule = get_schedule(name, num_stages, num_microbatches, virtual_stages=virtual_stages)
    schedule.validate(comm="buffered")
    return schedule


def check_checkpoint(mode: Any) -> str:
    """The checkpoint mode, checked; its one-time set-up (imports torch's selective-checkpoint
    machinery) happens here, so that the first step's timeout measures the step alone."""
    mode = check_mode(mode)
    if mode == selective.MODE:
        selective.prepare()
    return mode


def check_step_arguments(loss_fn: Any, loss_reduction: Any, optimizer: Any,
                         asynchronous: bool, scaler: Any) -> None:
    """``train_step``'s arguments, checked before any work."""
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(output, target), got {loss_fn!r}")
    if loss_reduction not in LOSS_REDUCTIONS:
        raise ValueError(f"loss_reduction={loss_reduction!r}; use 'mean' (losses averaged over "
                         f"the batch) or 'sum' (losses summed over the batch)")
    check_optimizer_argument(optimizer, asynchronous, scaler)


class FrontDoor(nn.Module):
    """The layout's read-only properties, its schedule, and plain-module names."""

    _balance: Tuple[int, ...]
    _chunks: int
    _checkpoint: str
    _schedule_name: str
    _virtual: int

    @property
    def num_stages(self) -> int:
        """Physical pipeline stages (devices of a ``Pipe``, ranks of a ``DistributedPipe``)."""
        raise NotImplementedError  # pragma: no cover - each front door says

    @property
    def balance(self) -> Tuple[int, ...]:
        """Number of layers in each (virtual) stage, in model order."""
        return self._balance

    @property
    def chunks(self) -> int:
        """Number of micro-batches per batch: the one requested, or with ``chunks='auto'`` the
        one the next step runs (the chosen one once ``chunk_search.chosen`` is set)."""
        return self._chunks

    @property
    def checkpoint(self) -> str:
        """The checkpoint mode."""
        return self._checkpoint

    @property
    def schedule(self) -> str:
        """The name of the schedule the next step runs; ``plan(m)`` gives the schedule itself."""
        return self._schedule_name

    @property
    def virtual_stages(self) -> int:
        """Model chunks per physical stage."""
        return self._virtual

    @property
    def last_step(self) -> Optional[StepStats]:
        """The last training step's samples/s, wall time and measured bubble share
        (``fastpipe.runtime.vitals.StepStats``), kept without tracing; ``None`` before the first."""
        return self.__dict__.get("_last_step")

    def plan(self, num_microbatches: Optional[int] = None) -> Schedule:
        """The validated schedule this pipe runs for ``num_microbatches`` (default ``chunks``)."""
        return validated_schedule(self._schedule_name, self.num_stages,
                                  num_microbatches or self._chunks, self._virtual)

    def _split(self, total: int, chunks: int, argument: str = "inputs") -> List[int]:
        """Micro-batch sizes of a batch of ``total``: ``torch.chunk``'s (fewer micro-batches
        for a short batch), or the nearest smaller count the schedule can run."""
        return microbatch.fitted_sizes(total, chunks, self._accepts, argument=argument)

    def _accepts(self, num_microbatches: int) -> bool:
        """Whether the schedule can run ``num_microbatches``."""
        return adaptive.accepted(self.plan, num_microbatches)

    def _new_chunk_search(self, total: int) -> adaptive.ChunkSearch:
        """``chunks='auto'``: the search over micro-batch counts for batches of ``total``,
        starting from the current count, skipping counts the schedule cannot run."""
        return adaptive.ChunkSearch(
            adaptive.candidate_counts(self.num_stages, total), self._chunks,
            lambda m: self._accepts(len(microbatch.split_sizes(total, m))))

    # ---------------------------------------------------------------- plain-module names
    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[Tuple[str, nn.Parameter]]:
        """Parameters under the plain module's names (``'4.weight'``), whatever the split."""
        return self.module.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[Tuple[str, torch.Tensor]]:
        """Buffers under the plain module's names."""
        return self.module.named_buffers(prefix, recurse, remove_duplicate)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The state under the plain module's names (its keys, or this rank's share of them)."""
        return self.module.state_dict(*args, **kwargs)



def step_loss(step: Any, count: int, sizes: Sequence[int], loss_reduction: str) -> torch.Tensor:
    """The step's loss from its ``count`` micro-batch losses. With ``(loss_sum, count)`` losses,
    their sum over the total count, and the step's gradients divided by that total
    (``fastpipe.runtime.token_mean``); otherwise their (weighted) sum, with a warning, once, when
    a mean-reduced loss meets micro-batches of different sizes."""
    loss = torch.stack([step.losses[i] for i in range(count)]).sum()
    token_mean = step.token_mean
    if token_mean is not None and token_mean.active:
        total = token_mean.total()
        token_mean.finish(total)
        return loss / total if total > 0 else loss * 0.0
    if loss_reduction == "mean" and len(set(sizes)) > 1:
        warn_uneven_mean(sizes)
    return loss


def warn_uneven_mean(sizes: Sequence[int]) -> None:
    """Once per process: a mean loss over micro-batches of different sizes is weighted by
    size, exact for a mean over samples but not for a mean over tokens (padding excluded)."""
    warnings.warn("micro-batches of different sizes with a mean loss: each micro-batch's loss "
                  "is weighted by its share of the samples, which is exact for a mean over "
                  "samples; for a mean over tokens (padding excluded) return (loss_sum, "
                  "token_count) from loss_fn instead", UncertainWeighting, stacklevel=3)


class UncertainWeighting(UserWarning):
    """A mean loss over micro-batches of different sizes (see ``warn_uneven_mean``)."""
