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
"""
from __future__ import annotations

import concurrent.futures as futures
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ..errors import (LossFunctionError, PipelineAborted, PipelineError, PipelineTimeout,
                      describe, located)
from ..schedule import Action, ActionKind, Schedule, SkipLink
from .observe.profiler_ranges import action_range
from .lowering import Route, is_ready, lowering, skip_links
from .transport.mailbox import Mailbox
from .stage import Stage
from .step import HANDLERS, StepState

Handler = Callable[[StepState, Stage, Action], None]
Rows = Sequence[Sequence[Tuple[Action, Route]]]  # each stage's actions with their routes


class LocalExecutor:
    """Runs per-stage action programs on a persistent pool of worker threads.

    ``groups[w]`` lists the physical stages worker ``w`` runs, in pipeline order.
    """

    rank: Optional[int] = None  # the process's pipeline rank, named in errors (distributed)

    def __init__(self, groups: Sequence[Sequence[int]],
                 handlers: Dict[ActionKind, Handler] = HANDLERS) -> None:
        self.groups = [list(g) for g in groups]
        self.handlers = handlers
        self._pool = futures.ThreadPoolExecutor(len(self.groups),
                                                thread_name_prefix="fastpipe-worker")
        self._lock = threading.Lock()

    def run(self, programs: Sequence[Sequence[Action]], step: StepState,
            schedule: Schedule) -> None:
        """Run one step: ``programs[s]`` is physical stage ``s``'s action list, in order (the
        ``schedule``'s actions or a subset of them; it places the chunks)."""
        self._check_programs(programs)
        lowered = lowering(schedule, programs, self._skip_links(step))
        step.routes = lowered.routes
        if not self._lock.acquire(timeout=step.timeout):  # one step at a time per pipeline
            raise PipelineTimeout(
                f"another step of this pipeline has been running for over {step.timeout:g}s; "
                f"run the steps of one Pipe one after another")
        try:
            bells = self._wire(programs, step, schedule)
            jobs = [self._pool.submit(self._work, step, w, group, lowered.rows, bells[w])
                    for w, group in enumerate(self.groups)]
            self._watch(jobs, step)
            futures.wait(jobs, timeout=step.timeout + 1.0)  # the others stop at their next check
            self._raise_first(jobs, step)
        finally:
            self._lock.release()

    def _check_programs(self, programs: Sequence[Sequence[Action]]) -> None:
        if len(programs) != sum(len(g) for g in self.groups):
            raise ValueError(f"expected {sum(len(g) for g in self.groups)} stage programs, "
                             f"got {len(programs)}")

    def _skip_links(self, step: StepState) -> Tuple[SkipLink, ...]:
        """The model's skip connections (every stage is in this process)."""
        return skip_links(stage.skips.skips for stage in step.stages if stage.skips is not None)

    watch_every = 1.0  # seconds between the watchdog's looks while the workers run

    def _failure_elsewhere(self) -> Optional[str]:
        """A failure reported from outside this executor (another rank), or None."""
        return None

    def _watch(self, jobs: List["futures.Future[None]"], step: StepState) -> None:
        """Wait for the workers; give up on a step whose actions stopped finishing, or that
        failed elsewhere."""
        seen, since = -1, time.monotonic()
        while True:
            done, pending = futures.wait(jobs, timeout=min(step.timeout, self.watch_every),
                                         return_when=futures.FIRST_EXCEPTION)
            if not pending or any(job.exception() is not None for job in done):
                return
            reason = self._failure_elsewhere()
            if reason is not None:
                step.abort.trip(reason)
                return
            if step.completed != seen:
                seen, since = step.completed, time.monotonic()
            elif time.monotonic() - since > step.timeout:
                step.abort.trip("the step made no progress")
                return

    def _wire(self, programs: Sequence[Sequence[Action]], step: StepState,
              schedule: Schedule) -> List[threading.Condition]:
        """Give every virtual stage a mailbox ringing the bell of the worker that runs it."""
        bells = [threading.Condition() for _ in self.groups]
        worker_of = {s: w for w, group in enumerate(self.groups) for s in group}
        step.mailboxes = [Mailbox(bells[worker_of[schedule.stage_of(v)[0]]])
                          for v in range(len(step.stages))]
        for bell in bells:
            step.abort.register(bell)
        step.progress = [("not started", None)] * len(programs)
        step.busy = [0.0] * len(self.groups)
        return bells

    def _work(self, step: StepState, worker: int, group: List[int], rows: Rows,
              bell: threading.Condition) -> None:
        cursors = {s: 0 for s in group}
        order = list(reversed(group))  # downstream first: outputs leave the worker sooner
        deadline = time.monotonic() + step.timeout
        with step.ambient():
            while any(cursors[s] < len(rows[s]) for s in group):
                ran = False
                if step.abort.reason is not None:
                    raise PipelineAborted(f"worker of stages {group} stopped because "
                                          f"{step.abort.reason}")
                for s in order:
                    if cursors[s] < len(rows[s]):
                        action, route = rows[s][cursors[s]]
                        if is_ready(step, route):
                            self._run_action(step, worker, step.stages[route.virtual_stage],
                                             action)
                            cursors[s] += 1
                            ran = True
                if ran:
                    deadline = time.monotonic() + step.timeout
                else:
                    self._sleep(step, group, rows, cursors, bell, deadline)

    def _sleep(self, step: StepState, group: List[int], rows: Rows, cursors: Dict[int, int],
               bell: threading.Condition, deadline: float) -> None:
        """Wait until a message arrives for one of the worker's stages, or fail."""
        waiting = [rows[s][cursors[s]] for s in group if cursors[s] < len(rows[s])]
        pending = [action for action, _ in waiting]
        with bell:
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
                bell.wait(remaining)

    def _run_action(self, step: StepState, worker: int, stage: Stage, action: Action) -> None:
        step.progress[action.stage] = ("running", action)
        start = time.perf_counter()
        try:
            with stage.context(), action_range(stage, action):
                token = step.recorder.begin(stage) if step.recorder else None
                (step.handlers or self.handlers)[action.kind](step, stage, action)
            if step.recorder:
                step.recorder.end(stage, action, token)
        except (PipelineError, LossFunctionError) as error:
            step.abort.trip(f"stage {action.stage} failed in action {action}: {error}")
            raise
        except BaseException as error:
            step.abort.trip(f"stage {action.stage} failed in action {action}: {describe(error)}")
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
                f"the pipeline step made no progress for {step.timeout:g}s ({where}); an action is "
                f"stuck in user code: raise the pipe's timeout=... if one action legitimately takes "
                f"longer")
        if errors:
            raise errors[0]

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _timeout(step: StepState, pending: List[Action]) -> PipelineTimeout:
    first = pending[0]
    waits = ", ".join(f"{a} (micro-batch {a.microbatch})" for a in pending)
    step.abort.trip(f"stage {first.stage} timed out waiting for the input of {first}")
    return PipelineTimeout(
        f"stage {first.stage} timed out after {step.timeout:g}s waiting for the input of action "
        f"{first} (micro-batch {first.microbatch}); waiting: {waits}. The stage that should send "
        f"it is stuck or slow: raise the pipe's timeout=... if stages are this slow",
        stage=first.stage, action=str(first), microbatch=first.microbatch)
