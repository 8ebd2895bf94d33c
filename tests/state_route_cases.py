"""Every state-dict route of the one-process front doors, saved by one process and loaded by
another (``dist_launch.launch(..., script="state_route_cases.py")`` with one rank; the second
launch is the new process).

The front doors: ``Pipe`` (a Sequential with a tied weight), torchgpipe's ``GPipe`` and a
traced ``Pipe`` (a module cut at split points, its head tied to its input layer), each at a
saving layout and another one; and the plain model. The routes: torch's
``get_state_dict`` / ``set_state_dict`` with default options (the optimizer state nested) and
with ``flatten_optimizer_state_dict=True``, both through ``torch.distributed.checkpoint``;
``fastpipe.checkpoint``; the process's own ``state_dict()``s with ``torch.save``. Each load
trains 3 more steps and compares the parameters and the optimizer state (Adam's moments and
step) with the uninterrupted 6 steps: bit for bit at the saving layout, within fp32 tolerance
at another layout and from the plain model.
"""
from __future__ import annotations

import os
import sys
import warnings
from typing import Any, Callable, Dict, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_state_dict)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fastpipe  # noqa: E402
from dist_common import main  # noqa: E402
from fastpipe import checkpoint as ckpt  # noqa: E402

WIDTH, BATCH = 8, 12
TOL = dict(rtol=1e-5, atol=1e-6)
EXACT = dict(rtol=0, atol=0)
ROUTES = ("nested", "flat", "fastpipe", "torch_save")
KINDS = ("Pipe", "GPipe", "traced")


# ------------------------------------------------------------------------------ models
def sequential() -> nn.Sequential:
    """6 layers, the first and the last sharing one weight."""
    torch.manual_seed(1234)
    m = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
                      nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH))
    m[5].weight = m[0].weight
    return m


