"""Sharded data parallelism inside pipeline stages, with FSDP2 (``fully_shard``).

Each stage of this rank is sharded over the data-parallel ranks that hold the same stage: every
top-level layer of the stage that has parameters is its own FSDP unit (a transformer block, an
embedding), then the stage itself (its root). Between steps a rank keeps ``1/S`` of its stage's
parameters, gradients and optimizer state.

The policy, per step, chosen for a pipeline (many micro-batches per step, each a separate
forward and backward):

- ``reshard_after_forward=False``: the parameters gathered by a stage's first forward stay
  gathered until its last backward of the step. Resharding after every forward would repeat the
  all-gather for each micro-batch's backward and the next forward: ``2 x chunks`` all-gathers
  per step instead of one.
- inside ``pipe.no_sync()`` nothing is reduced: the unsharded gradients accumulate over the
  calls, and the first call after the block reduces them all with its own.
- gradients are reduced once per step: ``set_requires_gradient_sync(False)`` (and
  ``set_reshard_after_backward(False)``) until the stage's second-to-last backward of the
  step has run, ``True`` for its last one, which reduce-scatters the accumulated gradient and
  reshards the parameters. Earlier micro-batches accumulate unsharded gradients locally.

So during a step a stage holds its whole parameters and gradients (as replicated data
parallelism does); between steps, and in the optimizer step, ``1/S`` of them and of the
optimizer state. Forward-only steps reshard when they end. Measured against FSDP2's own
policy (:meth:`ShardedStages.set_keep_gathered`, ``benchmarks/three_d.py``, 8 micro-batches on
CPU/gloo): 3x faster per step, and a lower peak resident memory too.

Zero-bubble schedules (``zb-h1``, ``zbv``, ``dualpipev``) split a backward into the input
gradient (B) and the weight gradient (W). FSDP2 reduces a unit's gradients in autograd hooks
that fire when the unit's backward reaches its inputs, which a split backward reaches before
any weight gradient exists; so with FSDP a B computes both and its W does nothing (the
schedule's order is kept, its zero-bubble benefit is not).
"""
from __future__ import annotations

from typing import Any, Dict, List, Sequence

from torch import nn

from ..schedule import Action, ActionKind, Schedule
from ..runtime.step import HANDLERS, StepState


def shard(stage_module: nn.Module, mesh: Any) -> nn.Module:
    """``fully_shard`` every top-level layer of the stage that has parameters, then the stage
    (in place; the same module objects, their parameters now sharded ``DTensor`` s)."""
    from torch.distributed.fsdp import fully_shard
    for layer in stage_module.children():
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh, reshard_after_forward=False)
    fully_shard(stage_module, mesh=mesh, reshard_after_forward=False)
    return stage_module


def _fused_weight(step: StepState, stage: Any, action: Action) -> None:
    """W under FSDP: its B already computed the weight gradients."""


class ShardedStages:
    """The per-step control of FSDP's gradient reduction for this rank's stages (the hooks the
    pipeline driver calls: :meth:`prepare`, :meth:`after_action`, :meth:`after_run`)."""

    def __init__(self, roots: Dict[int, nn.Module]) -> None:
        self.roots = roots  # virtual stage -> its fully_shard-ed module
        self.keep_gathered = True
        self.syncing = True  # False inside pipe.no_sync(): no reduction at all this step
        self._trigger: Dict[Action, int] = {}
        self._handlers = dict(HANDLERS)
        self._handlers[ActionKind.WEIGHT] = _fused_weight

    def set_keep_gathered(self, keep: bool) -> None:
        """``True`` (the default): the policy above. ``False``: FSDP2's own defaults, for
        comparison (``benchmarks/three_d.py``): every unit reshards after each forward and
        each backward, and reduces its gradients after every micro-batch's backward (less
        memory held during the step, ``2 x chunks`` all-gathers and ``chunks`` reductions per
        unit and step)."""
        from torch.distributed.fsdp import FSDPModule
        self.keep_gathered = keep
        for root in self.roots.values():
            for unit in root.modules():
                if isinstance(unit, FSDPModule):
                    unit.set_reshard_after_forward(not keep, recurse=False)

    def prepare(self, step: StepState, program: Sequence[Action], schedule: Schedule) -> None:
        """Before a step: B computes the weight gradients (W does nothing); every stage that
        runs more than one backward this step defers its reduction, until its second-to-last
        backward ends (:meth:`after_action`)."""
        if not step.train:
            return
        step.split = frozenset()
        step.handlers = self._handlers
        backwards: Dict[int, List[Action]] = {v: [] for v in self.roots}
        for action in program:
            if action.kind == ActionKind.BACKWARD:
                backwards.setdefault(schedule.virtual_stage_of(action), []).append(action)
        if not self.syncing:  # accumulate unsharded gradients until a call that syncs
            self._trigger = {}
            for root in self.roots.values():
                self._final(root, False)
            return
        self._trigger = {actions[-2]: v for v, actions in backwards.items()
                         if len(actions) > 1 and v in self.roots}
        for v, root in self.roots.items():
            self._final(root, len(backwards.get(v, ())) <= 1 or not self.keep_gathered)

    def after_action(self, stage: Any, action: Action) -> None:
        v = self._trigger.get(action)
        if v is not None:
            self._final(self.roots[v], True)

    def after_run(self, step: StepState) -> None:
        """A forward-only step leaves the parameters gathered: reshard them."""
        if not step.train:
            from torch.distributed.fsdp import FSDPModule
            for root in self.roots.values():
                for unit in root.modules():
                    if isinstance(unit, FSDPModule):
                        unit.reshard()

    @staticmethod
    def _final(root: Any, last: bool) -> None:
        root.set_requires_gradient_sync(last)
        root.set_reshard_after_backward(last)
