"""Casting and compiling a DistributedPipe, run by every rank of a gloo group
(``dist_launch.launch(..., script='cast_compile_cases.py')``): each case builds the plain model
with the same seed on every rank and compares the pipe's loss and gradients with it.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Dict, List

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dist_common import (TOL, DistributedPipe, check_grads, data, main, model,  # noqa: E402
                         tied_model)

AOT_EAGER = {"backend": "aot_eager"}  # eager kernels: exact, and quick to compile


def _train(pipe: nn.Module, plain: nn.Module, batch: int, dtype: torch.dtype, where: str,
           wide_targets: bool = False) -> None:
    """One step of the pipe against the plain model (both in ``dtype``)."""
    x, y = data(batch)
    if wide_targets:
        y = torch.cat([y, y], 1)
    x, y = x.to(dtype), y.to(dtype)
    plain.zero_grad(set_to_none=True)
    pipe.zero_grad(set_to_none=True)
    loss_ref = nn.functional.mse_loss(plain(x), y)
    loss_ref.backward()
    expected = {n: p.grad.clone() for n, p in plain.named_parameters(remove_duplicate=False)}
    loss = pipe.train_step(x, y, nn.functional.mse_loss)
    assert loss.dtype == dtype, f"{where}: the loss is {loss.dtype}"
    torch.testing.assert_close(loss, loss_ref.detach(), **TOL)
    check_grads(pipe, expected, where)


def casting(schedule: str = "1f1b") -> Dict:
    """A step in float32, then ``to(torch.float64)`` (and the other cast spellings) and steps
    in float64, tied weights across ranks included; moves to another device are refused with
    the layers untouched."""
    refused: List[str] = []
    for tied in (False, True):
        plain = tied_model() if tied else model()
        pipe = DistributedPipe(tied_model() if tied else model(), chunks=3, schedule=schedule,
                               timeout=60)
        _train(pipe, plain, 7, torch.float32, f"tied={tied} float32", wide_targets=tied)
        params = list(pipe.parameters())
        for move in (lambda: pipe.to("meta"), lambda: pipe.to("cuda", torch.float64),
                     lambda: pipe.cuda(), lambda: pipe.to(torch.ones(1, device="meta"))):
            try:
                move()
            except TypeError as error:
                assert "cannot be moved" in str(error), error
                refused.append(type(error).__name__)
            else:
                raise AssertionError("a move to another device was accepted")
        assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in params)
        assert pipe.to(torch.float64) is pipe and pipe.to("cpu", torch.float64) is pipe
        plain.double()
        now = list(pipe.parameters())  # the same Parameters, cast in place
        assert len(now) == len(params) and all(a is b for a, b in zip(now, params))
        assert all(p.dtype == torch.float64 for p in pipe.parameters())
        _train(pipe, plain, 7, torch.float64, f"tied={tied} float64", wide_targets=tied)
        pipe.to("cpu", dtype=torch.float32)
        plain.float()
        _train(pipe, plain, 5, torch.float32, f"tied={tied} back to float32",
               wide_targets=tied)
    return {"refused": refused}


def compiling(schedules: List[List[Any]]) -> Dict:
    """``compile=`` and models in ``torch.compile`` (as a whole, or a submodule): plain names,
    state dicts that load into the plain model, and the plain model's loss and gradients on
    each (schedule, checkpoint)."""
    names = [n for n, _ in model().named_parameters()]
    for schedule, checkpoint in schedules:
        plain = model()
        pipe = DistributedPipe(model(), chunks=3, schedule=schedule, checkpoint=checkpoint,
                               compile=AOT_EAGER, timeout=60)
        assert [s.compiled for s in pipe._stages if hasattr(s, "compiled")] == [True]
        for step in range(2):
            _train(pipe, plain, 7 - 2 * step, torch.float32, f"{schedule}/{checkpoint}")
    whole = DistributedPipe(torch.compile(model(), **AOT_EAGER), chunks=2, timeout=60)
    part = model()
    part[1] = torch.compile(part[1], **AOT_EAGER)
    inner = DistributedPipe(part, chunks=2, timeout=60)
    for pipe in (whole, inner):
        local = [n for n, _ in pipe.named_parameters()]
        assert local and all(n in names for n in local), local
        state = pipe.state_dict()
        assert all("_orig_mod" not in k for k in state), list(state)
        loaded = model()
        with torch.no_grad():
            for p in loaded.parameters():
                p.add_(1.0)
        loaded.load_state_dict(state, strict=False)  # this rank's share, into the plain model
        plain_state = loaded.state_dict()
        for key, value in state.items():
            torch.testing.assert_close(plain_state[key], value, rtol=0, atol=0)
        _train(pipe, model(), 6, torch.float32, "compiled model")
    return {"ranks": dist.get_world_size(), "names": [n for n, _ in inner.named_parameters()]}


def compile_errors() -> Dict:
    """Bad ``compile`` values and combinations fail before any work, on every rank alike."""
    errors = []
    for bad, kwargs in (({"bakend": "eager"}, {}), ("yes", {}),
                        ({"backend": "no-such-backend"}, {}),
                        (True, {"checkpoint": "selective"})):
        try:
            DistributedPipe(model(), chunks=2, compile=bad, timeout=60, **kwargs)
        except (TypeError, ValueError, NotImplementedError) as error:
            assert "compile" in str(error), error
            errors.append(type(error).__name__)
    return {"errors": errors}


def several(cases: List[List[Any]]) -> Dict:
    """Several cases in the same processes (saves a start-up per case), each result kept."""
    return {name: CASES[name](**args) for name, args in cases}


CASES = {f.__name__: f for f in (casting, compiling, compile_errors, several)}

if __name__ == "__main__":
    main(CASES)