class Net(nn.Module):
    """Not a Sequential (traced at split points), its head tied to its input layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1234)
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())
                                    for _ in range(4))
        self.head = nn.Linear(WIDTH, WIDTH)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def batch(step: int) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)


def plain_of(kind: str) -> nn.Module:
    return Net() if kind == "traced" else sequential()


def pipe_of(kind: str, layout: str) -> nn.Module:
    """``kind`` at the saving layout (``'saved'``) or another one (``'other'``)."""
    other = layout == "other"
    if kind == "Pipe":
        return fastpipe.Pipe(sequential(), chunks=3, devices=["cpu"] * (3 if other else 2),
                             balance=[2, 2, 2] if other else [3, 3],
                             schedule="1f1b" if other else "gpipe")
    if kind == "GPipe":
        return fastpipe.GPipe(sequential(), [2, 4] if other else [3, 3],
                              devices=["cpu"] * 2, chunks=2 if other else 3)
    return fastpipe.Pipe(Net(), chunks=2, devices=["cpu"] * (3 if other else 2),
                         split_points=["blocks.1", "blocks.3"] if other else ["blocks.2"],
                         example_inputs=batch(0)[0], schedule="1f1b" if other else "gpipe")


def optimizer_of(m: nn.Module) -> Tuple[torch.optim.Optimizer, Any]:
    opt = torch.optim.AdamW(m.parameters(), lr=0.05)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def train(m: nn.Module, opt: Any, sched: Any, start: int, stop: int) -> None:
    for step in range(start, stop):
        x, y = batch(step)
        opt.zero_grad(set_to_none=True)
        if isinstance(m, fastpipe.Pipe):
            m.train_step(x, y, nn.functional.mse_loss)
        else:
            nn.functional.mse_loss(m(x), y).backward()
        opt.step()
        sched.step()


def recorded(m: nn.Module, opt: torch.optim.Optimizer) -> Dict[str, torch.Tensor]:
    """Parameters and optimizer state by plain name."""
    out = {n: p.detach().clone() for n, p in m.named_parameters()}
    for name, p in m.named_parameters():
        for key, value in opt.state[p].items():
            out[f"optim.{name}.{key}"] = value.detach().clone()
    return out


def compare(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor], where: str,
            tol: Dict[str, float]) -> int:
    assert got.keys() == want.keys(), (where, sorted(set(got) ^ set(want)))
    for name in got:
        torch.testing.assert_close(got[name], want[name], **tol,
                                   msg=lambda m: f"{where}: {name}: {m}")
    return len(got)


# ------------------------------------------------------------------------------ the routes
def save_route(route: str, m: nn.Module, opt: Any, sched: Any, where: str) -> None:
    if route == "fastpipe":
        ckpt.save(where, m, opt, sched)
        return
    if route == "torch_save":
        torch.save({"model": m.state_dict(), "optim": opt.state_dict(),
                    "sched": sched.state_dict()}, where + ".pt")
        return
    options = StateDictOptions(flatten_optimizer_state_dict=route == "flat")
    model_sd, optim_sd = get_state_dict(m, opt, options=options)
    dcp.save({"model": model_sd, "optim": optim_sd, "sched": sched.state_dict()},
             checkpoint_id=where)


def load_route(route: str, m: nn.Module, opt: Any, sched: Any, where: str) -> None:
    if route == "fastpipe":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ckpt.RngNotRestoredWarning)
            ckpt.load(where, m, opt, sched)
        return
    if route == "torch_save":
        saved = torch.load(where + ".pt", weights_only=True)
        m.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optim"])
        sched.load_state_dict(saved["sched"])
        return
    options = StateDictOptions(flatten_optimizer_state_dict=route == "flat")
    model_sd, optim_sd = get_state_dict(m, opt, options=options)  # the template
    state = {"model": model_sd, "optim": optim_sd, "sched": sched.state_dict()}
    dcp.load(state, checkpoint_id=where)
    set_state_dict(m, opt, model_state_dict=model_sd, optim_state_dict=optim_sd,
                   options=options)
    sched.load_state_dict(state["sched"])


# ------------------------------------------------------------------------------ the cases
def routes_save(path: str) -> Dict:
    """Each front door at its saving layout and the plain models: 3 steps, saved by every
    route, 3 more steps recorded."""
    made: Dict[str, int] = {}
    for kind in (*KINDS, "plain-Sequential", "plain-traced"):
        m = plain_of(kind.split("-")[1]) if kind.startswith("plain") else pipe_of(kind, "saved")
        opt, sched = optimizer_of(m)
        train(m, opt, sched, 0, 3)
        for route in ROUTES:
            save_route(route, m, opt, sched, os.path.join(path, f"{kind}-{route}"))
        train(m, opt, sched, 3, 6)
        torch.save(recorded(m, opt), os.path.join(path, f"{kind}-uninterrupted.pt"))
        made[kind] = len(ROUTES)
    return made


def routes_load(path: str) -> Dict:
    """Every (front door, route, layout) and every plain-model route into every front door:
    new pipes, the load, 3 more steps, compared with the uninterrupted run."""
    checked: Dict[str, int] = {}

    def resume(kind: str, layout: str, route: str, source: str, tol: Dict[str, float],
               want: Callable[[], Dict[str, torch.Tensor]]) -> None:
        m = pipe_of(kind, layout)
        opt, sched = optimizer_of(m)
        load_route(route, m, opt, sched, os.path.join(path, f"{source}-{route}"))
        train(m, opt, sched, 3, 6)
        where = f"{source} -> {kind} at the {layout} layout by {route}"
        checked[where] = compare(recorded(m, opt), want(), where, tol)

    def uninterrupted(source: str) -> Callable[[], Dict[str, torch.Tensor]]:
        return lambda: torch.load(os.path.join(path, f"{source}-uninterrupted.pt"))

    for kind in KINDS:
        plain = "plain-traced" if kind == "traced" else "plain-Sequential"
        for route in ROUTES:
            resume(kind, "saved", route, kind, EXACT, uninterrupted(kind))
            resume(kind, "other", route, kind, TOL, uninterrupted(plain))
            resume(kind, "saved", route, plain, TOL, uninterrupted(plain))
    return checked


CASES = {f.__name__: f for f in (routes_save, routes_load)}

if __name__ == "__main__":
    main(CASES)
