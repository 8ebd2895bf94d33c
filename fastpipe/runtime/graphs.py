"""CUDA graphs for pipeline stages (``Pipe(..., cuda_graphs=True)``).

A launch-bound stage (many small kernels) spends its time in the CPU launching them; a CUDA graph
replays a whole forward or backward with one launch. Each stage keeps graphs captured with
``torch.cuda.make_graphed_callables`` (static input/output buffers, warm-up on a side stream,
forward and backward graphs) per input signature (shapes, dtypes, requires-grad flags) and per
forward slot: the k-th forward of a signature in a step replays graph k, so micro-batches in flight
at the same time never share static buffers, whatever the schedule.

Capture never runs while a step runs (other stages' threads use the GPU then, which a capture
forbids): a step that meets a new (signature, slot) runs it eagerly and records sample inputs; the
graphs are captured between steps by :func:`after_step` and replayed from the next step on. Stages
fall back to eager execution, with one warning per stage and reason, on the CPU, for inputs that
are not a tensor or a tuple of tensors, for signatures beyond ``max_signatures``, and for modules
whose capture fails (the step itself never fails because of a graph). Forwards that draw random
numbers, recomputations, checkpointed forwards, forward-only passes, deferred batch norm and
training batch norms that update running statistics always run eagerly (graph replay would not
reproduce them exactly, and the capture's warm-up forwards would update the statistics again).
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import nn

from ..policies.batchnorm import tracked_norms
from ..policies.checkpoint import is_checkpointing, is_recomputing

__all__ = ["DEFAULT_MAX_SIGNATURES", "FastpipeGraphWarning", "GraphedCall", "after_step",
           "before_step", "enable", "signature"]

DEFAULT_MAX_SIGNATURES = 4
Signature = Tuple[Tuple[Tuple[int, ...], torch.dtype, bool], ...]
Capture = Callable[[Callable[..., Any], nn.Module, Tuple[torch.Tensor, ...]], Callable[..., Any]]


class FastpipeGraphWarning(UserWarning):
    """A stage runs eagerly although ``cuda_graphs=True`` (said once per stage and reason)."""


def signature(inputs: Any) -> Optional[Signature]:
    """The graph key of a stage input: a tensor or a tuple of tensors; None for anything else."""
    tensors = inputs if isinstance(inputs, tuple) else (inputs,)
    if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        return None
    return tuple((tuple(t.shape), t.dtype, t.requires_grad) for t in tensors)


class _Body(nn.Module):
    """What is captured: the stage's call, as a module owning the stage's parameters."""

    def __init__(self, call: Callable[[Any], Any], module: nn.Module) -> None:
        super().__init__()
        self.layers = module
        self.call = call

    def forward(self, *inputs: torch.Tensor) -> Any:
        return self.call(inputs if len(inputs) > 1 else inputs[0])


def make_graphed(call: Callable[[Any], Any], module: nn.Module,
                 sample: Tuple[torch.Tensor, ...]) -> Callable[..., Any]:
    """Capture forward and backward of ``call`` for inputs like ``sample`` (own memory pool)."""
    return torch.cuda.make_graphed_callables(_Body(call, module), sample,
                                             allow_unused_input=True)


class GraphedCall:
    """A stage's ``call`` that replays captured graphs when it can and runs eagerly otherwise."""

    def __init__(self, call: Callable[[Any], Any], stage: Any,
                 max_signatures: int = DEFAULT_MAX_SIGNATURES,
                 capture: Capture = make_graphed) -> None:
        self.inner, self.stage, self.capture = call, stage, capture
        self.max_signatures = max_signatures
        self.graphs: Dict[Tuple[Signature, int], Callable[..., Any]] = {}
        self.pending: Dict[Tuple[Signature, int], Tuple[torch.Tensor, ...]] = {}
        self.failed: Set[Signature] = set()
        self.slots: Dict[Signature, int] = {}  # forwards of each signature in this step
        self.enabled = False  # True during training steps (set by before_step)
        self.norms = tracked_norms(stage.module)  # running statistics a capture would corrupt
        self._warned: Set[str] = set()

    def __call__(self, inputs: Any) -> Any:
        if not self._eligible():
            return self.inner(inputs)
        key = signature(inputs)
        if key is None:
            self._warn("its input is not a tensor or a tuple of tensors")
            return self.inner(inputs)
        if key in self.failed:
            return self.inner(inputs)
        slot = self.slots.get(key, 0)
        self.slots[key] = slot + 1
        graphed = self.graphs.get((key, slot))
        if graphed is not None:
            return self._replay(graphed, inputs)
        if key not in self.known_signatures() and len(self.known_signatures()) >= \
                self.max_signatures:
            self._warn(f"it met more than {self.max_signatures} input signatures")
            return self.inner(inputs)
        self.pending[(key, slot)] = _samples(inputs)
        return self.inner(inputs)

    def _eligible(self) -> bool:
        return (self.enabled and torch.is_grad_enabled() and not is_checkpointing()
                and not is_recomputing() and self.stage.rng.stochastic is False
                and getattr(self.stage, "deferred", None) is None
                and not any(norm.training for norm in self.norms))

    def known_signatures(self) -> Set[Signature]:
        return {k for k, _ in self.graphs} | {k for k, _ in self.pending} | self.failed

    def _replay(self, graphed: Callable[..., Any], inputs: Any) -> Any:
        # Accumulate into existing gradients: a fresh .grad could alias a graph's static buffer.
        for p in self.stage.module.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        return graphed(*inputs) if isinstance(inputs, tuple) else graphed(inputs)

    def capture_pending(self) -> None:
        """Capture the graphs recorded during the last step (called between steps)."""
        pending, self.pending = self.pending, {}
        for (key, slot), sample in pending.items():
            if key in self.failed:
                continue
            try:
                self.graphs[(key, slot)] = self.capture(self.inner, self.stage.module, sample)
            except Exception as error:  # capture is best effort: eager execution stays exact
                self.failed.add(key)
                self._warn(f"capturing it failed ({type(error).__name__}: {error})")

    def _warn(self, reason: str) -> None:
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"cuda_graphs: stage {self.stage.index} runs eagerly because {reason}",
                          FastpipeGraphWarning, stacklevel=3)


