"""Per-layer costs from a trace that times stages: what moves with a layer when the balance
changes.

A trace measures each virtual stage's F, B and W, not its layers'. Each stage's measured cost is
spread over its layers by a per-layer profile when one is known (``layer_costs``: e.g.
:func:`fastpipe.layer_costs.profile_times` of the model, any unit: only the ratios within a stage
count), else evenly. Regrouping those per-layer costs under another balance gives the costs the
simulator re-simulates, so a layer's time moves with the layer. Pure Python.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

from ..schedule.schedule import Schedule
from ..schedule.simulator import Costs
from ..schedule.trace_file import TraceFileError

__all__ = ["LayerCost", "check_profile", "costs_for", "layer_costs"]

LayerCost = Tuple[float, float, float]
"""One layer's (F, B, W) seconds."""


def layer_costs(costs: Costs, schedule: Schedule, balance: Sequence[int],
                profile: Optional[Sequence[float]] = None) -> List[LayerCost]:
    """Per layer in model order, its (F, B, W) cost: each virtual stage's measured cost split
    over its layers in proportion to ``profile`` (evenly without one, or where the stage's
    profile is all zeros)."""
    n = schedule.num_virtual_stages
    kinds = [costs.per_virtual_stage(name, n) for name in ("forward", "backward", "weight")]
    layers: List[LayerCost] = []
    start = 0
    for v, count in enumerate(balance):
        weights = _weights(profile[start:start + count] if profile is not None else None, count)
        layers += [(kinds[0][v] * w, kinds[1][v] * w, kinds[2][v] * w) for w in weights]
        start += count
    return layers


def _weights(profile: Optional[Sequence[float]], count: int) -> List[float]:
    """Each layer's share of its stage: its profile over the stage's total, or an even share."""
    total = sum(profile) if profile is not None else 0.0
    if profile is None or total <= 0:
        return [1.0 / count] * count
    return [p / total for p in profile]


def costs_for(layers: Sequence[LayerCost], balance: Sequence[int]) -> Costs:
    """Per virtual stage costs when consecutive ``layers`` are grouped by ``balance``."""
    sums, start = [], 0
    for count in balance:
        group = layers[start:start + count]
        sums.append(tuple(sum(c[k] for c in group) for k in range(3)))
        start += count
    return Costs(forward=[s[0] for s in sums], backward=[s[1] for s in sums],
                 weight=[s[2] for s in sums])


def check_profile(profile: object,
                  balance: Optional[Sequence[int]]) -> Optional[Tuple[float, ...]]:
    """``layer_costs`` as the doctor takes it: ``None``, or one finite number >= 0 per layer
    (as many as ``balance`` adds up to, when it is known)."""
    if profile is None:
        return None
    try:
        values = tuple(float(x) for x in profile)  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise TraceFileError(f"layer_costs must be one number per layer (e.g. "
                             f"fastpipe.layer_costs.profile_times(model, sample)), got "
                             f"{profile!r}") from None
    if not values or any(not math.isfinite(v) or v < 0 for v in values):
        raise TraceFileError(f"layer_costs must be finite numbers >= 0, one per layer, got "
                             f"{list(values)}")
    if balance is not None and len(values) != sum(balance):
        raise TraceFileError(f"layer_costs has {len(values)} entries but balance={list(balance)} "
                             f"holds {sum(balance)} layers; give one cost per layer")
    return values
