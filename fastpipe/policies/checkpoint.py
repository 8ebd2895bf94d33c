"""Activation checkpointing for pipeline stages: modes, recompute, and exact RNG replay.

A checkpointed stage keeps only its input during forward and recomputes its forward pass in
backward. Random numbers (dropout) are replayed exactly: every forward of (stage, micro-batch)
runs with the CPU and CUDA generators seeded from a per-step seed, so the recomputation draws
the same numbers as the original forward even when stages run concurrently on threads.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch.utils import _pytree as pytree

MODES = ("never", "except_last", "always", "offload",  # offload: see fastpipe.policies.offload
         "selective")  # selective: see fastpipe.policies.selective

_local = threading.local()
_TENSOR = object()  # marks where a tensor sits among a pytree's leaves
_RNG_LOCK = threading.RLock()

try:  # private but stable since torch 2.3; torch.autograd.backward is the fallback
    from torch.autograd.graph import _engine_run_backward as _run_backward
except ImportError:  # pragma: no cover
    _run_backward = None


def is_recomputing() -> bool:
    """True while fastpipe recomputes a checkpointed forward pass (in backward) on this thread.

    User modules can use it to skip side effects (logging, buffer updates) that must happen once.
    """
    return getattr(_local, "recomputing", False)


def is_checkpointing() -> bool:
    """True while a checkpointed forward pass runs on this thread (its activations are dropped)."""
    return getattr(_local, "checkpointing", False)


@contextlib.contextmanager
def _flag(name: str) -> Iterator[None]:
    previous = getattr(_local, name, False)
    setattr(_local, name, True)
    try:
        yield
    finally:
        setattr(_local, name, previous)


def checkpointing() -> contextlib.AbstractContextManager:
    """Marks, on this thread, a forward pass whose activations are dropped for recomputation."""
    return _flag("checkpointing")


def recomputing() -> contextlib.AbstractContextManager:
    """Marks, on this thread, the recomputation of a checkpointed forward pass."""
    return _flag("recomputing")


def check_mode(checkpoint: str) -> str:
    """Validate a checkpoint mode name, raising ``ValueError`` that lists the valid ones."""
    if checkpoint not in MODES:
        raise ValueError(
            f"checkpoint={checkpoint!r} is not a checkpoint mode; use one of {', '.join(MODES)}")
    return checkpoint


def checkpoint_stop(checkpoint: str, num_microbatches: int) -> int:
    """How many micro-batches (the first ones) are checkpointed under ``checkpoint``."""
    return {"always": num_microbatches, "except_last": num_microbatches - 1,
            "never": 0, "offload": 0,
            "selective": 0,  # no full recompute: fastpipe.policies.selective keeps a thinner graph
            }[check_mode(checkpoint)]


# --------------------------------------------------------------------------------------------
# RNG replay


def microbatch_seed(step_seed: int, stage: int, microbatch: int) -> int:
    """A seed for one (stage, micro-batch) forward, a pure function of the step's seed."""
    return (step_seed * 1_000_003 + stage * 7_919 + microbatch * 104_729 + 1) % (2 ** 63)


def draw_step_seed() -> int:
    """Draw the step's base seed from the global CPU generator (so ``torch.manual_seed`` fixes it)."""
    return int(torch.randint(0, 2 ** 62, (1,)).item())


def _generators(device: torch.device) -> List[torch.Generator]:
    generators = [torch.default_generator]
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        generators.append(torch.cuda.default_generators[index])
    return generators


