"""Activation offload's stream protocol (fastpipe.streams.offload_copies), driven through a real
StageOffloader saving a real module's activations under autograd, on a pretend GPU: the CPU
plays the device, its streams and allocator pools are RecordingStreams', and every tensor
operation of the forward and backward is declared on the stage's stream."""
import copy

import pytest
import torch
from torch import nn

from fastpipe.ops.pinned_pool import ReferencePool
from fastpipe.policies.offload import StageOffloader
from fastpipe.streams.offload_copies import OffloadCopies
from recording_streams import RecordingStreams

CPU = torch.device("cpu")


class _HostPool:
    """The offloader's host buffers, declared to the fake as host memory (outside the pools)."""

    def __init__(self, rec):
        self.rec, self.pool = rec, ReferencePool(pinned=False)

    def acquire(self, nbytes):
        with self.rec.quiet():
            buffer = self.pool.acquire(nbytes)
        if not self.rec.alive(buffer):
            self.rec.adopt(buffer, f"host buffer {len(self.rec.log)}")
        return buffer

    def release(self, buffer):
        self.pool.release(buffer)

    def stats(self):
        return self.pool.stats()


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.GELU(),
                         nn.Linear(32, 4))


def _offloader(rec):
    return StageOffloader(CPU, copies=OffloadCopies(CPU, backend=rec), pool=_HostPool(rec))


def _one_f_one_b(model, inputs, offloader=None, rec=None, stage=None):
    """A stage's 1F1B order, F0 F1 B0 F2 B1 B2, each backward starting with the prefetch (as
    the step's backward handler does); returns the weight gradients."""
    losses = {}

    def forward(mb):
        keep = [*model.parameters(), inputs[mb]]
        saving = offloader.saving(mb, keep) if offloader else torch.enable_grad()
        with saving:
            losses[mb] = model(inputs[mb]).square().sum()

    def backward(mb):
        if offloader:
            offloader.prefetch(mb)
        losses.pop(mb).backward()

    def run():
        for kind, mb in [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)]:
            (forward if kind == "F" else backward)(mb)

    if rec is None:
        run()
    else:
        with rec.tracking(), rec.using(stage):
            run()
    return [p.grad.clone() for p in model.parameters()]


def _ops_on(rec, stream, what):
    return [e for e in rec.log if e[0] == "op" and e[1] == what and e[2] is stream]


def test_offload_copies_keep_the_stream_protocol_and_gradients_exact():
    inputs = [torch.randn(4, 8) for _ in range(3)]
    expected = _one_f_one_b(_model(), inputs)
    rec = RecordingStreams("cpu")
    stage = rec.new_stream("cpu", "stage")
    offloader = _offloader(rec)
    grads = _one_f_one_b(_model(), inputs, offloader, rec, stage)
    rec.check()
    for got, want in zip(grads, expected):
        assert torch.equal(got, want)
    copies = offloader.copies
    assert len(_ops_on(rec, copies.out_stream, "copy")) >= 12  # 4 saved per micro-batch
    assert len(_ops_on(rec, copies.in_stream, "copy")) == len(
        _ops_on(rec, copies.out_stream, "copy"))
    assert offloader.pending == {}


def test_the_prefetch_destination_comes_from_the_in_streams_pool():
    """The stage's pool may hold blocks the previous backward just freed while its kernels
    are still queued; the in-stream is not ordered after them, so it allocates from its own."""
    rec = RecordingStreams("cpu")
    stage = rec.new_stream("cpu", "stage")
    offloader = _offloader(rec)
    _one_f_one_b(_model(), [torch.randn(4, 8) for _ in range(3)], offloader, rec, stage)
    allocations = [e for e in rec.log if e[0] == "empty"]
    assert allocations and all(e[2] is offloader.copies.in_stream for e in allocations)


def test_a_retained_graph_unpacks_twice_in_order():
    rec = RecordingStreams("cpu")
    stage = rec.new_stream("cpu", "stage")
    offloader = _offloader(rec)
    model = _model()
    x = torch.randn(4, 8, requires_grad=True)
    plain = copy.deepcopy(model)
    with rec.tracking(), rec.using(stage):
        with offloader.saving(0, [*model.parameters(), x]):
            out = model(x).sum()
        rec.compute(stage, what="other work queued on the stage")
        offloader.prefetch(0)
        (gx,) = torch.autograd.grad(out, [x], retain_graph=True)
        (gw,) = torch.autograd.grad(out, [model[0].weight])
    rec.check()
    ex, ew = torch.autograd.grad(plain(x).sum(), [x, plain[0].weight])
    assert torch.equal(gx, ex) and torch.equal(gw, ew)


@pytest.mark.parametrize("completed", [False, True], ids=["pending", "seen-complete"])
def test_host_buffers_are_reused_only_after_the_host_saw_their_copies_complete(completed):
    rec = RecordingStreams("cpu")
    rec.completed = completed  # what the host learns when it polls a copy's event
    stage = rec.new_stream("cpu", "stage")
    offloader = _offloader(rec)
    model = _model()
    x0, x1 = torch.randn(4, 8), torch.randn(4, 8)
    keep = [*model.parameters(), x0, x1]
    with rec.tracking(), rec.using(stage):
        with offloader.saving(0, keep):
            loss0 = model(x0).sum()
        offloader.prefetch(0)  # the copies back read micro-batch 0's host buffers
        allocated = offloader.pool_stats()[2]
        with offloader.saving(1, keep):  # the same sizes again: reuse if they are free
            loss1 = model(x1).sum()
        offloader.prefetch(1)
        (loss0 + loss1).backward()
    rec.check()
    assert (offloader.pool_stats()[2] == allocated) == completed
