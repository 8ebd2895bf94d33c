"""Moving lists of tensors between devices: the Python face of ``fastpipe::transfer``.

``transfer`` is what the pipeline calls on every stage hop. Tensors already on the target device
are handed back untouched (a same-device hop costs nothing); the others are grouped by source
device type and copied with the native ``fastpipe::transfer`` op when ``fastpipe._C`` loaded, or
with :func:`reference_transfer` otherwise. Both paths are differentiable: the gradient of each
moved tensor is sent back to the device its input came from.

The native op always returns new tensors (never aliases of its inputs), with the inputs' dtypes
and shapes. Strides follow ``Tensor.to``: dense inputs keep their strides (a transposed input
stays transposed), inputs with gaps or overlaps (e.g. slices with a step) come out contiguous.
"""
from __future__ import annotations

import functools
import threading
from typing import Any, Dict, List, Optional, Sequence, Union

import torch
from torch import Tensor

from .. import _native
from . import registry

__all__ = ["OP_NAME", "DeviceLike", "reference_transfer", "register_python_impls", "transfer"]

OP_NAME = "fastpipe::transfer"
DeviceLike = Union[torch.device, str, int]

# Device types with a compiled kernel, and the dispatch key each one is registered under.
_KERNEL_KEYS = {"cpu": "CPU", "cuda": "CUDA"}
_registered = False
_register_lock = threading.Lock()


def reference_transfer(
    tensors: Sequence[Tensor], device: DeviceLike, non_blocking: bool = False
) -> List[Tensor]:
    """Copies each tensor to ``device`` with plain ``Tensor.to`` (always a new tensor, autograd
    records the move); the oracle the native op is tested against and its fallback."""
    target = torch.device(device)
    return [t.to(target, non_blocking=non_blocking, copy=True) for t in tensors]


def transfer(
    tensors: Sequence[Tensor],
    device: DeviceLike,
    non_blocking: bool = False,
    *,
    use_native: Optional[bool] = None,
) -> List[Tensor]:
    """Moves ``tensors`` to ``device`` in order, returning tensors already there as they are.

    ``use_native``: None uses ``fastpipe::transfer`` when the native library loaded, True
    requires it (RuntimeError if unavailable), False always uses :func:`reference_transfer`.
    Source device types without a compiled kernel (e.g. meta, or CUDA in a CPU-only build)
    always take the reference path.
    """
    if _all_on(tensors, device):
        return list(tensors)  # the pipeline's common same-device hop: nothing to resolve or move
    target = _resolve_device(device)
    out = list(tensors)
    groups = _group_by_source_kind(out, target)
    if not groups:
        return out
    native = _native_wanted(use_native)
    for kind, positions in groups.items():
        moved = _move_group([out[i] for i in positions], kind, target, non_blocking, native)
        for i, tensor in zip(positions, moved):
            out[i] = tensor
    return out


def _all_on(tensors: Sequence[Tensor], device: DeviceLike) -> bool:
    """Whether every item is a tensor already on ``device`` (a fully specified torch.device)."""
    if not isinstance(device, torch.device) or (device.type != "cpu" and device.index is None):
        return False
    return all(isinstance(t, Tensor) and t.device == device for t in tensors)


def _resolve_device(device: DeviceLike) -> torch.device:
    """Turns ``device`` into a torch.device; a bare "cuda" means the current CUDA device."""
    target = torch.device(device)
    if target.type == "cuda" and target.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return target


def _group_by_source_kind(tensors: List[Tensor], target: torch.device) -> Dict[str, List[int]]:
    """Positions of the tensors that must move, keyed by their device type (insertion-ordered)."""
    groups: Dict[str, List[int]] = {}
    for i, t in enumerate(tensors):
        if not isinstance(t, Tensor):
            raise TypeError(f"transfer: item {i} is a {type(t).__name__}, not a Tensor")
        if t.device != target:
            groups.setdefault(t.device.type, []).append(i)
    return groups


