"""The ``Trainer``'s loss, as a pipe computes it: the same value and the same gradients.

The ``Trainer`` (``compute_loss`` and ``training_step``) backpropagates, per batch of a
gradient-accumulation window and per process, the model's loss

- divided by ``num_items_in_batch`` (the labels counted over the window and, with
  ``average_tokens_across_devices``, over the replicas) when the model takes loss keywords and
  its loss uses the count (a causal LM's ``ForCausalLMLoss``): a sum over the window's tokens;
- else the model's own mean over the batch;
- times the number of replicas when ``average_tokens_across_devices`` and the count were given
  (DDP then averages the replicas' gradients);
- divided by the window's batch count unless the loss counts as scaled for accumulation
  (``loss_is_scaled_for_ga``; by default: the model takes loss keywords and the count was
  given).

A pipe computes the model's loss per micro-batch, each a mean over its own counted elements
(the rule of ``fastpipe.hf_losses`` or ``output_reduction``), so each micro-batch's loss is
turned into its share of that quantity, ``mean * count * factor``, and the shares are summed
(``loss_reduction='sum'``): one micro-step's loss and gradients are the ``Trainer``'s, the
pipe's data-parallel average standing for DDP's.

In evaluation (``prediction_step``) the ``Trainer`` gives the model the batch's label count
(over the replicas too) and scales it as in training, without accumulation; TRL's
``SFTTrainer`` evaluates without the count, the model's own mean over the batch
(``evaluation_count=False``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Tuple

import torch

from ...model_loss import bind, use_model_loss
from ...outputs import Rule

NUM_ITEMS = "num_items_in_batch"


@dataclass(frozen=True)
class LossSemantics:
    """What the ``Trainer`` decided about the model's loss at construction."""

    accepts_loss_kwargs: bool  # Trainer.model_accepts_loss_kwargs
    scaled_for_ga: Optional[bool]  # Trainer.loss_is_scaled_for_ga (None: decided per step)
    average_tokens: bool  # TrainingArguments.average_tokens_across_devices
    replicas: int  # data-parallel replicas (DDP's processes)
    evaluation_count: bool = True  # prediction_step gives the model the batch's label count


@dataclass(frozen=True)
class MicroStep:
    """One batch of the window: the pipe's ``train_step`` arguments."""

    targets: Any
    loss_fn: Callable[[Any, Any], torch.Tensor]


def micro_step(pipe: Any, inputs: Any, num_items: Any, window: int,
               semantics: LossSemantics) -> MicroStep:
    """The ``loss_fn`` and targets with which ``pipe.train_step(inputs, targets, loss_fn,
    loss_reduction='sum')`` gives the ``Trainer``'s loss of this batch (``window``: the
    window's batch count, ``num_items``: the ``Trainer``'s count or ``None``)."""
    bound, context, _ = bind(use_model_loss, pipe.output_rules, inputs, True, counted=True)
    count, normalised = _count(bound.rule, context)
    given = num_items is not None and semantics.accepts_loss_kwargs
    if given and normalised and _uses_count(bound.rule, context, num_items):
        divisor = float(num_items)
    else:
        divisor = count if normalised else 1.0
    factor = _reciprocal(divisor)
    if semantics.average_tokens and given:
        factor *= semantics.replicas
    scaled = semantics.scaled_for_ga if semantics.scaled_for_ga is not None else given
    if not scaled:
        factor /= window

    def loss_fn(output: Any, micro_context: Any) -> torch.Tensor:
        value = bound(output, micro_context)
        total = value[0] if isinstance(value, tuple) else value  # the micro-batch's sum
        return total * factor

    return MicroStep(context, loss_fn)


def evaluation_scale(rule: Rule, inputs: Mapping[str, Any], semantics: LossSemantics,
                     replicas_count: Callable[[float], float]) -> float:
    """The factor from the model's own loss on an evaluation batch (combined over its
    micro-batches) to ``prediction_step``'s: the ``Trainer`` gives the model the batch's label
    count (summed over the replicas with ``average_tokens_across_devices``: ``replicas_count``,
    a collective, so every rank calls this) and scales as in training, without accumulation."""
    if not (semantics.evaluation_count and semantics.accepts_loss_kwargs) \
            or "labels" not in inputs:
        return 1.0
    context = (torch.empty(_rows(inputs["labels"]), 0), dict(inputs))
    count, normalised = _count(rule, context)
    total = replicas_count(count) if semantics.average_tokens else count
    factor = count * _reciprocal(total) if normalised and _uses_count(rule, context, total) \
        else 1.0
    return factor * semantics.replicas if semantics.average_tokens else factor


def _count(rule: Rule, context: Tuple[torch.Tensor, Mapping[str, Any]]) -> Tuple[float, bool]:
    """What the batch's mean is over (its count), and whether the loss is a mean at all."""
    samples, named = context
    return rule.weight({k: v for k, v in named.items() if k != NUM_ITEMS}, samples.shape[0])


def _uses_count(rule: Rule, context: Tuple[torch.Tensor, Mapping[str, Any]],
                num_items: Any) -> bool:
    """Whether the model's loss, given ``num_items_in_batch``, is a sum divided by it (a
    causal LM's) rather than its own mean (the count ignored)."""
    samples, named = context
    _, normalised = rule.weight({**named, NUM_ITEMS: num_items}, samples.shape[0])
    return not normalised


def _reciprocal(divisor: float) -> float:
    """``1 / divisor``; a mean over nothing is NaN, as the model's own is."""
    return 1.0 / divisor if divisor != 0 else math.nan


def _rows(labels: Any) -> int:
    return int(labels.shape[0]) if isinstance(labels, torch.Tensor) and labels.dim() > 0 else 1
