"""Training on the loss the model computes itself: ``train_step(batch)`` with ``labels`` in the
batch (a Hugging Face model), or ``loss_fn=fastpipe.use_model_loss``.

The loss is a leaf of the model's output (``'loss'``) and the labels are a model input, which
the traced graph carries to the stage that computes the loss. Each micro-batch's loss is a mean
over its own elements (its tokens, its samples), so the step weighs it by the leaf's rule
(:mod:`fastpipe.outputs`): as ``(loss * count, count)`` through the step's token-mean machinery
(``fastpipe.runtime.gradients.token_mean``), whose total count divides the step's gradients,
so loss and gradients are the plain model's on the whole batch, uneven micro-batches and
``-100`` padding included; a summed leaf (``num_items_in_batch`` given) is added as it is. On
the process that runs the last stage the rule reads the micro-batch's labels, from the inputs
given there. A loss with an auxiliary term (a mixture-of-experts LM's load-balancing loss) has
that term averaged over the step's micro-batches instead (:class:`Bound`).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .errors import LossFunctionError
from .microbatch import batch_size
from .outputs import (Cat, OutputReductionError, OutputRules, Rule, WithAuxiliary,
                      leaves_by_name)

Context = Tuple[torch.Tensor, Dict[str, Any]]  # (an empty row per sample, named inputs read)


class ModelLoss:
    """``train_step``'s ``loss_fn`` for a model that computes its own loss: the output leaf
    ``leaf`` (``'loss'``: a Hugging Face model's, when it is given ``labels``), weighted over
    micro-batches by the leaf's rule. Called on an output, it returns that leaf."""

    def __init__(self, leaf: str = "loss") -> None:
        if not isinstance(leaf, str) or not leaf:
            raise TypeError(f"ModelLoss(leaf=...) names an output leaf ('loss', '[0]'), got "
                            f"{leaf!r}")
        self.leaf = leaf

    def __call__(self, output: Any, targets: Any = None) -> Any:
        return read(output, self.leaf)

    def __repr__(self) -> str:
        return "fastpipe.use_model_loss" if self.leaf == "loss" else f"ModelLoss({self.leaf!r})"


use_model_loss = ModelLoss()


def read(output: Any, leaf: str) -> Any:
    """The leaf ``leaf`` of a model's output; a ``LossFunctionError`` naming the leaves there
    are when it is missing (a Hugging Face model returns no loss without labels)."""
    leaves = leaves_by_name(output)
    if leaf not in leaves:
        raise LossFunctionError(
            f"the model's output has no {leaf!r} leaf (its leaves: {sorted(leaves)[:8]}): pass "
            f"the labels in the inputs so that the model computes its loss (labels=... for a "
            f"Hugging Face model, also in example_inputs when it is traced), or give "
            f"train_step a loss_fn(output, targets)")
    return leaves[leaf]


def model_loss_of(loss_fn: Any, targets: Any) -> Optional[ModelLoss]:
    """The ``ModelLoss`` a ``train_step`` call trains on (``loss_fn=None`` means the model's
    own), or ``None`` for a ``loss_fn`` of the caller's; checked before any work."""
    if loss_fn is None:
        if targets is not None:
            raise TypeError("train_step got targets but no loss_fn: pass loss_fn(output, "
                            "targets), or targets=None to train on the loss the model computes "
                            "from the labels in its inputs")
        return use_model_loss
    if isinstance(loss_fn, ModelLoss):
        if targets is not None:
            raise ValueError(f"targets must be None with loss_fn={loss_fn!r}: the model computes "
                             f"its loss from the labels in its inputs (put them there, e.g. "
                             f"batch['labels'])")
        return loss_fn
    return None


def rule_of(model_loss: ModelLoss, rules: OutputRules, loss_reduction: str) -> Rule:
    """The rule that weighs the model's loss over micro-batches, before any work: an
    ``OutputReductionError`` naming the leaf and ``output_reduction`` when none is known."""
    if loss_reduction != "mean":
        raise ValueError(f"loss_reduction={loss_reduction!r} with loss_fn={model_loss!r}: the "
                         f"model's loss is weighted by its own rule (output_reduction=...), "
                         f"leave loss_reduction at its default")
    rule = rules.rule_for(model_loss.leaf)
    if rule is None or isinstance(rule, Cat):
        raise OutputReductionError(
            f"train_step on the model's own loss: how its {model_loss.leaf!r} leaf combines "
            f"over micro-batches is not known for {rules.model or 'this model'}; say how with "
            f"output_reduction={{{model_loss.leaf!r}: 'mean'}} (a mean over samples), "
            f"'token_mean' (over labels != -100), 'shifted_token_mean' (a causal LM's), 'sum', "
            f"or a function of a micro-batch's named inputs returning the count its mean is "
            f"over, on the pipe's constructor")
    return rule


@dataclass(frozen=True)
class Bound:
    """One step's loss function on the last stage: the model's loss leaf, weighed by ``rule``
    on the micro-batch's context (returned as ``(loss * count, count)`` when ``counted``).

    A loss with an auxiliary term (:class:`fastpipe.outputs.WithAuxiliary`: a
    mixture-of-experts LM's load-balancing loss) has its main part weighed by the rule and
    its auxiliary term averaged over the step's micro-batches (over data-parallel replicas
    too): :meth:`for_step` sets ``scale``, what the auxiliary term is multiplied by so that
    the step's division by the total count (or, for a summed loss, the data-parallel average)
    leaves its mean. ``batch_weight``: the rule's weight of this process's whole batch."""

    leaf: str
    rule: Rule
    counted: bool
    batch_weight: float = 0.0
    summed: bool = False  # the rule adds the micro-batch losses (num_items_in_batch given)
    scale: float = 1.0

    def __call__(self, output: Any, context: Context) -> Any:
        loss = read(output, self.leaf)
        if isinstance(loss, torch.Tensor) and loss.dim() > 0 and loss.numel() == 1:
            loss = loss.reshape(())  # a loss of shape (1,), as older models return
        samples, named = context
        weight, normalised = self.rule.weight(named, samples.shape[0])
        main, extra = self._parts(output, loss)
        if not normalised:  # a sum: added as it is
            return main if extra is None else main + extra * self.scale
        if weight == 0:  # nothing counted: its mean is 0/0, and it must add nothing
            main = torch.where(torch.zeros((), dtype=torch.bool, device=main.device), main, 0.0)
        if not self.counted:  # weighted by the step, by sample share (PipeDream)
            return main if extra is None else main + extra
        main = main * weight
        return (main if extra is None else main + extra * self.scale), weight

    def _parts(self, output: Any, loss: Any) -> Tuple[Any, Optional[Any]]:
        """The main loss and the auxiliary term (its coefficient applied), or ``None`` when
        the rule has none or the output lacks its leaf."""
        rule = self.rule
        if not isinstance(rule, WithAuxiliary):
            return loss, None
        auxiliary = leaves_by_name(output).get(rule.auxiliary)
        if auxiliary is None:
            return loss, None
        extra = rule.coefficient * auxiliary
        return loss - extra, extra

    def for_step(self, microbatches: int, replica_sums: Callable[[List[float]], List[float]]
                 ) -> "Bound":
        """This bound for a step of ``microbatches`` micro-batches: with an auxiliary term,
        its ``scale`` (``replica_sums`` adds values over the data-parallel replicas: a
        collective of the last stage's processes); else itself."""
        if not isinstance(self.rule, WithAuxiliary):
            return self
        if self.summed or not self.counted:
            return replace(self, scale=1.0 / microbatches)
        weight, count = replica_sums([self.batch_weight, float(microbatches)])
        return replace(self, scale=weight / count)


def bind(model_loss: ModelLoss, rules: OutputRules, inputs: Any, runs_last_stage: bool,
         counted: bool) -> Tuple[Callable[..., Any], Any, str]:
    """The step's ``(loss_fn, targets, loss_reduction)`` for the model's own loss (its rule
    checked by :func:`rule_of`). Where this process runs the last stage, the targets are the
    context the rule reads, taken from ``inputs``; elsewhere ``None``.
    ``counted``: whether the step weighs ``(loss_sum, count)`` pairs (not under PipeDream,
    whose micro-batch losses are weighted by their share of the samples)."""
    rule = rule_of(model_loss, rules, "mean")
    if not runs_last_stage:
        return Bound(model_loss.leaf, rule, counted), None, "mean"
    if inputs is None:
        raise ValueError("inputs is None on the process of the last stage: the model computes "
                         "its loss from the labels in its inputs, which that stage reads to "
                         "weigh each micro-batch's loss; pass the batch on this rank too")
    named = rules.named(inputs)
    total = batch_size(inputs, argument="inputs")
    wanted = named if "*" in rule.reads else {k: named[k] for k in rule.reads if k in named}
    weight, normalised = rule.weight(wanted, total)  # the whole batch: checks what it reads
    context = (torch.empty(total, 0), wanted)
    reduction = "mean" if normalised else "sum"
    return Bound(model_loss.leaf, rule, counted, weight, not normalised), context, reduction
