"""The step lifecycle that the front doors, ``Pipe`` and ``DistributedPipe``, share.

One place checks the arguments into a frozen ``Layout``, splits batches into micro-batches,
runs ``train_step`` / ``forward`` / ``evaluate`` / ``trace``, makes the automatic schedule and
chunk choices and weights the micro-batch losses. What differs between the front doors (where the
stages run, how the micro-batch sizes are agreed, how gradients are synchronised) is a driver
(``fastpipe.runtime.drivers.base``). A front door builds its stages, sets ``layout``,
``module`` (its
layers under their plain names), ``_stages``, ``_pipedream`` and ``_driver``, calls ``_begin``,
and says how many physical stages it has.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from . import generation, hf_losses, microbatch, outputs, tracing
from .model_loss import ModelLoss, bind as bind_model_loss, model_loss_of, rule_of
from .policies import amp, selective
from .policies.checkpoint import check_mode, checkpoint_stop, draw_step_seed
from .placement import check_chunks, check_flag, check_timeout, resolve_virtual_stages
from .autotune import chunk_count, schedule_choice
from .runtime.gradients import closing, grad_norm
from .runtime.observe import step_stats
from .runtime.drivers.base import Driver
from .runtime.weight_versions import check_optimizer_argument, step_optimizer
from .runtime.step import StepState
from .runtime.gradients.token_mean import TokenMean
from .runtime.observe.trace import StepRecorder, Trace
from .runtime.observe.step_stats import StepStats
from .schedule import Schedule, get_schedule

LOSS_REDUCTIONS = ("mean", "sum")


@dataclass(frozen=True)
class Layout:
    """A front door's checked arguments, fixed at construction: what the pipeline is."""

    chunks: int  # the requested micro-batch count (the first candidate with chunks='auto')
    auto_chunks: bool
    checkpoint: str
    schedule: str  # the requested schedule name, 'auto' included
    virtual_stages: int
    timeout: float
    deferred_batch_norm: bool
    balance: Tuple[int, ...] = ()

    @property
    def auto_schedule(self) -> bool:
        return self.schedule == "auto"

    @property
    def first_schedule(self) -> str:
        """The schedule of the first step (``'auto'`` starts with 1F1B or looped BFS)."""
        if self.auto_schedule:
            return schedule_choice.first_schedule(self.virtual_stages)
        return self.schedule

    def with_balance(self, balance: Sequence[int]) -> "Layout":
        return dataclasses.replace(self, balance=tuple(balance))


def parse_layout(chunks: Any, checkpoint: Any, schedule: Any, virtual_stages: Any,
                 timeout: Any, deferred_batch_norm: Any) -> Layout:
    """The arguments both front doors take, checked (a typed error naming the argument)."""
    auto_chunks = isinstance(chunks, str) and chunks == "auto"
    return Layout(chunks=1 if auto_chunks else check_chunks(chunks), auto_chunks=auto_chunks,
                  checkpoint=check_checkpoint(checkpoint),
                  schedule=schedule_choice.check_name(schedule),
                  virtual_stages=resolve_virtual_stages(virtual_stages, schedule),
                  timeout=check_timeout(timeout),
                  deferred_batch_norm=check_flag(deferred_batch_norm, "deferred_batch_norm"))


@functools.lru_cache(maxsize=64)
def validated_schedule(name: str, num_stages: int, num_microbatches: int,
                       virtual_stages: int) -> Schedule:
    """The named schedule for a layout, validated once (cached) for buffered sends: both
    executors buffer every send (mailboxes, non-blocking p2p)."""
    schedule = get_schedule(name, num_stages, num_microbatches, virtual_stages=virtual_stages)
    schedule.validate(comm="buffered")
    return schedule


def check_checkpoint(mode: Any) -> str:
    """The checkpoint mode, checked; its one-time set-up (imports torch's selective-checkpoint
    machinery) happens here, so that the first step's timeout measures the step alone."""
    mode = check_mode(mode)
    if mode == selective.MODE:
        selective.prepare()
    return mode


