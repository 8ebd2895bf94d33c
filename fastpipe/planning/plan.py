"""``fastpipe.planning.plan``: the feasible layouts of a training run, ranked by predicted step
time, before renting the GPUs.

Layouts are enumerated and pruned analytically (:mod:`~fastpipe.planning.layouts`: memory
first, then a closed-form estimate); the best ``simulate`` of them per schedule are simulated
with fastpipe's own schedule generators and simulator (:mod:`~fastpipe.planning.predict`) and
ranked by the simulated step. Pure Python.
"""
from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

from ..schedule import render
from .costs import Work
from .hardware import GPU, gpu as gpu_type
from .layouts import Candidate, candidates, schedules_of
from .model_shape import ModelShape, model_shape
from .predict import Prediction, predict
from .runtime_model import FASTPIPE, Runtime, runtime as runtime_named

__all__ = ["Plan", "plan"]

GIB = 2 ** 30


@dataclass(frozen=True)
class Plan:
    """The ranked predictions (fastest first), what they were asked for, and how many layouts
    were considered, dropped for memory and simulated."""

    work: Work
    gpus: int
    gpu: GPU
    runtime: Runtime
    memory: float
    ranked: List[Prediction]
    counts: Dict[str, int] = field(default_factory=dict)

    @property
    def best(self) -> Prediction:
        if not self.ranked:
            raise ValueError("no layout fits: see Plan.counts")
        return self.ranked[0]

    def table(self, top: int = 10) -> str:
        """The best ``top`` layouts: step time, tokens/s per GPU, MFU, peak memory per stage."""
        lines = [f"{'#':>3}  {'layout':<58}{'step s':>9}{'tok/s/GPU':>11}{'MFU':>6}"
                 f"{'peak GiB':>10}  fits"]
        for i, p in enumerate(self.ranked[:top], 1):
            fits = "yes" if p.max_memory <= self.memory else "NO"
            lines.append(f"{i:>3}  {p.layout.describe():<58}{p.step_time:>9.4g}"
                         f"{p.tokens_per_gpu:>11.4g}{p.mfu:>6.0%}{p.max_memory / GIB:>10.1f}"
                         f"  {fits}")
        return "\n".join(lines)

    def drawing(self, width: Optional[int] = 100) -> str:
        """The best layout's schedule, as simulated (the first micro-batches of the step)."""
        return render.ascii(self.best.result.timeline, width)

    def to_json(self) -> Dict[str, Any]:
        """Everything :meth:`table` shows, for every ranked layout, as JSON-able data."""
        return {
            "model": vars(self.work.model), "seq": self.work.seq,
            "global_batch": self.work.global_batch, "gpus": self.gpus, "gpu": self.gpu.name,
            "runtime": self.runtime.name, "memory_per_gpu": self.memory, "counts": self.counts,
            "calibrated": {name: getattr(self.gpu, name) for name in self.gpu.calibrated},
            "ranked": [_prediction_json(p) for p in self.ranked]}


def _prediction_json(p: Prediction) -> Dict[str, Any]:
    layout = {k: v for k, v in vars(p.layout).items()}
    return {"layout": layout, "describe": p.layout.describe(), "microbatches": p.microbatches,
            "step_time": p.step_time, "tokens_per_second_per_gpu": p.tokens_per_gpu,
            "mfu": p.mfu, "bubble": p.bubble, "peak_memory_per_stage": list(p.peak_memory)}


def plan(model: Union[ModelShape, Mapping[str, Any], str], gpus: int,
         gpu: Union[str, GPU] = "h100", *, global_batch: int, seq: int,
         gpus_per_node: Optional[int] = None, memory: Optional[float] = None,
         runtime: Union[str, Runtime] = FASTPIPE, schedules: Optional[Sequence[str]] = None,
         fixed: Optional[Mapping[str, object]] = None, balance: str = "even",
         simulate: int = 6, top: int = 20) -> Plan:
    """Rank the layouts of training ``model`` (a :class:`ModelShape`, a Hugging Face config
    dict or ``config.json`` path, or a name in ``model_shape.KNOWN``) on ``gpus`` GPUs of type
    ``gpu`` with ``global_batch`` sequences of ``seq`` tokens per step.

    ``memory``: bytes per GPU a layout may use (default the GPU's); ``fixed``: knobs to hold
    (``tensor``, ``pipeline``, ``data``, ``shard``, ``replicas``, ``virtual``, ``schedule``,
    ``micro_batch``, ``checkpoint``, ``order``, ``balance``: a value or a tuple of allowed
    values); ``balance``: ``'even'`` or ``'lighter-ends'`` layers per chunk; ``simulate``: how
    many of the best estimates per schedule are simulated; ``top``: how many are returned.
    Raises ``ValueError`` for bad arguments, before any work."""
    shape = model_shape(model)
    device = gpu_type(gpu)
    rt = runtime_named(runtime)
    _check(gpus, global_batch, seq, simulate, top)
    per_node = gpus_per_node or device.gpus_per_node
    limit = float(memory if memory is not None else device.memory)
    work = Work(shape, seq, global_batch)
    found, counts = candidates(work, gpus, device, rt, per_node=per_node, memory=limit,
                               schedules=schedules_of(schedules), fixed=dict(fixed or {}),
                               balance=balance)
    if not found:
        raise ValueError(f"no layout of {gpus} GPUs divides global_batch={global_batch} for "
                         f"{shape.name}; fixed={dict(fixed or {})}: use a batch that the "
                         f"data-parallel replicas and micro-batches divide")
    chosen = _shortlist(found, simulate)
    ranked = sorted((predict(work, c.layout, device, rt, per_node, c.costs) for c in chosen),
                    key=lambda p: (p.step_time, p.max_memory))
    counts = {**counts, "fit": len(found), "simulated": len(chosen)}
    return Plan(work, gpus, device, rt, limit, ranked[:top], counts)


def _check(gpus: int, global_batch: int, seq: int, simulate: int, top: int) -> None:
    for name, value in (("gpus", gpus), ("global_batch", global_batch), ("seq", seq),
                        ("simulate", simulate), ("top", top)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"plan({name}={value!r}): give a positive whole number")


def _shortlist(found: Sequence[Candidate], per_schedule: int) -> List[Candidate]:
    """The best ``per_schedule`` estimates of each schedule, and the best few overall."""
    by_schedule: Dict[str, List[Candidate]] = defaultdict(list)
    for c in found:
        if len(by_schedule[c.layout.schedule]) < per_schedule:
            by_schedule[c.layout.schedule].append(c)
    chosen = {id(c): c for group in by_schedule.values() for c in group}
    for c in found[:2 * per_schedule]:
        chosen.setdefault(id(c), c)
    return list(chosen.values())


def write_json(result: Plan, path: str) -> None:
    """Write :meth:`Plan.to_json` to ``path``."""
    with open(path, "w", encoding="utf-8") as file:
        json.dump(result.to_json(), file, indent=1)
