"""Balancing: how many consecutive layers each pipeline stage gets.

:func:`solve` is the exact partition solver (pure Python, no torch).
:func:`by_time` and :func:`by_size` profile an ``nn.Sequential`` layer by layer
and feed the per-layer costs to it; they import torch only when called, and
leave the module's parameters, gradients, buffers, training flags and the
global RNG state as they found them.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["solve", "by_time", "by_size", "profile_times", "profile_sizes", "balance_by_time",
           "balance_by_size", "profile_saved_sizes"]


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


# -- profiling --------------------------------------------------------------------------


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
    _check_partitions(partitions, _check_sequential(module))
    times = profile_times(module, sample, timeout=timeout, device=device, repeats=repeats)
    return solve(times, partitions)


def by_size(
    partitions: int, module: nn.Sequential, sample: Any, *, param_scale: float = 2.0
) -> list[int]:
    """Balance ``module`` by estimated memory per layer on ``sample``.

    See :func:`profile_sizes`; the module is left untouched.
    """
    _check_partitions(partitions, _check_sequential(module))
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
    return by_time(partitions, module, sample, timeout=timeout, device=_default_device(device))


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
    ``param_scale`` x parameter bytes plus the bytes each layer keeps for backward (and its
    output) on one micro-batch of ``input`` (the first ``ceil(batch / chunks)`` samples),
    run on ``device`` (default: CUDA when present, else the CPU). The module is untouched."""
    _check_partitions(partitions, _check_sequential(module))
    _check_positive("chunks", chunks, integer=True)
    sizes = profile_saved_sizes(module, _first_microbatch(input, chunks),
                                param_scale=param_scale, device=_default_device(device))
    return solve(sizes, partitions)


def profile_saved_sizes(
    module: nn.Sequential,
    sample: Any,
    *,
    param_scale: float = 2.0,
    device: torch.device | str | None = None,
) -> list[float]:
    """Bytes per layer: ``param_scale`` x parameter bytes + the distinct storages of the
    tensors autograd saves for the layer's backward and of its output, on ``sample``.

    Each layer runs forward with grad, in its own training mode, on a deep copy on ``device``
    (default: where the layer lives); the RNG state is restored afterwards.
    """
    import torch

    _check_sequential(module)
    _check_positive("param_scale", param_scale, allow_zero=True)
    sizes, x = [], sample
    with _preserved_rng(module, sample, device), torch.enable_grad(), _layerwise():
        for layer in module:
            target = _target_device(layer, x, device)
            sandbox = copy.deepcopy(layer).to(target)
            params = {p.untyped_storage().data_ptr() for p in sandbox.parameters()}
            saved: dict[int, int] = {}
            with _counting_saved(saved, params):
                out = sandbox(_map_tensors(_to(x, target), _leaf))
            for t in _tensors(out):
                saved.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            param_bytes = sum(_nbytes(p) for p in sandbox.parameters())
            sizes.append(param_scale * param_bytes + sum(saved.values()))
            x = _map_tensors(out, lambda t: t.detach())
    return sizes


def profile_times(
    module: nn.Sequential,
    sample: Any,
    *,
    timeout: float = 1.0,
    device: torch.device | str | None = None,
    repeats: int = 5,
) -> list[float]:
    """Seconds per layer for forward plus backward (median of up to ``repeats`` timed
    runs after one warm-up; fewer once ``timeout`` seconds have passed in total).

    Each layer runs on a deep copy in training mode, on ``device`` (default: where
    the layer lives), fed the previous layer's output; its backward uses a
    ones gradient and is skipped when no output requires grad.
    """
    import torch

    _check_sequential(module)
    _check_positive("timeout", timeout)
    _check_positive("repeats", repeats, integer=True)
    deadline = time.perf_counter() + timeout
    times, x = [], sample
    with _preserved_rng(module, sample, device), torch.enable_grad(), _layerwise():
        for layer in module:
            target = _target_device(layer, x, device)
            sandbox = copy.deepcopy(layer).to(target).train()
            seconds, x = _time_layer(sandbox, _to(x, target), target, repeats, deadline)
            times.append(seconds)
    return times


def profile_sizes(module: nn.Sequential, sample: Any, *, param_scale: float = 2.0) -> list[float]:
    """Bytes per layer: ``param_scale`` x parameter bytes (weights plus gradients and
    optimizer state) + buffer bytes + output activation bytes on ``sample``.

    Layers run forward without grad in eval mode on the device they live on;
    training flags are restored afterwards.
    """
    import torch

    _check_sequential(module)
    _check_positive("param_scale", param_scale, allow_zero=True)
    sizes, x = [], sample
    with _eval_mode(module), torch.no_grad(), _layerwise():
        for layer in module:
            x = layer(_to(x, _target_device(layer, x, None)))
            params = sum(_nbytes(p) for p in layer.parameters())
            buffers = sum(_nbytes(b) for b in layer.buffers())
            outputs = sum(_nbytes(t) for t in _tensors(x))
            sizes.append(param_scale * params + buffers + outputs)
    return sizes


