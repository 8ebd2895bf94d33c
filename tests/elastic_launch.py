"""Run a script as torchrun's elastic agent would, with hard time limits.

``torchrun(...)``: the real ``python -m torch.distributed.run --standalone --max-restarts=M``,
killed with every rank it started past its deadline. ``AgentStore`` and ``attempt(...)``: the
agent's part played by the test, one attempt at a time: the test process hosts the job's
key-value store, which outlives the ranks and is shared by every attempt (as torchrun's agent's
is), and starts the ranks with the environment the agent gives them (``RANK``, ``MASTER_PORT``,
``TORCHELASTIC_RESTART_COUNT``, ``TORCHELASTIC_USE_AGENT_STORE``, ...), but never kills the
survivors of a failure: what they report of it can be checked, without the agent's race.
"""
from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch.distributed as dist

from dist_launch import RankResult, free_port

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _env(**extra: str) -> Dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), **extra)


@dataclass
class Finished:
    """A torchrun job's exit status (None: killed at the deadline), output and wall time."""

    returncode: Optional[int]
    output: str
    seconds: float


def torchrun(script: str, args: Sequence[str], nproc: int, max_restarts: int,
             limit: float) -> Finished:
    """``script`` under ``torchrun --standalone``; torchrun and every rank are killed at
    ``limit`` seconds."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", f"--max-restarts={max_restarts}", script, *args]
    start = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_env(), cwd=ROOT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=limit)
        code: Optional[int] = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and every rank it started
        out, _ = proc.communicate()
        code = None
    return Finished(code, out, time.monotonic() - start)


class AgentStore:
    """The job's key-value store, hosted by the test as torchrun's agent hosts it."""

    def __init__(self, world_size: int, limit: float) -> None:
        self.port = free_port()
        self.store = dist.TCPStore("127.0.0.1", self.port, world_size + 1, is_master=True,
                                   wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=limit))


def attempt(store: Optional[AgentStore], script: str, args: Sequence[str], world_size: int,
            restart_count: int, limit: float,
            delays: Optional[Dict[int, float]] = None) -> List[RankResult]:
    """One attempt of the job: ``world_size`` ranks of ``script`` on ``store`` (``None``: a
    store of the attempt's own, hosted by rank 0, as under torchrun with
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``), rank ``r`` starting ``delays[r]`` seconds after
    the others; every rank is dead when this returns, killed at ``limit`` seconds if need be."""
    delays = delays or {}
    port = store.port if store is not None else free_port()
    procs: Dict[int, subprocess.Popen] = {}
    start = time.monotonic()
    for rank in sorted(range(world_size), key=lambda r: delays.get(r, 0.0)):
        time.sleep(max(0.0, start + delays.get(rank, 0.0) - time.monotonic()))
        env = _env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                   LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), TORCHELASTIC_RESTART_COUNT=str(restart_count),
                   TORCHELASTIC_MAX_RESTARTS="1", TORCHELASTIC_RUN_ID="fastpipe-test",
                   TORCHELASTIC_USE_AGENT_STORE=str(store is not None))
        procs[rank] = subprocess.Popen([sys.executable, script, *args], env=env, cwd=ROOT,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = start + limit
    results = []
    hung = False
    for rank in range(world_size):
        proc = procs[rank]
        try:
            out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            hung = True
            for other in procs.values():
                other.kill()
            out, err = proc.communicate()
        results.append(RankResult(rank, None if hung else proc.returncode, out, err))
    return results