def check_step_arguments(loss_fn: Any, loss_reduction: Any, optimizer: Any,
                         asynchronous: bool, scaler: Any) -> None:
    """``train_step``'s arguments, checked before any work."""
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(output, target), got {loss_fn!r}")
    if loss_reduction not in LOSS_REDUCTIONS:
        raise ValueError(f"loss_reduction={loss_reduction!r}; use 'mean' (losses averaged over "
                         f"the batch) or 'sum' (losses summed over the batch)")
    check_optimizer_argument(optimizer, asynchronous, scaler)


@dataclass(frozen=True)
class StepEnding:
    """How a training step ends once its gradients are final (checked arguments)."""

    optimizer: Optional[Any]
    scaler: Optional[Any]
    max_norm: Optional[float]
    nonfinite: str
    asynchronous: bool
    sync: bool  # False inside no_sync(): the gradients are not final yet

    @property
    def norm_type(self) -> Optional[float]:
        """The norm to measure (2), or ``None`` when nothing needs the gradients scanned:
        no clipping, and non-finite gradients not looked for (``'ignore'``, a scaler's own
        check, PipeDream's per-update check, or gradients not final yet)."""
        if not self.sync:
            return None
        looks = self.nonfinite != "ignore" and self.scaler is None and not self.asynchronous
        return 2.0 if self.max_norm is not None or looks else None


def check_ending(optimizer: Any, scaler: Any, max_grad_norm: Any, nonfinite: Any,
                 asynchronous: bool, sync: bool) -> StepEnding:
    """``train_step``'s ``max_grad_norm`` and ``nonfinite``, checked with the arguments they
    combine with, before any work."""
    nonfinite = grad_norm.check_nonfinite(nonfinite)
    max_norm = (None if max_grad_norm is None
                else grad_norm.check_max_norm(max_grad_norm, "max_grad_norm"))
    if not sync and (optimizer is not None or max_norm is not None):
        raise ValueError("optimizer= and max_grad_norm= inside pipe.no_sync(): the gradients "
                         "are final only after the first call outside the block; pass them "
                         "to that call")
    if asynchronous and max_norm is not None:
        raise NotImplementedError("max_grad_norm with schedule='pipedream': each stage updates "
                                  "its weights after every micro-batch, so there is no whole "
                                  "gradient to clip; use a flushed schedule such as '1f1b'")
    if nonfinite == "skip" and asynchronous:
        raise NotImplementedError("nonfinite='skip' with schedule='pipedream': its updates "
                                  "happen stage by stage inside the step and cannot be skipped "
                                  "together; use 'raise' (each stage checks before it updates)")
    if nonfinite == "skip" and optimizer is None and sync:
        raise ValueError("nonfinite='skip' skips the optimizer step, so it needs optimizer=...; "
                         "without it, use nonfinite='raise' and catch fastpipe.NonFiniteError")
    if max_norm is not None and scaler is not None and optimizer is None:
        raise ValueError("max_grad_norm with scaler= needs optimizer=...: the gradients must be "
                         "unscaled before they are clipped (scaler.unscale_(optimizer))")
    return StepEnding(optimizer, scaler, max_norm, nonfinite, asynchronous, sync)


def loss_weights(sizes: Sequence[int], loss_reduction: str) -> List[float]:
    """Each micro-batch loss's weight: its share of the batch (``'mean'``) or 1 (``'sum'``)."""
    total = sum(sizes)
    return [s / total for s in sizes] if loss_reduction == "mean" else [1.0] * len(sizes)


def warn_uneven_mean(sizes: Sequence[int]) -> None:
    """Once per process: a mean loss over micro-batches of different sizes is weighted by
    size, exact for a mean over samples but not for a mean over tokens (padding excluded)."""
    warnings.warn("micro-batches of different sizes with a mean loss: each micro-batch's loss "
                  "is weighted by its share of the samples, which is exact for a mean over "
                  "samples; for a mean over tokens (padding excluded) return (loss_sum, "
                  "token_count) from loss_fn instead", UncertainWeighting, stacklevel=4)


