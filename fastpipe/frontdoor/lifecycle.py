"""One step of the lifecycle the front doors share: from a batch to a run and its record.

A step's micro-batch sizes are computed from the batch this process reads and agreed by the
driver; the step's ``StepState`` is made in one place (``_new_step``); its programs run through
the driver, traced inside ``pipe.trace()``; ``chunks='auto'`` and ``schedule='auto'`` learn from
what the step measured, and a training step's record becomes ``pipe.last_step``.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .. import microbatch, outputs, tracing
from ..autotune import chunk_count, schedule_choice
from ..policies.checkpoint import checkpoint_stop, draw_step_seed
from ..runtime.drivers.base import Driver
from ..runtime.observe import profiler_ranges, step_stats
from ..runtime.observe.trace import StepRecorder, Trace
from ..runtime.step import StepConfig, StepState
from ..schedule import Schedule
from .arguments import loss_weights
from .layout import Layout


class StepLifecycle:
    """The steps of a front door (mixed into ``FrontDoor``, which sets what it reads)."""

    layout: Layout
    _driver: Driver
    _stages: List[Any]
    _chunks: int
    _schedule_name: str
    _auto: bool
    _trace: Optional[Trace]
    chunk_search: Optional[chunk_count.ChunkSearch]
    num_stages: int
    plan: Callable[..., Schedule]
    _step_shape: Callable[[], step_stats.StepShape]
    output_rules: outputs.OutputRules
    training: bool

    def _new_step(self, inputs: Any, targets: Any, *, train: bool, grad_enabled: bool,
                  loss_reduction: str = "mean",
                  **kwargs: Any) -> Tuple[StepState, List[int], Schedule]:
        """A fresh step over the batch's micro-batches, their sizes agreed by the driver, and
        the schedule it runs: the step's whole ``StepState`` is made here."""
        sizes = self._local_sizes(inputs, targets, train)
        local = self._driver.local
        # the graphs of the mode and of the inputs' shape, before the step
        tracing.prepare((self._stages[k].module for k in local), inputs)
        for k in local:  # probe for random draws again (graphed stages: if their modes changed)
            self._stages[k].rng.refresh(self._stages[k].module)
        config = StepConfig(tuple(self._stages), self.layout.timeout, self.layout.checkpoint)
        step = StepState(config, inputs=[], train=train, seed=draw_step_seed(),
                         checkpoint_stop=0, grad_enabled=grad_enabled, **kwargs)
        fixed = None if self.layout.auto_chunks else lambda n: self._split(n, self._chunks)
        sizes = self._driver.agree(step, sizes, train, fixed, self.plan)
        if self.layout.auto_chunks and not self._driver.searches_chunks:
            self._chunks = len(sizes)  # the count the first stage's rank announced
        schedule = self.plan(len(sizes))
        if 0 in local:
            step.inputs = microbatch.scatter(inputs, sizes)
        if self._reads_targets(train):
            step.targets = microbatch.scatter(targets, sizes)
        if train or (grad_enabled and self.training):  # a backward follows
            step.checkpoint_stop = checkpoint_stop(self.layout.checkpoint, len(sizes))
        if train:
            step.loss_weights = loss_weights(sizes, loss_reduction)
            step.split = schedule.split_backwards
        return step, sizes, schedule

    def _forward_microbatches(self, inputs: Any) -> Tuple[Optional[List[Any]], List[int]]:
        """Run the forward actions; the micro-batch outputs (``None`` where this process
        does not run the last stage) and the micro-batch sizes."""
        step, sizes, schedule = self._new_step(inputs, None, train=False,
                                               grad_enabled=torch.is_grad_enabled())
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
                self.chunk_search = self._new_chunk_search(total)
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
        self.auto_ranking = ranking
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

    def _record_step(self, step: StepState, samples: int, started: float) -> None:
        """Keep a finished training step's record as ``last_step``; inside ``pipe.trace()``,
        record its context in the trace too (what ``fastpipe.doctor`` reads)."""
        now = time.perf_counter()
        profiler_ranges.warn_if_workers_unseen()
        trace = self._trace
        timeline = trace.timelines[-1] if trace is not None and trace.timelines else None
        self._last_step = step_stats.finish_step(step, samples, started, now, timeline)
        if trace is None or timeline is None or step.recorder is None:
            return
        trace.contexts[len(trace.timelines) - 1] = step_stats.step_context(
            step, samples, started, now, trace, self._step_shape())
        trace.last_end = now
