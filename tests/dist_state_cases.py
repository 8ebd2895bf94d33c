"""Distributed cases: state dicts across processes.

torch.distributed.checkpoint round trips between layouts, state dicts gathered from every rank
and resumed on another layout, and models built on the meta device or from layer factories
that take the plain model's state dict.
"""
from __future__ import annotations

from typing import Any, Dict, List

import torch
import torch.distributed as dist
from dist_common import TOL, DistributedPipe, check_grads, data, model, reference_grads
from torch import nn

import fastpipe


def dcp_round_trip(path: str) -> Dict:
    """torch.distributed.checkpoint: a DistributedPipe's state (its own names, this rank's
    share) saved at one layout loads at another, and into the plain model in one process."""
    import torch.distributed.checkpoint as dcp
    torch.manual_seed(1)
    plain = model()
    pipe = DistributedPipe(model(), chunks=2, timeout=30)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.5)
    pipe.train_step(*data(6), nn.functional.mse_loss, optimizer=optimizer)  # weights moved
    dcp.save(pipe.state_dict(), checkpoint_id=path)
    other = DistributedPipe(model(), chunks=2, schedule="interleaved", virtual_stages=2,
                            timeout=30)
    state = other.state_dict()
    dcp.load(state, checkpoint_id=path)
    other.load_state_dict(state)
    dist.barrier()
    whole = plain.state_dict()
    dcp.load(whole, checkpoint_id=path, no_dist=True)  # the plain model, in this process alone
    plain.load_state_dict(whole)
    mine = dict(pipe.named_parameters())
    for name, p in other.named_parameters():
        if name in mine:
            torch.testing.assert_close(p, mine[name], rtol=0, atol=0)
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(plain.get_parameter(name), p, rtol=0, atol=0)
    return {"loaded": sorted(n for n, _ in other.named_parameters())}


def checkpoint_across_layouts() -> Dict:
    """Train on one layout, gather every rank's state dict (plain names), resume on another
    layout and in the plain model: the next step's loss is the same everywhere."""
    pipe = DistributedPipe(model(), chunks=3, balance=[4, 4], timeout=30)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    for step in range(2):
        x, y = data(9, seed=step)
        opt.zero_grad()
        pipe.train_step(x, y, nn.functional.mse_loss, optimizer=opt)
    parts: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, {k: v.clone() for k, v in pipe.state_dict().items()})
    merged = {k: v for part in parts for k, v in part.items()}
    plain = model()
    plain.load_state_dict(merged)  # strict: the pieces make exactly the plain model's keys
    other = DistributedPipe(model(), chunks=2, balance=[2, 6], timeout=30)
    other.load_state_dict(merged)
    x, y = data(9, seed=99)
    expected = nn.functional.mse_loss(plain(x), y)
    for label, resumed in (("same layout", pipe), ("other layout", other)):
        loss = resumed.train_step(x, y, nn.functional.mse_loss)
        torch.testing.assert_close(loss, expected.detach(), **TOL,
                                   msg=lambda m: f"{label}: {m}")
    return {"keys": len(merged)}


def meta_and_factories() -> Dict:
    """A model built on the meta device, or from layer factories, is materialised per rank;
    after loading the plain state dict the step is exact; state_dict uses plain names."""
    plain = model()
    x, y = data(9)
    ref_loss, ref = reference_grads(plain, x, y)
    with torch.device("meta"):
        on_meta = model()
    factories = [lambda i=i: model()[i] for i in range(8)]
    try:  # a device the process group cannot carry is refused before anything is built
        DistributedPipe(model(), chunks=2, device="cuda")
        raise AssertionError("device='cuda' was accepted on a gloo group")
    except fastpipe.errors.ProcessGroupError as error:
        assert "no backend for cuda tensors" in str(error), error
    out = {}
    for label, source in (("meta", on_meta), ("factories", factories)):
        pipe = DistributedPipe(source, chunks=3, balance=[4, 4], timeout=30)
        assert all(p.device.type == "cpu" for p in pipe.parameters()), label
        pipe.load_state_dict(plain.state_dict())
        keys = sorted(pipe.state_dict())
        loss = pipe.train_step(x, y, nn.functional.mse_loss)
        torch.testing.assert_close(loss, ref_loss, **TOL)
        check_grads(pipe, ref, label)
        out[label] = keys
    return out
