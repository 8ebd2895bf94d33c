"""The recording fake itself: it reports each kind of violation a GPU would suffer (a missing
wait, a missing record_stream, memory taken from another stream's pool too early, read-after-
write and write-after-read races) and accepts the correct protocols, so that a seam's test
that passes on it has passed a real check."""
import pytest
import torch
from torch import nn

from recording_streams import RecordingStreams


@pytest.fixture
def rec():
    return RecordingStreams("cuda:0")


def _streams(rec):
    return rec.new_stream("cuda:0", "producer"), rec.new_stream("cuda:0", "consumer")


def _violations(rec):
    with pytest.raises(AssertionError) as error:
        rec.check()
    return str(error.value)


def test_a_read_on_another_stream_without_a_wait_is_reported(rec):
    producer, consumer = _streams(rec)
    rec.compute(producer, what="earlier work")
    t = rec.made(torch.ones(4), producer)
    rec.record_stream(t, consumer)
    rec.compute(consumer, reads=[t])
    text = _violations(rec)
    assert "before its write" in text and "without waiting" in text


def test_a_read_after_waiting_for_the_producers_event_is_accepted(rec):
    producer, consumer = _streams(rec)
    t = rec.made(torch.ones(4), producer)
    rec.wait_event(consumer, rec.record_event(producer))
    rec.record_stream(t, consumer)
    rec.compute(consumer, reads=[t])
    rec.check()


def test_an_event_recorded_before_the_write_does_not_order_it(rec):
    producer, consumer = _streams(rec)
    early = rec.record_event(producer)
    t = rec.made(torch.ones(4), producer)
    rec.wait_event(consumer, early)
    rec.record_stream(t, consumer)
    rec.compute(consumer, reads=[t])
    assert "before its write" in _violations(rec)


def test_a_missing_record_stream_is_reported_and_a_recorded_one_accepted(rec):
    producer, consumer = _streams(rec)
    t = rec.made(torch.ones(4), producer)
    rec.wait_stream(consumer, producer)
    rec.compute(consumer, reads=[t])
    assert "never recorded" in _violations(rec)
    rec.record_stream(t, consumer)
    rec.check()


def test_a_dead_tensors_missing_record_is_still_reported_when_its_storage_is_registered_again(
        rec):
    producer, consumer = _streams(rec)
    t = rec.made(torch.ones(4), producer, label="first")
    rec.wait_stream(consumer, producer)
    rec.compute(consumer, reads=[t])
    rec.made(t, producer, label="second")  # as when a freed storage's address comes back
    assert "first was used on" in _violations(rec)


def test_memory_from_another_streams_pool_needs_that_streams_work_up_to_the_allocation(rec):
    stage, side = _streams(rec)
    early = rec.record_event(stage)
    rec.compute(stage, what="kernels that used a block now free")
    with rec.using(stage):
        block = rec.empty((4,), torch.float32, "cuda:0")  # from the stage's pool
    rec.wait_event(side, early)  # not enough: the stage's later kernels may still run
    rec.record_stream(block, side)
    with rec.using(side):
        rec.copy(block, rec.adopt(torch.ones(4), "host"))
    assert "allocated from" in _violations(rec)


def test_allocating_on_the_stream_that_writes_is_accepted(rec):
    stage, side = _streams(rec)
    rec.compute(stage, what="earlier work")
    with rec.using(side):
        block = rec.empty((4,), torch.float32, "cuda:0")
        rec.copy(block, rec.adopt(torch.ones(4), "host"))
    rec.wait_event(stage, rec.record_event(side))
    rec.record_stream(block, stage)
    rec.compute(stage, reads=[block])
    rec.check()


def test_a_write_racing_an_earlier_read_is_reported(rec):
    first, second = _streams(rec)
    buffer = rec.adopt(torch.zeros(4), "host buffer")  # outside the pools: data races only
    rec.compute(first, writes=[buffer])
    rec.wait_stream(second, first)
    rec.compute(second, reads=[buffer])
    rec.compute(first, writes=[buffer])  # overwrites while `second` may still read
    assert "overwrites host buffer before its read" in _violations(rec)


def test_the_host_seeing_an_event_complete_orders_later_work_after_it(rec):
    first, second = _streams(rec)
    buffer = rec.adopt(torch.zeros(4), "host buffer")
    rec.compute(first, writes=[buffer])
    rec.wait_stream(second, first)
    rec.compute(second, reads=[buffer])
    read = rec.record_event(second)
    rec.completed = False
    assert not rec.done(read)
    rec.compute(first, writes=[buffer])
    assert "overwrites" in _violations(rec)

    rec = RecordingStreams("cuda:0")
    first, second = _streams(rec)
    buffer = rec.adopt(torch.zeros(4), "host buffer")
    rec.compute(first, writes=[buffer])
    rec.wait_stream(second, first)
    rec.compute(second, reads=[buffer])
    assert rec.done(rec.record_event(second))  # the host saw the read complete
    rec.compute(first, writes=[buffer])
    rec.check()


def test_a_host_allocation_is_outside_the_pools_and_a_cpu_device_can_play_the_gpu():
    rec = RecordingStreams("cuda:0")
    host = rec.empty((2,), torch.float32, "cpu")
    side = rec.new_stream("cuda:0", "side")
    rec.compute(side, writes=[host])
    rec.check()  # host memory: no stream's pool, nothing to record

    rec = RecordingStreams("cpu")
    stage, side = rec.new_stream("cpu", "stage"), rec.new_stream("cpu", "side")
    rec.compute(stage, what="earlier work")
    with rec.using(stage):
        block = rec.empty((2,), torch.float32, "cpu")
    rec.compute(side, writes=[block])
    assert "allocated from" in _violations(rec)


def test_tracking_declares_a_real_modules_work_on_the_issuing_stream():
    rec = RecordingStreams("cpu")
    stage, other = rec.new_stream("cpu", "stage"), rec.new_stream("cpu", "other")
    layer = nn.Linear(4, 4)
    with rec.tracking():
        with rec.using(stage):
            out = torch.tanh(layer(torch.randn(2, 4)))
        with rec.using(other):
            out.sum()  # reads `out` without waiting for `stage`
    text = _violations(rec)
    assert "tanh" in text and "<stream other>" in text

    rec = RecordingStreams("cpu")
    stage, other = rec.new_stream("cpu", "stage"), rec.new_stream("cpu", "other")
    with rec.tracking():
        with rec.using(stage):
            out = torch.tanh(layer(torch.randn(2, 4)))
            view = out.t()  # a view touches no data
        rec.wait_event(other, rec.record_event(stage))
        rec.record_stream(out, other)
        with rec.using(other):
            view.sum()
            out.add_(1)  # in place: a write on `other`
    rec.check()
    writes = [entry for entry in rec.log if entry[:2] == ("op", "add_.Tensor")]
    assert writes and writes[0][2] is other


def test_the_backends_own_work_and_quiet_blocks_are_not_declared_twice():
    rec = RecordingStreams("cpu")
    stage = rec.new_stream("cpu", "stage")
    with rec.tracking(), rec.using(stage):
        with rec.quiet():
            torch.ones(3)
        block = rec.empty((3,), torch.float32, "cpu")
        rec.copy(block, torch.ones(3))
    ops = [entry[1] for entry in rec.log if entry[0] == "op"]
    assert ops.count("copy") == 1 and "copy_.default" not in ops
    assert ops.count("ones.default") == 1  # the second one, outside the quiet block