class UncertainWeighting(UserWarning):
    """A mean loss over micro-batches of different sizes (see ``warn_uneven_mean``)."""


class FrontDoor(nn.Module):
    """The step lifecycle, the layout's read-only properties, and plain-module names."""

    layout: Layout
    _driver: Driver
    _stages: List[Any]
    _pipedream: Optional[Any]

    def _begin(self, layout: Layout) -> Schedule:
        """Take the checked layout; pick the first micro-batch count (``chunks='auto'``);
        return the first step's schedule, which raises, before any stage is built, for a
        schedule that cannot run the layout."""
        object.__setattr__(self, "layout", layout)
        object.__setattr__(self, "_chunks", layout.chunks)
        object.__setattr__(self, "_schedule_name", layout.first_schedule)
        object.__setattr__(self, "_auto", layout.auto_schedule)
        object.__setattr__(self, "chunk_search", None)  # chunks='auto': a chunk_count.ChunkSearch
        object.__setattr__(self, "auto_ranking", None)  # schedule='auto': the ranking
        object.__setattr__(self, "_trace", None)
        if layout.auto_chunks:
            object.__setattr__(self, "_chunks", chunk_count.first_count(self.num_stages,
                                                                      self._accepts))
        return self.plan(self._chunks)

    # ---------------------------------------------------------------- read-only properties
    @property
    def num_stages(self) -> int:
        """Physical pipeline stages (devices of a ``Pipe``, ranks of a ``DistributedPipe``)."""
        raise NotImplementedError  # pragma: no cover - each front door says

    @property
    def balance(self) -> Tuple[int, ...]:
        """Number of layers in each (virtual) stage, in model order."""
        return self.layout.balance

    @property
    def chunks(self) -> int:
        """Number of micro-batches per batch: the one requested, or with ``chunks='auto'`` the
        one the next step runs (the chosen one once ``chunk_search.chosen`` is set)."""
        return self._chunks

    @property
    def checkpoint(self) -> str:
        """The checkpoint mode."""
        return self.layout.checkpoint

    @property
    def schedule(self) -> str:
        """The name of the schedule the next step runs; ``plan(m)`` gives the schedule itself."""
        return self._schedule_name

    @property
    def virtual_stages(self) -> int:
        """Model chunks per physical stage."""
        return self.layout.virtual_stages

    @property
    def last_step(self) -> Optional[StepStats]:
        """The last training step's samples/s, wall time and measured bubble share
        (``fastpipe.runtime.observe.step_stats.StepStats``), kept without tracing; ``None``
        before the first."""
        return self.__dict__.get("_last_step")

    def plan(self, num_microbatches: Optional[int] = None) -> Schedule:
        """The validated schedule this pipe runs for ``num_microbatches`` (default ``chunks``)."""
        return validated_schedule(self._schedule_name, self.num_stages,
                                  num_microbatches or self._chunks, self.layout.virtual_stages)

    def _take_outputs(self, given: Dict[str, outputs.Rule], module: Any, traced: bool) -> None:
        """How the outputs combine over micro-batches: the rules given (``output_reduction``,
        checked by ``outputs.check_output_reduction`` before any work) and those known for the
        model (a Hugging Face model's own loss); a traced module's signature names its
        positional inputs."""
        object.__setattr__(self, "_output_rules", outputs.OutputRules(
            given, hf_losses.known_rules(module),
            outputs.signature_of(module) if traced else None,
            type(module).__name__ if isinstance(module, nn.Module) else ""))

    @property
    def output_rules(self) -> outputs.OutputRules:
        """How the outputs' leaves that are not per-sample combine over micro-batches."""
        return self.__dict__.get("_output_rules") or outputs.OutputRules({}, {})

    # ---------------------------------------------------------------- running
    def train_step(self, inputs: Any, targets: Any = None,
                   loss_fn: Optional[Callable[[Any, Any], torch.Tensor]] = None,
                   *, loss_reduction: str = "mean", scaler: Optional[Any] = None,
                   optimizer: Optional[torch.optim.Optimizer] = None,
                   max_grad_norm: Optional[float] = None,
                   nonfinite: str = "raise") -> torch.Tensor:
        """Forward and backward of one batch on the pipe's schedule; returns the (detached) loss.

        Adds to every parameter's ``.grad`` what ``loss_fn(module(inputs), targets).backward()``
        adds, so gradients accumulate over calls as the plain model's do. ``loss_reduction=
        'mean'`` weights each micro-batch's loss by its share of the batch (exact for losses
        that average over the batch); ``'sum'`` adds them (for summed losses). ``loss_fn`` may
        return ``(loss_sum, count)`` per micro-batch (e.g. a token count): the step's loss is
        then the sums over the whole batch's count, and so are its gradients
        (``fastpipe.runtime.gradients.token_mean``).

        Without ``loss_fn`` (or with ``loss_fn=fastpipe.use_model_loss``) and with
        ``targets=None``, the step trains on the loss the model computes itself from the labels
        in ``inputs`` (``pipe.train_step({'input_ids': ids, 'labels': labels})``): its
        output's ``loss`` leaf, each micro-batch's weighted by what its mean is over (a Hugging
        Face model's tokens whose label is not -100, or the rule ``output_reduction`` gives),
        so loss and gradients are the plain model's on the whole batch
        (``fastpipe.model_loss``). On a ``DistributedPipe`` the last stage's rank reads the
        labels from ``inputs``: pass the batch there too.

        ``optimizer``: stepped once after the backward (through ``scaler`` when given); it does
        not zero the gradients: call ``optimizer.zero_grad()`` before each step as usual. Under
        ``schedule='pipedream'`` it is required, and each stage steps it on its own parameters
        after every micro-batch's backward (see ``fastpipe.runtime.weight_versions``).
        ``max_grad_norm``: before that, clip the gradients by the whole model's norm (over every
        stage and rank, each weight counted once; see :meth:`clip_grad_norm_`); the norm is in
        ``last_step.grad_norm``.
        ``nonfinite``: what a loss or gradient that is inf or NaN does: ``'raise'`` (default)
        raises ``fastpipe.NonFiniteError`` naming where it was first seen, before the optimizer
        step; ``'skip'`` (needs ``optimizer``) skips the optimizer step, as a GradScaler does,
        and reports it in ``last_step.skipped``; ``'ignore'`` checks nothing. Every rank of a
        ``DistributedPipe`` reaches the same verdict. With a ``scaler``, inf and NaN gradients
        are the scaler's to skip (it lowers its scale), and ``nonfinite`` concerns the loss.
        ``scaler``: a ``torch.amp.GradScaler``; each micro-batch's backward starts from its
        scaled loss (the returned loss is unscaled); pass ``optimizer`` too, or call
        ``scaler.step(optimizer)`` and ``scaler.update()`` yourself (see ``fastpipe.amp``).

        Inside ``with pipe.no_sync():`` the data-parallel and tied-weight gradient syncs wait
        for the next call outside the block (``optimizer`` and ``max_grad_norm`` belong to that
        call).

        On a ``DistributedPipe`` every rank calls it with the same arguments: ``inputs`` are
        read on the rank of the first stage, ``targets`` on the rank of the last (``None``
        elsewhere is fine); every rank returns the loss, and the local gradients are averaged
        over data-parallel replicas when there are some.
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
                    loss_reduction: str, ending: "StepEnding") -> torch.Tensor:
        optimizer, scaler, asynchronous = ending.optimizer, ending.scaler, ending.asynchronous
        handlers = self._pipedream.handlers(optimizer, ending.nonfinite) if asynchronous else None
        if isinstance(loss_fn, ModelLoss):  # the model's own loss, weighed by its rule
            loss_fn, targets, loss_reduction = bind_model_loss(
                loss_fn, self.output_rules, inputs, self._reads_targets(True),
                counted=not asynchronous)
        start = time.perf_counter()
        token_mean = None if asynchronous else TokenMean(self.parameters)
        self._driver.begin_training(ending.sync)
        step, sizes = self._new_step(inputs, targets, train=True, grad_enabled=True,
                                     loss_fn=loss_fn, scaler=scaler, token_mean=token_mean)
        schedule = self.plan(len(sizes))
        step.loss_weights = loss_weights(sizes, loss_reduction)
        step.checkpoint_stop = checkpoint_stop(self.layout.checkpoint, len(sizes))
        step.split = schedule.split_backwards
        step.handlers = handlers
        self._run(schedule.actions, step, schedule)
        loss, count = self._driver.loss(step, len(sizes))
        if count is None and loss_reduction == "mean" and len(set(sizes)) > 1 \
                and self._reads_targets(True):
            warn_uneven_mean(sizes)
        self._driver.finish_gradients(step, count)
        self._end_step(step, loss, len(sizes), ending)
        self._measured(sum(sizes), start)
        step_stats.finish_step(self, step, sum(sizes), start)
        return loss

    def _end_step(self, step: StepState, loss: torch.Tensor, count: int,
                  ending: "StepEnding") -> None:
        """After the gradients are final: unscale (scaler), gather every process's report
        (norm terms, non-finite findings; on a ``DistributedPipe`` the collective that confirms
        the step), then raise, skip, or clip and step the optimizer, alike everywhere."""
        optimizer, scaler = ending.optimizer, ending.scaler
        unscaled = scaler is not None and optimizer is not None and ending.sync
        scaler_skips = self._driver.before_update(optimizer, scaler) if unscaled else False
        norm_type = ending.norm_type if not scaler_skips else None
        counted = (self._driver.counted(list(self.named_parameters()))
                   if norm_type is not None else [])
        verdict = self._verdict(step, count, counted, norm_type, scaler is not None)
        step.grad_norm = verdict.grad_norm
        bad = verdict.culprit if ending.nonfinite != "ignore" else None
        if bad is not None and ending.nonfinite == "raise":
            name = self._driver.name_of(bad, counted) if bad.bad_parameter >= 0 else None
            if unscaled:
                scaler.update()  # unscaled this step: leave the scaler ready for the next
            raise closing.error(bad, float(loss), name, self._driver.distributed)
        step.skipped = optimizer is not None and (scaler_skips or bad is not None)
        if step.skipped:
            object.__setattr__(self, "_skipped_steps", self.skipped_steps + 1)
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
                 norm_type: Optional[float], scaled: bool) -> "closing.Verdict":
        """This process's report of the step, gathered with every other's: the verdict."""
        last = len(self._stages) - 1
        mine = closing.report(self._driver.rank, counted, norm_type, step.losses, count,
                              last if self._reads_targets(True) else None)
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
            mine = closing.report(self._driver.rank, counted, norm_type, {}, 0)
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
        object.__setattr__(self, "_unsynced", True)
        try:
            yield
        finally:
            object.__setattr__(self, "_unsynced", False)

    @property
    def skipped_steps(self) -> int:
        """How many optimizer steps ``train_step`` skipped (non-finite steps under
        ``nonfinite='skip'``, and those a GradScaler skipped)."""
        return self.__dict__.get("_skipped_steps", 0)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the batch through the stages (the forward actions of the pipe's schedule); the
        output is on the last stage's device. A traced module takes its own positional and
        keyword inputs (``pipe(input_ids=..., attention_mask=...)``).

        When grad is enabled the output of a ``Pipe`` is connected to every stage's parameters,
        so ``loss_fn(pipe(x), y).backward()`` works as with the plain module (the backward then
        runs in autograd's order, as in GPipe). A ``DistributedPipe`` evaluates forward only
        (no graph, no recompute, nothing kept for backward): the output on the last stage's
        rank, ``None`` on the others.
        """
        inputs = args[0] if len(args) == 1 and not kwargs else tracing.Call(args, kwargs)
        with self._driver.guarded(), self._driver.forward_grad_mode():
            found, sizes = self._forward_microbatches(inputs)
        # outside guarded(): every stage has finished, so a leaf that cannot be combined is an
        # error of this call alone, not one that stops the pipe
        return None if found is None else self._gather(found, sizes, inputs)

    def _forward(self, inputs: Any) -> Any:
        """The batch's output (``None`` where this process does not run the last stage)."""
        found, sizes = self._forward_microbatches(inputs)
        return None if found is None else self._gather(found, sizes, inputs)

    def _forward_microbatches(self, inputs: Any) -> Tuple[Optional[List[Any]], List[int]]:
        """Run the forward actions; the micro-batch outputs (``None`` where this process
        does not run the last stage) and the micro-batch sizes."""
        grad = torch.is_grad_enabled()
        step, sizes = self._new_step(inputs, None, train=False, grad_enabled=grad)
        if grad and self.training:
            step.checkpoint_stop = checkpoint_stop(self.layout.checkpoint, len(sizes))
        schedule = self.plan(len(sizes))
        self._run(schedule.forward_actions, step, schedule)
        if len(self._stages) - 1 not in self._driver.local:
            return None, sizes
        return [step.outputs[i] for i in range(len(sizes))], sizes

    def _gather(self, found: List[Any], sizes: List[int], inputs: Any) -> Any:
        """The micro-batch outputs combined into the batch's (``fastpipe.outputs``): a rule
        that reads the inputs (labels) reads those given to this process."""
        rules = self.output_rules

        def named() -> List[Dict[str, Any]]:
            if inputs is None:
                raise outputs.OutputReductionError(
                    "the output's loss is weighed by the labels in the inputs, but this "
                    "process (the last stage's) was given no inputs; pass the batch on this "
                    "rank too")
            return microbatch.scatter(rules.named(inputs), sizes)
        return microbatch.gather(found, sizes, rules, named)

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        """Inference: the forward pass in eval mode (dropout off, batch norms use their running
        statistics) without autograd, so nothing is checkpointed, recomputed or kept for a
        backward. The modules' train/eval modes are restored afterwards."""
        modes = [(m, m.training) for m in self._moded_modules()]
        self.eval()
        try:
            with torch.no_grad():
                return self(*args, **kwargs)
        finally:
            for m, training in modes:
                m.training = training

    def generate(self, input_ids: Any, max_new_tokens: int, *, attention_mask: Any = None,
                 do_sample: bool = False, temperature: Optional[float] = None,
                 top_k: Optional[int] = None, top_p: Optional[float] = None,
                 seed: Optional[int] = None, eos_token_id: Any = None,
                 pad_token_id: Optional[int] = None, chunks: Optional[int] = None,
                 use_cache: bool = True) -> torch.Tensor:
        """Generate ``max_new_tokens`` tokens after each prompt of ``input_ids`` (batch,
        length), with ``attention_mask`` for left-padded prompts, as ``transformers``'
        ``model.generate`` does: the prompts and their new tokens, (batch, length + new).

        Each stage keeps the KV cache of its own layers; ``chunks`` groups of sequences
        (default: one per physical stage) are in flight at once, so the stages decode
        concurrently, and each next token goes back to the first stage inside the pipeline
        (``fastpipe.generation``). Greedy by default; ``do_sample=True`` samples with
        ``temperature``, ``top_k`` and ``top_p`` (a ``transformers`` model's own settings
        when not given) from ``seed`` (else the global generator). Generation stops at
        ``eos_token_id`` (default: the model's) and pads finished sequences with
        ``pad_token_id``. ``use_cache=False`` recomputes the whole sequence for every token
        (any causal LM, an ``nn.Sequential`` of layers included). Eval mode, no autograd.
        On a ``DistributedPipe`` every rank calls it with the same arguments; ``input_ids``
        are read on the first stage's rank, and every rank returns the sequences.
        """
        traced, split_points = self.__dict__.get("_traced", (None, None))
        source = generation.Source(self, traced, split_points, self.module, self._stages,
                                   self.plan().placement, self._driver, self.layout.timeout)
        modes = [(m, m.training) for m in self._moded_modules()]
        self.eval()
        try:
            with torch.no_grad():
                return generation.generate(
                    source, input_ids, max_new_tokens, attention_mask=attention_mask,
                    do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                    seed=seed, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                    chunks=chunks, use_cache=use_cache)
        finally:
            for m, training in modes:
                m.training = training

    def train(self, mode: bool = True) -> "FrontDoor":
        """Train or eval mode for the plain module's layers and for every stage this process
        runs: the stages of a traced module are graphs (train and eval ones, each the module
        traced in that mode), and on a ``DistributedPipe`` they are not submodules of the pipe,
        so ``nn.Module.train`` alone would not reach them."""
        super().train(mode)
        for stage in self.__dict__.get("_stages", ()):
            module = getattr(stage, "module", None)  # None: another rank's stage
            if module is not None:
                module.train(mode)
        return self

    def _moded_modules(self) -> List[nn.Module]:
        """Every module whose ``training`` flag a step reads: the pipe's and its stages'."""
        seen: dict = {}
        for m in self.modules():
            seen.setdefault(id(m), m)
        for stage in self.__dict__.get("_stages", ()):
            module = getattr(stage, "module", None)
            for m in module.modules() if module is not None else ():
                seen.setdefault(id(m), m)
        return list(seen.values())

    @contextlib.contextmanager
    def trace(self) -> Iterator[Trace]:
        """Record the real start and end of every action of the steps run inside the block.

        ``with pipe.trace() as t: pipe.train_step(...)``; then ``t.timeline`` (the same format
        the simulator returns), ``t.bubble_fraction`` and ``t.busy`` describe the last step.
        On a ``DistributedPipe`` every rank enters the block and holds the whole pipeline's
        timeline (ranks on one machine share a clock; across machines the lanes are aligned
        only as well as the machines' clocks are).
        """
        trace = Trace()
        object.__setattr__(self, "_trace", trace)
        try:
            yield trace
        finally:
            object.__setattr__(self, "_trace", None)

    # ---------------------------------------------------------------- one step
    def _new_step(self, inputs: Any, targets: Any, *, train: bool, grad_enabled: bool,
                  **kwargs: Any) -> Tuple[StepState, List[int]]:
        """A fresh step over the batch's micro-batches, their sizes agreed by the driver."""
        sizes = self._local_sizes(inputs, targets, train)
        local = self._driver.local
        tracing.prepare(self._stages[k].module for k in local)  # eval graphs, before the step
        for k in local:
            self._stages[k].rng.reset()
        step = StepState(stages=self._stages, inputs=[], train=train, seed=draw_step_seed(),
                         checkpoint_stop=0, timeout=self.layout.timeout,
                         grad_enabled=grad_enabled, checkpoint_mode=self.layout.checkpoint,
                         **kwargs)
        fixed = None if self.layout.auto_chunks else lambda n: self._split(n, self._chunks)
        sizes = self._driver.agree(step, sizes, train, fixed, self.plan)
        if self.layout.auto_chunks and not self._driver.searches_chunks:
            self._chunks = len(sizes)  # the count the first stage's rank announced
        if 0 in local:
            step.inputs = microbatch.scatter(inputs, sizes)
        if self._reads_targets(train):
            step.targets = microbatch.scatter(targets, sizes)
        return step, sizes

    def _reads_targets(self, train: bool) -> bool:
        """Whether this process reads the targets (it runs the last stage of a training step)."""
        return train and len(self._stages) - 1 in self._driver.local

    def _local_sizes(self, inputs: Any, targets: Any, train: bool) -> Optional[List[int]]:
        """Micro-batch sizes from the batch this process reads, checked before any work."""
        reads_targets = self._reads_targets(train)
        self._driver.check_present(inputs, targets, reads_targets)
        sizes = None
        if 0 in self._driver.local:
            total = microbatch.batch_size(inputs, argument="inputs")
            sizes = self._split(total, self._step_chunks(total, train))
        if reads_targets:
            total = microbatch.batch_size(targets, argument="targets")
            if sizes is not None and sum(sizes) != total:
                raise ValueError(f"targets has batch size {total} but inputs has {sum(sizes)}; "
                                 f"give one target per input sample")
            sizes = self._split(total, self._step_chunks(total, train), argument="targets")
        return sizes

    def _split(self, total: int, chunks: int, argument: str = "inputs") -> List[int]:
        """Micro-batch sizes of a batch of ``total``: ``torch.chunk``'s (fewer micro-batches
        for a short batch), or the nearest smaller count the schedule can run."""
        return microbatch.fitted_sizes(total, chunks, self._accepts, argument=argument)

    def _step_chunks(self, total: int, train: bool) -> int:
        """The micro-batch count for a batch of ``total``; with ``chunks='auto'`` a training
        step takes the search's next count (where the driver searches)."""
        if not self.layout.auto_chunks:
            return self._chunks
        if train and self._driver.searches_chunks:
            if self.chunk_search is None:
                object.__setattr__(self, "chunk_search", self._new_chunk_search(total))
            self._chunks = self.chunk_search.next()
        return min(self._chunks, total)

    def _run(self, programs: Sequence[Sequence[Any]], step: StepState, schedule: Schedule) -> None:
        """Run the step's programs through the driver; trace them and, with
        ``schedule='auto'``, choose the schedule from the first training step's timeline."""
        choosing = self._auto and step.train
        if self._trace is not None or choosing:
            step.recorder = StepRecorder(self.num_stages)
        self._driver.run(programs, step, schedule)
        if step.recorder is not None:
            timeline = self._driver.timeline(step.recorder)
            if self._trace is not None:
                self._trace.timelines.append(timeline)
            if choosing:  # every rank ranks the same timeline: the same choice
                self._choose_schedule(timeline, schedule)

    def _choose_schedule(self, timeline: Any, schedule: Schedule) -> None:
        """``schedule='auto'``: rank the candidate schedules by simulated step time with the
        costs measured in the first step, and run the fastest from now on."""
        ranking = schedule_choice.rank(timeline, schedule)
        object.__setattr__(self, "auto_ranking", ranking)
        self._schedule_name, self._auto = ranking[0].name, False
        if self._driver.reports:
            schedule_choice.log_choice(ranking)

    def _measured(self, total: int, start: float) -> None:
        """``chunks='auto'``: report the step's time to the search (it may settle)."""
        search = self.chunk_search
        if search is None or search.chosen is not None:
            return
        self._driver.wait_for_devices()
        search.record(self._chunks, total, time.perf_counter() - start)
        if self._driver.shows_next_count:
            self._chunks = search.next()

    def _accepts(self, num_microbatches: int) -> bool:
        """Whether the schedule can run ``num_microbatches``."""
        return chunk_count.accepted(self.plan, num_microbatches)

    def _new_chunk_search(self, total: int) -> chunk_count.ChunkSearch:
        """``chunks='auto'``: the search over micro-batch counts for batches of ``total``,
        starting from the current count, skipping counts the schedule cannot run."""
        return chunk_count.ChunkSearch(
            chunk_count.candidate_counts(self.num_stages, total), self._chunks,
            lambda m: self._accepts(len(microbatch.split_sizes(total, m))))

    # ---------------------------------------------------------------- plain-module names
    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[Tuple[str, nn.Parameter]]:
        """Parameters under the plain module's names (``'4.weight'``), whatever the split."""
        return self.module.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[Tuple[str, torch.Tensor]]:
        """Buffers under the plain module's names."""
        return self.module.named_buffers(prefix, recurse, remove_duplicate)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The state under the plain module's names (its keys, or this rank's share of them)."""
        return self.module.state_dict(*args, **kwargs)

    def _fqn_modifiers(self) -> dict:
        """The plain module's names are the pipe's: ``torch.distributed.checkpoint.state_dict``
        (``get_state_dict(pipe, optimizer)``) reads this hook to skip the ``module`` level when
        it walks the pipe, so its keys are the plain model's FQNs."""
        return {name: "module" for name in self.module._modules}

    def _checkpoint_names(self) -> dict:
        """Each parameter's name as ``named_parameters()`` lists it, to its name in the plain
        model's ``named_parameters()``: the key of its optimizer state in checkpoints."""
        return {name: name for name, _ in self.named_parameters()}
