"""The state of one pipeline step and the handlers that run its actions.

A step is either a training step (``train``: stage boundaries are detached, each stage runs its
own backward, gradients travel back through mailboxes) or a forward pass (``forward``: the
autograd graph stays connected across stages so the caller can backprop through the output).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import AbstractSet, Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils import _pytree as pytree

from ..policies.amp import autocast_regions, autocast_state, scale_loss
from ..policies.checkpoint import (backward_pairs, checkpointing, grad_pairs, microbatch_seed,
                                   recomputing)
from ..policies import offload
from ..errors import LossFunctionError
from .token_mean import split_count
from ..policies.selective import run_stage
from ..schedule import Action, ActionKind
from .hop import Parcel, land, ship
from .mailbox import Abort, Mailbox
from .stage import Stage

_TENSOR = object()  # marks where a tensor sits among a message's leaves


@dataclass
class Message:
    """A pytree sent between stages: its structure, its constants and its shipped tensors."""

    spec: Any
    constants: List[Any]
    parcel: Parcel
    requires_grad: List[bool]


@dataclass
class StepState:
    """Everything one step's handlers share; built by the front door, read by the workers."""

    stages: Sequence[Stage]
    inputs: Sequence[Any]
    train: bool
    seed: int
    checkpoint_stop: int
    timeout: float
    grad_enabled: bool = True
    checkpoint_mode: str = "never"  # the Pipe's checkpoint mode (offload picks contexts by it)
    targets: Optional[Sequence[Any]] = None
    loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None
    loss_weights: Optional[Sequence[float]] = None
    token_mean: Optional[Any] = None  # a token_mean.TokenMean: (loss_sum, count) losses allowed
    scaler: Optional[Any] = None  # a GradScaler: backward starts from the scaled loss
    abort: Abort = field(default_factory=Abort)
    split: AbstractSet[Tuple[int, int]] = frozenset()  # (stage, micro-batch) with a W
    saved: Dict[Tuple[int, int], "Held"] = field(default_factory=dict)
    losses: Dict[int, torch.Tensor] = field(default_factory=dict)
    outputs: Dict[int, Any] = field(default_factory=dict)
    progress: List[Tuple[str, Optional[Action]]] = field(default_factory=list)
    completed: int = 0
    busy: List[float] = field(default_factory=list)  # seconds spent in actions, per worker
    recorder: Optional[Any] = None  # a trace.StepRecorder while the pipe is traced
    handlers: Optional[Dict[ActionKind, Any]] = None  # replaces the executor's table (PipeDream)
    inflight: Dict[int, int] = field(default_factory=dict)  # micro-batches held, per stage
    peak_inflight: Dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.mailboxes: List[Mailbox] = []  # wired by the executor
        self.autocast = autocast_state(stage.device.type for stage in self.stages)

    def ambient(self) -> contextlib.ExitStack:
        """Re-enter, on a worker thread, the caller's thread-local grad mode and autocast state."""
        stack = contextlib.ExitStack()
        stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
        stack.enter_context(autocast_regions(self.autocast))
        return stack

    @property
    def last(self) -> int:
        return len(self.stages) - 1

    def hold(self, stage: int, delta: int) -> None:
        """Count micro-batches whose activations a stage holds for backward (and the peak)."""
        count = self.inflight.get(stage, 0) + delta
        self.inflight[stage] = count
        self.peak_inflight[stage] = max(self.peak_inflight.get(stage, 0), count)

    def done(self) -> None:
        """Count a finished action (the executor's watchdog only looks for change)."""
        self.completed += 1


_BARE = object()  # the spec of a value that is a single tensor (the common case, kept fast)


def _flatten(value: Any) -> Tuple[List[Any], Any]:
    if isinstance(value, torch.Tensor):
        return [value], _BARE
    return pytree.tree_flatten(value)


def _unflatten(leaves: List[Any], spec: Any) -> Any:
    return leaves[0] if spec is _BARE else pytree.tree_unflatten(leaves, spec)


