"""CUDA graphs for pipeline stages (``Pipe(..., cuda_graphs=True)``).

A launch-bound stage (many small kernels) spends its time in the CPU launching them; a CUDA graph
replays a whole forward or backward with one launch. Each stage keeps graphs per key (the input
signature: shapes, dtypes, requires-grad flags; whether the input is a tuple; the autocast
regions the step runs in) and per forward slot: the k-th forward of a key in a step replays
graph k, so micro-batches in flight at the same time never share static buffers, whatever the
schedule. Graphs are captured by :class:`fastpipe.streams.capture.IsolatedCapture`: on the
stage's device and side stream, in thread-local capture mode, under the step's autocast
regions without their cache, all of a stage's graphs in one memory pool (its docstring says
why sharing the pool is safe).

Capture never runs while a step runs (other stages' threads use the GPU then): a step that meets
a new (key, slot) runs it eagerly and records sample inputs; the graphs are captured between
steps by :func:`after_step` and replayed from the next step on. A graphed stage is probed for
random draws (``RngReplay``) once, and again only when its train/eval modes change, rather than
at every step's first forward (which could then never replay); its first step records even
before the probe has answered and captures only if the probe found no draws, so every
micro-batch, the first included and ``chunks=1`` too, replays from the second training step
on. A stage's graphs are dropped (and recaptured) when
what they read changes under them: a parameter or buffer replaced (a cast), a requires-grad
flag or a train/eval mode changed.

Zero-bubble schedules split a backward into B (input gradients) and W (weight gradients): the
graph's backward replays once, in B, and W takes the weight gradients it computed. A graphed
B therefore costs the whole backward and its W next to nothing: the schedule's W no longer
fills bubbles with weight-gradient work (separate input- and weight-gradient graphs would keep
that, at twice the backward graphs' memory).

Stages run eagerly, with one warning per stage and reason, on the CPU, when they share
parameters with other stages (tied weights: their gradient taps are Python code a graph would
not replay), when they draw random numbers, for inputs that are not a tensor or a tuple of
tensors, for keys beyond ``max_signatures``, and for modules whose capture fails (the step
itself never fails because of a graph). Recomputations, checkpointed forwards, forward-only
passes, deferred batch norm and training-mode forwards that update buffers (batch-norm running
statistics) always run eagerly (graph replay would not reproduce them exactly, and the
capture's warm-up forwards would update the statistics again). PipeDream
(``schedule='pipedream'``) is refused with graphs: its weight versions swap parameters that a
graph reads at fixed addresses (:func:`fastpipe.runtime.weight_versions.check_cuda_graphs`).
"""
from __future__ import annotations

import itertools
import warnings
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Set, Tuple

import torch
from torch import nn

from ..policies.amp import autocast_state
from ..policies.batchnorm import tracked_norms
from ..policies.checkpoint import is_checkpointing, is_recomputing
from ..streams.capture import Graphed, IsolatedCapture

__all__ = ["DEFAULT_MAX_SIGNATURES", "FastpipeGraphWarning", "GraphedCall", "after_step",
           "before_step", "enable", "signature"]

DEFAULT_MAX_SIGNATURES = 4
Signature = Tuple[Tuple[Tuple[int, ...], torch.dtype, bool], ...]
Key = Tuple[Signature, bool, Tuple[Tuple[str, torch.dtype], ...]]  # signature, tuple?, autocast


class FastpipeGraphWarning(UserWarning):
    """A stage runs eagerly although ``cuda_graphs=True`` (said once per stage and reason)."""


def signature(inputs: Any) -> Optional[Signature]:
    """The graph key of a stage input: a tensor or a tuple of tensors; None for anything else."""
    tensors = inputs if isinstance(inputs, tuple) else (inputs,)
    if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        return None
    return tuple((tuple(t.shape), t.dtype, t.requires_grad) for t in tensors)