class RngReplay:
    """Runs a stage's forward passes with seeded generators, detecting whether it draws at all.

    The first forward of a step (``stochastic is None``) runs under a process-wide lock with the
    generators seeded and checks whether their state moved. Stages that draw random numbers keep
    using the lock and seeding (so concurrent stages never interleave draws); stages that do not
    run lock-free. Recomputation reuses the same seed, so it replays the same numbers.

    With ``across_steps`` (a stage replaying CUDA graphs, whose probed forward cannot replay)
    the answer is kept from step to step while the train/eval modes it was found under hold:
    dropout draws only in training mode, so a stage whose ``model.train()`` turns dropout back
    on is probed again. Such a stage must not start drawing for another reason between steps.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stochastic: Optional[bool] = None
        self.across_steps = False  # keep the answer while the modes hold (see above)
        self._modes: Optional[Tuple[bool, ...]] = None  # the modes the answer was found under

    def reset(self) -> None:
        """Forget the probe result: the next forward probes again."""
        self.stochastic = None

    def refresh(self, module: Any) -> None:
        """Before a step: forget the probe result, unless ``across_steps`` and no train/eval
        mode of ``module`` (its submodules included) changed since it was probed."""
        modes = tuple(m.training for m in module.modules()) if self.across_steps else None
        if modes is None or modes != self._modes:
            self.stochastic, self._modes = None, modes

    @contextlib.contextmanager
    def scope(self, seed: int) -> Iterator[None]:
        """Context in which one forward (or its recomputation) of a micro-batch runs."""
        if self.stochastic is False:
            yield
            return
        generators = _generators(self.device)
        with _RNG_LOCK:
            saved = [g.get_state() for g in generators]
            for g in generators:
                g.manual_seed(seed)
            seeded = [g.get_state() for g in generators] if self.stochastic is None else None
            try:
                yield
                if seeded is not None:
                    self.stochastic = any(not torch.equal(g.get_state(), s)
                                          for g, s in zip(generators, seeded))
            finally:
                for g, s in zip(generators, saved):
                    g.set_state(s)


# --------------------------------------------------------------------------------------------
# Checkpoint / recompute as an autograd function


def _phony() -> torch.Tensor:
    """An empty tensor that requires grad, so a checkpoint's outputs require grad even when its
    inputs do not (the first stage's inputs are data)."""
    phony = getattr(_local, "phony", None)
    if phony is None:
        phony = torch.empty(0, requires_grad=True)
        _local.phony = phony
    return phony


IN_PLACE_ON_INPUT = (
    "a leaf Variable that requires grad has been used in an in-place operation: a checkpointed "
    "stage changed its input in place (e.g. nn.ReLU(inplace=True) as a stage's first layer), so "
    "its recomputation would start from the changed values; use inplace=False in that layer, "
    "or checkpoint='never'")


IN_PLACE_ON_DATA = (
    "a checkpointed stage changed its input in place (e.g. x.add_(1), or nn.ReLU(inplace=True) "
    "as its first layer), so its recomputation in backward would start from the changed values "
    "and give wrong gradients; change a copy (x = x + 1 or x.clone()), or use "
    "checkpoint='never'")


def is_changed(tensors: Sequence[Any], versions: Sequence[int]) -> bool:
    """Whether any of ``tensors`` was changed in place since ``versions`` were read."""
    return any(t._version != v for t, v in zip(tensors, versions))


def _versions(leaves: Sequence[Any], grad_flags: Sequence[bool]) -> List[int]:
    """The version counters of the inputs that require grad (an in-place change bumps one)."""
    return [x._version for x, wants in zip(leaves, grad_flags) if wants]


class _Checkpoint(torch.autograd.Function):
    """Forward without keeping activations; backward recomputes the forward, then backprops."""

    @staticmethod
    def forward(ctx: Any, phony: torch.Tensor, run: Callable[[Any], Any], spec: Any,
                box: List[Any], *leaves: Any) -> Tuple[torch.Tensor, ...]:
        ctx.run, ctx.spec = run, spec
        ctx.set_materialize_grads(False)
        tensor_mask = [isinstance(x, torch.Tensor) for x in leaves]
        ctx.tensor_mask = tensor_mask
        ctx.constants = [None if is_tensor else x for x, is_tensor in zip(leaves, tensor_mask)]
        ctx.grad_flags = [is_tensor and x.requires_grad for x, is_tensor in zip(leaves, tensor_mask)]
        ctx.save_for_backward(*[x for x, is_tensor in zip(leaves, tensor_mask) if is_tensor])
        versions = _versions(leaves, ctx.grad_flags), _versions(leaves, tensor_mask)
        with torch.no_grad(), checkpointing():
            output = run(pytree.tree_unflatten(list(leaves), spec))
        ctx.changed_input = versions[0] != _versions(leaves, ctx.grad_flags)
        ctx.changed_data = versions[1] != _versions(leaves, tensor_mask)
        out_leaves, out_spec = pytree.tree_flatten(output)
        box.append((out_spec, [_TENSOR if isinstance(x, torch.Tensor) else x for x in out_leaves]))
        return tuple(x for x in out_leaves if isinstance(x, torch.Tensor))

    @staticmethod
    def backward(ctx: Any, *grads: Optional[torch.Tensor]) -> Tuple[Optional[torch.Tensor], ...]:
        if ctx.changed_input:
            raise RuntimeError(IN_PLACE_ON_INPUT)
        if ctx.changed_data:
            raise RuntimeError(IN_PLACE_ON_DATA)
        saved = iter(ctx.saved_tensors)
        leaves = []
        for is_tensor, constant, wants_grad in zip(ctx.tensor_mask, ctx.constants, ctx.grad_flags):
            leaves.append(next(saved).detach().requires_grad_(wants_grad) if is_tensor else constant)
        with torch.enable_grad(), recomputing():
            output = ctx.run(pytree.tree_unflatten(leaves, ctx.spec))
        outs = [x for x in pytree.tree_leaves(output) if isinstance(x, torch.Tensor)]
        backward_pairs(outs, grads)
        input_grads = [x.grad if isinstance(x, torch.Tensor) and wants else None
                       for x, wants in zip(leaves, ctx.grad_flags)]
        return (None, None, None, None, *input_grads)


def grad_pairs(outputs: Sequence[torch.Tensor], grads: Sequence[Optional[torch.Tensor]]
               ) -> Tuple[Tuple[torch.Tensor, ...], Tuple[torch.Tensor, ...]]:
    """The outputs that have both a gradient and a graph, and their gradients."""
    pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
    return tuple(o for o, _ in pairs), tuple(g for _, g in pairs)


def backward_pairs(outputs: Sequence[torch.Tensor], grads: Sequence[Optional[torch.Tensor]],
                   inputs: Optional[Sequence[torch.Tensor]] = None) -> None:
    """Backpropagate ``grads`` into ``outputs`` (skipping outputs with no grad or no graph),
    accumulating into every leaf, or only into ``inputs`` when given."""
    tensors, grad_tensors = grad_pairs(outputs, grads)
    if not tensors or (inputs is not None and not inputs):
        return
    if inputs is not None:
        torch.autograd.backward(tensors, grad_tensors, inputs=list(inputs))
    elif _run_backward is not None and all(o.shape == g.shape
                                           for o, g in zip(tensors, grad_tensors)):
        # The engine entry point of torch.autograd.backward, without its per-call Python checks
        # (the gradients are already tensors of the right shapes): measurably cheaper per stage.
        _run_backward(tensors, grad_tensors, False, False, (), allow_unreachable=True,
                      accumulate_grad=True)
    else:
        torch.autograd.backward(tensors, grad_tensors)


def checkpointed(run: Callable[[Any], Any], inputs: Any) -> Any:
    """Run ``run(inputs)`` without storing activations; its backward recomputes ``run``."""
    leaves, spec = pytree.tree_flatten(inputs)
    box: List[Any] = []
    tensors = _Checkpoint.apply(_phony(), run, spec, box, *leaves)
    out_spec, out_leaves = box[0]
    it = iter(tensors)
    return pytree.tree_unflatten([next(it) if x is _TENSOR else x for x in out_leaves], out_spec)
