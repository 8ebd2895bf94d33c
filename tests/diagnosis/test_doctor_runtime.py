"""The doctor on real CPU pipes: profiler labels, ``last_step``, traces from both front doors and
the ``doctor`` command line. Slow layers sleep, so the planted problems dominate whatever else
the machine is doing."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading
import time
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fastpipe
from fastpipe import Pipe
from fastpipe.apps.doctor_cli import main as doctor_main
from fastpipe.runtime.observe import profiler_ranges
from fastpipe.schedule import render
from fastpipe.schedule.trace_file import StepContext
from fastpipe.schedule.timeline import Timeline


class Sleepy(nn.Module):
    """A linear layer that also sleeps ``seconds`` per call (forward and recomputation)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return self.linear(x)


def sleepy_pipe(slow_stage=None, chunks=4, unit=0.002) -> Pipe:
    layers = [Sleepy(unit) for _ in range(4)]
    if slow_stage is not None:
        layers[2 * slow_stage].seconds = layers[2 * slow_stage + 1].seconds = 3 * unit
    return Pipe(nn.Sequential(*layers), balance=[2, 2], devices=["cpu", "cpu"], chunks=chunks,
                schedule="1f1b", checkpoint="never")


def mse(out, target):
    return ((out - target) ** 2).mean()


def batch(n=16):
    return torch.randn(n, 8), torch.randn(n, 8)


def test_every_action_appears_as_a_profiler_range_on_the_worker_threads(tmp_path):
    pipe = sleepy_pipe(unit=0.0)
    x, y = batch()
    with fastpipe.profile() as prof:
        pipe.train_step(x, y, mse)
    path = tmp_path / "profile.json"
    prof.export_chrome_trace(str(path))
    ranges = {e["name"]: e["tid"] for e in json.loads(path.read_text())["traceEvents"]
              if str(e.get("name", "")).startswith("fastpipe/")}
    expected = {profiler_ranges.label(a) for row in pipe.plan(4).actions for a in row}
    assert set(ranges) == expected
    assert threading.get_native_id() not in set(ranges.values())  # the workers' threads


