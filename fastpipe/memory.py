"""Peak activation memory per stage, measured on any device.

On GPUs ``torch.cuda.max_memory_allocated`` answers per device, but stages sharing a device (and
every CPU stage) share one number, and on the CPU torch's allocations are invisible to
``tracemalloc``. ``SavedActivationMeter`` instead counts, per stage, the bytes of the tensors
autograd saves for backward while they are alive (each storage once; parameters excluded), and
keeps the peak. It measures what pipelining trades: activations held for in-flight
micro-batches. Inputs kept by checkpointed micro-batches for their recomputation are outside
autograd and not counted (they are one boundary tensor per micro-batch).
"""
from __future__ import annotations

import threading
from typing import Any, Dict, List, Sequence, Tuple

import torch
from torch import nn


class _Saved:
    """A saved tensor, counted while autograd holds it."""

    __slots__ = ("tensor", "release")

    def __init__(self, tensor: torch.Tensor, release: Any) -> None:
        self.tensor, self.release = tensor, release

    def __del__(self) -> None:
        self.release()


class SavedActivationMeter:
    """Counts live saved-for-backward bytes per stage of ``partitions`` (one module per stage).

    ``with SavedActivationMeter(pipe.partitions) as meter: ...`` then ``meter.peak_bytes``.
    """

    def __init__(self, partitions: Sequence[nn.Module]) -> None:
        self.partitions = list(partitions)
        self.peak_bytes: List[int] = [0] * len(self.partitions)
        self.live_bytes: List[int] = [0] * len(self.partitions)
        self._storages: List[Dict[int, List[int]]] = [{} for _ in self.partitions]
        self._lock = threading.Lock()
        self._local = threading.local()
        self._handles: List[Any] = []
        self._params = {p.untyped_storage().data_ptr() for m in self.partitions
                        for p in m.parameters()}

    def __enter__(self) -> "SavedActivationMeter":
        for stage, module in enumerate(self.partitions):
            self._handles.append(module.register_forward_pre_hook(
                lambda _m, _args, stage=stage: self._enter(stage)))
            self._handles.append(module.register_forward_hook(
                lambda _m, _args, _out: self._exit(), always_call=True))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _enter(self, stage: int) -> None:
        hooks = torch.autograd.graph.saved_tensors_hooks(
            lambda t: self._pack(stage, t), lambda packed: _unpack(packed))
        hooks.__enter__()
        self._stack().append(hooks)

    def _exit(self) -> None:
        stack = self._stack()
        if stack:
            stack.pop().__exit__(None, None, None)

    def _stack(self) -> List[Any]:
        if not hasattr(self._local, "stack"):
            self._local.stack = []
        return self._local.stack

    def _pack(self, stage: int, tensor: torch.Tensor) -> Any:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self._params or storage.nbytes() == 0:
            return tensor
        nbytes = storage.nbytes()
        self._count(stage, key, nbytes, +1)
        return _Saved(tensor, lambda: self._count(stage, key, nbytes, -1))

    def _count(self, stage: int, key: int, nbytes: int, delta: int) -> None:
        with self._lock:
            entry = self._storages[stage].setdefault(key, [nbytes, 0])
            entry[1] += delta
            if entry[1] == 1 and delta > 0:
                self.live_bytes[stage] += nbytes
            elif entry[1] == 0:
                self.live_bytes[stage] -= entry[0]
                del self._storages[stage][key]
            self.peak_bytes[stage] = max(self.peak_bytes[stage], self.live_bytes[stage])

    def reset_peak(self) -> None:
        """Start a new peak from what is alive now."""
        with self._lock:
            self.peak_bytes = list(self.live_bytes)


def _unpack(packed: Any) -> torch.Tensor:
    return packed.tensor if isinstance(packed, _Saved) else packed


def format_bytes(count: float) -> str:
    """``1.5 MB``-style sizes (powers of 1024)."""
    for unit in ("B", "KB", "MB", "GB"):
        if count < 1024 or unit == "GB":
            return f"{count:.1f} {unit}" if unit != "B" else f"{int(count)} B"
        count /= 1024
    return f"{count:.1f} GB"


def cuda_peaks(devices: Sequence[torch.device]) -> Tuple[int, ...]:
    """Peak allocated bytes of each stage's CUDA device since the last reset (0 for the CPU)."""
    return tuple(torch.cuda.max_memory_allocated(d) if d.type == "cuda" else 0 for d in devices)
