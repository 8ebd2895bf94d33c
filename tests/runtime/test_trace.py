"""Measured traces: every action of a real step, on the simulator's timeline format."""
import pytest
import torch
from torch import nn

import fastpipe
from helpers import mlp


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_trace_records_every_action_in_program_order(schedule):
    pipe = fastpipe.Pipe(mlp(depth=6), chunks=4, balance=[2, 2, 2], devices=["cpu"] * 3,
                         schedule=schedule, cpu_workers=3)
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    pipe.train_step(x, y, nn.MSELoss())  # untraced steps record nothing
    with pipe.trace() as t:
        pipe.train_step(x, y, nn.MSELoss())
        pipe.train_step(x, y, nn.MSELoss())
    assert len(t.timelines) == 2
    timeline = t.timeline
    assert timeline.source == "measured" and timeline.num_stages == 3
    plan = pipe.plan()
    for stage in range(3):
        events = sorted((e for e in timeline.events if e.stage == stage), key=lambda e: e.start)
        assert [str(e.action) for e in events] == [str(a) for a in plan.actions[stage]]
        for before, after in zip(events, events[1:]):
            assert before.start <= before.end <= after.start
    assert 0.0 <= t.bubble_fraction < 1.0
    assert len(t.busy) == 3 and all(b > 0 for b in t.busy)
    assert timeline.makespan > 0


def test_trace_respects_dependencies_across_stages():
    pipe = fastpipe.Pipe(mlp(depth=4), chunks=3, balance=[2, 2], devices=["cpu"] * 2,
                         cpu_workers=2)
    with pipe.trace() as t:
        pipe.train_step(torch.randn(6, 8), torch.randn(6, 4), nn.MSELoss())
    end = {str(e.action): e.end for e in t.timeline.events}
    start = {str(e.action): e.start for e in t.timeline.events}
    # an action hands its result on just before it ends, so a consumer may start a hair before
    # its producer's end is stamped, but never before the producer started
    for first, then in [(f"0F{mb}", f"1F{mb}") for mb in range(3)] + \
                       [(f"1B{mb}", f"0B{mb}") for mb in range(3)]:
        assert start[first] < start[then] < end[then]


def test_forward_is_traced_too_and_empty_trace_is_an_error():
    pipe = fastpipe.Pipe(mlp(depth=4), chunks=2, balance=[2, 2], devices=["cpu"] * 2)
    with pipe.trace() as t:
        pass
    with pytest.raises(RuntimeError, match="no step ran inside pipe.trace"):
        t.timeline
    with pipe.trace() as t, torch.no_grad():
        pipe(torch.randn(4, 8))
    assert sorted(str(e.action) for e in t.timeline.events) == ["0F0", "0F1", "1F0", "1F1"]


def test_waiting_for_a_gpu_event_is_bounded_and_says_what_it_waited_for():
    from fastpipe.errors import PipelineTimeout
    from fastpipe.runtime.observe.trace import wait_for_event

    class Never:  # an event whose work never finishes
        def query(self):
            return False

    with pytest.raises(PipelineTimeout, match="after 0.05s waiting for cuda:0 to finish") as info:
        wait_for_event(Never(), 0.05, "cuda:0 to finish the step", stage=1, microbatch=3)
    assert (info.value.stage, info.value.microbatch) == (1, 3)
