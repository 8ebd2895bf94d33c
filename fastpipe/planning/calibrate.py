"""This machine as a device the planner knows: one transformer layer profiled here.

The planner prices a layer's forward and backward as matrix FLOPs over an achieved rate, bytes
over the memory bandwidth and a fixed cost per pass (:mod:`fastpipe.planning.costs`). On a
machine without a known GPU type those numbers are measured: the peak is the rate of a large
matrix product, the bandwidth that of a large copy, and the achieved efficiency and the fixed
cost per pass are solved from the layer's measured forward plus backward time at two
micro-batch sizes, so that the planner's own price of that layer matches what it took here.
The links are gloo's over the loopback device, as measured on this project's CPU machine
(about 1.2 GB/s each way, 0.5 ms per message). Imports torch.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Optional, Sequence, Tuple

from .costs import Work, chunk_costs
from .hardware import GPU, Link
from .layout import Layout
from .model_shape import ModelShape
from .runtime_model import RUNTIMES

__all__ = ["GLOO_LOOPBACK", "calibrate", "measure_layer"]

GLOO_LOOPBACK = Link(1.2e9, 0.5e-3)
"""gloo between processes of one machine (BUILD-NOTES: a 4 MB exchange both ways about 3 ms,
1.1-1.4 GB/s each way; 4 KB about 1 ms)."""

CPU_RUNTIME = RUNTIMES["fastpipe-cpu"]

MIN_TOKENS = 1024
"""Tokens per timed micro-batch at least, so the layer's work stands above its fixed costs."""


def _median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _matmul_rate(size: int = 1024, repeats: int = 5) -> float:
    import torch
    a, b = torch.randn(size, size), torch.randn(size, size)
    return 2.0 * size ** 3 / _median_seconds(lambda: a @ b, repeats)


def _copy_rate(elements: int = 2 ** 24, repeats: int = 5) -> float:
    import torch
    a, b = torch.randn(elements), torch.empty(elements)
    return 2.0 * 4 * elements / _median_seconds(lambda: b.copy_(a), repeats)


def measure_layer(layer: object, model: ModelShape, seq: int, micro_batch: int,
                  repeats: int = 5) -> float:
    """Median seconds of one forward and backward of ``layer`` (an ``nn.Module`` taking
    ``(batch, seq, hidden)``) on a ``micro_batch``."""
    import torch
    x = torch.randn(micro_batch, seq, model.hidden, requires_grad=True)

    def step() -> None:
        layer.zero_grad(set_to_none=True)  # type: ignore[attr-defined]
        layer(x).sum().backward()  # type: ignore[operator]
    return _median_seconds(step, repeats)


def _priced(device: GPU, model: ModelShape, seq: int, micro_batch: int) -> float:
    """The planner's seconds for one layer's forward and backward (the middle chunk of a
    three-chunk split of three layers)."""
    work = Work(ModelShape(3, model.hidden, model.heads, model.vocab, model.ffn,
                           model.kv_heads, model.gated), seq, micro_batch)
    costs = chunk_costs(work, Layout(pipeline=3, micro_batch=micro_batch), device,
                        CPU_RUNTIME, 1).costs
    return costs.forward[1] + costs.backward[1] + costs.weight[1]


def calibrate(model: ModelShape, seq: int, micro_batch: int = 1,
              layer: Optional[object] = None, sizes: Optional[Sequence[int]] = None,
              repeats: int = 5) -> GPU:
    """This machine's CPU as a :class:`GPU` description: its measured matrix rate and copy
    bandwidth, and the efficiency and per-pass cost that best make the planner's price of one
    ``model`` layer equal its measured times (least squares) at several micro-batch sizes
    (``sizes``, default ``micro_batch`` or enough sequences for :data:`MIN_TOKENS`, twice and
    four times that). ``layer``: the module to time (default: a pre-norm transformer block of
    ``model``'s width)."""
    if layer is None:
        layer = _block(model)
    if sizes is None:
        first = max(micro_batch, -(-MIN_TOKENS // seq))
        sizes = (first, 2 * first, 4 * first)
    peak, bandwidth = _matmul_rate(), _copy_rate()
    base = GPU("cpu (calibrated here)", {"fp32": peak, "bf16": peak}, memory=_memory(),
               memory_bandwidth=bandwidth, efficiency=1.0, intra_node=GLOO_LOOPBACK,
               inter_node=GLOO_LOOPBACK, memory_efficiency=1.0, gpus_per_node=1 << 20,
               sources={"flops": "a 1024^3 fp32 matrix product timed here",
                        "memory": "a 64 MB copy timed here",
                        "intra_node": GLOO_LOOPBACK.__doc__ or "gloo loopback"},
               calibrated=("efficiency", "layer_overhead"))
    measured = [measure_layer(layer, model, seq, b, repeats) for b in sizes]
    efficiency, overhead = _solve(base, model, seq, sizes, measured)
    return base.with_changes(efficiency=efficiency, layer_overhead=overhead)


def _solve(base: GPU, model: ModelShape, seq: int, sizes: Sequence[int],
           measured: Sequence[float]) -> Tuple[float, float]:
    """(efficiency, per-pass cost) for ``t(b) = compute(b) / e + memory(b) + 2 o``: ``o`` from
    the least-squares line's intercept (0 unless the line rises from a positive one), then
    ``e`` solved at the size with the most work."""
    compute, rest = [], []
    for b, seconds in zip(sizes, measured):
        unit = _priced(base, model, seq, b)
        bytes_only = _priced(base.with_changes(flops={k: float("inf") for k in base.flops}),
                             model, seq, b)
        compute.append(unit - bytes_only)
        rest.append(seconds - bytes_only)
    mean_c, mean_r = statistics.fmean(compute), statistics.fmean(rest)
    spread = sum((c - mean_c) ** 2 for c in compute)
    slope = sum((c - mean_c) * (r - mean_r) for c, r in zip(compute, rest)) / spread
    intercept = mean_r - slope * mean_c
    overhead = intercept / 2 if slope > 0 and intercept > 0 else 0.0
    largest = max(range(len(compute)), key=compute.__getitem__)  # the most work, least noise
    work = rest[largest] - 2 * overhead
    if work <= 0:
        overhead, work = 0.0, rest[largest]
    return min(1.0, compute[largest] / max(work, 1e-12)), overhead


def _memory() -> float:
    import os
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 8e9


def _block(model: ModelShape) -> object:
    """A pre-norm transformer block of ``model``'s width: causal self-attention and a GELU
    MLP of ``model.inner`` (what the planner prices as one layer)."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(model.hidden), nn.LayerNorm(model.hidden)
            self.attn = nn.MultiheadAttention(model.hidden, model.heads, batch_first=True)
            self.mlp = nn.Sequential(nn.Linear(model.hidden, model.inner), nn.GELU(),
                                     nn.Linear(model.inner, model.hidden))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            n = x.shape[1]
            mask = torch.ones(n, n, dtype=torch.bool).triu(1)
            h = self.norm1(x)
            x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
            return x + self.mlp(self.norm2(x))
    return Block()
