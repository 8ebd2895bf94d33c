"""Balancing: how many consecutive layers each pipeline stage gets.

:func:`solve` is the exact partition solver (pure Python, no torch).
:func:`by_time` and :func:`by_size` (and torchgpipe's :func:`balance_by_time` and
:func:`balance_by_size`) measure an ``nn.Sequential`` layer by layer with the profilers of
:mod:`fastpipe.layer_costs` and feed the per-layer costs to it; the module is left as it was.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from .layer_costs import (check_positive, check_sequential, default_device, first_microbatch,
                          profile_saved_sizes, profile_sizes, profile_times)

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["balance_by_size", "balance_by_time", "by_size", "by_time", "profile_saved_sizes",
           "profile_sizes", "profile_times", "solve"]


# -- the solver ------------------------------------------------------------------------


def solve(costs: Sequence[float], partitions: int) -> list[int]:
    """Split ``costs`` into ``partitions`` contiguous non-empty groups minimising the
    largest group sum; return the group sizes (the balance).

    Ties are broken deterministically: among partitions with the smallest maximum,
    prefer the smallest sum of squared group sums (the most even spread of the
    rest), then the lexicographically smallest balance (fewer layers on earlier
    stages, which hold the most in-flight activations under 1F1B). Arithmetic is
    exact -- every float is scaled to an integer by a common power of two -- so
    ties are real ties. Runs in O(n p log n) for the optimum plus at most
    O(n^2 p) for the tie-break.
    """
    units = _exact_units(costs)
    _check_partitions(partitions, len(units))
    prefix = _prefix_sums(units)
    limit = _min_max(prefix, partitions)
    return _most_even(prefix, partitions, limit)


def _check_partitions(partitions: object, num_layers: int) -> int:
    if isinstance(partitions, bool) or not isinstance(partitions, int):
        raise TypeError(f"partitions must be an int (the number of stages), got {partitions!r}")
    if partitions < 1:
        raise ValueError(f"partitions must be >= 1 (the number of stages), got {partitions}")
    if num_layers == 0:
        raise ValueError("there are 0 layers to split; give at least one layer cost")
    if partitions > num_layers:
        raise ValueError(
            f"partitions={partitions} exceeds the {num_layers} layers to split; every "
            f"stage needs at least one layer, so use at most {num_layers} partitions "
            "or split the model into more layers"
        )
    return partitions


def _exact_units(costs: Sequence[float]) -> list[int]:
    """Costs as integers with one common scale, so sums and comparisons are exact."""
    ratios = [_ratio(i, c) for i, c in enumerate(costs)]
    scale = max((den for _, den in ratios), default=1)  # all powers of two
    return [num * (scale // den) for num, den in ratios]


def _ratio(index: int, cost: object) -> tuple[int, int]:
    if isinstance(cost, int):
        value: float | int = cost
    else:
        try:
            value = float(cost)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise TypeError(f"costs[{index}]={cost!r} is not a number") from None
    if math.isnan(value) or math.isinf(value) or value < 0:
        raise ValueError(
            f"costs[{index}]={cost!r} is invalid; costs must be finite and >= 0 "
            "(e.g. seconds or bytes per layer)"
        )
    return value.as_integer_ratio()


def _prefix_sums(units: list[int]) -> list[int]:
    prefix = [0]
    for unit in units:
        prefix.append(prefix[-1] + unit)
    return prefix


def _min_max(prefix: list[int], partitions: int) -> int:
    """Smallest achievable largest group sum (DP over prefixes; the best split
    point is where the nondecreasing prefix optimum crosses the last group's sum)."""
    n = len(prefix) - 1
    best = prefix[:]  # one group: the whole prefix
    for k in range(2, partitions + 1):
        best = [math.inf] * k + [_best_split(prefix, best, k, j) for j in range(k, n + 1)]
    return int(best[n])


def _best_split(prefix: list[int], prev: list[float], k: int, j: int) -> float:
    lo, hi = k - 1, j - 1  # last group is items[i:j] for i in lo..hi
    while lo < hi:  # first i whose prefix optimum reaches the last group's sum
        mid = (lo + hi) // 2
        if prev[mid] >= prefix[j] - prefix[mid]:
            hi = mid
        else:
            lo = mid + 1
    candidates = (lo - 1, lo) if lo > k - 1 else (lo,)
    return min(max(prev[i], prefix[j] - prefix[i]) for i in candidates)


def _most_even(prefix: list[int], partitions: int, limit: int) -> list[int]:
    """Among partitions whose groups all fit ``limit``, the one with the least sum of
    squares, earliest groups smallest on ties."""
    n = len(prefix) - 1
    cost = _suffix_costs(prefix, partitions, limit)
    balance, i = [], 0
    for k in range(partitions, 0, -1):
        ends = _ends(prefix, i, k, limit)
        j = next(j for j in ends if _step(prefix, i, j, cost[k - 1]) == cost[k][i])
        balance.append(j - i)
        i = j
    assert i == n
    return balance


def _suffix_costs(prefix: list[int], partitions: int, limit: int) -> list[list[float]]:
    """cost[k][i]: least sum of squares splitting items[i:] into k groups within ``limit``."""
    n = len(prefix) - 1
    cost: list[list[float]] = [[math.inf] * n + [0]]
    for k in range(1, partitions + 1):
        row = [math.inf] * (n + 1)
        for i in [0] if k == partitions else range(n - k + 1):
            row[i] = min(
                (_step(prefix, i, j, cost[k - 1]) for j in _ends(prefix, i, k, limit)),
                default=math.inf,
            )
        cost.append(row)
    return cost


def _ends(prefix: list[int], i: int, k: int, limit: int) -> Iterator[int]:
    """Ends ``j`` of a first group items[i:j] that fits ``limit`` and leaves k-1 items or more."""
    last = len(prefix) - 1 - (k - 1)
    j = i + 1
    while j <= last and prefix[j] - prefix[i] <= limit:
        yield j
        j += 1


def _step(prefix: list[int], i: int, j: int, rest: list[float]) -> float:
    return (prefix[j] - prefix[i]) ** 2 + rest[j]


# -- the balancers: profile, then solve ---------------------------------------------------


def by_time(
    partitions: int,
    module: nn.Sequential,
    sample: Any,
    *,
    timeout: float = 1.0,
    device: torch.device | str | None = None,
    repeats: int = 5,
) -> list[int]:
    """Balance ``module`` by measured forward+backward time per layer on ``sample``.

    See :func:`profile_times`; the module is left untouched.
    """
    _check_partitions(partitions, check_sequential(module))
    times = profile_times(module, sample, timeout=timeout, device=device, repeats=repeats)
    return solve(times, partitions)


def by_size(
    partitions: int, module: nn.Sequential, sample: Any, *, param_scale: float = 2.0
) -> list[int]:
    """Balance ``module`` by estimated memory per layer on ``sample``.

    See :func:`profile_sizes`; the module is left untouched.
    """
    _check_partitions(partitions, check_sequential(module))
    return solve(profile_sizes(module, sample, param_scale=param_scale), partitions)


def balance_by_time(
    partitions: int,
    module: nn.Sequential,
    sample: Any,
    *,
    timeout: float = 1.0,
    device: torch.device | str | None = None,
) -> list[int]:
    """torchgpipe's ``balance_by_time``: balance by forward+backward time per layer on
    ``sample`` (a micro-batch), run on ``device`` (default: CUDA when present, else the CPU)."""
    _check_no_grads(module)
    return by_time(partitions, module, sample, timeout=timeout, device=default_device(device))


def balance_by_size(
    partitions: int,
    module: nn.Sequential,
    input: Any,
    *,
    chunks: int = 1,
    param_scale: float = 2.0,
    device: torch.device | str | None = None,
) -> list[int]:
    """torchgpipe's ``balance_by_size``: balance by memory per layer, counting
    ``param_scale`` x parameter bytes plus the bytes each layer keeps for backward on one
    micro-batch of ``input`` (the first ``ceil(batch / chunks)`` samples), run on ``device``
    (default: CUDA when present, else the CPU). The bytes are those the activation estimate
    (:func:`fastpipe.memory.estimate_activation_peaks`) profiles: a storage several layers save
    counts once, for the first that saves it. The module is untouched."""
    _check_no_grads(module)
    _check_partitions(partitions, check_sequential(module))
    check_positive("chunks", chunks, integer=True)
    sizes = profile_saved_sizes(module, first_microbatch(input, chunks),
                                param_scale=param_scale, device=default_device(device))
    return solve(sizes, partitions)


def _check_no_grads(module: Any) -> None:
    """torchgpipe's check before profiling: no parameter may hold a gradient yet."""
    named = getattr(module, "named_parameters", None)
    held = [name for name, p in named() if p.grad is not None] if callable(named) else []
    if held:
        more = f" and {len(held) - 1} more" if len(held) > 1 else ""
        raise ValueError(f"some parameter already has gradient ({held[0]!r}{more}); the "
                         f"balancers profile the layers' own backward, so clear the gradients "
                         f"first with module.zero_grad(set_to_none=True)")
