"""Graph capture isolated from everything a capture must not see: a stage's forward and
backward captured as graphs on the stage's own device, stream and memory pool, in this thread's
capture mode, under the caller's autocast regions without their cache, and replayed as one
autograd node.

What :class:`IsolatedCapture` guarantees, and why each part is needed:

- **The stage's device.** Pool, side stream, warm-up and capture are made and issued under the
  stage's device guard: a capture records only the work issued on its stream's device, so a
  stage on ``cuda:1`` captured with ``cuda:0`` current would capture nothing of its own work.
- **Its own side stream, ordered both ways.** Warm-up and capture run on one side stream of the
  stage (captures cannot use a default stream, and captures sharing a pool should use one
  stream). Before the warm-up it waits for the caller's current stream and the stage's stream
  (the parameters an optimizer updated, the sample inputs the stage made), and is recorded on
  the samples it reads; afterwards both wait for it (the next update writes what the warm-up
  read, and replays on the stage's stream follow it).
- **Thread-local capture mode.** Only this thread's unsafe calls (a synchronisation, a
  ``cudaMalloc`` outside the pool) break the capture; a DataLoader's pin-memory thread or an
  asynchronous checkpoint writing meanwhile does not.
- **The caller's autocast, without its cache.** Warm-up and capture run in the autocast regions
  given (the step's, so the graphs compute in the precision the eager step would) with the
  cast cache off: a cached cast made outside the capture would be read by every replay as it
  was (stale after the next optimizer step), and one made inside would be freed with the cache.
- **One memory pool per stage, shared by all its graphs.** Sharing is safe here whatever order
  the graphs replay in: a capture gives back to the pool only memory that lives within one
  replay (temporaries), while everything that outlives a replay stays allocated as long as the
  graph lives: the static inputs and outputs, the activations the forward saves for the
  backward (the capture's autograd graph is kept, its backward captured with
  ``retain_graph=True``) and the gradient buffers. A later capture can therefore reuse only
  memory that no other graph reads between replays, and a stage's graphs replay one at a time,
  on its stream. No ``empty_cache`` runs per capture.

A replay (:class:`Graphed`) copies new inputs into the static ones, replays the forward graph,
and adds one autograd node whose backward replays the backward graph once. A split backward
(zero-bubble: B for the input gradients, then W for the weight gradients) calls that node
twice: the first call replays the graph, which computes every gradient at once; the second
returns the weight gradients the first one computed (nothing can replay the graph in between:
each graph serves one micro-batch per step), so neither replays twice nor rewrites the input
gradient that B already handed upstream.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch.utils._pytree import TreeSpec, tree_flatten, tree_leaves, tree_unflatten

from .backend import StreamBackend, backend_for

__all__ = ["CAPTURE_MODE", "Graphed", "IsolatedCapture", "WARMUP"]

CAPTURE_MODE = "thread_local"  # cudaStreamCaptureMode: only this thread's unsafe calls fail
WARMUP = 3  # eager runs before a capture (lazy initialisation, cuDNN/cuBLAS choices), as torch
Regions = Sequence[Tuple[str, torch.dtype]]  # autocast regions: (device type, dtype)


class IsolatedCapture:
    """Captures one stage's graphs (see the module docstring for what is guaranteed).

    ``stream`` is the stage's own stream (where its sample inputs are made and its graphs
    replay; ``None``: the current stream); ``backend`` defaults to ``backend_for(device)``.
    """

    def __init__(self, device: torch.device, stream: Any = None,
                 backend: Optional[StreamBackend] = None, warmup: int = WARMUP) -> None:
        self.device = torch.device(device)
        self.stream = stream
        self.backend = backend or backend_for(self.device)
        self.warmup = warmup
        self.pool: Any = None  # the stage's one graph pool, made at the first capture
        self.side: Any = None  # the stream every capture of the stage runs on

    def capture(self, fn: Callable[..., Any], params: Sequence[torch.Tensor],
                sample: Tuple[torch.Tensor, ...], autocast: Regions = ()) -> "Graphed":
        """``fn(*sample)``'s forward and backward (with respect to the samples and ``params``
        that require grad) as graphs; ``fn`` may return a pytree of tensors and ``None``."""
        b = self.backend
        with b.on_device(self.device), torch.enable_grad(), \
                _without_cache(autocast, ("cpu", self.device.type)):
            if self.pool is None:
                self.pool, self.side = b.graph_pool(self.device), b.new_stream(self.device)
            users = self._users()
            for stream in users:
                b.wait_stream(self.side, stream)
            for tensor in sample:
                b.record_stream(tensor, self.side)
            try:
                with b.using(self.side):
                    for _ in range(self.warmup):
                        _warm_up(fn, params, sample)
                return self._capture(fn, tuple(params), sample)
            finally:  # a failed capture's warm-up read the parameters too
                for stream in users:
                    b.wait_stream(stream, self.side)

    def _users(self) -> List[Any]:
        """The streams the capture reads after and that read after it: the current one and
        the stage's."""
        current = self.backend.current(self.device)
        if self.stream is None or self.stream == current:
            return [current]
        return [current, self.stream]

    def _capture(self, fn: Callable[..., Any], params: Tuple[torch.Tensor, ...],
                 sample: Tuple[torch.Tensor, ...]) -> "Graphed":
        b = self.backend
        forward, backward = b.new_graph(), b.new_graph()
        with b.capturing(forward, self.side, self.pool, CAPTURE_MODE):
            outputs = fn(*sample)
        leaves, spec = tree_flatten(outputs)
        _check_outputs(leaves)
        surface = [t for t in (*sample, *params) if t.requires_grad]
        roots = [t for t in leaves if t is not None and t.requires_grad]
        computed: Sequence[Optional[torch.Tensor]] = ()
        grad_outputs: List[torch.Tensor] = []
        if roots and surface:
            with b.capturing(backward, self.side, self.pool, CAPTURE_MODE):
                grad_outputs = [torch.empty_like(t) for t in roots]
                computed = torch.autograd.grad(roots, surface, grad_outputs, retain_graph=True,
                                               allow_unused=True)
        found = iter(computed)
        grads = [next(found) if t.requires_grad and computed else None
                 for t in (*sample, *params)]
        return Graphed(b, _Captured(forward, backward if computed else None, sample, params,
                                    leaves, spec, grad_outputs, grads))


