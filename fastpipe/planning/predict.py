"""One layout's predicted step: its schedule simulated under the layout's costs, its peak memory
per stage, its throughput and model-FLOPs utilisation.

A step of many micro-batches is simulated at a few times the pipeline depth and extended
linearly: once every stage runs its steady pattern, each ``stages`` more micro-batches add the
same time (the schedules repeat per round of micro-batches), so two simulations, ``m1`` and
``m1 + stages`` micro-batches, give the rest exactly. Peak memory saturates earlier. Pure
Python.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Tuple

from ..schedule.recommend import make_schedule
from ..schedule.schedule import Schedule
from ..schedule.simulator import SimulationResult, activation_peaks, checkpointed_count, simulate
from .costs import ChunkCosts, Work, chunk_costs, model_flops
from .hardware import GPU
from .layout import Layout
from .runtime_model import FASTPIPE, Runtime

__all__ = ["Prediction", "predict", "schedule_for", "SIMULATED_ROUNDS"]

SIMULATED_ROUNDS = 2
"""Rounds of ``stages`` micro-batches simulated past the warm-up before extending linearly."""


@dataclass(frozen=True)
class Prediction:
    """A layout's predicted step: seconds, tokens per second per GPU, model-FLOPs utilisation,
    peak bytes per pipeline stage (weights, optimizer state, activations), the bubble share
    and the simulation behind it (of ``simulated_microbatches``, extended to the step's)."""

    layout: Layout
    microbatches: int
    step_time: float
    tokens_per_gpu: float
    mfu: float
    peak_memory: Tuple[float, ...]
    bubble: float
    result: SimulationResult
    simulated_microbatches: int

    @property
    def max_memory(self) -> float:
        return max(self.peak_memory)


@lru_cache(maxsize=512)
def schedule_for(name: str, stages: int, microbatches: int, virtual: int) -> Schedule:
    """The registered schedule (cached: the planner asks for the same ones many times)."""
    return make_schedule(name, stages, microbatches, virtual)


def _simulated_count(layout: Layout, microbatches: int) -> int:
    """How many micro-batches to simulate: all of them when few, else ``SIMULATED_ROUNDS``
    plus the chunks per stage rounds of ``stages`` micro-batches (past the warm-up)."""
    cap = layout.pipeline * (layout.virtual + SIMULATED_ROUNDS)
    return microbatches if microbatches <= cap + layout.pipeline else cap


def predict(work: Work, layout: Layout, gpu: GPU, rt: Runtime = FASTPIPE,
            gpus_per_node: Optional[int] = None, costs: Optional[ChunkCosts] = None
            ) -> Prediction:
    """The predicted step of ``layout`` (raises ``ValueError`` for a layout the batch or the
    schedule generator does not allow)."""
    m = layout.microbatches(work.global_batch)
    if m < 1 or m * layout.replicas * layout.micro_batch != work.global_batch:
        raise ValueError(f"global batch {work.global_batch} does not split into "
                         f"{layout.replicas} replicas x micro-batches of {layout.micro_batch}")
    costs = costs or chunk_costs(work, layout, gpu, rt, gpus_per_node)
    count = _simulated_count(layout, m)
    schedule = schedule_for(layout.schedule, layout.pipeline, count, layout.virtual)
    result = simulate(schedule, costs.costs)
    step = result.step_time
    if count < m:
        more = schedule_for(layout.schedule, layout.pipeline, count + layout.pipeline,
                            layout.virtual)
        per_round = simulate(more, costs.costs).step_time - step
        step += per_round * (m - count) / layout.pipeline
    peak = _peak_memory(schedule, costs, layout, count)
    tokens = work.global_batch * work.seq
    busy = sum(result.busy) / len(result.busy) * m / count
    return Prediction(layout, m, step, tokens / step / layout.gpus,
                      model_flops(work) / (step * layout.gpus * gpu.peak(rt.dtype)), peak,
                      max(0.0, 1.0 - busy / step), result, count)


def _peak_memory(schedule: Schedule, costs: ChunkCosts, layout: Layout,
                 count: int) -> Tuple[float, ...]:
    """Per stage: static bytes plus the most activation bytes in flight (a checkpointed
    micro-batch keeps its input, then its recomputed activations during its backward)."""
    checkpointed = checkpointed_count(layout.checkpoint if layout.checkpoint != "selective"
                                      else "never", count)
    held = activation_peaks(schedule, costs.held, checkpointed=checkpointed)
    if checkpointed:
        kept = activation_peaks(schedule, costs.inputs)
        held = tuple(a + b for a, b in zip(held, kept))
    return tuple(s + a for s, a in zip(costs.static, held))
