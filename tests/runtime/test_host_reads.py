"""Blocking reads of device buffers on the host, per step (``pipe.last_step.host_reads``).

The grouped transport sends headers and metadata on a gloo side channel (CPU tensors) and the
loss (and the count of ``(loss_sum, count)`` losses) as a tensor next to the payload, so its
host never reads a device buffer; the step's loss, token total and gradient division stay on
the device, and the close of a step reads once, only where the host must decide (the
non-finite check, clipping, a count tensor to check). The counter, the one read of the close,
the attached-loss header, the side channel's choice and a ``Pipe``'s steps without processes
(every conversion to a host value in a step is the counter's, or of a host tensor); every step
of runs on 2 gloo ranks in processes (hard time limit).
"""
import copy
import math
import os
import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fastpipe
from fastpipe.runtime.gradients import readout
from fastpipe.runtime.transport import backends
from fastpipe.runtime.transport.wire import (ATTACHED, COUNTED, HEADER_LEN, LOSS_DTYPES,
                                             Header, HostReads, attach, detach_attached)

from dist_launch import assert_all_ok, launch
from helpers import assert_same_grads, grads_of, mlp
from host_read_probe import raw_reads, unexplained

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_read_is_counted_on_any_device():
    reads = HostReads()
    assert torch.equal(reads.read(torch.arange(3)), torch.arange(3))
    assert reads.number(torch.tensor([2.5])) == 2.5
    assert reads.count == 2


def test_the_close_reads_all_its_facts_at_once_and_nothing_when_there_are_none():
    reads = HostReads()
    marks = torch.tensor([False, True, False, True])
    first = readout.first_marked(marks, [4, 7, 9, 11])
    none = readout.first_marked(torch.zeros(3, dtype=torch.bool), [0, 1, 2])
    assert reads.count == 0  # computed, not read
    values = readout.read_together([first, None, none, torch.tensor([2.5])], reads)
    assert values == [7.0, None, -1.0, 2.5] and reads.count == 1
    assert readout.read_together([None, None], reads) == [None, None] and reads.count == 1


@pytest.mark.parametrize("dtype", LOSS_DTYPES)
@pytest.mark.parametrize("count", [None, 0.0, 37.0, 2.0 ** 40])
def test_an_attached_part_brings_loss_and_count_back_exactly(dtype, count):
    loss = torch.tensor(-1.0 / 3.0, dtype=dtype)
    counted = None if count is None else torch.tensor(count)
    header = Header(1, 2, 0, 4, 8, 0, 64, 3, None, dtype, attached=True,
                    count_attached=counted is not None)
    decoded = Header.decode(header.encode())
    assert decoded == header
    part = attach(loss, counted)
    assert part.dtype == torch.uint8 and part.numel() == decoded.loss_nbytes
    value, back = detach_attached(decoded, part.clone())
    assert value.dtype == dtype and value.shape == () and torch.equal(value, loss)
    assert back is None if count is None else (back.dtype == torch.float64 and back == count)


def test_a_count_without_an_attached_loss_is_a_corrupt_header():
    raw = Header(1, 0, 0, 1, 1, 0, 0, 0, loss=math.pi).encode()
    raw[10] = COUNTED  # a count in a part that is not there
    with pytest.raises(ValueError, match="unknown loss dtype code"):
        Header.decode(raw)


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


