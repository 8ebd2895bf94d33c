"""Per-layer costs of an ``nn.Sequential``, measured for the balancer (:mod:`fastpipe.balance`).

:func:`profile_times` (forward plus backward seconds), :func:`profile_sizes` (parameter, buffer
and output bytes) and :func:`profile_saved_sizes` (the bytes autograd keeps for backward) run
the layers one at a time, skip connections included (their layer-wise frame, see
:mod:`fastpipe.skip.api`), and leave the module's parameters, gradients, buffers, training
flags and the global RNG state as they found them.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from .skip.api import layerwise

__all__ = [
    "check_positive",
    "check_sequential",
    "default_device",
    "first_microbatch",
    "profile_saved_sizes",
    "profile_sizes",
    "profile_times",
    "saved_storages",
]


def profile_saved_sizes(
    module: nn.Sequential,
    sample: Any,
    *,
    param_scale: float = 2.0,
    device: torch.device | str | None = None,
) -> list[float]:
    """Bytes per layer: ``param_scale`` x parameter bytes + the storages autograd saves for
    backward on ``sample`` that the layer saves first (see :func:`saved_storages`).

    A storage saved by several layers (a layer's output that the next one saves as its input,
    views of one tensor) counts once, for the first layer that saves it, so the bytes of
    consecutive layers add up to what a stage holding them keeps for one micro-batch; a stage's
    first layer may also save its input, which the previous stage counted (the estimate,
    :func:`fastpipe.memory.estimate_activation_peaks`, adds it per stage). ``sample`` is taken
    as an activation that requires grad (as every stage's input but the first), as torchgpipe
    profiled.
    """
    check_sequential(module)
    check_positive("param_scale", param_scale, allow_zero=True)
    seen: set[int] = set()
    sizes = []
    profiled = saved_storages(list(module), sample, device=device, grad_input=True)
    for layer, saved in zip(module, profiled):
        own = sum(nbytes for key, nbytes in saved.items() if key not in seen)
        seen.update(saved)
        params = sum(_nbytes(p) for p in layer.parameters())
        sizes.append(param_scale * params + own)
    return sizes


def saved_storages(
    layers: list[nn.Module], sample: Any, *, device: torch.device | str | None = None,
    grad_input: bool = False,
) -> list[dict[int, int]]:
    """Per layer, the storages (data pointer -> bytes) of the tensors autograd saves for its
    backward, parameters excluded, when ``layers`` run one after another on ``sample``.

    One pass with grad, each layer a deep copy in its own training mode on ``device`` (default:
    where it lives), skip connections in their layer-wise frame, the RNG state restored; the
    graph stays connected (inputs keep their ``requires_grad``, as in a pipeline's stage) and
    every saved tensor alive until the end, so a storage has one key however many layers or
    views save it. Storages of ``sample`` (the caller's batch) keep their keys. ``grad_input``:
    ``sample``'s floating-point tensors require grad (a later stage's input); else they are
    taken as they are (a pipeline's first stage reads data).
    """
    result, keep = [], []
    x = _map_tensors(sample, _leaf) if grad_input else sample
    with _preserved_rng(nn.ModuleList(layers), sample, device), torch.enable_grad(), \
            layerwise():
        for layer in layers:
            target = _target_device(layer, x, device)
            sandbox = copy.deepcopy(layer).to(target)
            params = {p.untyped_storage().data_ptr() for p in sandbox.parameters()}
            saved: dict[int, int] = {}
            with _counting_saved(saved, params, keep):
                x = sandbox(_to(x, target))
            keep.append(x)
            result.append(saved)
    return result


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
    check_sequential(module)
    check_positive("timeout", timeout)
    check_positive("repeats", repeats, integer=True)
    deadline = time.perf_counter() + timeout
    times, x = [], sample
    with _preserved_rng(module, sample, device), torch.enable_grad(), layerwise():
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
    check_sequential(module)
    check_positive("param_scale", param_scale, allow_zero=True)
    sizes, x = [], sample
    with _eval_mode(module), torch.no_grad(), layerwise():
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


# -- the arguments (shared with the balancers) and helpers ---------------------------------


def default_device(device: Any) -> Any:
    """torchgpipe profiles on CUDA by default; without CUDA, on the CPU."""
    if device is not None:
        return device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def first_microbatch(input: Any, chunks: int) -> Any:
    """The first micro-batch of ``input`` split into ``chunks`` (``torch.chunk`` sizes)."""
    sizes = [t.size(0) for t in _tensors(input) if t.dim() > 0]
    if not sizes:
        return input
    rows = max(1, -(-sizes[0] // chunks))
    return _map_tensors(input, lambda t: t[:rows] if t.dim() > 0 else t)


@contextmanager
def _counting_saved(saved: dict[int, int], params: set[int], keep: list) -> Iterator[None]:
    """Record in ``saved`` (storage -> bytes) every non-parameter tensor saved for backward,
    keeping each in ``keep`` (so no storage is freed and its address reused meanwhile)."""
    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and storage.nbytes() > 0:
            saved.setdefault(storage.data_ptr(), storage.nbytes())
            keep.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


def check_sequential(module: object) -> int:
    """The number of layers of ``module``, which must be an ``nn.Sequential``."""
    if not isinstance(module, nn.Sequential):
        raise TypeError(f"module must be an nn.Sequential, got {type(module).__name__}")
    return len(module)


def check_positive(
    name: str, value: object, *, integer: bool = False, allow_zero: bool = False
) -> None:
    """Reject a ``value`` that is not a finite number (an int if ``integer``) above zero (or
    zero, if ``allow_zero``), naming the argument ``name``."""
    kinds = (int,) if integer else (int, float)
    ok = isinstance(value, kinds) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        kind = "an int" if integer else "a finite number"
        raise ValueError(f"{name} must be {kind} {bound}, got {value!r}")


def _tensors(x: Any) -> Iterator[torch.Tensor]:
    """Tensors in a nested tuple / list / dict structure, in order."""
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
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu" and hasattr(torch, "accelerator"):
        torch.accelerator.synchronize(device)


@contextmanager
def _preserved_rng(module: nn.Module, sample: Any, device: Any) -> Iterator[None]:
    """Restore the CPU and every involved CUDA device's RNG state afterwards."""
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
