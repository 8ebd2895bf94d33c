"""Shared helpers for the benchmarks: interleaved timing, medians and a plain table."""
from __future__ import annotations

import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, List, Sequence

import torch

from fastpipe.apps.progress import progress


def time_interleaved(candidates: Dict[str, Callable[[], None]], rounds: int,
                     warmup: int = 3) -> Dict[str, List[float]]:
    """Time each candidate once per round, in turn, so machine noise hits them all alike."""
    for fn in candidates.values():
        for _ in range(warmup):
            fn()
    times: Dict[str, List[float]] = {name: [] for name in candidates}
    bar = progress(rounds, desc="rounds")  # on stderr; silent when stderr is a file
    for _ in range(rounds):
        for name, fn in candidates.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
        bar.update()
    bar.close()
    return times


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub-flavoured markdown table."""
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def machine() -> str:
    """One line about the machine and the library versions, for RESULTS.md."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
            f"torch {torch.__version__}, python {platform.python_version()}, "
            f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, "
            f"load average at start {load:.2f}")


def run_ranks(script: str, world: int, env: Dict[str, str], limit: float) -> str:
    """Run ``script`` as ``world`` local ranks (the environment torchrun would set, plus
    ``env``), at most ``limit`` seconds; rank 0's stdout. Exits naming the failure."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, script], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world),
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                                       OMP_NUM_THREADS="1", **env))
             for rank in range(world)]
    try:
        outputs = [p.communicate(timeout=limit) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise SystemExit(f"{script}: a rank did not finish in {limit:g} s")
    if any(p.returncode != 0 for p in procs):
        raise SystemExit(f"{script}: a rank failed (exit codes {[p.returncode for p in procs]}):"
                         f"\n" + "\n".join(err[-2000:] for _, err in outputs))
    return outputs[0][0]
