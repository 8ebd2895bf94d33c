"""How sure the doctor is: each finding's predicted gain against the measurement's own noise.

A trace of several steps measures its noise: the spread (sample standard deviation) of the
steps' times. Each step is diagnosed on its own; a change is kept when the median of its
predicted gains over the steps (0 for a step that does not propose it) exceeds that spread, and
its confidence grows with the ratio and with how many steps propose the same change. With one
step the noise is unknown: findings keep their gain but only ``'low'`` confidence. Risks and
hardware facts (no gain to weigh) are kept when most steps report them. Pure Python.
"""
from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, replace
from typing import Hashable, List, Optional, Sequence, Tuple

from .findings import Finding

__all__ = ["HIGH", "MEDIUM", "Noise", "weigh"]

HIGH = 3.0
"""A gain at least this many times the noise, proposed by every step (three or more): 'high'."""
MEDIUM = 1.5
"""A gain at least this many times the noise: 'medium' (one level less when steps disagree)."""
_LEVELS = ("low", "medium", "high")


LAYOUT_KINDS = frozenset({"imbalance", "chunks", "schedule"})
"""Advice re-simulated from the stages' measured costs: it must also clear the stages' noise."""


@dataclass(frozen=True)
class Noise:
    """The step-time spread over ``steps`` traced steps (seconds; ``None`` when unknown) and
    the stages' own: the largest spread, over the steps, of one stage's compute time
    (``stage_spread``; on a ``DistributedPipe`` each stage is a rank, so this is the noise
    from rank to rank that a re-simulated gain is built on)."""

    steps: int
    spread: Optional[float]
    stage_spread: Optional[float] = None

    @classmethod
    def of(cls, step_times: Sequence[float],
           stage_times: Optional[Sequence[Sequence[float]]] = None) -> Noise:
        """The noise of these step times (unknown for fewer than two) and of each stage's
        compute time per step (``stage_times[step][stage]``)."""
        times = list(step_times)
        spread = statistics.stdev(times) if len(times) > 1 else None
        stages = None
        if stage_times is not None and len(stage_times) > 1:
            stages = max(statistics.stdev(column) for column in zip(*stage_times))
        return cls(len(times), spread, stages)

    def describe(self) -> str:
        """``'5 steps, step-time spread 4.1 ms, stage spread 2 ms'`` or ``'1 step: noise
        unknown'``."""
        if self.spread is None:
            return f"{self.steps} step{'s' if self.steps != 1 else ''}: noise unknown"
        stages = ("" if self.stage_spread is None
                  else f", stage spread {self.stage_spread * 1e3:.3g} ms")
        return f"{self.steps} steps, step-time spread {self.spread * 1e3:.3g} ms{stages}"

    def confidence(self, gain: float, agreeing: int, total: int,
                   kind: Optional[str] = None) -> Optional[Tuple[str, str]]:
        """(label, evidence) for a change of ``kind`` with median predicted ``gain`` proposed
        by ``agreeing`` of ``total`` steps; ``None`` when the gain does not exceed the noise
        (for advice re-simulated from stage costs, the larger of the step and stage
        spreads)."""
        if self.spread is None:
            return "low", ("noise unknown: one step traced (trace five or more steps inside "
                           "pipe.trace() to weigh the advice)")
        noise, what = self.spread, "step-time spread"
        if kind in LAYOUT_KINDS and self.stage_spread is not None \
                and self.stage_spread > noise:
            noise, what = self.stage_spread, "stage spread"
        ratio = gain / noise if noise > 0 else float("inf")
        if ratio <= 1.0:
            return None
        level = 2 if ratio >= HIGH else 1 if ratio >= MEDIUM else 0
        if agreeing < total:
            level -= 1
        if total < 3:
            level = min(level, 1)
        label = _LEVELS[max(0, level)]
        shown = "no spread" if ratio == float("inf") else f"{ratio:.1f}x the spread"
        return label, (f"gain {gain * 1e3:.3g} ms vs {what} {noise * 1e3:.3g} ms "
                       f"over {total} steps ({shown}); {agreeing} of {total} steps propose it")


def weigh(per_step: Sequence[Sequence[Finding]], noise: Noise) -> List[Finding]:
    """One list of findings from each step's: per kind, the change most steps propose, its
    median gain over the steps and its confidence; largest gain first (risks and hardware
    facts last)."""
    kinds = list(dict.fromkeys(f.kind for found in per_step for f in found))
    weighed = [w for w in (_weigh_kind(kind, per_step, noise) for kind in kinds) if w]
    return sorted(weighed, key=lambda f: -f.gain)


def _weigh_kind(kind: str, per_step: Sequence[Sequence[Finding]],
                noise: Noise) -> Optional[Finding]:
    """The ``kind`` finding over all steps (see :func:`weigh`), or ``None``."""
    found = [next((f for f in step if f.kind == kind), None) for step in per_step]
    change, agreeing = Counter(_change(f) for f in found if f is not None).most_common(1)[0]
    same = [f for f in found if f is not None and _change(f) == change]
    gains = [f.gain if f is not None and _change(f) == change else 0.0 for f in found]
    gain = statistics.median(gains)
    typical = min(same, key=lambda f: abs(f.gain - gain))
    if typical.gain <= 0:  # a risk or a hardware fact: kept when most steps report it
        if 2 * agreeing <= len(found) and len(found) > 1:
            return None
        return replace(typical, confidence=_LEVELS[2 if agreeing == len(found) else 1],
                       evidence=f"reported by {agreeing} of {len(found)} steps")
    verdict = noise.confidence(gain, agreeing, len(found), kind)
    if verdict is None or gain <= 0:
        return None
    return replace(typical, gain=gain, confidence=verdict[0], evidence=verdict[1])


def _change(finding: Finding) -> Hashable:
    """What a finding proposes: its kind and the advised balance, chunks or schedule (else its
    fix), so findings of several steps can be matched."""
    if finding.balance is None and finding.chunks is None and finding.schedule is None:
        return finding.kind, finding.fix
    return finding.kind, finding.balance, finding.chunks, finding.schedule
