"""The one interface through which fastpipe orders GPU work: streams, events, the caching
allocator's stream records, device guards, and the allocations and copies whose stream matters.

Every place that orders work across streams (a stream protocol: the stage hand-off, offload out
and in, the grouped exchange's pack, send and receive, graph capture, the loss scaler's flag) is
a small seam in :mod:`fastpipe.streams` that performs its operations through a
:class:`StreamBackend` it is given. On a GPU that is :data:`CUDA` (torch's own calls); on the
CPU it is :data:`HOST`, where every operation is a no-op or a plain copy, so the same seam runs
on every device. The tests hand a seam a recording backend instead and check the happens-before
relations a GPU needs on the exact sequence of operations the seam issued.
"""
from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Iterator, Optional, Protocol, Sequence

import torch

__all__ = ["CUDA", "HOST", "CudaBackend", "HostBackend", "StreamBackend", "backend_for"]

_NOTHING = contextlib.nullcontext()
_NO_GRAPHS = "graphs need a CUDA device; the CPU runs stages eagerly"


class StreamBackend(Protocol):
    """Stream, event, allocator and device-guard operations (see the module docstring).

    Streams and events are opaque: a seam only passes back what the backend gave it. An
    allocation (``empty``) belongs to the stream current on its device when it is made, as the
    caching allocator's blocks do; ``copy`` is issued on the current stream of ``dst``'s device.
    """

    def current(self, device: torch.device) -> Any:
        """The stream current on ``device`` on this thread (``None`` where there are none)."""

    def new_stream(self, device: torch.device) -> Any:
        """A new side stream of ``device``."""

    def using(self, stream: Any) -> ContextManager[Any]:
        """Make ``stream`` current on its device inside the block."""

    def on_device(self, device: torch.device) -> ContextManager[Any]:
        """Make ``device`` the current device inside the block (a device guard)."""

    def wait_stream(self, waiter: Any, producer: Any) -> None:
        """Work issued on ``waiter`` from now on starts after all work queued on ``producer``."""

    def record_event(self, stream: Any) -> Any:
        """An event marking the work queued on ``stream`` so far."""

    def wait_event(self, waiter: Any, event: Any) -> None:
        """Work issued on ``waiter`` from now on starts after ``event``."""

    def done(self, event: Any) -> bool:
        """Whether ``event`` has completed (never blocks)."""

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """Tell the caching allocator that ``stream`` uses ``tensor``'s memory: it is not
        handed out again until the work queued on ``stream`` so far has finished."""

    def empty(self, shape: Sequence[int], dtype: torch.dtype,
              device: torch.device, pin_memory: bool = False) -> torch.Tensor:
        """An uninitialised tensor, from the pool of the stream current on ``device``."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = True) -> None:
        """``dst.copy_(src)``, issued on the current stream (of the device the copy runs on)."""

    # Graphs: captured work replayed with one launch (fastpipe.streams.capture).

    def graph_pool(self, device: torch.device) -> Any:
        """A new memory pool for graphs captured on ``device``. Captures given the same pool
        share its memory: a block one capture frees may be handed to a later capture into the
        pool, never to work outside graphs."""

    def new_graph(self) -> Any:
        """A new, empty graph to capture into."""

    def capturing(self, graph: Any, stream: Any, pool: Any, mode: str) -> ContextManager[Any]:
        """Inside the block, ``stream`` is current on its device and the work issued on it is
        recorded into ``graph`` instead of run; memory allocated meanwhile comes from ``pool``
        and keeps its address for every replay. ``mode`` is CUDA's stream capture mode: which
        unsafe calls (a synchronisation, an allocation outside the pool) break the capture:
        any thread's (``'global'``), this thread's (``'thread_local'``) or none
        (``'relaxed'``). ``stream`` must not be a default stream, and nothing recorded outside
        the capture may be waited for inside it."""

    def replay(self, graph: Any) -> None:
        """Issue ``graph``'s captured work again on the current stream of its device, reading
        and writing the memory the capture used."""


class HostBackend:
    """The CPU form: no streams, so ordering is program order; copies run at once."""

    def current(self, device: torch.device) -> Optional[Any]:
        return None

    def new_stream(self, device: torch.device) -> Optional[Any]:
        return None

    def using(self, stream: Any) -> ContextManager[Any]:
        return _NOTHING

    def on_device(self, device: torch.device) -> ContextManager[Any]:
        return _NOTHING

    def wait_stream(self, waiter: Any, producer: Any) -> None:
        pass

    def record_event(self, stream: Any) -> Optional[Any]:
        return None

    def wait_event(self, waiter: Any, event: Any) -> None:
        pass

    def done(self, event: Any) -> bool:
        return True

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        pass

    def empty(self, shape: Sequence[int], dtype: torch.dtype,
              device: torch.device, pin_memory: bool = False) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype, device=device, pin_memory=pin_memory)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = True) -> None:
        dst.copy_(src)

    def graph_pool(self, device: torch.device) -> Any:
        raise NotImplementedError(_NO_GRAPHS)

    def new_graph(self) -> Any:
        raise NotImplementedError(_NO_GRAPHS)

    def capturing(self, graph: Any, stream: Any, pool: Any, mode: str) -> ContextManager[Any]:
        raise NotImplementedError(_NO_GRAPHS)

    def replay(self, graph: Any) -> None:
        raise NotImplementedError(_NO_GRAPHS)


class CudaBackend:
    """torch's CUDA calls, one for one."""

    def current(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def new_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device)

    def using(self, stream: Any) -> ContextManager[Any]:
        return torch.cuda.stream(stream)

    def on_device(self, device: torch.device) -> ContextManager[Any]:
        return torch.cuda.device(device)

    def wait_stream(self, waiter: Any, producer: Any) -> None:
        if waiter != producer:
            waiter.wait_stream(producer)

    def record_event(self, stream: Any) -> Any:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait_event(self, waiter: Any, event: Any) -> None:
        waiter.wait_event(event)

    def done(self, event: Any) -> bool:
        return bool(event.query())

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        if tensor.is_cuda:
            tensor.record_stream(stream)

    def empty(self, shape: Sequence[int], dtype: torch.dtype,
              device: torch.device, pin_memory: bool = False) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype, device=device, pin_memory=pin_memory)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = True) -> None:
        dst.copy_(src, non_blocking=non_blocking)

    def graph_pool(self, device: torch.device) -> Any:
        with torch.cuda.device(device):
            return torch.cuda.graph_pool_handle()

    def new_graph(self) -> Any:
        return torch.cuda.CUDAGraph()

    @contextlib.contextmanager
    def capturing(self, graph: Any, stream: Any, pool: Any, mode: str) -> Iterator[None]:
        # torch.cuda.graph would also synchronise and empty the allocator's cache per capture
        with torch.cuda.stream(stream):
            graph.capture_begin(pool, capture_error_mode=mode)
            try:
                yield
            finally:
                graph.capture_end()

    def replay(self, graph: Any) -> None:
        graph.replay()


HOST = HostBackend()
CUDA = CudaBackend()


def backend_for(device: torch.device) -> StreamBackend:
    """The backend of a stage on ``device``: CUDA's calls on a CUDA device, else the host's."""
    return CUDA if torch.device(device).type == "cuda" else HOST
