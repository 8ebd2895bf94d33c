"""The stage hand-off (fastpipe.streams.handoff, through device_copy's ship and land) and a
stage's own stream (fastpipe.streams.stage_stream, through Stage.context and order_streams), on
a pretend GPU: the CPU plays the device, RecordingStreams its streams and pools.

The hop shown is between two stages of one device (interleaved schedules), where nothing is
copied and the seam alone orders the receiver after the producer; a hop between devices adds
the native transfer op's copy stream, whose protocol csrc/cuda/transfer.cpp documents."""
import torch
from torch import nn

from fastpipe.runtime.stage import Stage, order_streams
from fastpipe.runtime.transport.device_copy import land, ship
from recording_streams import RecordingStreams

CPU = torch.device("cpu")


def _stages(rec):
    return rec.new_stream("cpu", "stage 0"), rec.new_stream("cpu", "stage 1")


def test_the_receiver_waits_for_the_sender_and_owns_what_it_received():
    rec = RecordingStreams("cpu")
    sender, receiver = _stages(rec)
    rec.compute(sender, what="the sender's earlier work")
    activation = rec.made(torch.randn(4, 8), sender, label="activation")
    with rec.using(sender):
        parcel = ship([activation, None], CPU, backend=rec)
    rec.compute(sender, what="the sender's next action")
    with rec.using(receiver):
        received = land(parcel, CPU, backend=rec)
        rec.compute(receiver, reads=[received[0]], what="the receiver's layers")
    rec.check()
    assert received[0] is activation and received[1] is None


def test_a_parcel_without_tensors_or_event_waits_for_nothing():
    rec = RecordingStreams("cpu")
    assert ship([None, None], CPU, backend=rec).event is None
    assert not [e for e in rec.log if e[0] in ("record_event", "wait_event")]


def test_stage_context_issues_on_the_stages_stream_under_its_device_guard():
    rec = RecordingStreams("cpu")
    stage = Stage(0, nn.Sequential(nn.Linear(2, 2)), CPU)
    stage.stream_backend, stage.stream = rec, rec.new_stream("cpu", "stage")
    with stage.context():
        assert rec.current(CPU) is stage.stream and rec.device == CPU
    assert rec.current(CPU) is rec.default(CPU) and rec.device is None
    assert rec.devices_entered == [CPU]


def test_a_step_is_ordered_after_the_callers_work_and_the_caller_after_the_step():
    rec = RecordingStreams("cpu")
    caller = rec.default(CPU)
    stage = Stage(0, nn.Sequential(nn.Linear(2, 2)), CPU)
    stage.stream_backend, stage.stream = rec, rec.new_stream("cpu", "stage")
    weight = rec.adopt(torch.zeros(2, 2), "weight")  # lives outside the step's pools
    grad = rec.adopt(torch.zeros(2, 2), "gradient")
    rec.compute(caller, writes=[weight], what="the optimizer's update")
    order_streams([stage], before=True)
    with stage.context():
        rec.compute(stage.stream, reads=[weight], writes=[grad], what="the step")
    order_streams([stage], before=False)
    rec.compute(caller, reads=[grad], writes=[weight], what="the next update")
    rec.check()
