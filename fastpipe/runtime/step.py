"""The state of one pipeline step and the handlers that run its actions.

A step is either a training step (``train``: stage boundaries are detached, each stage runs its
own backward, gradients travel back through mailboxes) or a forward pass (``forward``: the
autograd graph stays connected across stages so the caller can backprop through the output).
What an action takes from its mailbox and where it sends its results come from the step's
lowered programs (:mod:`fastpipe.runtime.lowering`): each message is keyed by its receive op.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import (TYPE_CHECKING, AbstractSet, Any, Callable, Dict, List, Mapping, Optional,
                    Sequence, Tuple)

import torch

from ..policies.amp import autocast_regions, autocast_state, scale_loss
from ..policies.checkpoint import (IN_PLACE_ON_DATA, backward_pairs, checkpointing, grad_pairs,
                                   is_changed, microbatch_seed, recomputing)
from ..policies import offload
from ..errors import LossFunctionError
from ..model_loss import Bound as ModelLossStep
from .gradients.token_mean import TokenMean, split_count
from ..policies.selective import run_stage
from ..schedule import Action, ActionKind
from .transport.device_copy import land, ship
from .lowering import Place, Route
from .transport.mailbox import Abort, Mailbox
from .transport.wire import HostReads
from .transport.message import BARE, TENSOR, as_leaf, flatten, post, post_grads, take, unflatten
from .stage import Stage

if TYPE_CHECKING:
    from .observe.trace import StepRecorder


Handler = Callable[["StepState", Any, Action], None]  # runs one action of a stage


@dataclass(frozen=True)
class StepConfig:
    """What every step of a pipe shares, fixed by its layout: the stages, the longest any wait
    may take, and the checkpoint mode (offload picks its contexts by it)."""

    stages: Tuple[Stage, ...]
    timeout: float
    checkpoint_mode: str = "never"

    @property
    def last(self) -> int:
        """The index of the last (virtual) stage."""
        return len(self.stages) - 1


_worker_threads = threading.local()  # the intra-op thread count set on this thread


@dataclass
class StepState:
    """One step's record: what the call asked for (inputs, targets, loss), and what the
    handlers and workers fill in as the step runs. Built by the front door, read by the
    workers."""

    config: StepConfig
    inputs: Sequence[Any]
    train: bool
    seed: int
    checkpoint_stop: int
    grad_enabled: bool = True
    targets: Optional[Sequence[Any]] = None
    loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None
    loss_weights: Optional[Sequence[float]] = None
    token_mean: Optional[TokenMean] = None  # (loss_sum, count) losses allowed
    scaler: Optional[torch.amp.GradScaler] = None  # backward starts from the scaled loss
    abort: Abort = field(default_factory=Abort)
    split: AbstractSet[Tuple[int, int]] = frozenset()  # (stage, micro-batch) with a W
    saved: Dict[Tuple[int, int], "Held"] = field(default_factory=dict)
    losses: Dict[int, torch.Tensor] = field(default_factory=dict)
    outputs: Dict[int, Any] = field(default_factory=dict)
    progress: List[Tuple[str, Optional[Action]]] = field(default_factory=list)
    completed: int = 0
    busy: List[float] = field(default_factory=list)  # seconds spent in actions, per worker
    recorder: Optional["StepRecorder"] = None  # while the pipe is traced
    handlers: Optional[Mapping[ActionKind, Handler]] = None  # replaces the executor's (PipeDream)
    # PipeDream: micro-batch -> its weight version tag, the first stage's updates in the call
    # when it forwarded it (other ranks learn it from the micro-batch's messages)
    tags: Dict[int, int] = field(default_factory=dict)
    inflight: Dict[int, int] = field(default_factory=dict)  # micro-batches held, per stage
    peak_inflight: Dict[int, int] = field(default_factory=dict)
    grad_norm: Optional[float] = None  # the whole model's gradient norm, when measured
    skipped: bool = False  # the optimizer step was skipped (non-finite, or the scaler's verdict)
    reads: HostReads = field(default_factory=HostReads)  # blocking reads of device buffers

    def __post_init__(self) -> None:
        self.mailboxes: List[Mailbox] = []  # wired by the executor
        self.routes: Dict[Place, Route] = {}  # each action's messages, set by the executor
        self.autocast = autocast_state(stage.device.type for stage in self.config.stages)
        self.intra_op_threads = torch.get_num_threads()

    def ambient(self) -> contextlib.ExitStack:
        """Re-enter, on a worker thread, the caller's thread-local grad mode and autocast state,
        and its intra-op thread count: OpenMP and MKL keep that count per thread, and a thread
        torch did not start would otherwise use every core (and spin-wait on them)."""
        if getattr(_worker_threads, "count", None) != self.intra_op_threads:
            torch.set_num_threads(self.intra_op_threads)
            _worker_threads.count = self.intra_op_threads
        stack = contextlib.ExitStack()
        stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
        stack.enter_context(autocast_regions(self.autocast))
        return stack

    def hold(self, stage: int, delta: int) -> None:
        """Count micro-batches whose activations a stage holds for backward (and the peak)."""
        count = self.inflight.get(stage, 0) + delta
        self.inflight[stage] = count
        self.peak_inflight[stage] = max(self.peak_inflight.get(stage, 0), count)

    def done(self) -> None:
        """Count a finished action (the executor's watchdog only looks for change)."""
        self.completed += 1


def _moved(value: Any, device: torch.device) -> Tuple[List[Any], Any]:
    """The leaves of ``value`` with its tensors on ``device`` (caller-side inputs and targets)."""
    leaves, spec = flatten(value)
    moved = iter(land(ship([x for x in leaves if isinstance(x, torch.Tensor)], device), device))
    return [next(moved) if isinstance(x, torch.Tensor) else x for x in leaves], spec


def _stage_input(step: StepState, stage: Stage, route: Route,
                 mb: int) -> Tuple[Any, List[torch.Tensor]]:
    """The micro-batch input of ``stage`` and, for training, its boundary leaf tensors."""
    if route.input is None:  # the first stage reads the batch
        leaves, spec = _moved(step.inputs[mb], stage.device)
        flags = [False] * sum(isinstance(x, torch.Tensor) for x in leaves)
    else:
        message = take(step, stage, route.input)
        spec, flags = message.spec, message.requires_grad
        if spec is BARE:  # a single tensor: no pytree round trip
            tensor = message.parcel.tensors[0]
            if not step.train:
                return tensor, []
            tensor = as_leaf(tensor, flags[0])
            return tensor, [tensor]
        moved = iter(message.parcel.tensors)
        leaves = [next(moved) if x is TENSOR else x for x in message.constants]
    if not step.train:
        return unflatten(leaves, spec), []
    flag_it = iter(flags)
    leaves = [as_leaf(x, next(flag_it)) if isinstance(x, torch.Tensor) else x for x in leaves]
    return unflatten(leaves, spec), [x for x in leaves if isinstance(x, torch.Tensor)]


@dataclass
class Held:
    """What a stage keeps of one micro-batch between its forward and its backward actions."""

    boundary: List[torch.Tensor]  # the stage's input leaves (their .grad goes upstream)
    inputs: Any = None  # the whole input, kept only to recompute a checkpointed forward
    outputs: List[torch.Tensor] = field(default_factory=list)  # tensors to backprop from
    grads: List[Optional[torch.Tensor]] = field(default_factory=list)  # kept for W
    versions: List[int] = field(default_factory=list)  # of ``inputs``' tensors, when kept


def _input_tensors(inputs: Any) -> List[torch.Tensor]:
    return [x for x in flatten(inputs)[0] if isinstance(x, torch.Tensor)]


def _loss(step: StepState, stage: Stage, mb: int, output: Any) -> torch.Tensor:
    targets = unflatten(*_moved(step.targets[mb], stage.device))
    try:
        loss = step.loss_fn(output, targets)
    except Exception as error:
        if isinstance(step.loss_fn, ModelLossStep):  # the model's own loss: no targets
            error.add_note(f"raised reading the model's own loss on micro-batch {mb}, from "
                           f"its output {_shapes(output)}")
        else:
            error.add_note(f"raised by loss_fn(output, targets) on micro-batch {mb}, with "
                           f"output {_shapes(output)} and targets {_shapes(targets)}: check "
                           f"that the targets match the model's output")
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
    leaves = [x for x in flatten(value)[0] if isinstance(x, torch.Tensor)]
    shapes = ", ".join(f"{tuple(x.shape)} {x.dtype}" for x in leaves[:4])
    return f"[{shapes}{', ...' if len(leaves) > 4 else ''}]"


def _backprop_roots(step: StepState, stage: Stage, mb: int, output: Any) -> List[torch.Tensor]:
    """The tensors a stage's backward starts from: the weighted loss on the last stage, else
    the stage's tensor outputs."""
    if stage.index == step.config.last:
        loss = _loss(step, stage, mb, output)
        step.losses.setdefault(mb, loss.detach())
        return [scale_loss(step.scaler, loss)]
    return [x for x in flatten(output)[0] if isinstance(x, torch.Tensor)]


def forward_action(step: StepState, stage: Stage, action: Action) -> None:
    """F: run one micro-batch through the stage and pass the result on."""
    mb = action.microbatch
    route = step.routes[stage.index, action.kind, mb]
    inputs, boundary = _stage_input(step, stage, route, mb)
    if stage.skips is not None:  # pack the popped skip tensors with the input (fastpipe.skip)
        inputs, boundary = stage.skips.receive(step, stage, route, inputs, boundary)
    seed = microbatch_seed(step.seed, stage.index, mb)
    checkpoint = step.grad_enabled and mb < step.checkpoint_stop
    if not step.train:
        mode = step.config.checkpoint_mode
        output = (stage.forward(inputs, seed, True) if checkpoint
                  else run_stage(mode, stage, inputs, seed))  # the selective policy
        output, _ = _skips_out(step, stage, mb, output, False)
        if route.output is None:  # the last stage keeps the output
            step.outputs[mb] = output
        else:
            post(step, *route.output, output, detach=False)
        return
    if checkpoint:  # keep the input only; backward recomputes the forward
        with torch.no_grad(), checkpointing():
            output, _ = _skips_out(step, stage, mb, stage.run(inputs, seed), True)
        held = Held(boundary, inputs=inputs,
                    versions=[t._version for t in _input_tensors(inputs)])
        if stage.index == step.config.last:
            with torch.no_grad():
                step.losses[mb] = _loss(step, stage, mb, output).detach()
    else:
        with offload.forward_context(step.config.checkpoint_mode, stage, mb, boundary):
            output = run_stage(step.config.checkpoint_mode, stage, inputs, seed)  # selective
            output, stashed = _skips_out(step, stage, mb, output, False)
            held = Held(boundary, outputs=_backprop_roots(step, stage, mb, output) + stashed)
    step.saved[(stage.index, mb)] = held
    step.hold(stage.index, 1)
    if route.output is not None:
        post(step, *route.output, output, detach=True, differentiable=checkpoint)


def _skips_out(step: StepState, stage: Stage, mb: int, output: Any,
               differentiable: bool) -> Tuple[Any, List[torch.Tensor]]:
    """Send what a stage stashed for later stages (``fastpipe.skip``); its own output and the
    stashed tensors, extra roots of its backward. A stage without skips passes through."""
    if stage.skips is None:
        return output, []
    return stage.skips.send(step, mb, output, differentiable)


def _recompute(step: StepState, stage: Stage, mb: int, held: Held) -> None:
    if is_changed(_input_tensors(held.inputs), held.versions):  # would recompute from them
        raise RuntimeError(f"stage {stage.index}, micro-batch {mb}: {IN_PLACE_ON_DATA}")
    with torch.enable_grad(), recomputing():
        output = stage.run(held.inputs, microbatch_seed(step.seed, stage.index, mb))
        output, stashed = stage.skips.split(output) if stage.skips is not None else (output, [])
        held.outputs = _backprop_roots(step, stage, mb, output) + stashed  # stashed: not re-sent
    held.inputs = None


def backward_action(step: StepState, stage: Stage, action: Action) -> None:
    """B: backpropagate one micro-batch and send the input gradient back. When the schedule
    has a W for it, B computes the input gradient only and keeps the graph for W."""
    mb = action.microbatch
    route = step.routes[stage.index, action.kind, mb]
    held = step.saved[(stage.index, mb)]
    offload.prefetch(step.config.checkpoint_mode, stage, mb)
    if held.inputs is not None:
        _recompute(step, stage, mb, held)
    if route.input is None:  # the last stage starts from its loss
        grads: List[Optional[torch.Tensor]] = [torch.ones_like(held.outputs[0])]
    else:
        grads = list(take(step, stage, route.input).parcel.tensors)
    if stage.skips is not None:  # the gradients of the tensors it stashed for later stages
        grads += stage.skips.receive_grads(step, stage, route)
    if (stage.index, mb) in step.split:
        input_grads = _input_grads(held, grads)
        held.grads = grads
    else:
        backward_pairs(held.outputs, grads)
        input_grads = [x.grad if x.requires_grad else None for x in held.boundary]
        _release(step, stage, mb)
    if stage.skips is not None:  # the popped tensors' gradients go back to their producers
        input_grads = stage.skips.send_grads(step, route, input_grads)
    if route.output is not None:
        post_grads(step, *route.output, input_grads)


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


HANDLERS: Dict[ActionKind, Handler] = {
    ActionKind.FORWARD: forward_action,
    ActionKind.BACKWARD: backward_action,
    ActionKind.WEIGHT: weight_action,
}