def test_trace_and_profiler_merge_into_one_file_the_doctor_reads(tmp_path, capsys):
    pipe = sleepy_pipe(unit=0.001)
    profiled = tmp_path / "profile.json"
    with profiler_ranges.profile() as prof, pipe.trace() as t:
        pipe.train_step(*batch(), mse)
    prof.export_chrome_trace(str(profiled))
    merged = tmp_path / "merged.json"
    t.write(merged, merge_with=profiled)
    events = json.loads(merged.read_text())["traceEvents"]
    ranges = {e["name"][len("fastpipe/"):]: e["ts"] for e in events
              if str(e.get("name", "")).startswith("fastpipe/") and e.get("ph") == "X"}
    lanes = [e for e in events if e.get("args", {}).get("kind") in ("F", "B")]
    assert len(lanes) == len(ranges) == 16
    # each action's lane event sits where its profiler range is: the same clock (the typical
    # gap is microseconds; a busy machine may delay a thread between the two timestamps, so
    # the median is checked, and every gap against the step's length)
    gaps = sorted(abs(e["ts"] - ranges[e["name"]]) for e in lanes)
    span = max(ranges.values()) - min(ranges.values())
    assert gaps[len(gaps) // 2] < 2000 and gaps[-1] < span / 2
    assert _cli(merged) == 0 and "schedule '1f1b'" in capsys.readouterr().out


def test_a_profiler_of_the_calling_thread_alone_warns_that_workers_are_unseen():
    pipe = sleepy_pipe(unit=0.0)
    with pytest.warns(RuntimeWarning, match="profile_all_threads"):
        with torch.profiler.profile():
            pipe.train_step(*batch(), mse)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with fastpipe.profile():
            pipe.train_step(*batch(), mse)


def test_no_profiler_no_range():
    stage = type("Stage", (), {"stream": None})()
    action = fastpipe.Action(0, "F", 0)
    assert not profiler_ranges.profiling()
    with profiler_ranges.action_range(stage, action) as entered:
        assert entered is None


def test_last_step_without_tracing():
    pipe = sleepy_pipe()
    assert pipe.last_step is None
    pipe.train_step(*batch(), mse)
    stats = pipe.last_step
    assert stats.samples == 16 and stats.stages == 2
    assert stats.samples_per_second == pytest.approx(16 / stats.step_time)
    assert 0.0 <= stats.bubble_fraction < 1.0
    assert "samples/s" in str(stats)


QUIET = StepContext(load=0.0)
"""The slow layers sleep, needing no core: the machine's load (other tests) is set aside."""


def test_a_slow_stage_of_a_real_pipe_is_named_and_rebalanced():
    # sleeps large enough that the gain (about 50 ms) stands above a busy machine's spread
    pipe = sleepy_pipe(slow_stage=1, chunks=8, unit=0.005)
    pipe.train_step(*batch(), mse)
    with pipe.trace() as t:
        for _ in range(4):
            pipe.train_step(*batch(), mse)
    diagnosis = fastpipe.doctor(t, context=QUIET)
    finding = diagnosis.finding("imbalance")
    assert finding is not None and finding.stage == 1, diagnosis.report()
    assert finding.balance == (3, 1)  # a layer moves away from the slow stage
    assert finding.confidence in ("low", "medium", "high") and "4 steps" in finding.evidence
    assert diagnosis.context.balance == (2, 2) and diagnosis.context.samples == 16
    assert diagnosis.noise.steps == 4 and diagnosis.noise.spread is not None


def test_a_traced_step_records_the_hardware():
    pipe = sleepy_pipe(unit=0.0)
    with pipe.trace() as t:
        pipe.train_step(*batch(), mse)
    context = t.contexts[0]
    assert context.devices == ("cpu", "cpu") and context.cores >= 1
    assert context.intra_op_threads == torch.get_num_threads() and context.load >= 0
    # each stage's thread: CPU time over the wall time of its actions
    assert len(context.cpu_busy) == 2 and all(0.0 <= share <= 1.0 for share in context.cpu_busy)


def test_a_stage_that_sleeps_got_little_of_a_core():
    """A sleeping layer holds no core: its stage's CPU time over wall time is far below 1."""
    pipe = sleepy_pipe(unit=0.01)
    with pipe.trace() as t:
        pipe.train_step(*batch(), mse)
    assert max(t.contexts[0].cpu_busy) < 0.5


def test_a_balanced_well_sized_real_pipe_gets_no_layout_advice():
    pipe = sleepy_pipe(chunks=16)
    x, y = batch(32)
    pipe.train_step(x, y, mse)
    with pipe.trace() as t:
        pipe.train_step(x, y, mse)
    kinds = {f.kind for f in fastpipe.doctor(t).findings}
    # contention from other processes may show as waiting; the layout is fine
    assert not kinds & {"imbalance", "chunks", "schedule", "input", "memory"}


def test_a_slow_input_of_a_real_pipe_is_found(tmp_path):
    pipe = sleepy_pipe(chunks=8)
    with pipe.trace() as t:
        time.sleep(0.15)  # the data loader
        pipe.train_step(*batch(), mse)
    diagnosis = fastpipe.doctor(t)
    assert diagnosis.findings[0].kind == "input"
    assert diagnosis.findings[0].gain >= 0.14
    path = tmp_path / "pipe.json"
    t.write(path)
    assert _cli(path) == 0


def _cli(path, *extra) -> int:
    return doctor_main([str(path), *extra])


def test_the_command_line_reports_a_saved_trace(tmp_path, capsys):
    # sleeps long enough that the fixed costs of a step (a busy machine's) do not hide the gain
    pipe = sleepy_pipe(slow_stage=0, unit=0.005)
    with pipe.trace() as t:
        pipe.train_step(*batch(), mse)
    t.contexts[0] = dataclasses.replace(t.contexts[0], load=0.0)  # see QUIET
    path = tmp_path / "trace.json"
    t.write(path)
    assert _cli(path) == 0
    out = capsys.readouterr().out
    assert "stage  compute  bubble  imbalance" in out and "schedule '1f1b'" in out
    assert "stage 0 is the slowest" in out and "1 step: noise unknown" in out


@pytest.mark.parametrize("content, words", [
    (None, "cannot read"),
    ('{"traceEvents": [', "not complete JSON"),
    ('{"traceEvents": []}', "no fastpipe actions"),
    ("one stage", "one stage|1 stage"),
])
def test_bad_input_is_one_line_and_exit_status_2(tmp_path, capsys, content, words):
    path = tmp_path / "trace.json"
    if content == "one stage":
        render.write_chrome_trace(Timeline.from_intervals(1, [(0, "0F0", 0.0, 1.0)]), path)
    elif content is not None:
        path.write_text(content)
    assert _cli(path) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("python -m fastpipe doctor: error:")
    assert __import__("re").search(words, err)


def test_bad_options_exit_2(tmp_path, capsys):
    assert _cli(tmp_path / "x.json", "--balance", "two") == 2
    assert "--balance" in capsys.readouterr().err


def test_python_dash_m_fastpipe_doctor(tmp_path):
    path = tmp_path / "foreign.json"
    path.write_text('{"traceEvents": [{"ph": "X", "name": "aten::mm", "ts": 0, "dur": 1}]}')
    done = subprocess.run([sys.executable, "-m", "fastpipe", "doctor", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "another tool" in done.stderr


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                    reason="needs torch.distributed with gloo")
def test_a_distributed_trace_is_diagnosed_by_the_command_line(tmp_path, capsys):
    from dist_launch import assert_all_ok, launch
    path = tmp_path / "distributed.json"
    results = assert_all_ok(launch("doctored", 2, limit=120, args={"path": str(path)}))
    for r in results:
        assert r["samples"] == 8 and r["stages"] == 1 and 0.0 <= r["bubble"] < 1.0
    assert _cli(path) == 0
    out = capsys.readouterr().out
    assert "input-bound" in out and "2 stages, 4 micro-batches" in out
    from fastpipe.schedule.trace_file import load_trace
    busy = load_trace(path)[1].cpu_busy  # every rank's stage, gathered with the timeline
    assert busy is not None and len(busy) == 2 and all(0.0 <= b <= 1.0 for b in busy)


@pytest.mark.cuda
@pytest.mark.timeout(120)
def test_cuda_stages_get_nvtx_and_profiler_ranges_and_a_traced_bubble(tmp_path):
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    pipe = Pipe(model, balance=[2, 2], devices=["cuda:0", "cuda:0"], chunks=4, schedule="1f1b")
    x, y = batch()
    pipe.train_step(x, y, mse)
    assert pipe.last_step.bubble_fraction is None  # the host only launched the actions
    with profiler_ranges.profile() as prof, pipe.trace() as t:
        pipe.train_step(x, y, mse)
    assert 0.0 <= pipe.last_step.bubble_fraction < 1.0  # from the CUDA events
    path = tmp_path / "profile.json"
    prof.export_chrome_trace(str(path))
    names = {e.get("name") for e in json.loads(path.read_text())["traceEvents"]}
    assert {profiler_ranges.label(a) for row in pipe.plan(4).actions for a in row} <= names
    assert t.contexts[0].memory_peak[0] > 0 and t.contexts[0].memory_limit[0] > 0
    t.write(tmp_path / "cuda.json")
    assert _cli(tmp_path / "cuda.json") == 0
