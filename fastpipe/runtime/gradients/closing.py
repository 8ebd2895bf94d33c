"""The close of a training step: what every process reports once its gradients are final, and
the one verdict all of them reach from the reports.

Each process reports its share of the gradient norm
(:mod:`fastpipe.runtime.gradients.grad_norm`), the
first parameter whose gradient is not finite and the first micro-batch whose loss is not finite
(as a :class:`Report`, a few numbers), all computed on its device and read on the host
together, once (:mod:`fastpipe.runtime.gradients.readout`). A ``Pipe`` reads its one report;
the ranks of a ``DistributedPipe`` gather every rank's report in one collective of host
numbers, which is also the step's confirmation that every rank finished it. From the same
reports in the same order, every process computes the same :class:`Verdict`: the total norm,
and where the step first went non-finite, so that all of them raise, skip or step together.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Mapping, Optional, Sequence

import torch

from ...errors import NonFiniteError
from . import grad_norm, readout

if TYPE_CHECKING:
    from ..transport.wire import HostReads
    from .token_mean import TokenMean

REPORT_LEN = 5


@dataclass(frozen=True)
class Report:
    """One process's facts at the end of a step."""

    rank: int
    norm_terms: float = 0.0  # grad_norm.Terms.value (0 when the norm was not asked for)
    bad_parameter: int = -1  # index of the first non-finite gradient among the counted ones
    bad_stage: int = -1  # the virtual stage holding it
    bad_microbatch: int = -1  # the first micro-batch whose loss is not finite here
    bad_count: int = -1  # the first micro-batch whose count is not a count (never gathered:
    # the process that finds one refuses the step before the reports are gathered)

    def encode(self) -> List[float]:
        return [float(self.rank), self.norm_terms, float(self.bad_parameter),
                float(self.bad_stage), float(self.bad_microbatch)]

    @classmethod
    def decode(cls, values: Sequence[float]) -> "Report":
        rank, terms, parameter, stage, microbatch = values
        return cls(int(rank), float(terms), int(parameter), int(stage), int(microbatch))

    @property
    def nonfinite(self) -> bool:
        return self.bad_parameter >= 0 or self.bad_microbatch >= 0


@dataclass(frozen=True)
class Verdict:
    """What every process concludes from all reports (in rank order)."""

    grad_norm: Optional[float]  # None when no norm was asked for
    culprit: Optional[Report]  # the first report (by rank) that saw something non-finite

    @property
    def nonfinite(self) -> bool:
        return self.culprit is not None


def first_bad_loss(losses: Mapping[int, torch.Tensor], count: int) -> Optional[torch.Tensor]:
    """Unread, on the first loss's device: the first micro-batch of ``count`` whose loss is not
    finite, else -1 (``None`` when no loss is known here)."""
    present = [mb for mb in range(count) if losses.get(mb) is not None]
    if not present:
        return None
    home = losses[present[0]].device
    values = torch.stack([losses[mb].detach().reshape(()).to(home) for mb in present])
    return readout.first_marked(~torch.isfinite(values), present)


def report(rank: int, params: Sequence[grad_norm.Counted], norm_type: Optional[float],
           losses: Mapping[int, torch.Tensor], count: int, loss_stage: Optional[int] = None,
           *, reads: "HostReads", counts: Optional["TokenMean"] = None) -> Report:
    """This process's report, from one read of its device (none when it has nothing to
    read): its norm terms and first non-finite gradient when ``norm_type`` is given (a pass
    over the gradients); on the process of the last stage (``loss_stage``, else ``None``),
    the first micro-batch of ``count`` whose loss in ``losses`` is not finite and, with
    ``counts`` (``(loss_sum, count)`` losses), the first whose count tensor is not a count
    (``Report.bad_count``: refused before the reports are gathered)."""
    terms = grad_norm.terms(params, norm_type) if norm_type is not None else None
    on_loss_stage = loss_stage is not None
    bad_loss = first_bad_loss(losses, count) if on_loss_stage else None
    device = next((t.device for t in (terms[0] if terms else None, bad_loss) if t is not None),
                  None)
    bad_count = counts.first_bad(device) if on_loss_stage and counts is not None else None
    value, bad, bad_mb, count_mb = readout.read_together(
        [*(terms if terms is not None else (None, None)), bad_loss, bad_count], reads)
    bad = -1 if bad is None else int(bad)
    stage = params[bad].stage if bad >= 0 and params[bad].stage is not None else -1
    bad_mb = -1 if bad_mb is None else int(bad_mb)
    if bad_mb >= 0:
        stage = loss_stage
    return Report(rank, value if value is not None else 0.0, bad, stage, bad_mb,
                  -1 if count_mb is None else int(count_mb))


def verdict(reports: Sequence[Report], norm_type: Optional[float]) -> Verdict:
    """The same conclusion on every process, from the reports in rank order."""
    ordered = sorted(reports, key=lambda r: r.rank)
    norm = (grad_norm.total([r.norm_terms for r in ordered], norm_type)
            if norm_type is not None else None)
    culprits = [r for r in ordered if r.nonfinite]
    loss_first = [r for r in culprits if r.bad_microbatch >= 0]
    culprit = (loss_first or culprits or [None])[0]  # a bad loss explains the bad gradients
    return Verdict(norm, culprit)


def error(culprit: Report, loss: Optional[float], parameter: Optional[str],
          distributed: bool, clipping: bool = False) -> NonFiniteError:
    """The error every process raises for a non-finite step (``parameter``: the name of the
    culprit's bad parameter, when it has one; ``clipping``: raised by ``clip_grad_norm_``)."""
    stage = culprit.bad_stage if culprit.bad_stage >= 0 else None
    rank: Optional[int] = culprit.rank if distributed else None
    place = [f"rank {culprit.rank}"] if distributed else []
    if culprit.bad_microbatch >= 0:
        what = f"the loss of micro-batch {culprit.bad_microbatch} is not finite"
        if stage is not None:
            place.append(f"stage {stage}, the last")
    elif loss is not None and not math.isfinite(loss):  # a replica elsewhere: its loss
        what = ("the loss of a micro-batch of another data-parallel replica is not finite (the "
                "gradients averaged with it followed; that replica's ranks name it)")
        place, stage, parameter, rank = [], None, None, None
    else:
        what = f"the gradient of {parameter!r} is not finite"
        if stage is not None:
            place.append(f"stage {stage}")
    where = f" ({', '.join(place)})" if place else ""
    shown = "" if loss is None else f"; the step's loss is {loss}"
    message = (f"non-finite training step: {what}{where}{shown}. No optimizer state has "
               f"changed; find the cause (the data, the learning rate, an overflow), or pass "
               f"nonfinite='skip' to skip such steps as a GradScaler does")
    if clipping:
        message = (f"clip_grad_norm_: {what}{where}, so the total norm is not finite; nothing "
                   f"was clipped (error_if_nonfinite=False scales by the non-finite norm, as "
                   f"torch does)")
    return NonFiniteError(
        message,
        rank=rank, stage=stage,
        microbatch=culprit.bad_microbatch if culprit.bad_microbatch >= 0 else None,
        parameter=parameter if culprit.bad_microbatch < 0 else None, agreed=True)
