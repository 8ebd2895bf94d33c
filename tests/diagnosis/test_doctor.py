"""The pipeline doctor on synthetic measured timelines (milliseconds each, no torch work).

A timeline is made by simulating a schedule with planted costs (seconds) and relabelling it as
measured, so every planted problem is known exactly.
"""
from __future__ import annotations

import json

import pytest

from fastpipe.diagnosis.findings import Memory
from fastpipe.schedule.trace_file import StepContext, TraceFileError, load_trace
from fastpipe.diagnosis.report import doctor
from fastpipe.diagnosis.split import CATEGORIES
from fastpipe.schedule import get_schedule, render
from fastpipe.schedule.simulator import Costs, simulate
from fastpipe.schedule.timeline import Event, Timeline

MS = 1e-3


def measured(name="1f1b", stages=4, chunks=32, forward=(1 * MS,), backward=(2 * MS,),
             p2p=0.0, gap=0.0, virtual=1):
    """A 'measured' timeline: the simulated one, each action shortened by ``gap`` at its start
    (the runtime's time between ready actions)."""
    schedule = get_schedule(name, stages, chunks, virtual_stages=virtual)
    n = schedule.num_virtual_stages
    costs = Costs(forward=_per(forward, n), backward=_per(backward, n), weight=0.0, p2p=p2p)
    events = [Event(e.stage, e.action, e.start + gap, e.end)
              for e in simulate(schedule, costs).timeline.events]
    return Timeline(stages, events, "measured", "s")