def _time_layer(
    layer: nn.Module, x: Any, device: torch.device, repeats: int, deadline: float
) -> tuple[float, Any]:
    inputs = _map_tensors(x, _leaf)
    _forward_backward(layer, inputs, device)  # warm-up
    samples = []
    for _ in range(repeats):
        layer.zero_grad(set_to_none=True)
        for t in _tensors(inputs):
            t.grad = None
        seconds, output = _forward_backward(layer, inputs, device)
        samples.append(seconds)
        if time.perf_counter() > deadline:
            break
    return statistics.median(samples), _map_tensors(output, lambda t: t.detach())


def _forward_backward(layer: nn.Module, inputs: Any, device: torch.device) -> tuple[float, Any]:
    import torch

    start = time.perf_counter()
    output = layer(inputs)
    _synchronize(device)
    forward = time.perf_counter() - start
    roots = [t for t in _tensors(output) if t.requires_grad]
    if not roots:
        return forward, output
    grads = [torch.ones_like(t) for t in roots]
    start = time.perf_counter()
    torch.autograd.backward(roots, grads)
    _synchronize(device)
    return forward + time.perf_counter() - start, output


# -- helpers ----------------------------------------------------------------------------------


def _default_device(device: Any) -> Any:
    """torchgpipe profiles on CUDA by default; without CUDA, on the CPU."""
    import torch

    if device is not None:
        return device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _first_microbatch(input: Any, chunks: int) -> Any:
    """The first micro-batch of ``input`` split into ``chunks`` (``torch.chunk`` sizes)."""
    sizes = [t.size(0) for t in _tensors(input) if t.dim() > 0]
    if not sizes:
        return input
    rows = max(1, -(-sizes[0] // chunks))
    return _map_tensors(input, lambda t: t[:rows] if t.dim() > 0 else t)


@contextmanager
def _counting_saved(saved: dict[int, int], params: set[int]) -> Iterator[None]:
    """Record in ``saved`` (storage -> bytes) every non-parameter tensor saved for backward."""
    import torch

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


def _check_sequential(module: object) -> int:
    from torch import nn

    if not isinstance(module, nn.Sequential):
        raise TypeError(f"module must be an nn.Sequential, got {type(module).__name__}")
    return len(module)


def _check_positive(
    name: str, value: object, *, integer: bool = False, allow_zero: bool = False
) -> None:
    kinds = (int,) if integer else (int, float)
    ok = isinstance(value, kinds) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        kind = "an int" if integer else "a finite number"
        raise ValueError(f"{name} must be {kind} {bound}, got {value!r}")


def _tensors(x: Any) -> Iterator[torch.Tensor]:
    """Tensors in a nested tuple / list / dict structure, in order."""
    import torch

    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for item in x:
            yield from _tensors(item)
    elif isinstance(x, dict):
        for item in x.values():
            yield from _tensors(item)


def _map_tensors(x: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply ``fn`` to every tensor in a nested structure, keeping its shape."""
    import torch

    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # namedtuple
        return type(x)(*(_map_tensors(item, fn) for item in x))
    if isinstance(x, (tuple, list)):
        return type(x)(_map_tensors(item, fn) for item in x)
    if isinstance(x, dict):
        return {key: _map_tensors(item, fn) for key, item in x.items()}
    return x


def _leaf(t: torch.Tensor) -> torch.Tensor:
    """A detached leaf (sharing storage) that requires grad when its dtype allows."""
    leaf = t.detach()
    return leaf.requires_grad_(leaf.is_floating_point() or leaf.is_complex())


def _to(x: Any, device: torch.device) -> Any:
    return _map_tensors(x, lambda t: t.to(device))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _target_device(layer: nn.Module, x: Any, device: torch.device | str | None) -> torch.device:
    """``device`` if given, else where the layer's weights live, else where its input is."""
    import torch

    if device is not None:
        return torch.device(device)
    for t in _layer_tensors(layer):
        return t.device
    for t in _tensors(x):
        return t.device
    return torch.device("cpu")


def _layer_tensors(layer: nn.Module) -> Iterator[torch.Tensor]:
    yield from layer.parameters()
    yield from layer.buffers()


def _synchronize(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu" and hasattr(torch, "accelerator"):
        torch.accelerator.synchronize(device)


def _layerwise() -> Any:
    """Skip connections (``fastpipe.skip``) work with layers profiled one at a time."""
    from .skip.api import layerwise

    return layerwise()


@contextmanager
def _preserved_rng(module: nn.Module, sample: Any, device: Any) -> Iterator[None]:
    """Restore the CPU and every involved CUDA device's RNG state afterwards."""
    import torch

    cuda = {t.device for t in (*_layer_tensors(module), *_tensors(sample)) if t.is_cuda}
    if device is not None and torch.device(device).type == "cuda":
        cuda.add(torch.device(device))
    with torch.random.fork_rng(devices=sorted(cuda, key=str)):
        yield


@contextmanager
def _eval_mode(module: nn.Module) -> Iterator[None]:
    """Put every submodule in eval mode, restoring each one's own flag afterwards."""
    flags = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, training in flags:
            m.training = training
