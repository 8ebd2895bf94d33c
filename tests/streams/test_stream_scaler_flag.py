"""The loss scaler's agreement flag (fastpipe.streams.scaler_flag): made, gathered and reduced
on the rank's pipeline device, whatever the rank's gradients are on, even none; through the
seam with a recording backend, and through ``unscale_and_sync`` with a stand-in device (meta)
where a rank without gradients once put its flag on the CPU."""
import pytest
import torch
import torch.distributed as dist
from torch import nn

from fastpipe.policies import amp
from fastpipe.streams.scaler_flag import agreed_flag
from recording_streams import RecordingStreams

GPU = torch.device("cuda:1")


def test_the_flag_is_made_and_reduced_on_the_pipeline_device_under_its_guard():
    rec = RecordingStreams(GPU)
    reduced = []

    def reduce(flag):
        reduced.append((flag, rec.device, rec.alive(flag)))
        flag.fill_(1.0)  # another rank found an inf

    flag = agreed_flag([torch.zeros(()), torch.tensor(0.0)], GPU, reduce, backend=rec)
    (seen, device, tracked), = reduced
    assert seen is flag and device == GPU and tracked
    assert rec.devices_entered == [GPU]
    allocations = [e for e in rec.log if e[0] == "empty"]
    assert len(allocations) == 1 and allocations[0][2].device == GPU  # from the GPU's pool
    assert float(flag) == 1.0


def test_the_flag_is_the_largest_found_and_zero_without_gradients():
    assert float(agreed_flag([], torch.device("cpu"), lambda flag: None)) == 0.0
    found = [torch.zeros(()), torch.ones(()), torch.zeros(1)]
    assert float(agreed_flag(found, torch.device("cpu"), lambda flag: None)) == 1.0


class _Reduced:
    """``dist.all_reduce`` of one process: records where each reduced tensor lives."""

    def __init__(self):
        self.devices = []

    def __call__(self, tensor, op=None, group=None, async_op=False):
        self.devices.append(tensor.device)
        return self

    def wait(self, timeout=None):
        return True


def test_a_rank_without_gradients_reduces_on_its_pipeline_device(monkeypatch):
    reduced = _Reduced()
    monkeypatch.setattr(dist, "all_reduce", reduced)
    layer = nn.Linear(2, 2)  # its stage took no gradient this step
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    pipeline = torch.device("meta")  # stands for the rank's GPU
    amp.unscale_and_sync(scaler, optimizer, device=pipeline)
    assert reduced.devices == [pipeline]
    assert scaler._scale.device == pipeline  # the scale starts there too
    found = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
    assert list(found) == [pipeline]  # the verdict is recorded for scaler.step


def test_a_rank_with_gradients_keeps_their_verdict_on_the_pipeline_device(monkeypatch):
    reduced = _Reduced()
    monkeypatch.setattr(dist, "all_reduce", reduced)
    layer = nn.Linear(2, 2)
    layer.weight.grad = torch.full((2, 2), float("inf"))
    layer.bias.grad = torch.ones(2)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    scaler.scale(torch.ones(()))  # this rank scaled the loss: its scale is on the CPU
    amp.unscale_and_sync(scaler, optimizer, device=torch.device("cpu"))
    found = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
    assert reduced.devices == [torch.device("cpu")]
    assert [float(v) for v in found.values()] == [1.0]


def test_without_a_device_a_cpu_flag_on_an_nccl_group_is_refused(monkeypatch):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "all_reduce", _Reduced())
    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(ValueError, match="pass device="):
        amp.unscale_and_sync(scaler, optimizer)
    assert scaler._scale is None  # refused before any work
