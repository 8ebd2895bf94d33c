"""The local executor: worker threads interpret the stages' action lists.

Each worker runs the programs of one or more physical stages (one stage per worker on GPUs; on the
CPU, consecutive stages share a worker when there are more stages than cores). A worker runs, in
each pass over its stages, the next action of every stage whose input has arrived, and sleeps on
its doorbell only when none can move. The programs are the schedule's, lowered
(:mod:`fastpipe.runtime.lowering`): an action can run when the messages its receive ops name
have arrived in its stage's mailbox. Stages on different workers run concurrently (torch releases
the GIL inside kernels and autograd), each on its own CUDA stream on a GPU. The executor knows
nothing of particular schedules: it looks each action's kind up in a handler table. A failing stage
aborts the step for every worker, and a worker whose stages wait longer than the timeout fails
with an error naming the stage, the action and the micro-batch.

What differs when the executor runs one rank's stage of a distributed pipe (the wiring, how a
worker walks its program and waits for a missing message, where failures elsewhere are read,
what surrounds an action) is a :class:`Strategy`; :class:`InProcess` is the default.
"""
from __future__ import annotations

import concurrent.futures as futures
import contextlib
import functools
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Dict, List, Optional, Protocol, Sequence, Tuple

from ..errors import (LossFunctionError, PipelineAborted, PipelineError, PipelineTimeout,
                      describe, located)
from ..schedule import Action, ActionKind, Schedule, SkipLink
from .failure.timeouts import Waiting, timeout_error
from .observe.profiler_ranges import action_range, profiling
from .lowering import Route, is_ready, lowering, skip_links
from .transport.mailbox import Bell, Mailbox
from .stage import Stage
from .step import HANDLERS, Handler, StepState

Rows = Sequence[Sequence[Tuple[Action, Route]]]  # each stage's actions with their routes
Pending = List[Tuple[Action, Route]]  # the next action of each stage not finished, with its route


@dataclass
class Worker:
    """One worker thread's share of a step: its physical stages, every stage's lowered actions,
    its doorbell, and ``run(stage, action)``, which runs one action for it."""

    index: int
    stages: List[int]
    rows: Rows
    bell: Bell
    run: Callable[[Any, Action], None]


class Strategy(Protocol):
    """What differs between running every stage in this process (:class:`InProcess`) and
    running one rank's stage of a distributed pipe: the programs expected, the skip
    connections, the wiring, where failures elsewhere are read, how a worker walks its
    programs (and waits for a missing message), and what surrounds each action."""

    watch_every: float  # seconds between the watchdog's looks while the workers run
    inline: bool  # a single worker may run on the calling thread (no peer to watch for)
    surrounds_actions: bool  # whether around_action does anything

    def check_programs(self, programs: Sequence[Sequence[Action]],
                       groups: Sequence[Sequence[int]]) -> None: ...

    def skip_links(self, step: StepState) -> Tuple[SkipLink, ...]: ...

    def wire_workers(self, programs: Sequence[Sequence[Action]], step: StepState,
                     schedule: Schedule, groups: Sequence[Sequence[int]]
                     ) -> List[Bell]: ...

    def failure_elsewhere(self) -> Optional[str]: ...

    def work(self, step: StepState, worker: Worker) -> None: ...

    def around_action(self, step: StepState, stage: Any,
                      action: Action) -> ContextManager[None]: ...