class GraphedCall:
    """A stage's ``call`` that replays captured graphs when it can and runs eagerly otherwise.

    ``capture`` defaults to an :class:`IsolatedCapture` on the stage's device and stream.
    """

    def __init__(self, call: Callable[[Any], Any], stage: Any,
                 max_signatures: int = DEFAULT_MAX_SIGNATURES,
                 capture: Optional[IsolatedCapture] = None) -> None:
        self.inner, self.stage = call, stage
        self.capture = capture if capture is not None else IsolatedCapture(
            stage.device, getattr(stage, "stream", None), getattr(stage, "stream_backend", None))
        self.max_signatures = max_signatures
        self.graphs: Dict[Tuple[Key, int], Graphed] = {}
        self.pending: Dict[Tuple[Key, int], Tuple[torch.Tensor, ...]] = {}
        self.failed: Set[Key] = set()
        self.slots: Dict[Key, int] = {}  # forwards of each key in this step
        self.enabled = False  # True during training steps (set by before_step)
        self.updates_buffers = False  # a forward would update buffers in place (per step)
        self.identity: Optional[Hashable] = None  # what the graphs read (see ``_identity``)
        self.replays = 0  # forward replays so far
        self._kinds = sorted({"cpu", torch.device(stage.device).type})
        self._warned: Set[str] = set()
        stage.rng.across_steps = True  # a probed forward cannot replay: probe once per modes

    def __call__(self, inputs: Any) -> Any:
        if not self._eligible():
            return self.inner(inputs)
        key = self._key(inputs)
        if key is None:
            self._warn("its input is not a tensor or a tuple of tensors")
            return self.inner(inputs)
        if key in self.failed:
            return self.inner(inputs)
        slot = self.slots.get(key, 0)
        self.slots[key] = slot + 1
        graphed = self.graphs.get((key, slot))
        if graphed is not None:
            return self._replay(graphed, inputs) if self._probed() else self.inner(inputs)
        if key not in self.known_keys() and len(self.known_keys()) >= self.max_signatures:
            self._warn(f"it met more than {self.max_signatures} input signatures")
            return self.inner(inputs)
        self.pending[(key, slot)] = _samples(inputs)
        return self.inner(inputs)

    def _eligible(self) -> bool:
        """Whether this forward may replay or be recorded for a capture (a stage not yet
        probed for random draws is recorded: ``capture_pending`` reads the probe's answer)."""
        return (self.enabled and torch.is_grad_enabled() and not is_checkpointing()
                and not is_recomputing() and self.stage.rng.stochastic is not True
                and getattr(self.stage, "deferred", None) is None and not self.updates_buffers)

    def _probed(self) -> bool:
        return self.stage.rng.stochastic is False

    def _key(self, inputs: Any) -> Optional[Key]:
        found = signature(inputs)
        if found is None:
            return None
        return found, isinstance(inputs, tuple), tuple(autocast_state(self._kinds))

    def known_keys(self) -> Set[Key]:
        return {k for k, _ in self.graphs} | {k for k, _ in self.pending} | self.failed

    def _replay(self, graphed: Graphed, inputs: Any) -> Any:
        # Accumulate into existing gradients: a fresh .grad could alias a graph's static buffer.
        for p in self.stage.module.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        self.replays += 1
        return graphed(*inputs) if isinstance(inputs, tuple) else graphed(inputs)

    def begin(self, train: bool) -> None:
        """A new step (``train``: a training step): slots start at 0; graphs captured under
        other parameters, buffers, flags or modes are dropped."""
        self.enabled, self.slots = train, {}
        if not train:
            return
        module = self.stage.module
        identity = _identity(module)
        if identity != self.identity:
            self.graphs, self.pending, self.identity = {}, {}, identity
        self.updates_buffers = _updates_buffers(module)

    def capture_pending(self) -> None:
        """Capture the graphs recorded during the last step (called between steps), in the
        order the step first ran them."""
        pending, self.pending = self.pending, {}
        if pending and not self._probed():
            self._warn("it draws random numbers (dropout in training mode, say)")
            return
        params = [p for p in self.stage.module.parameters() if p.requires_grad]
        for (key, slot), sample in pending.items():
            if key in self.failed:
                continue
            try:
                self.graphs[(key, slot)] = self.capture.capture(
                    self._body(key[1]), params, sample, key[2])
            except Exception as error:  # capture is best effort: eager execution stays exact
                self.failed.add(key)
                self._warn(f"capturing it failed ({type(error).__name__}: {error})")

    def _body(self, packed: bool) -> Callable[..., Any]:
        """The stage's call on separate input tensors (what a graph captures)."""
        inner = self.inner

        def body(*tensors: torch.Tensor) -> Any:
            return inner(tensors if packed else tensors[0])
        return body

    def _warn(self, reason: str) -> None:
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"cuda_graphs: stage {self.stage.index} runs eagerly because {reason}",
                          FastpipeGraphWarning, stacklevel=3)


