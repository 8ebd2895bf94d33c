"""One pipeline stage: its layers, its device and stream, and how it runs a forward pass."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Optional, Sequence

import torch
from torch import nn

from ..policies.amp import autocast_regions, autocast_state
from ..policies.batchnorm import DeferredNorms
from ..policies import compile as compiling
from ..policies.checkpoint import RngReplay, checkpointed, is_recomputing
from ..streams import stage_stream
from ..streams.backend import backend_for


_NO_STREAM = contextlib.nullcontext()  # reusable: CPU stages enter it for every action


class Stage:
    """A contiguous slice of the model placed on one device (a virtual stage of the pipeline)."""

    def __init__(self, index: int, module: nn.Sequential, device: torch.device, *,
                 deferred_batch_norm: bool = False,
                 compiler: Optional[compiling.Compiler] = None) -> None:
        self.index = index
        self.module = module
        # compiled in place: ``module(...)`` runs compiled code, whoever calls it (``call`` or a
        # wrapper of it), under the same names (fastpipe.policies.compile)
        self.compiled = compiler is not None
        if compiler is not None:
            compiling.compile_module(module, compiler, f"fastpipe_stage_{index}")
        self.device = device
        self.rng = RngReplay(device)
        self.stream_backend = backend_for(device)  # stream operations (no-ops on the CPU)
        self.stream: Optional[Any] = self.stream_backend.new_stream(device)  # None on the CPU
        self._norms = [m for m in module.modules()
                       if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
        # whether a recomputation could update buffers twice (see ``_running``)
        self._keeps_running = bool(self._running())
        # batch-norm running statistics updated once per mini-batch (see fastpipe.batchnorm)
        self.deferred: Optional[DeferredNorms] = (
            DeferredNorms(module) if deferred_batch_norm else None) or None
        # how ``run`` calls the layers: the module, or a wrapper around it (fastpipe.tied copies
        # weights from another device; fastpipe.skip packs skip tensors with the input)
        self.call: Callable[[Any], Any] = module
        self.skips: Optional[Any] = None  # a fastpipe.skip.exchange.StageSkips, when it has skips

    @property
    def plain(self) -> bool:
        """Whether :meth:`context` enters nothing (a CPU stage, not compiled)."""
        return self.stream is None and not self.compiled

    def context(self) -> ContextManager[Any]:
        """What every action of this stage runs in: its device and the stream (CUDA) in which
        its work is issued (a no-op on the CPU) and, for a compiled stage, the compiler's
        settings."""
        stream = (_NO_STREAM if self.stream is None
                  else stage_stream.issuing(self.stream, self.device, self.stream_backend))
        if not self.compiled:
            return stream
        return _both(stream, compiling.without_donated_buffers)

    def run(self, inputs: Any, seed: int) -> Any:
        """The stage's layers on one micro-batch, drawing random numbers from ``seed`` (so a
        recomputation with the same seed draws the same ones)."""
        if self.rng.stochastic is False and self.deferred is None and not self._keeps_running:
            return self.call(inputs)  # nothing to surround the layers with
        with self._keep_running_stats(), (
                self.deferred.deferring() if self.deferred else _NO_STREAM):
            if self.rng.stochastic is False:  # probed this step: draws no random numbers
                return self.call(inputs)
            # a compile elsewhere saves and restores the global generator: none runs meanwhile
            with compiling.outside_compiles(), self.rng.scope(seed):
                return self.call(inputs)

    def forward(self, inputs: Any, seed: int, checkpoint: bool) -> Any:
        """``run`` with, if ``checkpoint``, only the input kept for a recomputation in backward
        (an autograd function, so the output can be backpropagated by the caller)."""
        if not checkpoint:
            return self.run(inputs, seed)
        # the recomputation runs in the caller's backward, on any thread, maybe outside the
        # autocast region of this forward: it re-enters that region
        regions = autocast_state([self.device.type])

        def run(x: Any) -> Any:
            with autocast_regions(regions):
                return self.run(x, seed)
        return checkpointed(run, inputs)

    def parameters(self) -> list:
        """The stage's parameters that take gradients (what a weight-gradient action fills)."""
        return [p for p in self.module.parameters() if p.requires_grad]

    @contextlib.contextmanager
    def _keep_running_stats(self) -> Any:
        """While recomputing, leave batch-norm running statistics as the first forward left them
        (otherwise a checkpointed micro-batch would be counted twice)."""
        if not self._keeps_running or not is_recomputing():
            yield
            return
        running = self._running()
        saved = [b.clone() for b in running]
        try:
            yield
        finally:
            # ``.data``: batch norm saves its running statistics for backward (which does not
            # read them in training mode); restoring through .data keeps their version counter.
            for buffer, value in zip(running, saved):
                buffer.data.copy_(value)

    def _running(self) -> list:
        """What a recomputation must not update twice: the running statistics of batch norms,
        and the buffers that traced graphs update in place (``fastpipe.tracing``). Looked up
        each time: ``nn.Module``'s casts of the model (``model.half()``) replace buffers."""
        return [b for m in self._norms for b in _stats(m)] + [
            b for m in self.module.modules() for b in getattr(m, "mutated_buffers", ())]

    def __repr__(self) -> str:
        return f"Stage({self.index}, {len(self.module)} layers, {self.device})"


@contextlib.contextmanager
def _both(first: ContextManager[Any], second: ContextManager[Any]) -> Any:
    with first, second:
        yield


def _stats(norm: nn.Module) -> list:
    return [b for b in (norm.running_mean, norm.running_var, norm.num_batches_tracked)
            if b is not None]


def order_streams(stages: Sequence[Any], *, before: bool) -> None:
    """Order the stages' CUDA streams after the caller's work (parameters just updated by an
    optimizer, inputs just made) before a step, and the caller's streams after the stages' work
    (gradients, outputs) once it ends (:mod:`fastpipe.streams.stage_stream`). A no-op for CPU
    stages."""
    order = stage_stream.stage_after_caller if before else stage_stream.caller_after_stage
    for stage in stages:
        if stage.stream is not None:
            order(stage.device, stage.stream, getattr(stage, "stream_backend", None))