def _moved(value: Any, device: torch.device) -> Tuple[List[Any], Any]:
    """The leaves of ``value`` with its tensors on ``device`` (caller-side inputs and targets)."""
    leaves, spec = _flatten(value)
    moved = iter(land(ship([x for x in leaves if isinstance(x, torch.Tensor)], device), device))
    return [next(moved) if isinstance(x, torch.Tensor) else x for x in leaves], spec


def _send(step: StepState, dst: int, key: Tuple[str, int], value: Any, detach: bool,
          differentiable: bool = False) -> None:
    """Ship ``value`` to stage ``dst``. ``differentiable`` marks floating-point tensors as
    wanting a gradient even without a graph (a checkpointed forward ran without one)."""
    leaves, spec = _flatten(value)
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    flags = [t.requires_grad or (differentiable and (t.is_floating_point() or t.is_complex()))
             for t in tensors]
    if detach:
        tensors = [t.detach() for t in tensors]
    parcel = ship(tensors, step.stages[dst].device)
    constants = [_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves]
    step.mailboxes[dst].put(key, Message(spec, constants, parcel, flags))


def is_ready(step: StepState, stage: Stage, action: Action) -> bool:
    """Whether ``action`` can run now without waiting: its input has arrived (or it needs none)."""
    if stage.skips is not None and not stage.skips.ready(step, action):
        return False  # a skip tensor (F) or its gradient (B) has not arrived (fastpipe.skip)
    if action.kind == ActionKind.FORWARD:
        return stage.index == 0 or step.mailboxes[stage.index].has(("act", action.microbatch))
    if action.kind == ActionKind.BACKWARD:
        return (stage.index == step.last
                or step.mailboxes[stage.index].has(("grad", action.microbatch)))
    return True


def _receive(step: StepState, stage: Stage, key: Tuple[str, int], action: Action) -> Message:
    message = step.mailboxes[stage.index].take(key)
    message.parcel.tensors = land(message.parcel, stage.device)
    return message


