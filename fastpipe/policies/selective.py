"""Selective recomputation: keep the outputs of matrix products, recompute everything else.

``Pipe(checkpoint='selective')`` runs each stage's forward under ``torch.utils.checkpoint``
(non-reentrant) with a dispatch-level policy: the outputs of matrix products and attention
(the expensive ops) are cached during the forward, every other op (norms, activations, dropout,
the fused ops of ``fastpipe.ops``) is recomputed in backward from those and the stage input.
Random numbers replay exactly: the stage runs with fastpipe's per-(stage, micro-batch) seed in
both passes, and fused dropout draws its mask seed from that generator.

Unlike torch's own selective-checkpoint caches, the cache here is not consumed by the first
backward, so a zero-bubble schedule can backpropagate a stage twice (B for the input gradient,
then W for the weights); each pass recomputes the cheap ops again.

The cached outputs are checked on replay: one modified in place after the forward raises instead
of replaying a changed value.

This module also holds the table of checkpoint modes that run a stage with a graph kept
(:data:`RUNNERS`): the step runtime runs a stage through :func:`run_stage`.
"""
from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from typing import Any, Callable, Dict, FrozenSet, Optional, Tuple

import torch
from torch.utils import checkpoint as torch_checkpoint
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from .checkpoint import recomputing

__all__ = ["MODE", "RUNNERS", "SAVED_OPS", "run_selective", "run_stage", "selective_checkpoint"]

MODE = "selective"

aten = torch.ops.aten


def _saved_ops() -> FrozenSet[Any]:
    """Matrix-product and attention overloads whose outputs are kept (those this torch has)."""
    names = ["mm", "addmm", "bmm", "baddbmm", "convolution", "_scaled_mm",
             "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu"]
    packets = [getattr(aten, name) for name in names if hasattr(aten, name)]
    return frozenset(getattr(p, o) for p in packets for o in p.overloads())


SAVED_OPS = _saved_ops()


def _detach(t: torch.Tensor) -> torch.Tensor:
    """``t.detach()`` that shares ``t``'s version counter even below autograd (where a plain
    detach would not), so an in-place change of the cached output can be seen on replay."""
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        return t.detach()


def _detached(value: Any) -> Any:
    return tree_map(lambda t: _detach(t) if isinstance(t, torch.Tensor) else t, value)


def _versions(value: Any) -> Any:
    """The version counters of the tensors in ``value`` (a detached view shares its base's)."""
    return tree_map(lambda t: t._version if isinstance(t, torch.Tensor) else None, value)


class _Record(TorchDispatchMode):
    """Forward pass: runs every op, and keeps (detached) the outputs of :data:`SAVED_OPS`."""

    def __init__(self, cache: Dict[Tuple[Any, int], Any]) -> None:
        super().__init__()
        self.cache = cache
        self.counter: Dict[Any, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in SAVED_OPS:
            kept = _detached(out)
            self.cache[(func, self.counter[func])] = (kept, _versions(kept))
            self.counter[func] += 1
        return out


class _Replay(TorchDispatchMode):
    """Recomputation: hands back the recorded outputs of :data:`SAVED_OPS` (in call order) and
    runs every other op again. Reusable: each recomputation starts counting afresh."""

    def __init__(self, cache: Dict[Tuple[Any, int], Any]) -> None:
        super().__init__()
        self.cache = cache
        self.counter: Dict[Any, int] = defaultdict(int)

    def __enter__(self):
        self.counter.clear()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in SAVED_OPS:
            return func(*args, **(kwargs or {}))
        key = (func, self.counter[func])
        self.counter[func] += 1
        if key not in self.cache:
            raise RuntimeError(f"selective recompute: {func} call {key[1]} has no recorded "
                               "output; the forward is not deterministic in its op sequence")
        kept, versions = self.cache[key]
        if _versions(kept) != versions:
            raise RuntimeError(f"selective recompute: the output of {func} (call {key[1]}) was "
                               "modified in place after the forward; use the out-of-place op "
                               "(e.g. inplace=False) or checkpoint='always'")
        return _detached(kept)


class _RecomputeScope:
    """The recompute context: :func:`fastpipe.policies.checkpoint.is_recomputing` is True and cached
    outputs replay. Re-enterable, since each backward through the region recomputes it."""

    def __init__(self, mode: _Replay) -> None:
        self.mode = mode
        self.stack: Optional[contextlib.ExitStack] = None

    def __enter__(self) -> None:
        stack = contextlib.ExitStack()
        stack.enter_context(recomputing())
        stack.enter_context(self.mode)
        self.stack = stack

    def __exit__(self, *exc: Any) -> Optional[bool]:
        stack, self.stack = self.stack, None
        return stack.__exit__(*exc) if stack is not None else None


def _contexts() -> Tuple[Any, Any]:
    """The (forward, recompute) context managers of one checkpointed call, sharing a cache."""
    cache: Dict[Tuple[Any, int], Any] = {}
    return _Record(cache), _RecomputeScope(_Replay(cache))


def selective_checkpoint(fn: Callable[..., Any], *args: Any,
                         preserve_rng_state: bool = True) -> Any:
    """``fn(*args)`` keeping only its inputs and matrix-product outputs for backward.

    ``preserve_rng_state``: torch.utils.checkpoint's own RNG save and restore, for callers that
    do not seed the recomputation themselves.
    """
    return torch_checkpoint.checkpoint(fn, *args, use_reentrant=False, context_fn=_contexts,
                                       preserve_rng_state=preserve_rng_state)


def run_selective(stage: Any, inputs: Any, seed: int) -> Any:
    """A stage's forward on one micro-batch under :func:`selective_checkpoint`. The stage seeds
    its generators itself (under fastpipe's RNG lock), so torch's unlocked RNG restore, which
    would race with stages running on other threads, stays off."""
    return selective_checkpoint(lambda x: stage.run(x, seed), inputs, preserve_rng_state=False)


_prepared = threading.Event()


def prepare() -> None:
    """Run one tiny selective checkpoint, forward and backward, once per process: its first call
    imports much of ``torch._dynamo`` (about a second, several with concurrent processes), which
    a pipe then pays at construction instead of inside its first step's timeout."""
    if _prepared.is_set():
        return
    x = torch.ones(2, requires_grad=True)
    with torch.enable_grad():
        out = selective_checkpoint(lambda v: torch.sin(v) * 2, x, preserve_rng_state=False)
        out.sum().backward()
    _prepared.set()


# Checkpoint modes whose forward keeps an autograd graph (thinner than usual) instead of only
# the stage input: mode name -> runner(stage, inputs, seed) -> output.
RUNNERS: Dict[str, Callable[[Any, Any, int], Any]] = {MODE: run_selective}


def run_stage(mode: str, stage: Any, inputs: Any, seed: int) -> Any:
    """A stage's forward that keeps a graph, the way checkpoint ``mode`` wants it: the mode's
    runner while autograd records, else plain ``stage.run`` (the modes the step runtime
    handles itself: never, except_last, always, offload)."""
    runner = RUNNERS.get(mode)
    if runner is None or not torch.is_grad_enabled():
        return stage.run(inputs, seed)
    return runner(stage, inputs, seed)
