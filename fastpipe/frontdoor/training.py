"""Training steps: ``train_step``, ``clip_grad_norm_`` and ``no_sync`` of every front door.

``train_step``'s arguments in full:

- ``loss_reduction='mean'`` weights each micro-batch's loss by its share of the batch (exact for
  losses that average over the batch); ``'sum'`` adds them (for summed losses). ``loss_fn`` may
  return ``(loss_sum, count)`` per micro-batch (e.g. a token count): the step's loss is then the
  sums over the whole batch's count, and so are its gradients
  (``fastpipe.runtime.gradients.token_mean``).
- Without ``loss_fn`` (or with ``loss_fn=fastpipe.use_model_loss``) and with ``targets=None``,
  the step trains on the loss the model computes itself from the labels in ``inputs``
  (``pipe.train_step({'input_ids': ids, 'labels': labels})``): its output's ``loss`` leaf, each
  micro-batch's weighted by what its mean is over (a Hugging Face model's tokens whose label is
  not -100, or the rule ``output_reduction`` gives), so loss and gradients are the plain
  model's on the whole batch (``fastpipe.model_loss``). On a ``DistributedPipe`` the last
  stage's rank reads the labels from ``inputs``: pass the batch there too.
- ``optimizer``: stepped once after the backward (through ``scaler`` when given); it does not
  zero the gradients: call ``optimizer.zero_grad()`` before each step as usual. Under
  ``schedule='pipedream'`` it is required, and each stage steps it on its own parameters after
  every micro-batch's backward (see ``fastpipe.runtime.weight_versions``).
- ``max_grad_norm``: before that, clip the gradients by the whole model's norm (over every
  stage and rank, each weight counted once; see ``clip_grad_norm_``); the norm is in
  ``last_step.grad_norm``.
- ``nonfinite``: what a loss or gradient that is inf or NaN does: ``'raise'`` (default) raises
  ``fastpipe.NonFiniteError`` naming where it was first seen, before the optimizer step;
  ``'skip'`` (needs ``optimizer``) skips the optimizer step, as a GradScaler does, and reports
  it in ``last_step.skipped``; ``'ignore'`` checks nothing. Every rank of a ``DistributedPipe``
  reaches the same verdict. With a ``scaler``, inf and NaN gradients are the scaler's to skip
  (it lowers its scale), and ``nonfinite`` concerns the loss.
- ``scaler``: a ``torch.amp.GradScaler``; each micro-batch's backward starts from its scaled
  loss (the returned loss is unscaled); pass ``optimizer`` too, or call
  ``scaler.step(optimizer)`` and ``scaler.update()`` yourself (see ``fastpipe.amp``).
- Inside ``with pipe.no_sync():`` the data-parallel and tied-weight gradient syncs wait for the
  next call outside the block (``optimizer`` and ``max_grad_norm`` belong to that call).
- On a ``DistributedPipe`` every rank calls it with the same arguments: ``inputs`` are read on
  the rank of the first stage, ``targets`` on the rank of the last (``None`` elsewhere is
  fine); every rank returns the loss, and the local gradients are averaged over data-parallel
  replicas when there are some.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from ..model_loss import Bound as BoundModelLoss, ModelLoss, bind as bind_model_loss, \
    model_loss_of, rule_of
from ..placement import check_flag
from ..policies import amp
from ..runtime.gradients import closing, grad_norm
from ..runtime.gradients.token_mean import TokenMean
from ..runtime.step import StepState
from ..runtime.transport.wire import HostReads
from ..runtime.weight_versions import step_optimizer
from .arguments import StepEnding, check_ending, check_step_arguments, warn_uneven_mean
from .lifecycle import StepLifecycle


class Training(StepLifecycle):
    """A front door's training steps (mixed into ``FrontDoor``)."""

    _pipedream: Optional[Any]

    def train_step(self, inputs: Any, targets: Any = None,
                   loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None,
                   *, loss_reduction: str = "mean", scaler: Optional[Any] = None,
                   optimizer: Optional[torch.optim.Optimizer] = None,
                   max_grad_norm: Optional[float] = None,
                   nonfinite: str = "raise") -> torch.Tensor:
        """Forward and backward of one batch on the pipe's schedule; returns the (detached) loss.

        Adds to every parameter's ``.grad`` what ``loss_fn(module(inputs), targets).backward()``
        adds, so gradients accumulate over calls as the plain model's do. ``loss_reduction``:
        ``'mean'`` weights each micro-batch's loss by its share of the batch, ``'sum'`` adds
        them; a ``loss_fn`` that returns ``(loss_sum, count)`` makes the loss and gradients the
        sums over the whole batch's count. Without ``loss_fn`` and ``targets``, the step trains
        on the loss the model computes from the labels in ``inputs`` (``fastpipe.model_loss``).
        ``optimizer``: stepped once after the backward (through ``scaler``, a GradScaler, when
        given), the gradients first clipped to ``max_grad_norm`` by the whole model's norm
        (``last_step.grad_norm``); ``nonfinite``: ``'raise'``, ``'skip'`` (the optimizer step)
        or ``'ignore'`` an inf or NaN loss or gradient. Each argument in full:
        ``fastpipe.frontdoor.training``. On a ``DistributedPipe`` every rank calls it with the
        same arguments (``inputs`` read on the first stage's rank, ``targets`` on the last's;
        ``None`` elsewhere) and every rank returns the loss.
        """
        asynchronous = self._pipedream is not None  # arguments first: every rank alike
        scaler = amp.check_scaler(scaler)
        model_loss = model_loss_of(loss_fn, targets)
        check_step_arguments(model_loss or loss_fn, loss_reduction, optimizer, asynchronous,
                             scaler)
        if model_loss is not None:
            rule_of(model_loss, self.output_rules, loss_reduction)
            loss_fn = model_loss
        ending = check_ending(optimizer, scaler, max_grad_norm, nonfinite, asynchronous,
                              sync=not self.__dict__.get("_unsynced", False))
        with self._driver.guarded():
            return self._train_step(inputs, targets, loss_fn, loss_reduction, ending)

    def _train_step(self, inputs: Any, targets: Any, loss_fn: Callable[[Any, Any], torch.Tensor],
                    loss_reduction: str, ending: StepEnding) -> torch.Tensor:
        optimizer, scaler, asynchronous = ending.optimizer, ending.scaler, ending.asynchronous
        handlers = self._pipedream.handlers(optimizer, ending.nonfinite) if asynchronous else None
        if isinstance(loss_fn, ModelLoss):  # the model's own loss, weighed by its rule
            loss_fn, targets, loss_reduction = bind_model_loss(
                loss_fn, self.output_rules, inputs, self._reads_targets(True),
                counted=not asynchronous)
        start = time.perf_counter()
        token_mean = None if asynchronous else TokenMean(self.parameters)
        self._driver.begin_training(ending.sync)
        step, sizes, schedule = self._new_step(
            inputs, targets, train=True, grad_enabled=True, loss_reduction=loss_reduction,
            loss_fn=loss_fn, scaler=scaler, token_mean=token_mean, handlers=handlers)
        if isinstance(loss_fn, BoundModelLoss) and self._reads_targets(True):
            step.loss_fn = loss_fn.for_step(len(sizes), self._driver.replica_sums)
        self._run(schedule.actions, step, schedule)
        loss, count = self._driver.loss(step, len(sizes))
        if count is None and loss_reduction == "mean" and len(set(sizes)) > 1 \
                and self._reads_targets(True):
            warn_uneven_mean(sizes)
        self._driver.finish_gradients(step, count)
        self._end_step(step, loss, len(sizes), ending)
        self._measured(sum(sizes), start)
        self._record_step(step, sum(sizes), start)
        return loss

    def _end_step(self, step: StepState, loss: torch.Tensor, count: int,
                  ending: StepEnding) -> None:
        """After the gradients are final: unscale (scaler), gather every process's report
        (norm terms, non-finite findings; on a ``DistributedPipe`` the collective that confirms
        the step), then raise, skip, or clip and step the optimizer, alike everywhere."""
        optimizer, scaler = ending.optimizer, ending.scaler
        unscaled = scaler is not None and optimizer is not None and ending.sync
        scaler_skips = (self._driver.before_update(optimizer, scaler, step.reads) if unscaled
                        else False)
        norm_type = ending.norm_type if not scaler_skips else None
        counted = (self._driver.counted(list(self.named_parameters()))
                   if norm_type is not None else [])
        verdict = self._verdict(step, count, counted, norm_type, scaler is not None,
                                ending.nonfinite != "ignore")
        step.grad_norm = verdict.grad_norm
        bad = verdict.culprit if ending.nonfinite != "ignore" else None
        if bad is not None and ending.nonfinite == "raise":
            name = self._driver.name_of(bad, counted) if bad.bad_parameter >= 0 else None
            if unscaled:
                scaler.update()  # unscaled this step: leave the scaler ready for the next
            raise closing.error(bad, step.reads.number(loss), name, self._driver.distributed)
        step.skipped = optimizer is not None and (scaler_skips or bad is not None)
        if step.skipped:
            self._skipped_steps = self.skipped_steps + 1
        elif ending.max_norm is not None:
            factor = grad_norm.coefficient(ending.max_norm, verdict.grad_norm,
                                           grad_norm.grad_dtype(self.parameters()))
            grad_norm.clip_(self.parameters(), factor)
        if optimizer is not None and not ending.asynchronous:
            if bad is None:
                step_optimizer(optimizer, scaler)  # a scaler skips its own verdicts
            elif scaler is not None:
                scaler.update()  # skipped as the scaler's own skips are: its scale moves

    def _verdict(self, step: StepState, count: int, counted: Sequence[Any],
                 norm_type: Optional[float], scaled: bool, losses: bool) -> closing.Verdict:
        """This process's report of the step (one read of its device at most: the norm terms,
        and on the last stage's process the losses' finiteness when ``losses`` and the counts
        of ``(loss_sum, count)`` losses), gathered with every other's: the verdict. A count
        that is not a count refuses the step here, its gradients put back."""
        last = len(self._stages) - 1
        token_mean = step.token_mean if step.token_mean is not None and \
            step.token_mean.active else None
        mine = closing.report(self._driver.rank, counted, norm_type,
                              step.losses if losses else {}, count,
                              last if self._reads_targets(True) else None,
                              reads=step.reads, counts=token_mean)
        if token_mean is not None:
            if mine.bad_count >= 0:
                raise token_mean.refuse(mine.bad_count, step.reads)
            token_mean.release()
        if scaled:  # inf gradients are the scaler's: only the loss is checked
            mine = dataclasses.replace(mine, bad_parameter=-1, bad_stage=-1)
        return closing.verdict(self._driver.gather_reports(mine), norm_type)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the whole model: scale every gradient by
        ``min(max_norm / (total_norm + 1e-6), 1)`` and return ``total_norm``, the p-norm of the
        model's whole gradient (every stage and virtual stage; on a ``DistributedPipe`` every
        rank's, each data-parallel replica, tensor-parallel or FSDP shard and tied weight
        counted once), the same on every rank.

        torch's own function clips only the gradients it is given: on a rank of a
        ``DistributedPipe`` that is one stage's, by that stage's norm. On a
        ``DistributedPipe`` this is a collective: every rank calls it. Not inside ``no_sync()``
        (the gradients are not final there). ``error_if_nonfinite``: raise
        ``fastpipe.NonFiniteError`` (nothing clipped) when the norm is inf or NaN.
        """
        max_norm = grad_norm.check_max_norm(max_norm)
        norm_type = grad_norm.check_norm_type(norm_type)
        error_if_nonfinite = check_flag(error_if_nonfinite, "error_if_nonfinite")
        self._driver.check_synced("clip_grad_norm_")
        with self._driver.guarded():
            counted = self._driver.counted(list(self.named_parameters()))
            mine = closing.report(self._driver.rank, counted, norm_type, {}, 0,
                                  reads=HostReads())  # one read (outside any step)
            verdict = closing.verdict(self._driver.gather_reports(mine), norm_type)
            if error_if_nonfinite and verdict.culprit is not None:
                bad = verdict.culprit
                name = self._driver.name_of(bad, counted)
                raise closing.error(bad, None, name, self._driver.distributed, clipping=True)
        total = verdict.grad_norm if verdict.grad_norm is not None else 0.0
        dtype = grad_norm.grad_dtype(self.parameters())
        grad_norm.clip_(self.parameters(), grad_norm.coefficient(max_norm, total, dtype))
        return torch.tensor(total, dtype=dtype, device=self._driver.norm_device)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients over several ``train_step`` calls without syncing them, as
        ``DistributedDataParallel.no_sync`` does: inside the block, data-parallel averages and
        the sums of weights tied across ranks wait; the first call after the block syncs all
        that the calls accumulated. The result equals syncing every call (and the plain model
        accumulating ``.grad``); what it saves is one all-reduce per call. On a ``Pipe`` (one
        process, nothing to sync) it changes nothing."""
        if self.__dict__.get("_unsynced", False):
            raise RuntimeError("pipe.no_sync() is already active; do not nest it")
        if self._pipedream is not None:
            raise NotImplementedError("no_sync() with schedule='pipedream': PipeDream updates "
                                      "the weights inside each step, there is nothing to defer")
        self._unsynced = True
        try:
            yield
        finally:
            self._unsynced = False

    @property
    def skipped_steps(self) -> int:
        """How many optimizer steps ``train_step`` skipped (non-finite steps under
        ``nonfinite='skip'``, and those a GradScaler skipped)."""
        return self.__dict__.get("_skipped_steps", 0)