def _as_leaf(t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    grad_ok = requires_grad and (t.is_floating_point() or t.is_complex())
    return t.detach().requires_grad_(grad_ok)


def _stage_input(step: StepState, stage: Stage, action: Action) -> Tuple[Any, List[torch.Tensor]]:
    """The micro-batch input of ``stage`` and, for training, its boundary leaf tensors."""
    mb = action.microbatch
    if stage.index == 0:
        leaves, spec = _moved(step.inputs[mb], stage.device)
        flags = [False] * sum(isinstance(x, torch.Tensor) for x in leaves)
    else:
        message = _receive(step, stage, ("act", mb), action)
        spec, flags = message.spec, message.requires_grad
        moved = iter(message.parcel.tensors)
        leaves = [next(moved) if x is _TENSOR else x for x in message.constants]
    if not step.train:
        return _unflatten(leaves, spec), []
    flag_it = iter(flags)
    leaves = [_as_leaf(x, next(flag_it)) if isinstance(x, torch.Tensor) else x for x in leaves]
    return _unflatten(leaves, spec), [x for x in leaves if isinstance(x, torch.Tensor)]


@dataclass
class Held:
    """What a stage keeps of one micro-batch between its forward and its backward actions."""

    boundary: List[torch.Tensor]  # the stage's input leaves (their .grad goes upstream)
    inputs: Any = None  # the whole input, kept only to recompute a checkpointed forward
    outputs: List[torch.Tensor] = field(default_factory=list)  # tensors to backprop from
    grads: List[Optional[torch.Tensor]] = field(default_factory=list)  # kept for W


def _loss(step: StepState, stage: Stage, mb: int, output: Any) -> torch.Tensor:
    targets = _unflatten(*_moved(step.targets[mb], stage.device))
    try:
        loss = step.loss_fn(output, targets)
    except Exception as error:
        error.add_note(f"raised by loss_fn(output, targets) on micro-batch {mb}, with output "
                       f"{_shapes(output)} and targets {_shapes(targets)}: check that the "
                       f"targets match the model's output")
        raise
    loss, count = split_count(loss, mb)
    check_loss(loss, mb)
    if count is None:
        if step.token_mean is not None and step.token_mean.active:
            raise LossFunctionError(f"loss_fn returned a loss alone for micro-batch {mb} but "
                                    f"(loss_sum, count) for others; return one form throughout")
        return loss * step.loss_weights[mb]
    if step.token_mean is None:
        raise LossFunctionError("loss_fn returned (loss_sum, count), which this schedule cannot "
                                "weight (PipeDream updates per micro-batch); return a loss")
    step.token_mean.count(mb, count)
    return loss  # sums are added; the step divides its gradient by the total count


def check_loss(loss: Any, mb: int) -> None:
    """A loss a backward can start from: a floating-point scalar that, while autograd records,
    has a gradient graph (plain PyTorch's ``backward`` refuses the others too)."""
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise LossFunctionError(f"loss_fn must return a 0-dim tensor, got "
                                f"{type(loss).__name__} {tuple(getattr(loss, 'shape', ()))} for "
                                f"micro-batch {mb}; reduce the loss to a scalar")
    if not (loss.is_floating_point() or loss.is_complex()):
        raise LossFunctionError(f"loss_fn returned a {loss.dtype} tensor for micro-batch {mb}; "
                                f"a loss must be floating-point to have gradients")
    if torch.is_grad_enabled() and not loss.requires_grad:
        raise LossFunctionError(f"loss_fn returned a loss without a gradient graph for "
                                f"micro-batch {mb} (detached, computed under torch.no_grad(), "
                                f"or rebuilt from a number?); return the tensor computed from "
                                f"the output, or make sure some parameter requires grad")


def _shapes(value: Any) -> str:
    """The shapes of a value's tensors, for error messages."""
    leaves = [x for x in _flatten(value)[0] if isinstance(x, torch.Tensor)]
    shapes = ", ".join(f"{tuple(x.shape)} {x.dtype}" for x in leaves[:4])
    return f"[{shapes}{', ...' if len(leaves) > 4 else ''}]"


def _backprop_roots(step: StepState, stage: Stage, mb: int, output: Any) -> List[torch.Tensor]:
    """The tensors a stage's backward starts from: the weighted loss on the last stage, else
    the stage's tensor outputs."""
    if stage.index == step.last:
        loss = _loss(step, stage, mb, output)
        step.losses.setdefault(mb, loss.detach())
        return [scale_loss(step.scaler, loss)]
    return [x for x in _flatten(output)[0] if isinstance(x, torch.Tensor)]


def forward_action(step: StepState, stage: Stage, action: Action) -> None:
    """F: run one micro-batch through the stage and pass the result on."""
    mb = action.microbatch
    inputs, boundary = _stage_input(step, stage, action)
    if stage.skips is not None:  # pack the popped skip tensors with the input (fastpipe.skip)
        inputs, boundary = stage.skips.receive(step, stage, action, inputs, boundary)
    seed = microbatch_seed(step.seed, stage.index, mb)
    checkpoint = step.grad_enabled and mb < step.checkpoint_stop
    if not step.train:
        output = (stage.forward(inputs, seed, True) if checkpoint
                  else run_stage(step.checkpoint_mode, stage, inputs, seed))  # selective policy
        output, _ = _skips_out(step, stage, mb, output, False)
        if stage.index == step.last:
            step.outputs[mb] = output
        else:
            _send(step, stage.index + 1, ("act", mb), output, detach=False)
        return
    if checkpoint:  # keep the input only; backward recomputes the forward
        with torch.no_grad(), checkpointing():
            output, _ = _skips_out(step, stage, mb, stage.run(inputs, seed), True)
        held = Held(boundary, inputs=inputs)
        if stage.index == step.last:
            with torch.no_grad():
                step.losses[mb] = _loss(step, stage, mb, output).detach()
    else:
        with offload.forward_context(step.checkpoint_mode, stage, mb, boundary):
            output = run_stage(step.checkpoint_mode, stage, inputs, seed)  # selective policy
            output, stashed = _skips_out(step, stage, mb, output, False)
            held = Held(boundary, outputs=_backprop_roots(step, stage, mb, output) + stashed)
    step.saved[(stage.index, mb)] = held
    step.hold(stage.index, 1)
    if stage.index != step.last:
        _send(step, stage.index + 1, ("act", mb), output, detach=True, differentiable=checkpoint)


def _skips_out(step: StepState, stage: Stage, mb: int, output: Any,
               differentiable: bool) -> Tuple[Any, List[torch.Tensor]]:
    """Send what a stage stashed for later stages (``fastpipe.skip``); its own output and the
    stashed tensors, extra roots of its backward. A stage without skips passes through."""
    if stage.skips is None:
        return output, []
    return stage.skips.send(step, mb, output, differentiable)


def _recompute(step: StepState, stage: Stage, mb: int, held: Held) -> None:
    with torch.enable_grad(), recomputing():
        output = stage.run(held.inputs, microbatch_seed(step.seed, stage.index, mb))
        output, stashed = stage.skips.split(output) if stage.skips is not None else (output, [])
        held.outputs = _backprop_roots(step, stage, mb, output) + stashed  # stashed: not re-sent
    held.inputs = None


def backward_action(step: StepState, stage: Stage, action: Action) -> None:
    """B: backpropagate one micro-batch and send the input gradient back. When the schedule
    has a W for it, B computes the input gradient only and keeps the graph for W."""
    mb = action.microbatch
    held = step.saved[(stage.index, mb)]
    offload.prefetch(step.checkpoint_mode, stage, mb)
    if held.inputs is not None:
        _recompute(step, stage, mb, held)
    if stage.index == step.last:
        grads: List[Optional[torch.Tensor]] = [torch.ones_like(held.outputs[0])]
    else:
        grads = list(_receive(step, stage, ("grad", mb), action).parcel.tensors)
    if stage.skips is not None:  # the gradients of the tensors it stashed for later stages
        grads += stage.skips.receive_grads(step, stage, action)
    if (stage.index, mb) in step.split:
        input_grads = _input_grads(held, grads)
        held.grads = grads
    else:
        backward_pairs(held.outputs, grads)
        input_grads = [x.grad if x.requires_grad else None for x in held.boundary]
        _release(step, stage, mb)
    if stage.skips is not None:  # the popped tensors' gradients go back to their producers
        input_grads = stage.skips.send_grads(step, mb, input_grads)
    if stage.index > 0:
        parcel = ship(input_grads, step.stages[stage.index - 1].device)
        step.mailboxes[stage.index - 1].put(("grad", mb), Message(None, [], parcel, []))


def _input_grads(held: Held, grads: List[Optional[torch.Tensor]]) -> List[Optional[torch.Tensor]]:
    """Gradients of the stage's loss with respect to its boundary inputs only; keeps the graph."""
    outputs, output_grads = grad_pairs(held.outputs, grads)
    wanted = [x for x in held.boundary if x.requires_grad]
    if not outputs or not wanted:
        return [None] * len(held.boundary)
    found = iter(torch.autograd.grad(outputs, wanted, output_grads, retain_graph=True,
                                     allow_unused=True))
    return [next(found) if x.requires_grad else None for x in held.boundary]


def weight_action(step: StepState, stage: Stage, action: Action) -> None:
    """W: accumulate the stage's weight gradients for a micro-batch whose B already ran."""
    mb = action.microbatch
    held = step.saved[(stage.index, mb)]
    backward_pairs(held.outputs, held.grads, inputs=stage.parameters())
    _release(step, stage, mb)


def _release(step: StepState, stage: Stage, mb: int) -> None:
    del step.saved[(stage.index, mb)]
    step.hold(stage.index, -1)


HANDLERS: Dict[ActionKind, Callable[[StepState, Stage, Action], None]] = {
    ActionKind.FORWARD: forward_action,
    ActionKind.BACKWARD: backward_action,
    ActionKind.WEIGHT: weight_action,
}
