"""The close of a training step: what every process reports once its gradients are final, and
the one verdict all of them reach from the reports.

Each process reports its share of the gradient norm
(:mod:`fastpipe.runtime.gradients.grad_norm`), the
first parameter whose gradient is not finite and the first micro-batch whose loss is not finite
(as a :class:`Report`, a few numbers). A ``Pipe`` reads its one report; the ranks of a
``DistributedPipe`` gather every rank's report in one collective, which is also the step's
confirmation that every rank finished it. From the same reports in the same order, every
process computes the same :class:`Verdict`: the total norm, and where the step first went
non-finite, so that all of them raise, skip or step together.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Mapping, Optional, Sequence

import torch

from ...errors import NonFiniteError
from . import grad_norm

REPORT_LEN = 5


@dataclass(frozen=True)
class Report:
    """One process's facts at the end of a step."""

    rank: int
    norm_terms: float = 0.0  # grad_norm.Terms.value (0 when the norm was not asked for)
    bad_parameter: int = -1  # index of the first non-finite gradient among the counted ones
    bad_stage: int = -1  # the virtual stage holding it
    bad_microbatch: int = -1  # the first micro-batch whose loss is not finite here

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


def first_bad_loss(losses: Mapping[int, torch.Tensor], count: int) -> int:
    """The first micro-batch whose loss is not finite (-1: all are)."""
    for mb in range(count):
        value = losses.get(mb)
        if value is not None and not math.isfinite(float(value)):
            return mb
    return -1


def report(rank: int, params: Sequence[grad_norm.Counted], norm_type: Optional[float],
           losses: Mapping[int, torch.Tensor], count: int,
           loss_stage: Optional[int] = None) -> Report:
    """This process's report: its norm terms and first non-finite gradient when ``norm_type``
    is given (a pass over the gradients); on the process of the last stage (``loss_stage``,
    else ``None``), the first micro-batch of ``count`` whose loss in ``losses`` is not
    finite."""
    terms = grad_norm.terms(params, norm_type) if norm_type is not None else None
    bad = terms.first_nonfinite if terms is not None else -1
    stage = params[bad].stage if bad >= 0 and params[bad].stage is not None else -1
    bad_loss = first_bad_loss(losses, count) if loss_stage is not None else -1
    if bad_loss >= 0:
        stage = loss_stage
    return Report(rank, terms.value if terms is not None else 0.0, bad, stage, bad_loss)


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
