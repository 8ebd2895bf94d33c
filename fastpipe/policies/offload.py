"""Activation offload (``checkpoint='offload'``): saved tensors wait for backward in host memory.

During a training forward, the tensors that autograd saves for backward (activations, not the
stage's parameters or its boundary inputs, which live on anyway) are copied into host buffers of a
per-stage :func:`~fastpipe.ops.pinned_pool.host_pool` through
``torch.autograd.graph.saved_tensors_hooks``; the device copy is then freed by the allocator. When
a micro-batch's backward starts, its tensors are copied back (if not already) and so are those of
the stage's next micro-batch, so that copy overlaps this backward. Values are copied bit for bit,
so gradients are exactly those of ``checkpoint='never'``.

On a CUDA stage the copies run on two side streams (device-to-host, host-to-device) into pinned
buffers, with the ordering of :mod:`fastpipe.streams.offload_copies`. On a CPU stage the same code
runs synchronously into plain host buffers: nothing is saved there (host memory is the device
memory), but every step of the mechanism runs and is tested on the CPU.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Callable, ContextManager, Dict, Iterable, List, Optional, Set, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ..ops.pinned_pool import host_pool
from ..streams.offload_copies import OffloadCopies

__all__ = ["MODE", "StageOffloader", "forward_context", "offloader", "prefetch"]

MODE = "offload"
MIN_BYTES_CUDA = 16 * 1024  # smaller saved tensors stay on a GPU (a copy would cost more)

_NOTHING = contextlib.nullcontext()
_offloaders: "weakref.WeakKeyDictionary[Any, StageOffloader]" = weakref.WeakKeyDictionary()
_offloaders_lock = threading.Lock()


class _Stash:
    """Returns host buffers to the pool once the copies that use them have finished."""

    def __init__(self, pool: Any, done: Callable[[Any], bool]) -> None:
        self.pool = pool
        self._done = done  # whether a copy's event has completed
        self._waiting: List[Tuple[Any, torch.Tensor]] = []
        self._lock = threading.Lock()

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A host buffer of at least ``nbytes``, after recycling the buffers whose copies ended."""
        with self._lock:
            still = []
            for event, buffer in self._waiting:
                if self._done(event):
                    self.pool.release(buffer)
                else:
                    still.append((event, buffer))
            self._waiting = still
        return self.pool.acquire(nbytes)

    def give_back(self, buffer: torch.Tensor, event: Any) -> None:
        """Return ``buffer`` to the pool once ``event`` (the last copy using it) has completed."""
        with self._lock:
            self._waiting.append((event, buffer))


class _Packed:
    """One saved tensor, offloaded to a host buffer; brought back to its device on demand."""

    __slots__ = ("owner", "shape", "dtype", "buffer", "host", "copied", "value", "fetched")

    def __init__(self, owner: "StageOffloader", t: torch.Tensor) -> None:
        self.owner = owner
        self.shape, self.dtype = t.shape, t.dtype
        nbytes = t.numel() * t.element_size()
        self.buffer: Optional[torch.Tensor] = owner.stash.acquire(nbytes)
        self.host = self.buffer[:nbytes].view(t.dtype).view(t.shape)
        self.copied = owner.copy_out(t, self.host)
        self.value: Optional[torch.Tensor] = None
        self.fetched: Any = None  # the in-copy's event

    def fetch(self) -> None:
        """Start copying the tensor back to its device (once); frees the host buffer after."""
        if self.value is None:
            self.value, self.fetched = self.owner.copy_in(self.host, self.copied)
            self._give_back(self.fetched)

    def get(self) -> torch.Tensor:
        """The tensor on its device, ready for the current stream."""
        self.fetch()
        self.owner.wait(self.fetched, self.value)
        return self.value

    def _give_back(self, event: Any) -> None:
        if self.buffer is not None:
            self.owner.stash.give_back(self.buffer, event)
            self.buffer = self.host = None

    def __del__(self) -> None:  # a graph freed without its backward (e.g. an aborted step)
        try:
            self._give_back(self.copied)
        except Exception:  # interpreter shutdown: nothing to return to
            pass


class _SavedOnce:
    """The tensors offloaded so far in one forward, found again by the identity of their memory.

    A tensor is identified by its storage object (not the storage's address: a freed tensor's
    address is reused by the next allocation, which must not be mistaken for it), its place in
    that storage, and its version counter. Each entry holds a weak reference to its storage,
    which keeps the storage object's identity from being reused while the entry exists, without
    keeping the tensor's memory alive.
    """

    def __init__(self) -> None:
        self._found: Dict[Tuple[Any, ...], Tuple[StorageWeakRef, _Packed]] = {}

    @staticmethod
    def _key(t: torch.Tensor) -> Tuple[Any, ...]:
        storage = t.untyped_storage()
        return (storage._cdata, storage.data_ptr(), t.storage_offset(), tuple(t.shape),
                t.stride(), t.dtype, t._version)

    def find(self, t: torch.Tensor) -> Optional["_Packed"]:
        """The copy already made of ``t`` in this forward, if any."""
        entry = self._found.get(self._key(t))
        return None if entry is None else entry[1]

    def add(self, t: torch.Tensor, packed: "_Packed") -> "_Packed":
        """Remember ``packed`` as the copy of ``t``."""
        self._found[self._key(t)] = (StorageWeakRef(t.untyped_storage()), packed)
        return packed