class LocalExecutor:
    """Runs per-stage action programs on a persistent pool of worker threads.

    ``groups[w]`` lists the physical stages worker ``w`` runs, in pipeline order; ``strategy``
    says how they are wired and walked (every stage in this process by default); ``rank`` is the
    process's pipeline rank, named in errors (distributed).
    """

    def __init__(self, groups: Sequence[Sequence[int]],
                 handlers: Dict[ActionKind, Handler] = HANDLERS,
                 strategy: Optional[Strategy] = None, rank: Optional[int] = None) -> None:
        self.groups = [list(g) for g in groups]
        self.handlers = handlers
        self.strategy: Strategy = strategy if strategy is not None else InProcess()
        self.rank = rank
        self._pool = futures.ThreadPoolExecutor(len(self.groups),
                                                thread_name_prefix="fastpipe-worker")
        self._lock = threading.Lock()

    def run(self, programs: Sequence[Sequence[Action]], step: StepState,
            schedule: Schedule) -> None:
        """Run one step: ``programs[s]`` is physical stage ``s``'s action list, in order (the
        ``schedule``'s actions or a subset of them; it places the chunks)."""
        self.strategy.check_programs(programs, self.groups)
        lowered = lowering(schedule, programs, self.strategy.skip_links(step))
        step.routes = lowered.routes
        timeout = step.config.timeout
        if not self._lock.acquire(timeout=timeout):  # one step at a time per pipeline
            raise PipelineTimeout(
                f"another step of this pipeline has been running for over {timeout:g}s; "
                f"run the steps of one Pipe one after another")
        try:
            bells = self.strategy.wire_workers(programs, step, schedule, self.groups)
            workers = [Worker(w, group, lowered.rows, bells[w],
                              functools.partial(self._run_action, step, w))
                       for w, group in enumerate(self.groups)]
            if len(workers) == 1 and self.strategy.inline:
                # nothing to overlap with: no thread hand-off. Nor a watchdog: an action stuck
                # in user code blocks the caller, as in the plain model (there is no peer)
                self._work(step, workers[0])
                return
            jobs = [self._pool.submit(self._work, step, worker) for worker in workers]
            self._watch(jobs, step)
            futures.wait(jobs, timeout=timeout + 1.0)  # the others stop at their next check
            self._raise_first(jobs, step)
        finally:
            self._lock.release()

    def _watch(self, jobs: List["futures.Future[None]"], step: StepState) -> None:
        """Wait for the workers; give up on a step whose actions stopped finishing, or that
        failed elsewhere."""
        seen, since = -1, time.monotonic()
        while True:
            done, pending = futures.wait(jobs, timeout=min(step.config.timeout,
                                                           self.strategy.watch_every),
                                         return_when=futures.FIRST_EXCEPTION)
            if not pending or any(job.exception() is not None for job in done):
                return
            reason = self.strategy.failure_elsewhere()
            if reason is not None:
                step.abort.trip(reason)
                return
            if step.completed != seen:
                seen, since = step.completed, time.monotonic()
            elif time.monotonic() - since > step.config.timeout:
                step.abort.trip("the step made no progress")
                return

    def _work(self, step: StepState, worker: Worker) -> None:
        with step.ambient():
            self.strategy.work(step, worker)

    def _run_action(self, step: StepState, worker: int, stage: Stage, action: Action) -> None:
        handler = (step.handlers or self.handlers)[action.kind]
        if (getattr(stage, "plain", False) and step.recorder is None
                and not self.strategy.surrounds_actions and not profiling()):
            self._attempt(step, worker, stage, action, handler, False)  # the common CPU case
            return
        with self.strategy.around_action(step, stage, action):
            self._attempt(step, worker, stage, action, handler, True)

    def _attempt(self, step: StepState, worker: int, stage: Stage, action: Action,
                 handler: Handler, observed: bool) -> None:
        """Run one action's handler (``observed``: in its stage's context, a profiler range,
        and the trace), counted; a failure aborts the step, its error located."""
        step.progress[action.stage] = ("running", action)
        start = time.perf_counter()
        try:
            if observed:
                _observed(step, stage, action, handler)
            else:
                handler(step, stage, action)
        except (PipelineError, LossFunctionError) as error:
            step.abort.trip(f"stage {action.stage} failed in action {action}: {error}")
            raise
        except BaseException as error:
            step.abort.trip(f"stage {action.stage} failed in action {action}: "
                            f"{describe(error)}")
            located(error, action, self.rank)
            raise
        step.progress[action.stage] = ("finished", action)
        step.busy[worker] += time.perf_counter() - start
        step.done()

    @staticmethod
    def _raise_first(jobs: List["futures.Future[None]"], step: StepState) -> None:
        errors = [job.exception() for job in jobs if job.done() and job.exception() is not None]
        root = [e for e in errors if not isinstance(e, PipelineAborted)]
        if root:
            raise root[0]
        if not all(job.done() for job in jobs):
            where = "; ".join(f"stage {s}: {state} {action or ''}".rstrip()
                              for s, (state, action) in enumerate(step.progress))
            step.abort.trip("the step timed out")
            raise PipelineTimeout(
                f"the pipeline step made no progress for {step.config.timeout:g}s ({where}); an "
                f"action is stuck in user code: raise the pipe's timeout=... if one action "
                f"legitimately takes longer")
        if errors:
            raise errors[0]

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


Wait = Callable[[StepState, Worker, Pending, float], None]


def _observed(step: StepState, stage: Stage, action: Action, handler: Handler) -> None:
    """``handler`` in the stage's stream and compiler settings, in a profiler range, and
    recorded when the pipe is traced."""
    with stage.context(), action_range(stage, action):
        token = step.recorder.begin(stage) if step.recorder else None
        handler(step, stage, action)
    if step.recorder:
        step.recorder.end(stage, action, token)


