"""Exact token-mean losses: ``loss_fn`` returns ``(loss_sum, count)`` for each micro-batch.

The step's loss is then the sum of the micro-batch sums over the sum of their counts (over the
data-parallel replicas too): the causal-LM loss averaged over the non-padding tokens of the whole
batch, which weighting micro-batch means by micro-batch size gets wrong when micro-batches hold
different numbers of tokens. The total count is known only when every micro-batch has been seen,
after the first backwards have run, so (as Megatron-LM does for per-token losses) each micro-batch
backpropagates its sum, and at the end of the step the gradient the step added is divided by the
total count. Gradients that were in ``.grad`` before the step (accumulation over several steps)
are kept apart and not divided.
"""
from __future__ import annotations

import math
import threading
from typing import Any, Callable, Dict, Iterable, Optional, Tuple

import torch

from ...errors import LossFunctionError


def split_count(value: Any, microbatch: int) -> Tuple[Any, Optional[float]]:
    """``(loss, count)`` from what ``loss_fn`` returned: a ``(loss_sum, count)`` pair, or a
    loss alone (count ``None``)."""
    if not isinstance(value, (tuple, list)):
        return value, None
    if len(value) != 2:
        raise LossFunctionError(f"loss_fn returned {len(value)} values for micro-batch "
                                f"{microbatch}; return a loss, or (loss_sum, count)")
    loss, count = value
    if isinstance(count, torch.Tensor):
        if count.numel() != 1:
            raise LossFunctionError(f"loss_fn's count for micro-batch {microbatch} has shape "
                                    f"{tuple(count.shape)}; return the number of elements the "
                                    f"sum covers, as an int or a one-element tensor")
        count = count.item()
    if isinstance(count, bool) or not isinstance(count, (int, float)) \
            or not math.isfinite(count) or count < 0 or count != int(count):
        raise LossFunctionError(f"loss_fn's count for micro-batch {microbatch} is {count!r}; "
                                f"return (loss_sum, count) with count the number of elements "
                                f"(tokens) the sum covers, a non-negative whole number (a pair "
                                f"of losses is not a (sum, count) pair: add them instead)")
    return loss, float(count)


class TokenMean:
    """One step's ``(loss_sum, count)`` bookkeeping: the counts, the gradients from before the
    step, and the final division."""

    def __init__(self, parameters: Callable[[], Iterable[torch.nn.Parameter]]) -> None:
        # read before the step: during it, FSDP registers its gathered parameters in the
        # modules, while the gradients the step ends with are the sharded parameters'
        self._parameters = list(parameters())
        self._lock = threading.Lock()
        self._prior: Optional[Dict[torch.nn.Parameter, Optional[torch.Tensor]]] = None
        self.counts: Dict[int, float] = {}

    @property
    def active(self) -> bool:
        """Whether this step's losses came as ``(loss_sum, count)``."""
        return self._prior is not None

    def count(self, microbatch: int, count: float) -> None:
        """Record a micro-batch's count; the first one sets aside the gradients from before the
        step (no backward of the step has run yet: every backward starts from a loss)."""
        with self._lock:
            if self._prior is None:
                self._prior = {p: (None if p.grad is None else p.grad.detach().clone())
                               for p in self._parameters}
            self.counts.setdefault(microbatch, count)

    def total(self) -> float:
        """The step's total count."""
        return sum(self.counts.values())

    def finish(self, total: float, scale: float = 1.0) -> None:
        """Divide what the step added to each ``.grad`` by ``total`` (times ``scale``: a
        data-parallel average already divided it by the replica count)."""
        if self._prior is None:
            return
        factor = scale / total if total > 0 else 0.0
        with torch.no_grad():
            for p, prior in self._prior.items():
                if p.grad is None:
                    continue
                if prior is None:
                    p.grad.mul_(factor)
                else:
                    p.grad.sub_(prior).mul_(factor).add_(prior)
        self._prior = None
