"""Distributed cases: the transports' blocking reads of device buffers, per step.

``pipe.last_step.host_reads`` counts the reads a rank's transport made on the host of buffers
that live on its device (on a GPU, each one makes the host wait for the device). The grouped
transport reads headers and metadata from its side channel (CPU tensors) and keeps the loss on
the device, so it makes none, on any step: the first, a repeated one, a new batch size, a new
sequence length. The tagged transport reads every header it receives. Every step is exact.
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

from dist_common import DistributedPipe
from dist_pipeline_cases import seq_model, seq_step_matches

# (batch, sequence length) per step: repeats, then a new batch size, then a new length
STEPS: Tuple[Tuple[int, int], ...] = ((8, 5), (8, 5), (8, 5), (12, 5), (12, 5), (12, 7), (12, 7))


def host_reads(schedule: str = "1f1b", steps: Sequence[Sequence[int]] = STEPS) -> Dict:
    """Every rank's ``last_step.host_reads`` per step on both transports (exact steps)."""
    return {p2p: _reads(p2p, schedule, steps) for p2p in ("grouped", "tagged")}


def _reads(p2p: str, schedule: str, steps: Sequence[Sequence[int]]) -> List[int]:
    plain = seq_model()
    pipe = DistributedPipe(seq_model(), chunks=4, schedule=schedule, balance=[3, 3], timeout=30,
                           p2p=p2p)
    reads = []
    for step, (batch, length) in enumerate(steps):
        seq_step_matches(plain, pipe, step, batch, length, f"{p2p} ")
        reads.append(pipe.last_step.host_reads)
    return reads
