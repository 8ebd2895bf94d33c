"""Which backend carries a device's tensors, which device a rank uses, which transport it runs:
process groups as users make them (no processes: the group's backend name is substituted)."""
import pytest
import torch
import torch.distributed as dist

from fastpipe.errors import ProcessGroupError
from fastpipe.runtime.transport import backends


class Group:
    """Stands for a process group: only its backend name and device backends are read."""

    def __init__(self, name, devices=("cpu",)):
        self.name, self.devices = name, devices

    def _get_backend(self, device):
        if device.type not in self.devices:
            raise RuntimeError(f"No backend type associated with device type {device.type}")
        return object()


@pytest.fixture(autouse=True)
def fake_dist(monkeypatch):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: group.name)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 3)


@pytest.mark.parametrize("name, devices, cpu, cuda", [
    ("gloo", (), "gloo", None),
    ("nccl", (), None, "nccl"),
    ("cpu:gloo,cuda:nccl", (), "gloo", "nccl"),
    ("undefined", ("cpu",), "gloo", None),  # init_process_group() on a machine without GPUs
    ("undefined", ("cpu", "cuda"), "gloo", "nccl"),  # ... and with them
])
def test_backend_of_each_device_type(name, devices, cpu, cuda):
    group = Group(name, devices)
    assert backends.backend_of(group, "cpu") == cpu
    assert backends.backend_of(group, "cuda") == cuda


def test_the_default_device_is_the_cpu_without_nccl_or_gpus():
    assert backends.resolve_device(None, Group("gloo")) == torch.device("cpu")
    assert backends.resolve_device(None, Group("undefined", ("cpu",))) == torch.device("cpu")


def test_a_device_the_group_cannot_carry_is_refused_naming_the_rank_and_the_fix():
    with pytest.raises(ProcessGroupError, match=r"rank 3: device='cuda:0'.*backend='nccl'"):
        backends.resolve_device("cuda:0", Group("gloo"))
    with pytest.raises(ProcessGroupError, match=r"no backend for cpu tensors.*'gloo'"):
        backends.resolve_device("cpu", Group("nccl"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU exists here")
def test_a_gpu_that_does_not_exist_is_refused():
    with pytest.raises(ProcessGroupError, match="does not exist on this machine"):
        backends.resolve_device("cuda:0", Group("nccl"))


def test_the_transport_follows_the_device():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert backends.resolve_p2p("auto", cpu, Group("gloo")) == "tagged"
    assert backends.resolve_p2p("auto", cuda, Group("nccl")) == "grouped"
    assert backends.resolve_p2p("grouped", cpu, Group("gloo")) == "grouped"
    with pytest.raises(ValueError, match="p2p='tagged' needs gloo"):
        backends.resolve_p2p("tagged", cuda, Group("cpu:gloo,cuda:nccl"))
    with pytest.raises(ValueError, match="p2p='fast' is not a transport"):
        backends.resolve_p2p("fast", cpu, Group("gloo"))


def test_ranks_that_disagree_are_refused_with_both_values():
    mine = backends.agreement(torch.device("cuda", 0), "grouped")
    other_gpu = backends.agreement(torch.device("cuda", 1), "grouped")
    backends.check_agreement(mine, {0: mine, 1: other_gpu}, me=0)  # itself, another GPU
    theirs = backends.agreement(torch.device("cpu"), "grouped")
    with pytest.raises(ProcessGroupError, match="disagree on device type: this rank has 'cuda', "
                                                "rank 1 has 'cpu'"):
        backends.check_agreement(mine, {0: mine, 1: theirs}, me=0)
    tagged = backends.agreement(torch.device("cpu"), "tagged")
    with pytest.raises(ProcessGroupError, match="disagree on p2p"):
        backends.check_agreement(theirs, {1: tagged}, me=0)


def test_two_ranks_on_one_gpu_are_refused():
    mine = backends.agreement(torch.device("cuda", 0), "grouped")
    with pytest.raises(ProcessGroupError, match="both run on .*/cuda:0: NCCL cannot put two"):
        backends.check_agreement(mine, {0: mine, 3: mine}, me=0)