def _samples(inputs: Any) -> Tuple[torch.Tensor, ...]:
    """Detached copies of the input tensors with their requires-grad flags (capture samples)."""
    tensors = inputs if isinstance(inputs, tuple) else (inputs,)
    return tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in tensors)


def _identity(module: nn.Module) -> Hashable:
    """What a graph of ``module`` reads at fixed addresses, and the flags it was captured
    under: each parameter's and buffer's memory, dtype, shape and requires-grad flag, and every
    submodule's train/eval mode."""
    tensors = itertools.chain(module.parameters(), module.buffers())
    return (tuple(m.training for m in module.modules()),
            tuple((t.data_ptr(), t.dtype, t.shape, t.requires_grad) for t in tensors))


def _updates_buffers(module: nn.Module) -> bool:
    """Whether a forward of ``module`` now updates buffers in place: batch norms in training
    mode, or a traced stage whose training graph writes buffers."""
    return any(norm.training for norm in tracked_norms(module)) or any(
        m.training and getattr(m, "mutated_buffers", None) for m in module.modules())


def enable(stages: Sequence[Any], max_signatures: int = DEFAULT_MAX_SIGNATURES) -> None:
    """Wrap each CUDA stage's ``call`` in a :class:`GraphedCall`; warn once for CPU stages
    and for stages with tied weights."""
    cpu = [s.index for s in stages if s.device.type != "cuda"]
    if cpu:
        warnings.warn(f"cuda_graphs: stages {cpu} run on the CPU, eagerly (CUDA graphs need a "
                      f"CUDA device)", FastpipeGraphWarning, stacklevel=3)
    tied = _tied(stages)
    if tied:
        warnings.warn(f"cuda_graphs: stages {tied} share parameters with other stages (tied "
                      f"weights) and run eagerly: a graph would not replay the hooks that sum "
                      f"their gradients", FastpipeGraphWarning, stacklevel=3)
    for stage in stages:
        if stage.device.type == "cuda" and stage.index not in tied:
            stage.call = GraphedCall(stage.call, stage, max_signatures)


def _tied(stages: Sequence[Any]) -> List[int]:
    """The stages holding a parameter that another stage holds too."""
    holders: Dict[int, Set[int]] = {}
    for stage in stages:
        for p in stage.module.parameters():
            holders.setdefault(id(p), set()).add(stage.index)
    return sorted({s for found in holders.values() if len(found) > 1 for s in found})


def _graphed(stages: Sequence[Any]) -> List[GraphedCall]:
    return [s.call for s in stages if isinstance(s.call, GraphedCall)]


def before_step(stages: Sequence[Any], train: bool) -> None:
    """Graphs replay only in training steps; every step starts at slot 0."""
    for g in _graphed(stages):
        g.begin(train)


def after_step(stages: Sequence[Any]) -> None:
    """Capture what the step recorded, now that no stage thread uses the GPU."""
    for g in _graphed(stages):
        g.enabled = False
        g.capture_pending()