def _samples(inputs: Any) -> Tuple[torch.Tensor, ...]:
    """Detached copies of the input tensors with their requires-grad flags (capture samples)."""
    tensors = inputs if isinstance(inputs, tuple) else (inputs,)
    return tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in tensors)


def enable(stages: Sequence[Any], max_signatures: int = DEFAULT_MAX_SIGNATURES) -> None:
    """Wrap each CUDA stage's ``call`` in a :class:`GraphedCall`; warn once for CPU stages."""
    cpu = [s.index for s in stages if s.device.type != "cuda"]
    if cpu:
        warnings.warn(f"cuda_graphs: stages {cpu} run on the CPU, eagerly (CUDA graphs need a "
                      f"CUDA device)", FastpipeGraphWarning, stacklevel=3)
    for stage in stages:
        if stage.device.type == "cuda":
            stage.call = GraphedCall(stage.call, stage, max_signatures)


def _graphed(stages: Sequence[Any]) -> List[GraphedCall]:
    return [s.call for s in stages if isinstance(s.call, GraphedCall)]


def before_step(stages: Sequence[Any], train: bool) -> None:
    """Graphs replay only in training steps; every step starts at slot 0."""
    for g in _graphed(stages):
        g.enabled, g.slots = train, {}


def after_step(stages: Sequence[Any]) -> None:
    """Capture what the step recorded, now that no stage thread uses the GPU."""
    graphed = _graphed(stages)
    for g in graphed:
        g.enabled = False
        g.capture_pending()
