"""Exact token-mean losses: ``loss_fn`` returns ``(loss_sum, count)`` for each micro-batch.

The step's loss is then the sum of the micro-batch sums over the sum of their counts (over the
data-parallel replicas too): the causal-LM loss averaged over the non-padding tokens of the whole
batch, which weighting micro-batch means by micro-batch size gets wrong when micro-batches hold
different numbers of tokens. The total count is known only when every micro-batch has been seen,
after the first backwards have run, so (as Megatron-LM does for per-token losses) each micro-batch
backpropagates its sum, and at the end of the step the gradient the step added is divided by the
total count. Gradients that were in ``.grad`` before the step (accumulation over several steps)
are kept apart and not divided. Counts given as tensors stay on their device: they travel
attached to the gradient messages, the total and the division are device work, and their values
are checked in the step's one read at its close (``fastpipe.runtime.gradients.readout``).
"""
from __future__ import annotations

import math
import threading
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, Optional, Tuple, Union

import torch

from ...errors import LossFunctionError
from . import readout
from .grad_norm import local_gradient

if TYPE_CHECKING:
    from ..transport.wire import HostReads

Count = Union[float, torch.Tensor]  # a number, or a one-element tensor (0-dim) on a device


def split_count(value: Any, microbatch: int) -> Tuple[Any, Optional[Count]]:
    """``(loss, count)`` from what ``loss_fn`` returned: a ``(loss_sum, count)`` pair, or a
    loss alone (count ``None``). A count given as a number is checked here; a count tensor
    stays on its device, unread: its value is checked at the step's close
    (:meth:`TokenMean.first_bad`), with the step's other facts, in one read."""
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
        if count.dtype == torch.bool or count.is_complex():
            raise count_error(microbatch, count)
        return loss, count.detach().reshape(())
    if isinstance(count, bool) or not isinstance(count, (int, float)) \
            or not math.isfinite(count) or count < 0 or count != int(count):
        raise count_error(microbatch, count)
    return loss, float(count)


def count_error(microbatch: int, count: Any) -> LossFunctionError:
    """The error of a count that is not a count (``count``: its value, as shown)."""
    return LossFunctionError(f"loss_fn's count for micro-batch {microbatch} is {count!r}; "
                             f"return (loss_sum, count) with count the number of elements "
                             f"(tokens) the sum covers, a non-negative whole number (a pair "
                             f"of losses is not a (sum, count) pair: add them instead)")


class TokenMean:
    """One step's ``(loss_sum, count)`` bookkeeping: the counts (numbers, or tensors left on
    their device), the gradients from before the step, and the final division."""

    def __init__(self, parameters: Callable[[], Iterable[torch.nn.Parameter]]) -> None:
        # read before the step: during it, FSDP registers its gathered parameters in the
        # modules, while the gradients the step ends with are the sharded parameters'
        self._parameters = list(parameters())
        self._lock = threading.Lock()
        self._prior: Optional[Dict[torch.nn.Parameter, Optional[torch.Tensor]]] = None
        self.counts: Dict[int, Count] = {}

    @property
    def active(self) -> bool:
        """Whether this step's losses came as ``(loss_sum, count)``."""
        return self._prior is not None

    def count(self, microbatch: int, count: Count) -> None:
        """Record a micro-batch's count; the first one sets aside the gradients from before the
        step (no backward of the step has run yet: every backward starts from a loss)."""
        with self._lock:
            if self._prior is None:
                self._prior = {p: (None if p.grad is None else p.grad.detach().clone())
                               for p in self._parameters}
            self.counts.setdefault(microbatch, count)

    def total(self, device: torch.device) -> torch.Tensor:
        """The step's total count, a 0-dim float64 on ``device`` (unread: the counts are whole
        numbers, so the sum is exact in any order below 2**53)."""
        numbers = [c for c in self.counts.values() if not isinstance(c, torch.Tensor)]
        tensors = [c.to(device, torch.float64) for c in self.counts.values()
                   if isinstance(c, torch.Tensor)]
        total = torch.tensor(math.fsum(numbers), dtype=torch.float64).to(device)
        return total + torch.stack(tensors).sum() if tensors else total

    def first_bad(self, device: Optional[torch.device] = None) -> Optional[torch.Tensor]:
        """On ``device`` (else the first count's), unread: the first micro-batch whose count
        tensor is not a whole number >= 0, else -1 (``None`` when no count is a tensor:
        numbers were checked as they came)."""
        found = sorted(((mb, c) for mb, c in self.counts.items()
                        if isinstance(c, torch.Tensor)), key=lambda item: item[0])
        if not found:
            return None
        device = device if device is not None else found[0][1].device
        values = torch.stack([c.to(device, torch.float64) for _, c in found])
        bad = ~torch.isfinite(values) | (values < 0) | (values != torch.trunc(values))
        return readout.first_marked(bad, [mb for mb, _ in found])

    def refuse(self, microbatch: int, reads: "HostReads") -> LossFunctionError:
        """A step whose count of ``microbatch`` is bad ends without a trace: the gradients
        from before it are put back; returns the error to raise (the count read to show
        it)."""
        self.restore()
        return count_error(microbatch, reads.number(self.counts[microbatch]))

    def finish(self, total: torch.Tensor, scale: float = 1.0) -> None:
        """Divide what the step added to each ``.grad`` by ``total`` (times ``scale``: a
        data-parallel average already divided it by the replica count), on the device: the
        factor is never read on the host."""
        if self._prior is None:
            return
        factor = torch.where(total > 0, scale / total, torch.zeros_like(total))
        factors: Dict[Tuple[torch.device, torch.dtype], torch.Tensor] = {}
        with torch.no_grad():
            for p, prior in self._prior.items():
                if p.grad is None:
                    continue
                grad = local_gradient(p.grad)
                key = (grad.device, grad.dtype)
                if key not in factors:
                    factors[key] = factor.to(*key)
                if prior is None:
                    grad.mul_(factors[key])
                else:
                    grad.sub_(local_gradient(prior)).mul_(factors[key]).add_(
                        local_gradient(prior))

    def restore(self) -> None:
        """Put back the gradients from before the step (a step refused at its close)."""
        with torch.no_grad():
            for p, prior in (self._prior or {}).items():
                if prior is None or p.grad is None:
                    p.grad = prior
                else:
                    p.grad.copy_(prior)
        self.release()

    def release(self) -> None:
        """Drop the gradients kept from before the step (the step is over)."""
        self._prior = None