def _per(values, n):
    return tuple(values) * (n // len(values)) if len(values) < n else tuple(values)


def test_a_balanced_well_sized_pipe_gets_no_finding():
    timeline = measured(chunks=32, gap=0.01 * MS)
    diagnosis = doctor(timeline, context=StepContext(balance=(2, 2, 2, 2), samples=256,
                                                     step_start=timeline.start,
                                                     step_end=timeline.end))
    assert diagnosis.findings == ()
    assert "no problem found" in diagnosis.report()
    assert diagnosis.share("imbalance") == pytest.approx(0.0, abs=1e-9)
    assert diagnosis.share("inherent") == pytest.approx(3 / 35, abs=0.01)


def test_every_stage_row_adds_up_to_the_step():
    timeline = measured(chunks=8, forward=(1 * MS, 1 * MS, 3 * MS, 1 * MS),
                        backward=(2 * MS, 2 * MS, 6 * MS, 2 * MS), gap=0.05 * MS, p2p=0.1 * MS)
    diagnosis = doctor(timeline, context=StepContext(step_start=timeline.start - 5 * MS,
                                                     step_end=timeline.end + 2 * MS))
    for stage in range(4):
        assert sum(diagnosis.share(c, stage) for c in CATEGORIES) == pytest.approx(1.0)
    assert diagnosis.share("input") == pytest.approx(5 * MS / diagnosis.step_time)
    assert diagnosis.share("optimizer") == pytest.approx(2 * MS / diagnosis.step_time)


def test_a_stage_three_times_slower_is_named_and_rebalanced():
    layer = [1.0, 1.0, 1.0, 1.0, 3.0, 3.0, 1.0, 1.0]  # stage 2 holds the two slow layers
    stage = [layer[2 * s] + layer[2 * s + 1] for s in range(4)]
    timeline = measured(chunks=8, forward=tuple(c * MS for c in stage),
                        backward=tuple(2 * c * MS for c in stage))
    diagnosis = doctor(timeline, context=StepContext(balance=(2, 2, 2, 2), samples=64))
    finding = diagnosis.findings[0]
    assert finding.kind == "imbalance" and finding.stage == 2
    assert "stage 2 is the slowest (3.0x" in finding.message
    assert finding.balance is not None and finding.balance[2] < 2 and sum(finding.balance) == 8
    # the simulator agrees: the same schedule with the suggested balance is faster
    schedule = get_schedule("1f1b", 4, 8)
    new, start = [], 0
    for count in finding.balance:
        new.append(sum(layer[start:start + count]) * MS)
        start += count
    faster = simulate(schedule, Costs(forward=new, backward=[2 * c for c in new], weight=0.0))
    assert faster.makespan < timeline.makespan - finding.gain * 0.99
    assert diagnosis.share("imbalance") > 0.2


def test_a_slow_input_is_found_with_its_cost():
    timeline = measured(chunks=32)
    wait = 0.3 * timeline.makespan
    diagnosis = doctor(timeline, context=StepContext(step_start=timeline.start - wait))
    finding = diagnosis.findings[0]
    assert finding.kind == "input" and finding.gain == pytest.approx(wait)
    assert "DataLoader" in finding.fix


def test_too_few_microbatches_gets_a_larger_chunks():
    timeline = measured(chunks=4)
    diagnosis = doctor(timeline, context=StepContext(samples=64))
    finding = diagnosis.finding("chunks")
    assert finding is not None and finding.chunks > 4
    assert "too few micro-batches" in finding.message and "43%" in finding.message


def test_chunks_never_exceed_the_batch():
    diagnosis = doctor(measured(chunks=4), context=StepContext(samples=4))
    assert diagnosis.finding("chunks") is None


def test_tiny_actions_get_a_smaller_chunks():
    timeline = measured(chunks=32, forward=(0.04 * MS,), backward=(0.08 * MS,), gap=0.03 * MS)
    diagnosis = doctor(timeline, context=StepContext(samples=256))
    finding = diagnosis.finding("chunks")
    assert finding is not None and finding.chunks < 32
    assert "micro-batches too small" in finding.message


def test_transfer_latency_is_communication():
    timeline = measured(chunks=16, p2p=1 * MS)
    diagnosis = doctor(timeline)
    assert diagnosis.share("communication") > 0.1
    assert diagnosis.finding("communication") is not None


def test_a_faster_schedule_is_recommended_for_few_microbatches():
    diagnosis = doctor(measured(name="gpipe", chunks=4), context=StepContext(samples=4))
    finding = diagnosis.finding("schedule")
    assert finding is not None and finding.schedule == "zb-h1"


def test_checkpointing_with_memory_to_spare_and_no_checkpointing_near_the_limit():
    timeline = measured(chunks=16)
    spare = doctor(timeline, context=StepContext(checkpoint="always"),
                   memory=Memory(peak=(1e9,) * 4, limit=(8e9,) * 4))
    assert spare.finding("memory").fix.startswith("checkpoint='never'")
    full = doctor(timeline, context=StepContext(checkpoint="never"),
                  memory=Memory(peak=(1e9, 1e9, 7.8e9, 1e9), limit=(8e9,) * 4))
    risk = full.finding("memory")
    assert risk.stage == 2 and risk.gain == 0 and "except_last" in risk.fix


def test_memory_recorded_in_the_context_is_used():
    context = StepContext(checkpoint="never", memory_peak=(1e9, 7.9e9, 1e9, 1e9),
                          memory_limit=(8e9,) * 4)
    assert doctor(measured(chunks=16), context=context).finding("memory").stage == 1
    assert StepContext.from_dict(json.loads(json.dumps(context.to_dict()))) == context


def test_interleaved_schedules_are_recognised():
    diagnosis = doctor(measured(name="interleaved", chunks=8, virtual=2))
    assert diagnosis.split.schedule.name == "interleaved"
    assert diagnosis.split.schedule.num_chunks == 2


def test_the_report_is_short():
    timeline = measured(chunks=4, forward=(1 * MS, 1 * MS, 3 * MS, 1 * MS), p2p=1 * MS)
    report = doctor(timeline, context=StepContext(step_start=timeline.start - 0.05,
                                                  balance=(2, 2, 2, 2))).report()
    advice = [line for line in report.splitlines() if line[:2] in {f"{i}." for i in range(9)}]
    assert 1 <= len(advice) <= 5
    assert report.splitlines()[2].split() == ["stage", "compute", "bubble", "imbalance", "comm",
                                              "input", "optimizer", "other"]


def test_a_saved_trace_reads_back_with_its_context(tmp_path):
    timeline = measured(chunks=4)
    context = StepContext(step_start=-0.01, step_end=timeline.end, schedule="1f1b",
                          virtual_stages=1, balance=(1, 2, 2, 1), samples=8)
    path = tmp_path / "trace.json"
    render.write_chrome_trace(timeline, path, meta=context.to_dict())
    loaded, read = load_trace(path)
    assert read == context
    assert sorted(map(str, (e.action for e in loaded.events))) == sorted(
        map(str, (e.action for e in timeline.events)))
    assert loaded.makespan == pytest.approx(timeline.makespan)


@pytest.mark.parametrize("content, words", [
    ('{"traceEvents": [{"ph": "X", "name": "aten::mm", "ts": 0, "dur": 1}]}', "another tool"),
    ('{"traceEvents": [', "not complete JSON"),
    ("[]", "not a Chrome/Perfetto trace"),
])
def test_foreign_or_truncated_traces_are_refused(tmp_path, content, words):
    path = tmp_path / "trace.json"
    path.write_text(content)
    with pytest.raises(TraceFileError, match=words):
        load_trace(path)


def test_unusable_timelines_are_refused():
    with pytest.raises(TraceFileError, match="one stage|1 stage"):
        doctor(Timeline.from_intervals(1, [(0, "0F0", 0.0, 1.0)]))
    with pytest.raises(TraceFileError, match="empty"):
        doctor(Timeline(2, (), "measured", "s"))
    with pytest.raises(TraceFileError, match="Trace"):
        doctor("trace.json")
    with pytest.raises(TraceFileError, match="entries"):
        doctor(measured(chunks=4), memory=[1.0, 2.0])
    with pytest.raises(TraceFileError, match="peak bytes per stage"):
        doctor(measured(chunks=4), memory="lots")


def test_json_meta_is_plain_json():
    context = StepContext(balance=(2, 2), samples=4)
    assert json.loads(json.dumps(context.to_dict())) == {"balance": [2, 2], "samples": 4}


def test_a_slow_stage_of_one_layer_is_named_without_a_balance():
    timeline = measured(chunks=8, forward=(1 * MS, 1 * MS, 3 * MS, 1 * MS),
                        backward=(2 * MS, 2 * MS, 6 * MS, 2 * MS))
    for balance, words in (((1, 1, 1, 1), "split its slowest layer"), (None, "balance=...")):
        finding = doctor(timeline, context=StepContext(balance=balance)).finding("imbalance")
        assert finding.stage == 2 and finding.balance is None and words in finding.fix


def test_stages_sharing_a_thread_are_named_and_their_waits_are_not_overhead():
    # stages 0 and 1 on one thread: stage 1's forward waits while stage 0 runs its next one
    intervals = []
    t = 0.0
    for mb in range(8):
        intervals += [(0, f"0F{mb}", t, t + 1 * MS), (1, f"1F{mb}", t + 1 * MS, t + 2 * MS)]
        t += 2 * MS
    for mb in range(8):
        intervals += [(1, f"1B{mb}", t, t + 2 * MS), (0, f"0B{mb}", t + 2 * MS, t + 4 * MS)]
        t += 4 * MS
    timeline = Timeline.from_intervals(2, intervals)
    shared = doctor(timeline, context=StepContext(threads=((0, 1),)))
    assert shared.split.dispatch_gaps and max(shared.split.dispatch_gaps) < 1e-9
    finding = shared.finding("unexplained")
    assert finding is not None and "stages 0-1 each shared a worker thread" in finding.fix
    alone = doctor(timeline, context=StepContext(threads=((0,), (1,))))
    assert max(alone.split.dispatch_gaps) >= 1 * MS
