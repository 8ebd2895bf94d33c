"""Blocking reads of device buffers on the host, per step (``pipe.last_step.host_reads``).

The grouped transport sends headers and metadata on a gloo side channel (CPU tensors) and the
loss as a tensor next to the payload, so its host never reads a device buffer: on a GPU it runs
ahead of the device. The counter itself, the attached-loss header, the side channel's choice
without processes; every step of a run on 2 gloo ranks in processes (hard time limit).
"""
import math
import os
import re

import pytest
import torch
import torch.distributed as dist

from fastpipe.runtime.transport import backends
from fastpipe.runtime.transport.wire import (ATTACHED, HEADER_LEN, LOSS_DTYPES, Header,
                                             HostReads)

from dist_launch import assert_all_ok, launch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_read_is_counted_on_any_device():
    reads = HostReads()
    assert torch.equal(reads.read(torch.arange(3)), torch.arange(3))
    assert reads.number(torch.tensor([2.5])) == 2.5
    assert reads.count == 2


@pytest.mark.parametrize("dtype", LOSS_DTYPES)
def test_a_header_says_an_attached_loss_and_its_dtype_without_its_value(dtype):
    header = Header(1, 3, 0, 4, 8, 0, 64, 2, None, dtype, 5.0, attached=True)
    decoded = Header.decode(header.encode())
    assert decoded == header and decoded.loss is None and decoded.loss_nbytes == dtype.itemsize
    plain = Header.decode(Header(1, 3, 0, 4, 8, 0, 64, 2, loss=0.5, loss_dtype=dtype).encode())
    assert not plain.attached and plain.loss == 0.5 and plain.loss_nbytes == 0
    assert Header.decode(Header(0, 0, 0, 1, 1, 0, 0, 0).encode()).loss_nbytes == 0


@pytest.mark.parametrize("code", [len(LOSS_DTYPES), ATTACHED + len(LOSS_DTYPES), 2 * ATTACHED,
                                  -1, -ATTACHED])
def test_an_unknown_loss_code_is_a_corrupt_header(code):
    raw = Header(1, 0, 0, 1, 1, 0, 0, 0, loss=math.pi).encode()
    raw[10] = code
    assert raw.numel() == HEADER_LEN
    with pytest.raises(ValueError, match="unknown loss dtype code"):
        Header.decode(raw)


@pytest.mark.parametrize("path", ["fastpipe/runtime/transport/grouped.py",
                                  "fastpipe/runtime/grouped_executor.py"])
def test_the_grouped_transport_reads_no_device_buffer_on_the_host(path):
    """Its host waits only for side-channel works: no ``.cpu()``, ``.item()``, ``.tolist()``
    or number of a tensor anywhere in it (a read would go through HostReads, and count)."""
    with open(os.path.join(ROOT, path)) as f:
        source = f.read()
    found = re.findall(r"\.(?:cpu|item|tolist)\(|\b(?:float|int|bool)\(", source)
    assert found == [], f"{path} reads on the host: {found}"


class Group:
    """Stands for a process group: only its backend name is read."""

    def __init__(self, name):
        self.name = name


def test_the_side_channel_is_the_group_itself_when_it_has_gloo(monkeypatch):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: group.name)
    made = []
    monkeypatch.setattr(dist, "new_group", lambda *a, **k: made.append((a, k)) or "gloo twin")
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda group: [2, 5])
    for name in ("gloo", "cpu:gloo,cuda:nccl"):
        group = Group(name)
        assert backends.side_channel(group) is group
    nccl = Group("nccl")
    assert backends.side_channel(nccl) == "gloo twin" == backends.side_channel(nccl)
    assert made == [(([2, 5],), {"backend": "gloo", "use_local_synchronization": True})]


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                    reason="needs torch.distributed with gloo")
def test_no_host_read_on_any_grouped_step_and_every_step_exact():
    """2 ranks, 7 exact steps: repeated sizes, a new batch size, a new sequence length. The
    grouped transport reads nothing on the host; the tagged one reads every header (and the
    first rank's losses it forwards), so the counter counts."""
    results = assert_all_ok(launch("host_reads", 2, limit=120))
    for rank, reads in enumerate(results):
        assert reads["grouped"] == [0] * 7, (rank, reads)
        assert all(n > 0 for n in reads["tagged"]), (rank, reads)
    first, steady = results[1]["tagged"][0], results[1]["tagged"][1]
    assert first > steady  # the metadata of a new shape comes once, and is read