def _native_wanted(use_native: Optional[bool]) -> bool:
    """Decides whether to use the native op (see ``transfer``'s ``use_native``)."""
    if use_native is False:
        return False
    loaded = _native.load()
    if use_native and not loaded:
        raise RuntimeError(f"transfer: the native op is unavailable ({_native.load_error()})")
    if loaded:
        register_python_impls()
    return loaded


def _move_group(
    group: List[Tensor], kind: str, target: torch.device, non_blocking: bool, native: bool
) -> List[Tensor]:
    """Moves tensors of one source device type with the native op, if it has a kernel for it."""
    if native and _has_kernel(kind):
        return list(torch.ops.fastpipe.transfer(group, target, non_blocking))
    return reference_transfer(group, target, non_blocking)


@functools.lru_cache(maxsize=None)
def _has_kernel(kind: str) -> bool:
    """Whether the loaded library registered a ``fastpipe::transfer`` kernel for ``kind``."""
    key = _KERNEL_KEYS.get(kind)
    return key is not None and torch._C._dispatch_has_kernel_for_dispatch_key(OP_NAME, key)


# --- Python-side registrations for the C++-defined op -------------------------------------------


def _op_defined() -> bool:
    """Whether ``fastpipe::transfer`` exists in the dispatcher (i.e. ``fastpipe._C`` is loaded)."""
    return hasattr(torch.ops.fastpipe, "transfer")


def _fake_transfer(tensors: List[Tensor], device: torch.device, non_blocking: bool = False):
    """Shape/dtype/stride propagation (FakeTensor, meta, torch.compile): empty copies on device."""
    kinds = {t.device.type for t in tensors}
    torch._check(
        len(kinds) <= 1,
        lambda: f"fastpipe::transfer: one call takes one device type, got {sorted(kinds)}",
    )
    return [torch.empty_like(t, device=device) for t in tensors]


def _setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
    """Remembers where each input came from and which inputs want a gradient."""
    tensors, _, non_blocking = inputs
    ctx.sources = [t.device for t in tensors]
    ctx.wants_grad = [t.requires_grad for t in tensors]
    ctx.non_blocking = non_blocking
    ctx.set_materialize_grads(False)  # unused outputs: no zero tensors shipped back


def _backward(ctx: Any, grads: List[Optional[Tensor]]):
    """Sends each gradient back to its input's device, one op call per original device."""
    wanted = [g if w else None for g, w in zip(grads, ctx.wants_grad)]
    moved = _send_back(wanted, ctx.sources, ctx.non_blocking)
    # The dispatcher drops trailing arguments equal to their defaults before autograd sees the
    # call, so answer one entry per argument actually passed (needs_input_grad mirrors them).
    return (moved, *([None] * (len(ctx.needs_input_grad) - 1)))


def _send_back(
    grads: List[Optional[Tensor]], devices: List[torch.device], non_blocking: bool
) -> List[Optional[Tensor]]:
    """Moves ``grads[i]`` to ``devices[i]`` (None stays None), grouped by destination device."""
    out: List[Optional[Tensor]] = [None] * len(grads)
    by_device: Dict[torch.device, List[int]] = {}
    for i, g in enumerate(grads):
        if g is not None:
            by_device.setdefault(devices[i], []).append(i)
    for device, positions in by_device.items():
        # A non-blocking copy into host memory would race the autograd engine: only copies
        # onto an accelerator (ordered on its stream) keep the caller's non_blocking.
        blocking_needed = device.type == "cpu"
        group = [grads[i] for i in positions]
        kind = group[0].device.type  # all gradients sit on the forward's target device
        moved = _move_group(group, kind, device, non_blocking and not blocking_needed, True)
        for i, g in zip(positions, moved):
            out[i] = g
    return out


def register_python_impls() -> bool:
    """Registers the op's fake impl and autograd formula once, if ``fastpipe._C`` is loaded;
    returns whether they are registered. Called on import and by the loader."""
    global _registered
    with _register_lock:
        if not _registered and _op_defined():
            registry.register_fake(OP_NAME, _fake_transfer)  # the library's fake module
            torch.library.register_autograd(OP_NAME, _backward, setup_context=_setup_context)
            _registered = True
    return _registered


register_python_impls()
