"""Elastic restarts: a rank dies mid-step under ``torchrun --max-restarts``, the others stop
within seconds naming it, the next attempt starts clean and resumes from the last complete
checkpoint, and the job ends with the weights of a run that was never interrupted, bit for bit.

The job is ``examples/train_elastic.py`` (through ``tests/elastic_job.py``, which injects the
failure and reports each rank's final state as a digest): 8 optimizer steps of a small GPT
(tied embedding and head, dropout, AdamW, warm-up and cosine schedule, clipping, accumulation of
2 batches under ``no_sync``), checkpoints after steps 3, 6 and 8.
"""
from __future__ import annotations

import itertools
import json
import os
from typing import Dict, List, Optional, Tuple

import pytest
import torch.distributed as dist

from dist_launch import describe
from elastic_launch import AgentStore, attempt, torchrun
from fastpipe.runtime.transport import backends
from fastpipe.runtime.failure.board import Board
from fastpipe.runtime.failure.liveness import unreachable

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
JOB = os.path.join(HERE, "elastic_job.py")
TRAINING = ["--steps", "8", "--save-every", "3", "--accumulate", "2", "--layers", "2",
            "--dim", "32", "--seq", "8", "--batch", "8", "--chunks", "4", "--warmup", "3",
            "--dropout", "0.1", "--timeout", "30", "--log-every", "1"]
LIMIT = 100.0  # seconds for one job (two attempts); a run takes about 10-20 s on 2 cores
EXIT_CODES = {"exit": 21, "sigkill": -9, "raise": 1}

pytestmark = pytest.mark.timeout(600)


