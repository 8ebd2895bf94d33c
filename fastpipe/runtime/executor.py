"""The local executor: one worker thread per physical stage interprets that stage's actions.

Stages run concurrently (torch releases the GIL inside kernels and autograd), each on its own
CUDA stream when on a GPU. The executor knows nothing of particular schedules: it looks each
action's kind up in a handler table. A failing stage aborts the step for every other stage, and a
step that makes no progress within the timeout is stopped with an error naming where each
stage stood.
"""
from __future__ import annotations

import concurrent.futures as futures
import threading
import time
from typing import Callable, Dict, List, Sequence

import torch

from ..errors import PipelineAborted, PipelineError, PipelineTimeout, StageFailure
from ..schedule import Action, ActionKind
from .stage import Stage
from .step import HANDLERS, StepState

Handler = Callable[[StepState, Stage, Action], None]


class LocalExecutor:
    """Runs per-stage action programs on a persistent pool of worker threads."""

    def __init__(self, num_workers: int, handlers: Dict[ActionKind, Handler] = HANDLERS) -> None:
        self.num_workers = num_workers
        self.handlers = handlers
        self._pool = futures.ThreadPoolExecutor(num_workers, thread_name_prefix="fastpipe-stage")
        self._lock = threading.Lock()

    def run(self, programs: Sequence[Sequence[Action]], step: StepState,
            virtual_stage: Callable[[Action], int]) -> None:
        """Run one step: ``programs[s]`` is physical stage ``s``'s action list, in order, and
        ``virtual_stage`` maps an action to the index of the model chunk it runs."""
        if len(programs) != self.num_workers:
            raise ValueError(f"expected {self.num_workers} stage programs, got {len(programs)}")
        with self._lock:  # one step at a time per pipeline
            step.progress = ["not started"] * self.num_workers
            jobs = [self._pool.submit(self._program, step, s, programs[s], virtual_stage)
                    for s in range(self.num_workers)]
            self._wait(jobs, step)

    def _program(self, step: StepState, worker: int, program: Sequence[Action],
                 virtual_stage: Callable[[Action], int]) -> None:
        with step.ambient():
            for action in program:
                if step.abort.reason is not None:
                    return
                stage = step.stages[virtual_stage(action)]
                step.progress[worker] = f"running {action}"
                try:
                    with stage.context():
                        self.handlers[action.kind](step, stage, action)
                except PipelineError as error:
                    step.abort.trip(f"stage {worker} failed in action {action}: {error}")
                    raise
                except BaseException as error:
                    step.abort.trip(f"stage {worker} failed in action {action}: "
                                    f"{type(error).__name__}: {error}")
                    raise StageFailure(
                        f"stage {worker} failed in action {action} (micro-batch "
                        f"{action.microbatch}): {type(error).__name__}: {error}",
                        stage=worker, action=str(action), microbatch=action.microbatch) from error
                step.done(worker, action)

    def _wait(self, jobs: List["futures.Future[None]"], step: StepState) -> None:
        last_progress, last_count = time.monotonic(), -1
        pending = set(jobs)
        while pending:
            done, pending = futures.wait(pending, timeout=min(step.timeout, 1.0),
                                         return_when=futures.FIRST_EXCEPTION)
            if any(job.exception() is not None for job in done):
                break
            if step.completed != last_count:
                last_progress, last_count = time.monotonic(), step.completed
            elif time.monotonic() - last_progress > step.timeout:
                where = "; ".join(f"stage {s}: {p}" for s, p in enumerate(step.progress))
                step.abort.trip("the step timed out")
                futures.wait(pending, timeout=step.timeout)
                raise PipelineTimeout(
                    f"pipeline step made no progress for {step.timeout:g}s ({where}); a stage "
                    f"is stuck: raise Pipe(timeout=...) if one action legitimately takes longer")
        if pending:  # an error: the others stop at their next wait or action
            futures.wait(pending, timeout=step.timeout)
        self._raise_first(jobs)

    @staticmethod
    def _raise_first(jobs: List["futures.Future[None]"]) -> None:
        errors = [job.exception() for job in jobs if job.done() and job.exception() is not None]
        root = [e for e in errors if not isinstance(e, PipelineAborted)]
        if root or errors:
            raise (root or errors)[0]

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