def masked(seed):
    """Inputs, and targets with a mask of the positions that count (different counts per
    micro-batch)."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
    mask = (torch.rand(8, 4, generator=g) < 0.5).float()
    mask[0, 0] = 1.0
    return x, y, mask


def token_sum(output, targets):
    """``(loss_sum, count)``, the count a tensor (``mask.sum()``)."""
    y, mask = targets
    return ((output - y) ** 2 * mask).sum(), mask.sum()


def token_sum_int(output, targets):
    """The same, its count a number (the loss function read it: the caller's read)."""
    total, count = token_sum(output, targets)
    return total, int(count)


CLIP = 0.05  # below the norms here: every step clips

# (train_step settings, loss: 'mean' or a (loss_sum, count) function, reads per step)
PIPE_STEPS = [
    ({}, "mean", 1),  # nonfinite='raise': the close reads its check, once
    ({}, token_sum, 1),  # counts on the device: checked in the same read
    ({"nonfinite": "ignore"}, "mean", 0),  # nothing to decide: nothing read
    ({"nonfinite": "ignore"}, token_sum, 1),  # the count tensors' check
    ({"nonfinite": "ignore"}, token_sum_int, 0),  # numbers are checked as they come
    ({"nonfinite": "ignore", "max_grad_norm": CLIP}, "mean", 1),  # the norm terms
    ({"max_grad_norm": CLIP}, token_sum, 1),  # norm, check and counts: one read
]


@pytest.mark.parametrize("settings,loss,reads", PIPE_STEPS)
def test_a_pipe_step_reads_once_where_the_host_decides_and_is_exact(settings, loss, reads):
    """A ``Pipe``'s steps on CPU stages count what the same code reads on GPUs, and every
    conversion to a host value its code makes is the counter's or of a host tensor."""
    model = mlp(depth=6)
    plain = copy.deepcopy(model)
    pipe = fastpipe.Pipe(model, chunks=4, devices=["cpu"] * 2)
    counts = []
    with raw_reads() as found:
        for seed in range(3):
            x, y, mask = masked(seed)
            plain.zero_grad(set_to_none=True)
            if loss == "mean":
                expected = nn.functional.mse_loss(plain(x), y)
            else:
                expected = token_sum(plain(x), (y, mask))[0] / mask.sum()
            expected.backward()
            if "max_grad_norm" in settings:
                norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), CLIP)
                assert norm > CLIP
            pipe.zero_grad(set_to_none=True)
            got = pipe.train_step(x, y if loss == "mean" else (y, mask),
                                  nn.functional.mse_loss if loss == "mean" else loss,
                                  **settings)
            torch.testing.assert_close(got, expected.detach(), rtol=1e-5, atol=1e-7)
            assert_same_grads(grads_of(model), grads_of(plain))
            counts.append(pipe.last_step.host_reads)
    assert counts == [reads] * 3
    assert unexplained(found) == {}


@pytest.mark.parametrize("nonfinite,reads", [("raise", 2 * 4 + 1), ("ignore", 0)])
def test_pipedream_reads_once_per_update_it_checks(nonfinite, reads):
    """PipeDream checks each stage's gradients before each micro-batch's update: one read of
    all of them per update (2 stages x 4 micro-batches), and the close's check of the losses."""
    pipe = fastpipe.Pipe(mlp(depth=6), chunks=4, devices=["cpu"] * 2, schedule="pipedream")
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.01)
    for seed in range(2):
        x, y, _ = masked(seed)
        pipe.train_step(x, y, nn.functional.mse_loss, optimizer=optimizer,
                        nonfinite=nonfinite)
        assert pipe.last_step.host_reads == reads


def test_pipedream_names_the_first_non_finite_gradient_from_its_one_read():
    """Every gradient of the bad micro-batch is NaN: the stage whose update meets it first
    raises, naming its first parameter (layer 0, or layer 4 = the second stage's module 1)."""
    pipe = fastpipe.Pipe(mlp(depth=6), chunks=2, devices=["cpu"] * 2, schedule="pipedream",
                         balance=[3, 3])
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.01)
    x, y, _ = masked(0)
    y[5] = math.inf  # the second micro-batch's loss and gradients
    with pytest.raises(fastpipe.NonFiniteError, match="micro-batch 1") as caught:
        pipe.train_step(x, y, nn.functional.mse_loss, optimizer=optimizer)
    assert caught.value.parameter == {0: "0.weight", 1: "1.weight"}[caught.value.stage]


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
def test_each_grouped_step_reads_once_where_the_host_decides_and_every_step_is_exact():
    """2 ranks, 7 exact steps per setting: repeated sizes, a new batch size, a new sequence
    length. The grouped transport reads nothing on the host, the loss and the counts of
    ``(loss_sum, count)`` losses stay on the device: a step reads only at its close, once,
    where the host must decide. ``nonfinite='raise'`` (the default) must raise in this call on
    every rank for a non-finite loss or gradient, so every rank reads its check (and norm
    terms: clipping shares the read); with nonfinite='ignore' nothing is read, but for the
    count tensors the last stage checks. The tagged transport reads every header, so the
    counter counts the transport's reads too."""
    results = assert_all_ok(launch("host_reads", 2, limit=180))
    assert [r["last"] for r in results] == [False, True]
    for rank, reads in enumerate(results):
        for name in ("default", "tokens", "clip", "clip tokens"):
            assert reads[f"grouped {name}"] == [1] * 7, (rank, name, reads)
        assert reads["grouped ignore"] == [0] * 7, (rank, reads)
        assert reads["grouped ignore tokens"] == [int(reads["last"])] * 7, (rank, reads)
        assert all(n > 1 for n in reads["tagged default"]), (rank, reads)
        assert all(found == {} for found in reads["unexplained"].values()), (rank, reads)
    first, steady = results[1]["tagged default"][0], results[1]["tagged default"][1]
    assert first > steady  # the metadata of a new shape comes once, and is read