# ------------------------------------------------------------------ keys of an attempt
@pytest.mark.parametrize("env, scope", [
    ({}, ""),
    ({"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "3"}, "attempt3/"),
    ({"TORCHELASTIC_USE_AGENT_STORE": "False", "TORCHELASTIC_RESTART_COUNT": "3"}, ""),
])
def test_the_keys_of_an_attempt_are_apart_only_in_a_store_shared_by_attempts(
        monkeypatch, env, scope):
    for name in ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert backends.attempt_scope() == scope


def test_a_new_attempt_never_reads_an_earlier_attempts_notices(monkeypatch):
    store = dist.HashStore()
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    first = Board("pipe0", 0, store=store, ranks=[0, 1])
    old = Board("pipe0", 1, store=store, ranks=[0, 1])
    old.share("facts of the first attempt")
    old.publish("rank 1 (stage 1) failed: RuntimeError: boom")
    assert first.read() is not None  # the same attempt sees it
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    new = Board("pipe0", 0, store=store, ranks=[0, 1])
    assert new.key.startswith("fastpipe/attempt1/pipe0/")
    assert new.read() is None  # the first attempt's failure is not this one's
    assert new.facts([0, 1]) == {}  # nor are its ranks' facts
    assert "rank 1 never built its pipe" in new.liveness.culprit()


def test_a_lost_store_names_the_process_that_hosted_it(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    assert unreachable(ConnectionError("reset")).startswith("rank 0, which hosts the job's")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert "torchrun's agent" in unreachable(ConnectionError("reset"))


def test_a_restarted_attempt_connects_although_the_store_holds_dead_ranks_addresses():
    """The first attempt's ranks end without ``destroy_process_group`` (as after a failure),
    so their gloo addresses stay in the store; in the next attempt rank 1 starts 2 s late.
    With torch's ``init_process_group``, rank 0 then reads rank 1's dead address: in 5 of 6
    runs (torch 2.13) the attempt failed in gloo's ``connectFullMesh`` (connection refused)
    or hung, both ranks. fastpipe's keeps the attempts apart."""
    store = AgentStore(2, 60)
    script = os.path.join(HERE, "elastic_rendezvous.py")
    first = attempt(store, script, ["exit"], 2, restart_count=0, limit=60)
    assert [r.returncode for r in first] == [0, 0], describe(first)
    second = attempt(store, script, [], 2, restart_count=1, limit=60, delays={1: 2.0})
    assert [r.returncode for r in second] == [0, 0], describe(second)
    assert all(r.stdout.strip() == "RESULT 3" for r in second), describe(second)


# ------------------------------------------------------------------ the job
def job_args(out: str, failure: Optional[Tuple[str, int, int, str]]) -> List[str]:
    """``tests/elastic_job.py``'s arguments: results in ``out``, checkpoints in ``out/ckpts``,
    and the failure (kind, rank, step, forward or backward) to inject on the first attempt."""
    args = ["--out", out]
    if failure is not None:
        kind, rank, step, where = failure
        args += ["--fail", kind, "--fail-rank", str(rank), "--fail-step", str(step),
                 "--fail-where", where]
    return args + ["--", "--dir", os.path.join(out, "ckpts"), *TRAINING]


def reports(out: str, attempt_number: int, world: int) -> Dict[int, dict]:
    """What each rank of an attempt wrote when it ended (ranks that were killed wrote none)."""
    found = {}
    for rank in range(world):
        path = os.path.join(out, f"attempt{attempt_number}-rank{rank}.json")
        if os.path.exists(path):
            with open(path) as f:
                found[rank] = json.load(f)
    return found


_REFERENCE: Dict[int, List[str]] = {}


def reference(world: int, tmp_path_factory: pytest.TempPathFactory) -> List[str]:
    """Each rank's final digest in a run that is never interrupted (computed once per world
    size)."""
    if world not in _REFERENCE:
        out = str(tmp_path_factory.mktemp(f"reference{world}"))
        results = attempt(AgentStore(world, LIMIT), JOB, job_args(out, None), world,
                          restart_count=0, limit=LIMIT)
        assert all(r.returncode == 0 for r in results), describe(results)
        done = reports(out, 0, world)
        assert sorted(done) == list(range(world)) and all(
            d["resumed_at"] == 0 for d in done.values()), done
        _REFERENCE[world] = [done[rank]["digest"] for rank in range(world)]
    return _REFERENCE[world]


def last_checkpoint_before(step: int) -> int:
    """The step a job resumes at when it failed during optimizer step ``step``, or in the
    first save from that step on (checkpoints after steps 3, 6 and 8)."""
    return (step // 3) * 3


def check_resumed(out: str, world: int, fail_step: int, expected: List[str]) -> None:
    """The second attempt resumed at the last checkpoint and ended with ``expected``."""
    done = reports(out, 1, world)
    assert sorted(done) == list(range(world)), done
    assert [done[r]["resumed_at"] for r in range(world)] == \
        [last_checkpoint_before(fail_step)] * world, done
    assert [done[r]["digest"] for r in range(world)] == expected, \
        "the resumed job's weights or optimizer state differ from an uninterrupted run's"


@pytest.mark.parametrize("world, kind, victim, step, where, shared", [
    (2, "sigkill", 0, 4, "backward", True),
    (4, "exit", 2, 5, "forward", True),
    (2, "exit", 0, 2, "forward", False),
])
def test_survivors_name_the_dead_rank_within_seconds_and_the_next_attempt_resumes(
        tmp_path, tmp_path_factory, world, kind, victim, step, where, shared):
    """The agent's part played by the test, so that the survivors of the first attempt are not
    stopped by the agent before they report: the store is the agent's, shared by the attempts
    (``shared``), or each attempt's own, hosted by rank 0 (torchrun with
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: a dead rank 0 takes the store with it)."""
    expected = reference(world, tmp_path_factory)
    out = str(tmp_path)
    store = AgentStore(world, LIMIT) if shared else None
    first = attempt(store, JOB, job_args(out, (kind, victim, step, where)), world,
                    restart_count=0, limit=LIMIT)
    assert first[victim].returncode == EXIT_CODES[kind], describe(first)
    told = reports(out, 0, world)
    for rank in range(world):
        if rank == victim:
            continue
        assert first[rank].returncode == 1, describe(first)
        report = told[rank]
        assert f"rank {victim}" in report["message"], report
        assert report["seconds"] is not None and report["seconds"] < 10.0, report
    second = attempt(store, JOB, job_args(out, None), world, restart_count=1, limit=LIMIT)
    assert all(r.returncode == 0 for r in second), describe(second)
    check_resumed(out, world, step, expected)


# ------------------------------------------------------------------ under torchrun itself
def run_under_torchrun(out: str, world: int, failure: Tuple[str, int, int, str],
                       expected: List[str]) -> None:
    _, victim, step, _ = failure
    finished = torchrun(JOB, job_args(out, failure), nproc=world, max_restarts=1, limit=LIMIT)
    assert finished.returncode == 0, finished.output[-6000:]
    assert f"resumed from {os.path.join(out, 'ckpts')}" in finished.output or \
        last_checkpoint_before(step) == 0, finished.output[-3000:]
    assert os.path.exists(os.path.join(out, "injected-at")), "no failure was injected"
    victim_said = reports(out, 0, world).get(victim)  # unless the agent stopped it first
    assert victim_said is None or victim_said["error"] == "InjectedFailure", victim_said
    check_resumed(out, world, step, expected)


@pytest.mark.parametrize("world, failure", [
    (2, ("raise", 1, 4, "forward")),
    (4, ("sigkill", 3, 5, "save")),
])
def test_torchrun_restarts_the_job_and_it_ends_as_if_never_interrupted(
        tmp_path, tmp_path_factory, world, failure):
    run_under_torchrun(str(tmp_path), world, failure, reference(world, tmp_path_factory))


def failures(world: int, runs: int) -> List[Tuple[str, int, int, str]]:
    """``runs`` failures: every kind in every place (forward, backward, checkpoint save), on
    every rank in turn, at steps before the first checkpoint and after later ones."""
    places = list(itertools.product(("exit", "raise", "sigkill"),
                                    ("forward", "backward", "save")))
    steps = (4, 1, 7, 5, 2, 6, 3, 0)
    return [(places[i % len(places)][0], i % world, steps[i % len(steps)],
             places[i % len(places)][1]) for i in range(runs)]


@pytest.mark.slow
@pytest.mark.timeout(12 * LIMIT)
@pytest.mark.parametrize("world", [2, 4])
def test_torchrun_restarts_resume_exactly_ten_times_out_of_ten(tmp_path, tmp_path_factory,
                                                               world):
    expected = reference(world, tmp_path_factory)
    outcomes = []
    for i, failure in enumerate(failures(world, 10)):
        out = str(tmp_path / f"run{i}")
        os.makedirs(out)
        try:
            run_under_torchrun(out, world, failure, expected)
            outcomes.append("ok")
        except AssertionError as error:
            outcomes.append(f"{failure}: {str(error)[-2000:]}")
    failed = [o for o in outcomes if o != "ok"]
    assert not failed, f"{len(failed)} of 10 runs failed:\n" + "\n".join(failed)
