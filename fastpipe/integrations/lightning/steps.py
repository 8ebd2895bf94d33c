"""The two calls a ``LightningModule`` makes to train and evaluate through its model:
``training_loss`` in ``training_step``, ``evaluate`` in ``validation_step`` / ``test_step``.

Under ``PipelineStrategy`` they run the pipeline's ``train_step`` and ``evaluate`` on the
whole batch; under any other strategy (Lightning's own single-process run, DDP, ...) they call
the model and the loss as written, so one module runs either way. The strategy registers the
models it pipelines here; a model it does not know takes the plain path.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Optional, Protocol

import torch
from torch import nn

from ...model_call import as_call
from ...model_loss import ModelLoss, use_model_loss


class Runner(Protocol):
    """What runs a pipelined model's steps (``PipelineStrategy``)."""

    def run_training(self, inputs: Any, targets: Any,
                     loss_fn: Optional[Callable[..., Any]]) -> torch.Tensor:
        ...

    def run_evaluation(self, inputs: Any, targets: Any,
                       metric_fn: Optional[Callable[..., Any]]) -> Any:
        ...


_RUNNERS: "weakref.WeakKeyDictionary[nn.Module, Any]" = weakref.WeakKeyDictionary()


def bind(model: nn.Module, runner: Runner) -> None:
    """``model``'s steps now run through ``runner`` (held weakly: the runner holds the model)."""
    _RUNNERS[model] = weakref.ref(runner)


def runner_of(model: nn.Module) -> Optional[Runner]:
    """The runner that pipelines ``model``, or ``None``."""
    ref = _RUNNERS.get(model) if isinstance(model, nn.Module) else None
    return ref() if ref is not None else None


def training_loss(model: nn.Module, inputs: Any, targets: Any = None,
                  loss_fn: Optional[Callable[..., Any]] = None) -> torch.Tensor:
    """The loss of one batch, for ``training_step`` to log and return.

    ``inputs``: the model's inputs (a dict: keyword inputs; a tuple: positional inputs;
    anything else: its one input). ``loss_fn(output, targets)`` returns the batch's mean loss,
    or ``(loss_sum, count)`` (then the loss is ``loss_sum / count``, exactly over any split);
    without it the model's own loss (the ``loss`` of its output, from labels in ``inputs``).
    Under ``PipelineStrategy`` the pipeline computes the loss and the gradients in one step
    (return this very loss from ``training_step``); elsewhere the model runs as it is and
    Lightning backpropagates the loss.
    """
    _check_fn(loss_fn, "loss_fn")
    runner = runner_of(model)
    if runner is not None:
        return runner.run_training(inputs, targets, loss_fn)
    return _plain_loss(_plain_output(model, inputs), targets, loss_fn)


def evaluate(model: nn.Module, inputs: Any, targets: Any = None,
             metric_fn: Optional[Callable[..., Any]] = None) -> Any:
    """``metric_fn(output, targets)`` of the model's output in eval mode, without autograd (or
    the model's own loss when no ``metric_fn`` is given), for ``validation_step`` /
    ``test_step`` to log.

    Under ``PipelineStrategy`` the pipeline evaluates the whole batch; on a
    ``DistributedPipe`` ``metric_fn`` runs where the output is (the last stage's rank) and its
    value (tensors and numbers, in dicts, lists or tuples) reaches every rank. Either way every
    module's train/eval mode is restored afterwards.
    """
    _check_fn(metric_fn, "metric_fn")
    runner = runner_of(model)
    if runner is not None:
        return runner.run_evaluation(inputs, targets, metric_fn)
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            return value_of(_plain_output(model, inputs), targets, metric_fn)
    finally:
        for m, training in modes:
            m.training = training


def value_of(output: Any, targets: Any, metric_fn: Optional[Callable[..., Any]]) -> Any:
    """What ``evaluate`` returns for one output: ``metric_fn``'s value, or the model's loss."""
    if metric_fn is None or isinstance(metric_fn, ModelLoss):
        _no_targets(targets, "metric_fn")
        return (metric_fn or use_model_loss)(output)
    return metric_fn(output, targets)


def _plain_output(model: nn.Module, inputs: Any) -> Any:
    call = as_call(inputs)
    return model(*call.args, **call.kwargs)


def _plain_loss(output: Any, targets: Any, loss_fn: Optional[Callable[..., Any]]) -> Any:
    if loss_fn is None or isinstance(loss_fn, ModelLoss):
        _no_targets(targets, "loss_fn")
        return (loss_fn or use_model_loss)(output)
    loss = loss_fn(output, targets)
    if isinstance(loss, tuple) and len(loss) == 2:
        total, count = loss
        return total / count
    return loss


def _no_targets(targets: Any, argument: str) -> None:
    if targets is not None:
        raise TypeError(f"targets given without {argument}: the model's own loss reads its "
                        f"labels from the inputs; pass {argument}(output, targets), or put the "
                        f"labels in the inputs")


def _check_fn(fn: Any, argument: str) -> None:
    if fn is not None and not callable(fn):
        raise TypeError(f"{argument} must be a function (output, targets) -> value, or None "
                        f"for the model's own loss; got {type(fn).__name__}")