class StageOffloader:
    """Offloads one stage's saved tensors, per micro-batch, and prefetches them for backward.
    ``copies`` orders the copies (default: on ``device``'s own streams); ``pool`` hands out the
    host buffers (default: pinned on a GPU)."""

    def __init__(self, device: torch.device, copies: Optional[OffloadCopies] = None,
                 pool: Optional[Any] = None) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.copies = copies or OffloadCopies(device)
        self.stash = _Stash(pool or host_pool(pinned=self.cuda), self.copies.done)
        self.min_bytes = MIN_BYTES_CUDA if self.cuda else 0
        self.pending: Dict[int, List[_Packed]] = {}  # micro-batch -> its offloaded tensors

    # ------------------------------------------------------------------ forward
    def saving(self, microbatch: int, keep: Iterable[torch.Tensor]) -> ContextManager[Any]:
        """Offload what autograd saves inside the block for ``microbatch``, except the tensors
        sharing memory with ``keep`` (parameters, buffers, boundary inputs)."""
        kept = {t.untyped_storage().data_ptr() for t in keep}
        packs = self.pending[microbatch] = []
        seen = _SavedOnce()  # a tensor saved by two ops is copied once

        def pack(t: torch.Tensor) -> Any:
            if not self._worth_it(t, kept):
                return t
            packed = seen.find(t)
            if packed is None:
                packed = seen.add(t, _Packed(self, t))
                packs.append(packed)
            return packed

        return torch.autograd.graph.saved_tensors_hooks(pack, _unpack)

    def _worth_it(self, t: torch.Tensor, kept: Set[int]) -> bool:
        return (t.device == self.device and t.is_contiguous() and not t.is_sparse
                and t.numel() * t.element_size() >= max(self.min_bytes, 1)
                and t.untyped_storage().data_ptr() not in kept)

    def copy_out(self, t: torch.Tensor, host: torch.Tensor) -> Any:
        """Copy ``t`` into ``host`` after the current stream's work; the copy's event."""
        return self.copies.copy_out(t, host)

    # ------------------------------------------------------------------ backward
    def prefetch(self, microbatch: int) -> None:
        """Bring ``microbatch``'s tensors back and start on the next held micro-batch's."""
        packs = self.pending.pop(microbatch, [])
        later = [m for m in self.pending if m > microbatch] or list(self.pending)
        nxt = self.pending.get(min(later), []) if later else []
        for packed in packs + nxt:
            packed.fetch()

    def copy_in(self, host: torch.Tensor, copied: Any) -> Tuple[torch.Tensor, Any]:
        """A device tensor being filled from ``host`` (after ``copied``) and its ready event."""
        return self.copies.copy_in(host, copied)

    def wait(self, fetched: Any, value: torch.Tensor) -> None:
        """Make the current stream wait until ``value`` has landed (no-op on the CPU)."""
        self.copies.ready(value, fetched)

    def pool_stats(self) -> Tuple[int, int, int, int]:
        """The host pool's (bytes reserved, bytes in use, buffers allocated, buffers free)."""
        return self.stash.pool.stats()


def _unpack(saved: Any) -> torch.Tensor:
    return saved.get() if isinstance(saved, _Packed) else saved


def offloader(stage: Any) -> StageOffloader:
    """The offloader of ``stage`` (a ``runtime.stage.Stage``), made on first use."""
    with _offloaders_lock:
        found = _offloaders.get(stage)
        if found is None:
            found = _offloaders[stage] = StageOffloader(stage.device)
        return found


def forward_context(mode: str, stage: Any, microbatch: int,
                    boundary: Iterable[torch.Tensor]) -> ContextManager[Any]:
    """The context a training forward of ``microbatch`` runs in under checkpoint ``mode``:
    offloading saved tensors for ``'offload'``, nothing otherwise."""
    if mode != MODE:
        return _NOTHING
    keep = [*stage.module.parameters(), *stage.module.buffers(), *boundary]
    return offloader(stage).saving(microbatch, keep)


def prefetch(mode: str, stage: Any, microbatch: int) -> None:
    """Called when ``microbatch``'s backward starts: under ``'offload'``, bring its saved tensors
    back to the stage's device and start prefetching the next micro-batch's."""
    if mode == MODE:
        offloader(stage).prefetch(microbatch)