def _warm_up(fn: Callable[..., Any], params: Sequence[torch.Tensor],
             sample: Tuple[torch.Tensor, ...]) -> None:
    """One eager forward and backward, as the capture will run them (gradients not kept)."""
    roots = [t for t in tree_leaves(fn(*sample))
             if isinstance(t, torch.Tensor) and t.requires_grad]
    surface = [t for t in (*sample, *params) if t.requires_grad]
    if roots and surface:
        torch.autograd.grad(roots, surface, [torch.zeros_like(t) for t in roots],
                            allow_unused=True)


def _check_outputs(leaves: Sequence[Any]) -> None:
    odd = [type(x).__name__ for x in leaves if x is not None and not isinstance(x, torch.Tensor)]
    if odd:
        raise TypeError(f"a captured stage must return tensors (or None) only, got {odd[0]}")


@contextlib.contextmanager
def _without_cache(regions: Regions, kinds: Sequence[str]) -> Iterator[None]:
    """Exactly ``regions`` entered (other regions of ``kinds`` left), the cast cache off."""
    wanted = dict(regions)
    with contextlib.ExitStack() as stack:
        for kind in sorted(set(kinds) | set(wanted)):
            if kind in wanted:
                stack.enter_context(torch.autocast(kind, dtype=wanted[kind], cache_enabled=False))
            elif torch.is_autocast_enabled(kind):
                stack.enter_context(torch.autocast(kind, enabled=False, cache_enabled=False))
        yield


@dataclass
class _Captured:
    """What a capture left: the graphs and the memory they read and write at fixed places."""

    forward: Any
    backward: Any  # None: nothing to differentiate
    inputs: Tuple[torch.Tensor, ...]  # static inputs (the samples)
    params: Tuple[torch.Tensor, ...]
    outputs: List[Optional[torch.Tensor]]  # static outputs, their autograd graph kept
    spec: TreeSpec
    grad_outputs: List[torch.Tensor]  # static gradients of the outputs that require grad
    grads: List[Optional[torch.Tensor]]  # static gradients of inputs then params


class Graphed:
    """A captured forward and backward, called like the function they were captured from
    (with tensors like the samples, in the same order)."""

    def __init__(self, backend: StreamBackend, captured: _Captured) -> None:
        self.backend, self.captured = backend, captured
        self.tensors = [t for t in captured.outputs if t is not None]

    def __call__(self, *inputs: torch.Tensor) -> Any:
        if len(inputs) != len(self.captured.inputs):
            raise ValueError(f"a graph captured for {len(self.captured.inputs)} inputs was "
                             f"called with {len(inputs)}")
        flat = iter(_Replay.apply(self, *inputs, *self.captured.params))
        leaves = [None if t is None else next(flat) for t in self.captured.outputs]
        return tree_unflatten(leaves, self.captured.spec)

    def forward(self, inputs: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, ...]:
        """Copy ``inputs`` into the static inputs (where they are not those) and replay."""
        for static, given in zip(self.captured.inputs, inputs):
            if static.data_ptr() != given.data_ptr():
                static.copy_(given)
        self.backend.replay(self.captured.forward)
        return tuple(t.detach() for t in self.tensors)

    def backward(self, grads: Sequence[Optional[torch.Tensor]],
                 again: bool) -> Tuple[Optional[torch.Tensor], ...]:
        """The gradients of inputs and params; ``again``: a second backward of one replay,
        which returns the weight gradients the first one computed."""
        captured, count = self.captured, len(self.captured.inputs)
        if again:
            return (None,) * count + tuple(_detached(g) for g in captured.grads[count:])
        wanted = [g for t, g in zip(self.tensors, grads) if t.requires_grad]
        for static, given in zip(captured.grad_outputs, wanted):
            if given is None:
                static.zero_()
            elif static.data_ptr() != given.data_ptr():
                static.copy_(given)
        if captured.backward is not None:
            self.backend.replay(captured.backward)
        return tuple(_detached(g) for g in captured.grads)


def _detached(tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if tensor is None else tensor.detach()


class _Replay(torch.autograd.Function):
    """One replay of a :class:`Graphed` as one autograd node (inputs: the call's tensors,
    then the parameters; outputs: the static outputs' tensors)."""

    @staticmethod
    def forward(ctx: Any, graphed: Graphed, *tensors: torch.Tensor) -> Any:  # type: ignore
        outputs = graphed.forward(tensors[:len(graphed.captured.inputs)])
        ctx.graphed, ctx.replayed = graphed, False
        ctx.mark_non_differentiable(*[o for o, t in zip(outputs, graphed.tensors)
                                      if not t.requires_grad])
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *grads: Optional[torch.Tensor]) -> Any:  # type: ignore[override]
        again, ctx.replayed = ctx.replayed, True
        return (None, *ctx.graphed.backward(grads, again))
