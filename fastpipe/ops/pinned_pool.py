"""A pool of (pinned) host buffers for activation offload: the Python face of
``torch.classes.fastpipe.PinnedPool``.

Offload copies the same tensor sizes to the host every step; the pool allocates each host buffer
once and hands it out again, so page-locked memory (slow to allocate) is not allocated per step.
:func:`host_pool` returns the native pool when ``fastpipe._C`` loaded and :class:`ReferencePool`,
its pure-Python twin with the same methods (and the oracle of its tests), otherwise.
"""
from __future__ import annotations

import threading
from typing import Any, Dict, List, Tuple

import torch

from .. import _native

__all__ = ["GRANULE", "ReferencePool", "host_pool"]

GRANULE = 512  # buffer sizes are multiples of this many bytes (as in csrc/cpu/pinned_pool.cpp)


class ReferencePool:
    """Host buffers of at least ``nbytes`` (at most twice that), reused after ``release``."""

    def __init__(self, pinned: bool) -> None:
        self._pinned = pinned
        self._lock = threading.Lock()
        self._free: List[torch.Tensor] = []
        self._in_use: Dict[int, int] = {}
        self._reserved = self._in_use_bytes = self._allocations = 0

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A uint8 host buffer of at least ``nbytes`` bytes, reused when a free one fits."""
        if nbytes < 0:
            raise RuntimeError(f"PinnedPool.acquire: nbytes must be >= 0, got {nbytes}")
        size = -(-max(nbytes, 1) // GRANULE) * GRANULE
        with self._lock:
            fits = [b for b in self._free if size <= b.numel() <= 2 * size]
            if fits:
                buffer = min(fits, key=torch.Tensor.numel)
                self._free = [b for b in self._free if b is not buffer]
            else:
                buffer = torch.empty(size, dtype=torch.uint8, pin_memory=self._pinned)
                self._reserved += size
                self._allocations += 1
            self._in_use[buffer.data_ptr()] = buffer.numel()
            self._in_use_bytes += buffer.numel()
        return buffer

    def release(self, buffer: torch.Tensor) -> None:
        """Gives back a buffer returned by ``acquire``."""
        with self._lock:
            size = self._in_use.pop(buffer.data_ptr(), None)
            if size is None:
                raise RuntimeError("PinnedPool.release: this buffer is not in use from this pool "
                                   "(released twice, or not returned by acquire)")
            self._in_use_bytes -= size
            self._free.append(buffer)

    def empty_cache(self) -> None:
        """Frees the buffers nobody uses."""
        with self._lock:
            self._reserved -= sum(b.numel() for b in self._free)
            self._free = []

    def stats(self) -> Tuple[int, int, int, int]:
        """(bytes reserved, bytes in use, buffers allocated so far, buffers free now)."""
        with self._lock:
            return self._reserved, self._in_use_bytes, self._allocations, len(self._free)

    def pinned(self) -> bool:
        return self._pinned


def host_pool(pinned: bool, *, use_native: bool = True) -> Any:
    """A new host-buffer pool (page-locked buffers when ``pinned``): the native one if loaded."""
    if use_native and _native.load():
        try:
            return torch.classes.fastpipe.PinnedPool(pinned)
        except RuntimeError:  # a library built before the pool existed
            pass
    return ReferencePool(pinned)
