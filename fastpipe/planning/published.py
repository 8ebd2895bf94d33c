"""Published training runs as data, and the planner's prediction of each.

A file (``benchmarks/published/*.json``) holds one source (``source``: its title, where its
text was read, its notes), the ``runtime`` its runs used (:data:`~.runtime_model.RUNTIMES`)
and ``rows``: each run's model dimensions, sequence length, global batch, GPU type and count,
``layout`` (``tensor``, ``pipeline``, ``data``, ``shard`` or ``replicas``, ``virtual``,
``schedule``, ``micro_batch``, ``checkpoint``, ``balance``: a value where the source publishes
it, ``null`` where it does not: the planner then picks the fastest that fits), what was
``measured`` (throughput in the source's own unit, and memory where given) and ``compare``: a
group of rows the source compares on one model. Pure Python.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Union

from .costs import Work
from .hardware import GPU, gpu as gpu_type
from .model_shape import ModelShape
from .plan import plan
from .predict import Prediction
from .runtime_model import runtime

__all__ = ["FLOP_COUNTS", "Row", "load", "measured_step", "predict_row"]

GIB = 2 ** 30
_KNOBS = ("tensor", "pipeline", "data", "shard", "replicas", "virtual", "schedule",
          "micro_batch", "checkpoint")


@dataclass(frozen=True)
class Row:
    """One published run and the file it came from."""

    data: Mapping[str, Any]
    source: Mapping[str, Any]
    runtime: str
    path: str

    @property
    def id(self) -> str:
        return str(self.data["id"])

    @property
    def model(self) -> ModelShape:
        fields = dict(self.data["model"])
        return ModelShape(**fields)

    @property
    def work(self) -> Work:
        return Work(self.model, int(self.data["seq"]), int(self.data["global_batch"]))

    @property
    def gpus(self) -> int:
        return int(self.data["gpus"])

    @property
    def memory_gib(self) -> Optional[float]:
        value = self.data["measured"].get("memory_gib")
        return None if value is None else float(value)


def load(paths: Iterable[Union[str, "os.PathLike[str]"]]) -> List[Row]:
    """Every row of the files at ``paths``."""
    rows = []
    for path in paths:
        with open(path, encoding="utf-8") as file:
            data = json.load(file)
        rows += [Row(row, data["source"], data["runtime"], os.fspath(path))
                 for row in data["rows"]]
    return rows


def _megatron_2021(row: Row) -> float:
    """Equation (3) of arXiv 2104.04473 (recomputation included)."""
    m, work = row.model, row.work
    b, s, l, h, v = work.global_batch, work.seq, m.layers, m.hidden, m.vocab
    return 96.0 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


def _megatron_core_2024(row: Row) -> float:
    """``num_floating_point_operations`` of Megatron-LM's training.py (commit f2e5db402c)."""
    m, work = row.model, row.work
    b, s, l, h = work.global_batch, work.seq, m.layers, m.hidden
    gated = 1.5 if m.gated else 1.0
    return 12.0 * b * s * l * h * h * ((1 + m.groups / m.heads + s / h)
                                       + m.inner / h * m.top_k * gated + m.vocab / (2 * l * h))


def _model(row: Row) -> float:
    from .costs import model_flops
    return model_flops(row.work)


FLOP_COUNTS = {"megatron-2021": _megatron_2021, "megatron-core-2024": _megatron_core_2024,
               "model": _model}
"""How each source counts the FLOPs of a step, to turn its FLOP/s per GPU into seconds."""


def measured_step(row: Row) -> float:
    """The published step time in seconds, from the throughput in the source's unit."""
    measured, work = row.data["measured"], row.work
    if "samples_per_gpu_per_s" in measured:
        return work.global_batch / (float(measured["samples_per_gpu_per_s"]) * row.gpus)
    if "tokens_per_gpu_per_s" in measured:
        return work.global_batch * work.seq / (float(measured["tokens_per_gpu_per_s"])
                                               * row.gpus)
    if "tflops_per_gpu" in measured:
        count = FLOP_COUNTS[measured["flops"]](row)
        return count / (float(measured["tflops_per_gpu"]) * 1e12 * row.gpus)
    if "step_seconds" in measured:
        return float(measured["step_seconds"])
    raise ValueError(f"row {row.id}: measured holds no throughput the planner reads")


def fixed_knobs(row: Row) -> Dict[str, object]:
    """The layout knobs the source publishes."""
    layout = row.data["layout"]
    return {k: layout[k] for k in _KNOBS if layout.get(k) is not None}


def predict_row(row: Row, device: Optional[GPU] = None, simulate: int = 4) -> Prediction:
    """The planner's prediction of ``row``: its published knobs held, the others chosen
    (fastest that fits the GPU's memory)."""
    device = device or gpu_type(row.data["gpu"])
    layout = row.data["layout"]
    result = plan(row.model, row.gpus, device, global_batch=row.work.global_batch,
                  seq=row.work.seq, gpus_per_node=int(row.data.get("gpus_per_node", 8)),
                  runtime=runtime(row.runtime), fixed=fixed_knobs(row),
                  balance=str(layout.get("balance") or "even"), simulate=simulate, top=1)
    return result.best


def rows_in(directory: Union[str, "os.PathLike[str]"]) -> List[Row]:
    """Every row of every ``*.json`` file in ``directory`` (sorted by file name)."""
    names = sorted(n for n in os.listdir(directory) if n.endswith(".json"))
    return load(os.path.join(directory, n) for n in names)


def errors(rows: Sequence[Row], device_for: Any = None) -> List[Dict[str, Any]]:
    """Per row: the published and predicted step times, their relative error, and the
    memory pair where the source publishes memory."""
    out = []
    for row in rows:
        device = device_for(row) if device_for else None
        p = predict_row(row, device)
        actual = measured_step(row)
        entry = {"id": row.id, "measured": actual, "predicted": p.step_time,
                 "error": p.step_time / actual - 1.0, "layout": p.layout.describe(),
                 "compare": row.data.get("compare")}
        if row.memory_gib is not None:
            entry["memory_measured"] = row.memory_gib
            entry["memory_predicted"] = p.max_memory / GIB
        out.append(entry)
    return out
