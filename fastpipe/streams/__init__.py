"""Stream protocols: each place that orders GPU work, as one small seam over a
:class:`~fastpipe.streams.backend.StreamBackend` (real CUDA calls on a GPU, no-ops on the CPU,
a recording fake in the tests)."""
from .backend import CUDA, HOST, CudaBackend, HostBackend, StreamBackend, backend_for

__all__ = ["CUDA", "HOST", "CudaBackend", "HostBackend", "StreamBackend", "backend_for"]
