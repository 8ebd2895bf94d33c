"""The runtime half of skip connections: a stage's forward frame, and the mailbox exchange.

A stage with skips runs its layers as ``(input, {name: popped}) -> (output, {name: stashed})``
(:class:`Framed`, the stage's ``call``), so checkpointing treats the skip tensors as inputs and
outputs like any other and a recomputation stashes again without sending. Skip tensors and
their gradients are messages of the step's lowered programs like any other (their ``Comm`` names
the skip connection; see :mod:`fastpipe.runtime.lowering`): the consumer runs its backward first
(it is downstream), so the producer's backward waits for that gradient and adds it to its own.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..runtime.lowering import Route
from ..runtime.transport.message import as_leaf, post, post_grads, take
from ..runtime.step import StepState
from ..schedule import ActionKind
from . import api
from .layout import StageSkips

Tensors = Dict[str, Optional[torch.Tensor]]


class StageFrame:
    """The skip tensors of one forward pass of one stage (what ``stash`` / ``pop`` reach)."""

    def __init__(self, skips: StageSkips, incoming: Tensors) -> None:
        self.skips = skips
        self.sends = {name for name, _ in skips.sends}
        self.incoming = dict(incoming)
        self.local: Tensors = {}
        self.outgoing: Tensors = {}
        self.stashed: set = set()

    def stash(self, name: str, tensor: Optional[torch.Tensor]) -> None:
        if name in self.stashed:
            raise api.SkipError(f"skip {name!r} was stashed twice in one forward of stage "
                                f"{self.skips.index}; stash each name once")
        if name in self.sends:
            self.outgoing[name] = tensor
        elif name in self.skips.local:
            self.local[name] = tensor
        else:
            raise api.SkipError(f"stash({name!r}) ran in stage {self.skips.index}, whose layers "
                                f"do not declare it; add it to @skippable(stash=[...]) of the "
                                f"layer that stashes it")
        self.stashed.add(name)

    def pop(self, name: str) -> Optional[torch.Tensor]:
        if name in self.local:
            return self.local.pop(name)
        if name in self.incoming:
            return self.incoming.pop(name)
        raise api.SkipError(f"pop({name!r}) in stage {self.skips.index} found no tensor: no "
                            f"layer stashed it before, or it was popped already; declare it with "
                            f"@skippable(pop=[...]) and pop it once, after its stash")

    def finish(self) -> Tensors:
        """The stashed tensors for later stages, in wire order; checks nothing was left over."""
        missing = [name for name, _ in self.skips.sends if name not in self.outgoing]
        left = sorted(self.local) + sorted(self.incoming)
        if missing or left:
            raise api.SkipError(f"stage {self.skips.index} declares skips its forward did not "
                                f"use: not stashed {missing}, not popped {left}; every declared "
                                f"stash and pop must run in every forward")
        return {name: self.outgoing[name] for name, _ in self.skips.sends}


class Framed:
    """A stage's ``call`` with skips: ``(input, popped) -> (output, stashed)``."""

    def __init__(self, inner: Callable[[Any], Any], skips: StageSkips) -> None:
        self.inner = inner
        self.skips = skips

    def __call__(self, packed: Tuple[Any, Tensors]) -> Tuple[Any, Tensors]:
        inputs, incoming = packed
        frame = StageFrame(self.skips, incoming)
        previous = api.enter(frame)
        try:
            output = self.inner(inputs)
        finally:
            api.enter(previous)
        return output, frame.finish()


class StageExchange:
    """What the step handlers do for a stage with skips (``stage.skips``): pack received skip
    tensors with the input, send stashed ones, and route their gradients."""

    def __init__(self, skips: StageSkips) -> None:
        self.skips = skips
        self.index = skips.index

    def receive(self, step: StepState, stage: Any, route: Route, inputs: Any,
                boundary: List[torch.Tensor]) -> Tuple[Any, List[torch.Tensor]]:
        """The stage's packed input ``(input, popped)``; in training the popped tensors are
        boundary leaves too (their gradients go back to the producers)."""
        popped: Tensors = {}
        for name, _ in self.skips.receives:
            message = take(step, stage, route.skip_inputs[name])
            tensor = message.parcel.tensors[0] if message.parcel.tensors else None  # stash(n, None)
            popped[name] = (as_leaf(tensor, message.requires_grad[0])
                            if step.train and tensor is not None else tensor)
        leaves = _roots(popped) if step.train else []
        return (inputs, popped), boundary + leaves

    def send(self, step: StepState, mb: int, output: Tuple[Any, Tensors],
             differentiable: bool) -> Tuple[Any, List[torch.Tensor]]:
        """Send the stashed tensors to their consumers; the stage's own output and the stashed
        tensors (extra roots of the stage's backward)."""
        value, stashed = output
        route = step.routes[self.index, ActionKind.FORWARD, mb]
        for name, _ in self.skips.sends:
            post(step, *route.skip_outputs[name], stashed[name], detach=step.train,
                 differentiable=differentiable)
        return value, _roots(stashed)

    @staticmethod
    def split(output: Tuple[Any, Tensors]) -> Tuple[Any, List[torch.Tensor]]:
        """A recomputed ``(output, stashed)``: used for the backward, never sent again."""
        value, stashed = output
        return value, _roots(stashed)

    def receive_grads(self, step: StepState, stage: Any, route: Route) -> List[Optional[torch.Tensor]]:
        """The gradients of the tensors this stage stashed, from their consumers."""
        return [take(step, stage, route.skip_inputs[name]).parcel.tensors[0]
                for name, _ in self.skips.sends]

    def send_grads(self, step: StepState, route: Route, input_grads: List[Optional[torch.Tensor]]
                   ) -> List[Optional[torch.Tensor]]:
        """Send the popped tensors' gradients (the tail of ``input_grads``) to their producers;
        returns the gradients of the stage's ordinary input."""
        head = len(input_grads) - len(self.skips.receives)
        for (name, _), grad in zip(self.skips.receives, input_grads[head:]):
            post_grads(step, *route.skip_outputs[name], [grad])
        return input_grads[:head]


def _roots(tensors: Dict[str, Optional[torch.Tensor]]) -> List[torch.Tensor]:
    """The skip tensors in wire order, an empty tensor (no gradient) for a stashed ``None``."""
    return [torch.empty(0) if t is None else t for t in tensors.values()]


def wire(stages: List[Any], plans: Dict[int, StageSkips]) -> None:
    """Give the stages that take part in skip connections their frame and exchange."""
    for index, skips in plans.items():
        stage = stages[index]
        stage.call = Framed(stage.call, skips)
        stage.skips = StageExchange(skips)
