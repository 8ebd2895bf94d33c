"""The step lifecycle that the front doors, ``Pipe`` and ``DistributedPipe``, share.

One place checks the arguments into a frozen ``Layout``, splits batches into micro-batches,
runs ``train_step`` / ``forward`` / ``evaluate`` / ``trace``, makes the automatic schedule and
chunk choices and weights the micro-batch losses. What differs between the front doors (where the
stages run, how the micro-batch sizes are agreed, how gradients are synchronised) is a driver
(``fastpipe.runtime.driver``). A front door builds its stages, sets ``layout``, ``module`` (its
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
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from . import microbatch, tracing
from .policies import amp, selective
from .policies.checkpoint import check_mode, checkpoint_stop, draw_step_seed
from .placement import check_chunks, check_flag, check_timeout, resolve_virtual_stages
from .runtime import adaptive, auto, vitals
from .runtime.driver import Driver
from .runtime.weight_versions import check_optimizer_argument, step_optimizer
from .runtime.step import StepState
from .runtime.token_mean import TokenMean
from .runtime.trace import StepRecorder, Trace
from .runtime.vitals import StepStats
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
        return auto.first_schedule(self.virtual_stages) if self.auto_schedule else self.schedule

    def with_balance(self, balance: Sequence[int]) -> "Layout":
        return dataclasses.replace(self, balance=tuple(balance))


def parse_layout(chunks: Any, checkpoint: Any, schedule: Any, virtual_stages: Any,
                 timeout: Any, deferred_batch_norm: Any) -> Layout:
    """The arguments both front doors take, checked (a typed error naming the argument)."""
    auto_chunks = isinstance(chunks, str) and chunks == "auto"
    return Layout(chunks=1 if auto_chunks else check_chunks(chunks), auto_chunks=auto_chunks,
                  checkpoint=check_checkpoint(checkpoint), schedule=auto.check_name(schedule),
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
        object.__setattr__(self, "chunk_search", None)  # chunks='auto': an adaptive.ChunkSearch
        object.__setattr__(self, "auto_ranking", None)  # schedule='auto': the ranking
        object.__setattr__(self, "_trace", None)
        if layout.auto_chunks:
            object.__setattr__(self, "_chunks", adaptive.first_count(self.num_stages,
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
        (``fastpipe.runtime.vitals.StepStats``), kept without tracing; ``None`` before the first."""
        return self.__dict__.get("_last_step")

    def plan(self, num_microbatches: Optional[int] = None) -> Schedule:
        """The validated schedule this pipe runs for ``num_microbatches`` (default ``chunks``)."""
        return validated_schedule(self._schedule_name, self.num_stages,
                                  num_microbatches or self._chunks, self.layout.virtual_stages)

    # ---------------------------------------------------------------- running
    def train_step(self, inputs: Any, targets: Any, loss_fn: Callable[[Any, Any], torch.Tensor],
                   *, loss_reduction: str = "mean", scaler: Optional[Any] = None,
                   optimizer: Optional[torch.optim.Optimizer] = None) -> torch.Tensor:
        """Forward and backward of one batch on the pipe's schedule; returns the (detached) loss.

        Adds to every parameter's ``.grad`` what ``loss_fn(module(inputs), targets).backward()``
        adds. ``loss_reduction='mean'`` weights each micro-batch's loss by its share of the batch
        (exact for losses that average over the batch); ``'sum'`` adds them (for summed losses).
        ``scaler``: a ``torch.amp.GradScaler``; each micro-batch's backward starts from its
        scaled loss (the returned loss is unscaled); then ``scaler.step(optimizer)`` with one
        optimizer over ``pipe.parameters()`` and ``scaler.update()``, or pass ``optimizer``
        (see ``fastpipe.amp``).
        ``optimizer``: stepped once after the backward (through ``scaler`` when given); it does
        not zero the gradients: call ``optimizer.zero_grad()`` before each step as usual. Under
        ``schedule='pipedream'`` it is required, and each stage steps it on its own parameters
        after every micro-batch's backward, with that micro-batch's gradient (``.grad`` then
        holds the last one); see ``fastpipe.runtime.weight_versions`` for the exact semantics.
        ``loss_fn`` may return ``(loss_sum, count)`` per micro-batch (e.g. a token count): the
        step's loss is then the sums over the whole batch's count, and so are its gradients
        (``fastpipe.runtime.token_mean``).

        On a ``DistributedPipe`` every rank calls it with the same arguments: ``inputs`` are
        read on the rank of the first stage, ``targets`` on the rank of the last (``None``
        elsewhere is fine); every rank returns the loss, and the local gradients are averaged
        over data-parallel replicas when there are some. With ``scaler`` and ``optimizer``, all
        ranks agree whether any gradient anywhere is inf or NaN (so they skip the step
        together); without ``optimizer``, call ``fastpipe.amp.unscale_and_sync(scaler,
        optimizer)`` on every rank before ``scaler.step(optimizer)``.
        """
        with self._driver.guarded():
            return self._train_step(inputs, targets, loss_fn, loss_reduction,
                                    amp.check_scaler(scaler), optimizer)

    def _train_step(self, inputs: Any, targets: Any, loss_fn: Callable[[Any, Any], torch.Tensor],
                    loss_reduction: str, scaler: Optional[Any],
                    optimizer: Optional[torch.optim.Optimizer]) -> torch.Tensor:
        asynchronous = self._pipedream is not None
        check_step_arguments(loss_fn, loss_reduction, optimizer, asynchronous, scaler)
        handlers = self._pipedream.handlers(optimizer) if asynchronous else None
        start = time.perf_counter()
        token_mean = None if asynchronous else TokenMean(self.parameters)
        step, sizes = self._new_step(inputs, targets, train=True, grad_enabled=True,
                                     loss_fn=loss_fn, scaler=scaler, token_mean=token_mean)
        schedule = self.plan(len(sizes))
        step.loss_weights = loss_weights(sizes, loss_reduction)
        step.checkpoint_stop = checkpoint_stop(self.layout.checkpoint, len(sizes))
        step.split = schedule.split_backwards
        step.handlers = handlers
        self._run(schedule.actions, step, schedule)
        loss, count = self._driver.loss(step, len(sizes))
        self._driver.average_gradients()
        if count is not None:  # (loss_sum, count) losses: the step's gradients over the count
            step.token_mean.finish(count, scale=self._driver.replicas)
        elif loss_reduction == "mean" and len(set(sizes)) > 1 and self._reads_targets(True):
            warn_uneven_mean(sizes)
        self._driver.sum_tied_gradients()
        if optimizer is not None and not asynchronous:
            self._driver.before_update(optimizer, scaler)
            step_optimizer(optimizer, scaler)
        self._measured(sum(sizes), start)
        vitals.finish_step(self, step, sum(sizes), start)
        return loss

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
            return self._forward(inputs)

    def _forward(self, inputs: Any) -> Any:
        grad = torch.is_grad_enabled()
        step, sizes = self._new_step(inputs, None, train=False, grad_enabled=grad)
        if grad and self.training:
            step.checkpoint_stop = checkpoint_stop(self.layout.checkpoint, len(sizes))
        schedule = self.plan(len(sizes))
        self._run(schedule.forward_actions, step, schedule)
        if len(self._stages) - 1 not in self._driver.local:
            return None
        return microbatch.gather([step.outputs[i] for i in range(len(sizes))])

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        """Inference: the forward pass in eval mode (dropout off, batch norms use their running
        statistics) without autograd, so nothing is checkpointed, recomputed or kept for a
        backward. The modules' train/eval modes are restored afterwards."""
        modes = [(m, m.training) for m in self.modules()]
        self.eval()
        try:
            with torch.no_grad():
                return self(*args, **kwargs)
        finally:
            for m, training in modes:
                m.training = training

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
        ranking = auto.rank(timeline, schedule)
        object.__setattr__(self, "auto_ranking", ranking)
        self._schedule_name, self._auto = ranking[0].name, False
        if self._driver.reports:
            auto.log_choice(ranking)

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
        return adaptive.accepted(self.plan, num_microbatches)

    def _new_chunk_search(self, total: int) -> adaptive.ChunkSearch:
        """``chunks='auto'``: the search over micro-batch counts for batches of ``total``,
        starting from the current count, skipping counts the schedule cannot run."""
        return adaptive.ChunkSearch(
            adaptive.candidate_counts(self.num_stages, total), self._chunks,
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
