"""Run a test case in N processes on gloo, with a hard time limit on the whole group.

The parent picks a free port, starts one ``python tests/dist_cases.py CASE ARGS`` process per
rank (the environment ``torchrun`` would set), and kills every process still alive at the
deadline, so a hung case fails the test instead of hanging the suite.
"""
from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


@dataclass
class RankResult:
    rank: int
    returncode: Optional[int]  # None: killed at the deadline
    stdout: str
    stderr: str

    @property
    def result(self) -> Any:
        """The JSON a rank printed on its ``RESULT`` line (None if it printed none)."""
        for line in self.stdout.splitlines():
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT "):])
        return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(case: str, world_size: int, limit: float = 120.0,
           args: Optional[Dict[str, Any]] = None, p2p: str = "auto",
           script: str = "dist_cases.py") -> List[RankResult]:
    """Run ``case`` (a function of ``script``, a case file under tests/ whose ``main`` is
    ``dist_cases.main``) on ``world_size`` ranks, its pipes on the ``p2p`` transport; every
    process is dead when this returns."""
    port = free_port()
    # The parent hosts the key-value store, as torchrun's agent does: a rank that exits early
    # does not take the store (and its peers' failure notices) with it.
    store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=True,
                          wait_for_workers=False, timeout=datetime.timedelta(seconds=limit))
    procs = []
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", FASTPIPE_CASES_P2P=p2p,
                   PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
        procs.append(subprocess.Popen(
            [sys.executable, os.path.join(HERE, script), case, json.dumps(args or {})],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT))
    deadline = time.monotonic() + limit
    results = []
    hung = False
    for rank, proc in enumerate(procs):
        try:
            out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            hung = True
            for other in procs:
                other.kill()
            out, err = proc.communicate()
        results.append(RankResult(rank, None if hung else proc.returncode, out, err))
    del store
    return results


def describe(results: List[RankResult]) -> str:
    """Every rank's exit status and the tail of its stderr, for assertion messages."""
    parts = []
    for r in results:
        status = "HUNG (killed)" if r.returncode is None else f"exit {r.returncode}"
        parts.append(f"--- rank {r.rank}: {status}\n{r.stdout[-1500:]}\n{r.stderr[-3000:]}")
    return "\n".join(parts)


def assert_all_ok(results: List[RankResult]) -> List[Any]:
    """Every rank exited 0 and printed a result; returns the results."""
    assert all(r.returncode == 0 and r.result is not None for r in results), describe(results)
    return [r.result for r in results]


def torchrun(script: str, args: List[str], cwd: str, nproc: int = 2,
             limit: float = 120.0) -> str:
    """Run ``script`` under ``torchrun --standalone`` with the source tree importable; its
    stdout. Fails the test (killing torchrun and every rank) past ``limit`` seconds or on a
    non-zero exit."""
    import signal

    import pytest

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", script, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1",  # the package's tree, installed or not
               PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=cwd, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and every rank it started
        proc.communicate()
        pytest.fail(f"torchrun did not finish in {limit:g} s")
    assert proc.returncode == 0, out[-2000:] + err[-4000:]
    return out