def run_when_ready(step: StepState, worker: Worker, wait: Wait) -> None:
    """Run the worker's programs: in each pass over its stages, the next action of every stage
    whose messages have arrived (downstream first: outputs leave the worker sooner); when none
    can move, ``wait(step, worker, pending, deadline)`` until one can, or fail."""
    rows, stages, run = worker.rows, worker.stages, worker.run
    order = [rows[s] for s in reversed(stages)]
    cursors = [0] * len(order)
    left = sum(len(row) for row in order)
    models = step.config.stages
    timeout = step.config.timeout
    deadline = time.monotonic() + timeout
    abort = step.abort
    while left:
        ran = False
        for i, row in enumerate(order):
            cursor = cursors[i]
            if cursor < len(row):
                action, route = row[cursor]
                if not route.waits or is_ready(step, route):
                    if abort.reason is not None:  # before every action: stop at once
                        raise PipelineAborted(f"worker of stages {stages} stopped because "
                                              f"{abort.reason}")
                    run(models[route.virtual_stage], action)
                    cursors[i] = cursor + 1
                    left -= 1
                    ran = True
        if ran:
            deadline = time.monotonic() + timeout
        else:
            wait(step, worker, [row[c] for row, c in zip(order, cursors) if c < len(row)][::-1],
                 deadline)


class InProcess:
    """Every stage in this process: each virtual stage's mailbox rings the bell of the worker
    that runs it, and a worker with nothing ready sleeps on its bell."""

    watch_every = 1.0
    inline = True
    surrounds_actions = False

    def check_programs(self, programs: Sequence[Sequence[Action]],
                       groups: Sequence[Sequence[int]]) -> None:
        if len(programs) != sum(len(g) for g in groups):
            raise ValueError(f"expected {sum(len(g) for g in groups)} stage programs, "
                             f"got {len(programs)}")

    def skip_links(self, step: StepState) -> Tuple[SkipLink, ...]:
        """The model's skip connections (every stage is in this process)."""
        return skip_links(stage.skips.skips for stage in step.config.stages
                          if stage.skips is not None)

    def wire_workers(self, programs: Sequence[Sequence[Action]], step: StepState,
                     schedule: Schedule, groups: Sequence[Sequence[int]]
                     ) -> List[Bell]:
        """Give every virtual stage a mailbox ringing the bell of the worker that runs it."""
        bells = [Bell() for _ in groups]
        worker_of = {s: w for w, group in enumerate(groups) for s in group}
        step.mailboxes = [None] * len(step.config.stages)
        for stage, chunks in enumerate(schedule.placement):
            for virtual_stage in chunks:
                step.mailboxes[virtual_stage] = Mailbox(bells[worker_of[stage]])
        for bell in bells:
            step.abort.register(bell)
        step.progress = [("not started", None)] * len(programs)
        step.busy = [0.0] * len(groups)
        return bells

    def failure_elsewhere(self) -> Optional[str]:
        """Nothing fails outside this process's workers."""
        return None

    def work(self, step: StepState, worker: Worker) -> None:
        run_when_ready(step, worker, _sleep)

    def around_action(self, step: StepState, stage: Any,
                      action: Action) -> ContextManager[None]:
        return contextlib.nullcontext()


def _sleep(step: StepState, worker: Worker, waiting: Pending, deadline: float) -> None:
    """Wait until a message arrives for one of the worker's stages, or fail."""
    pending = [action for action, _ in waiting]
    with worker.bell:
        worker.bell.sleepers += 1  # before looking: a put from now on rings (see Mailbox)
        try:
            while True:
                if step.abort.reason is not None:
                    first = pending[0]
                    raise PipelineAborted(
                        f"stage {first.stage} stopped waiting for the input of {first} "
                        f"(micro-batch {first.microbatch}) because {step.abort.reason}")
                if any(is_ready(step, route) for _, route in waiting):
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise _timeout(step, pending)
                worker.bell.wait(remaining)
        finally:
            worker.bell.sleepers -= 1


def _timeout(step: StepState, pending: List[Action]) -> PipelineTimeout:
    first = pending[0]
    waits = ", ".join(f"{a} (micro-batch {a.microbatch})" for a in pending)
    step.abort.trip(f"stage {first.stage} timed out waiting for the input of {first}")
    return timeout_error(Waiting(
        f"the input of action {first} (micro-batch {first.microbatch})", step.config.timeout,
        stage=first.stage, action=first,
        detail=f"; waiting: {waits}. The stage that should send it is stuck or slow"))
