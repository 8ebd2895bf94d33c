"""Checkpoints that resume exactly, at any layout (``fastpipe.checkpoint`` and torch's
``get_state_dict`` / ``set_state_dict`` on the pipes).

Train 3 steps with AdamW, an LR scheduler and dropout, save, build new pipes, load, train 3
more: bit for bit the 6 uninterrupted steps at the same layout, within fp32 tolerance at
another (a ``Pipe`` of another balance, the plain model, and back). Across processes:
``checkpoint_cases.py`` (2 and 4 gloo ranks, two launches each: the second loads in new
processes). Bad input raises a typed error naming what is wrong, before anything changes.
"""
from __future__ import annotations

import copy
import os
import warnings
from collections import OrderedDict
from typing import Any, Dict, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_state_dict)

import fastpipe
from fastpipe import checkpoint as ckpt
from fastpipe.checkpoint import directory as folder
from fastpipe.parallel import optimizer_names

import checkpoint_cases
from dist_launch import assert_all_ok, launch

TOL = dict(rtol=1e-5, atol=1e-6)
EXACT = dict(rtol=0, atol=0)
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def model(dropout: float = 0.0, last: int = 8) -> nn.Sequential:
    """6 layers, the first and the last sharing one weight."""
    torch.manual_seed(1234)
    m = nn.Sequential(nn.Linear(8, 8), nn.Dropout(dropout), nn.Tanh(), nn.Linear(8, 8),
                      nn.Tanh(), nn.Linear(8, last))
    if last == 8:
        m[5].weight = m[0].weight
    return m


def batch(step: int) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(12, 8, generator=g), torch.randn(12, 8, generator=g)


def optimizer_of(m: nn.Module) -> Tuple[torch.optim.Optimizer, Any]:
    opt = torch.optim.AdamW(m.parameters(), lr=0.05)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def pipe_of(kind: str, m: nn.Module) -> nn.Module:
    if kind == "plain":
        return m
    if kind == "GPipe":
        return fastpipe.GPipe(m, [3, 3], devices=["cpu"] * 2, chunks=3)
    if kind == "Pipe-3":
        return fastpipe.Pipe(m, chunks=2, balance=[2, 2, 2], devices=["cpu"] * 3,
                             schedule="1f1b")
    return fastpipe.Pipe(m, chunks=3, balance=[3, 3], devices=["cpu"] * 2)


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


def params(m: nn.Module) -> Dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in m.named_parameters()}


def same(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor], **tol: Any) -> None:
    assert got.keys() == want.keys()
    for name in got:
        torch.testing.assert_close(got[name], want[name], **tol, msg=lambda m: f"{name}: {m}")


def uninterrupted(kind: str, dropout: float) -> Dict[str, torch.Tensor]:
    m = pipe_of(kind, model(dropout))
    opt, sched = optimizer_of(m)
    torch.manual_seed(7)
    train(m, opt, sched, 0, 6)
    return params(m)


def saved(tmp_path: Any, kind: str, dropout: float = 0.0, steps: int = 3) -> str:
    m = pipe_of(kind, model(dropout))
    opt, sched = optimizer_of(m)
    torch.manual_seed(7)
    train(m, opt, sched, 0, steps)
    return ckpt.save(tmp_path / "ckpt" / f"step-{steps}", m, opt, sched, extra={"step": steps})


def resumed(path: str, kind: str, dropout: float = 0.0) -> Tuple[Dict[str, torch.Tensor], Any]:
    torch.manual_seed(999)  # what the new process drew: the load restores the saved state
    m = pipe_of(kind, model(dropout))
    opt, sched = optimizer_of(m)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        extra = ckpt.load(path, m, opt, sched)
    assert extra == {"step": 3}
    train(m, opt, sched, 3, 6)
    return params(m), [w.category for w in caught]


# ------------------------------------------------------------------------------ resume
@pytest.mark.parametrize("kind", ["Pipe", "GPipe", "plain"])
def test_resume_at_the_same_layout_is_bit_for_bit(tmp_path, kind):
    """Tied weights, dropout, AdamW and StepLR: the RNG states continue, so dropout draws
    what the uninterrupted run drew."""
    path = saved(tmp_path, kind, dropout=0.3)
    got, warned = resumed(path, kind, dropout=0.3)
    same(got, uninterrupted(kind, dropout=0.3), **EXACT)
    assert ckpt.RngNotRestoredWarning not in warned


@pytest.mark.parametrize("saved_as, loaded_as", [("Pipe", "plain"), ("plain", "Pipe-3"),
                                                 ("Pipe", "Pipe-3"), ("GPipe", "Pipe-3")])
def test_resume_at_another_layout(tmp_path, saved_as, loaded_as):
    """Another balance, stage count or schedule, the plain model, and back: the model, the
    optimizer and the scheduler continue exactly; the RNG does not (a warning says so)."""
    got, warned = resumed(saved(tmp_path, saved_as), loaded_as)
    same(got, uninterrupted("plain", dropout=0.0), **TOL)
    assert warned == [ckpt.RngNotRestoredWarning]


def test_an_optimizer_saved_before_its_first_step_loads_as_new(tmp_path):
    """No state saved, none loaded: the next steps are those of a new optimizer."""
    m = pipe_of("Pipe", model())
    opt, sched = optimizer_of(m)
    ckpt.save(tmp_path / "fresh", m, opt, sched)
    assert not opt.state  # saving did not initialise it
    other = pipe_of("Pipe", model())
    opt2, sched2 = optimizer_of(other)
    train(other, opt2, sched2, 0, 1)  # state to be replaced by the saved (none)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ckpt.RngNotRestoredWarning)
        ckpt.load(tmp_path / "fresh", other, opt2, sched2)
    assert not opt2.state and sched2.last_epoch == 0
    torch.manual_seed(7)
    train(other, opt2, sched2, 0, 6)
    same(params(other), uninterrupted("Pipe", dropout=0.0), **EXACT)


Net = checkpoint_cases.Net  # a traced module, its head tied to the input layer


def test_a_traced_model_resumes_and_moves_to_the_plain_model(tmp_path):
    x = batch(0)[0]
    pipe = fastpipe.Pipe(Net(), chunks=2, devices=["cpu"] * 2, split_points=["blocks.2"],
                         example_inputs=x)
    opt, sched = optimizer_of(pipe)
    train(pipe, opt, sched, 0, 3)
    ckpt.save(tmp_path / "traced", pipe, opt, sched, extra={"step": 3})
    plain = Net()
    opt2, sched2 = optimizer_of(plain)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ckpt.RngNotRestoredWarning)
        ckpt.load(tmp_path / "traced", plain, opt2, sched2)
    train(pipe, opt, sched, 3, 5)
    train(plain, opt2, sched2, 3, 5)
    same(params(plain), params(pipe), **TOL)


# --------------------------------------------------------------- torch's state-dict helpers
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("kind", ["Pipe", "GPipe", "traced"])
def test_torch_state_dict_helpers_work_on_the_pipe(tmp_path, kind):
    """get_state_dict(pipe, optimizer) keys everything by the plain model's names (the
    optimizer flattened), and set_state_dict loads it, through DCP, at another layout."""
    make = Net if kind == "traced" else model
    x = batch(0)[0]

    def build(m: nn.Module) -> nn.Module:
        if kind == "traced":
            return fastpipe.Pipe(m, chunks=2, devices=["cpu"] * 2, split_points=["blocks.1"],
                                 example_inputs=x)
        return pipe_of(kind, m)

    pipe = build(make())
    opt, sched = optimizer_of(pipe)
    train(pipe, opt, sched, 0, 2)
    model_sd, optim_sd = get_state_dict(pipe, opt, options=FLAT)
    plain = make()
    plain_opt, _ = optimizer_of(plain)
    plain_sd, plain_optim_sd = get_state_dict(plain, plain_opt, options=FLAT)
    assert model_sd.keys() == plain_sd.keys()
    assert optim_sd.keys() == plain_optim_sd.keys()
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp_path / "dsd"),
             no_dist=True)
    dcp.load({"model": plain_sd, "optim": plain_optim_sd}, checkpoint_id=str(tmp_path / "dsd"),
             no_dist=True)
    set_state_dict(plain, plain_opt, model_state_dict=plain_sd, optim_state_dict=plain_optim_sd,
                   options=FLAT)
    same(params(plain), params(pipe), **EXACT)
    for p, q in zip(plain.parameters(), pipe.parameters()):
        same(plain_opt.state[p], opt.state[q], **EXACT)
    back = build(make())
    back_opt, _ = optimizer_of(back)
    set_state_dict(back, back_opt, model_state_dict=plain_sd, optim_state_dict=plain_optim_sd,
                   options=FLAT)
    same(params(back), params(pipe), **EXACT)


# ------------------------------------------------------------------------- atomic directories
def test_latest_finds_the_last_complete_checkpoint_and_skips_a_crashed_save(tmp_path,
                                                                           monkeypatch):
    m = pipe_of("Pipe", model())
    opt, sched = optimizer_of(m)
    for name in ("b", "a"):  # saved in this order: 'a' is the last, whatever the names say
        ckpt.save(tmp_path / name, m, opt, sched)
    assert ckpt.latest(tmp_path) == str(tmp_path / "a")

    def crash(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt("the process died before the checkpoint was complete")
    monkeypatch.setattr(folder, "commit", crash)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(tmp_path / "c", m, opt, sched)
    monkeypatch.undo()
    assert os.path.isdir(folder.staging(str(tmp_path / "c")))  # written, never completed
    assert ckpt.latest(tmp_path) == str(tmp_path / "a")
    os.makedirs(tmp_path / "d")  # renamed, but died before the marker
    assert ckpt.latest(tmp_path) == str(tmp_path / "a") and not ckpt.is_complete(tmp_path / "d")
    for name in ("c", "d"):
        with pytest.raises(ckpt.IncompleteCheckpointError, match="not a complete checkpoint"):
            ckpt.load(tmp_path / name, m, opt, sched)
        ckpt.save(tmp_path / name, m, opt, sched)  # replaces what the crash left
    assert ckpt.latest(tmp_path) == str(tmp_path / "d")
    assert not os.path.exists(folder.staging(str(tmp_path / "c")))
    assert ckpt.latest(tmp_path / "none") is None


def test_a_complete_checkpoint_is_never_overwritten(tmp_path):
    m = pipe_of("Pipe", model())
    ckpt.save(tmp_path / "s", m)
    with pytest.raises(FileExistsError, match="already holds a complete checkpoint"):
        ckpt.save(tmp_path / "s", m)


# ----------------------------------------------------------------------------- bad input
def _untouched(m: nn.Module, opt: Any) -> Any:
    before = (params(m), {k: dict(v) for k, v in opt.state.items()})

    def check() -> None:
        same(params(m), before[0], **EXACT)
        assert {k: dict(v) for k, v in opt.state.items()}.keys() == before[1].keys()
        for k, v in before[1].items():
            same(opt.state[k], v, **EXACT)
    return check


@pytest.mark.parametrize("other, match", [
    (lambda: nn.Sequential(*model(), nn.Linear(8, 8)), "lacks 2 entries of the model"),
    (lambda: model()[:5], "does not have, e.g. \\['5.bias'"),
    (lambda: model(last=4), "other shapes in the checkpoint, e.g. '5.weight'"),
])
def test_a_checkpoint_of_another_model_is_refused_before_any_change(tmp_path, other, match):
    path = saved(tmp_path, "Pipe")
    m = other()
    opt, sched = optimizer_of(m)
    m(batch(0)[0]).square().mean().backward()
    opt.step()  # state to keep
    check = _untouched(m, opt)
    with pytest.raises(ckpt.CheckpointMismatchError, match=match):
        ckpt.load(path, m, opt, sched)
    check()


def test_bad_arguments_are_named(tmp_path):
    m = pipe_of("Pipe", model())
    opt, sched = optimizer_of(m)
    train(m, opt, sched, 0, 1)
    path = ckpt.save(tmp_path / "s", m, opt)
    foreign = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1)
    other_opt, other_sched = optimizer_of(model())
    regrouped = torch.optim.AdamW([{"params": [m.module[0].weight], "lr": 1.0},
                                   {"params": [p for n, p in m.named_parameters()
                                               if n != "0.weight"]}], lr=0.05)
    grouped = ckpt.save(tmp_path / "grouped", m, regrouped)  # one group at lr 1.0
    check = _untouched(m, opt)
    cases = [
        (lambda: ckpt.save(tmp_path / "x", m, foreign), ValueError, "not the pipe's"),
        (lambda: ckpt.save(tmp_path / "x", m, "adam"), TypeError, "torch.optim.Optimizer"),
        (lambda: ckpt.save(tmp_path / "x", m, opt, other_sched), ValueError, "another"),
        (lambda: ckpt.save(tmp_path / "x", m, opt, extra=[3]), TypeError, "extra must be a"),
        (lambda: ckpt.save(tmp_path / "x", m, opt, extra={"f": lambda: 0}), TypeError,
         "picklable"),
        (lambda: ckpt.save(tmp_path / "x", 3, opt), TypeError, "pipe must be"),
        (lambda: ckpt.load(path, m, opt, sched), ckpt.CheckpointMismatchError,
         "without one; load with scheduler=None"),
        (lambda: ckpt.load(tmp_path / "nowhere", m, opt), FileNotFoundError, "no checkpoint"),
        (lambda: ckpt.load(grouped, m, opt), ckpt.CheckpointMismatchError,
         "parameter groups it was saved with"),
        (lambda: ckpt.load(path, m, other_opt), ValueError, "not the pipe's"),
    ]
    for call, kind, match in cases:
        with pytest.raises(kind, match=match):
            call()
    check()
    assert not os.path.exists(tmp_path / "x")
    ckpt.save(tmp_path / "model-only", m)
    with pytest.raises(ckpt.CheckpointMismatchError, match="load with optimizer=None"):
        ckpt.load(tmp_path / "model-only", m, opt)
    check()


# --------------------------------------------- a DistributedPipe rank's optimizer.state_dict()
class Rank(nn.Sequential):
    """Stands for one rank of a DistributedPipe: layers under their plain-model names."""

    def __init__(self, first: int) -> None:
        super().__init__(OrderedDict((str(i), nn.Linear(4, 4)) for i in (first, first + 1)))
        optimizer_names.watch(self)

    def _checkpoint_names(self) -> Dict[str, str]:
        return {n: n for n, _ in self.named_parameters()}


def _stepped(rank: Rank) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(rank.parameters(), lr=0.1)
    rank(torch.randn(3, 4)).sum().backward()
    opt.step()
    return opt


def test_a_rank_optimizer_state_dict_is_keyed_by_plain_names_and_checked(tmp_path):
    """Indices are the same on every rank, names are not: each rank's own state dict loads
    back exactly (torch.save, weights_only), another rank's is refused, through the hooks or
    (an optimizer that never stepped, which torch maps by position) at the first step."""
    first, last = Rank(0), Rank(2)
    opt_first, opt_last = _stepped(first), _stepped(last)
    saved = opt_last.state_dict()
    assert sorted(saved["state"]) == ["2.bias", "2.weight", "3.bias", "3.weight"]
    torch.save(saved, tmp_path / "last.pt")
    again = torch.optim.AdamW(last.parameters(), lr=0.1)  # never stepped: torch's own load
    again.load_state_dict(torch.load(tmp_path / "last.pt", weights_only=True))
    last(torch.randn(3, 4)).sum().backward()
    reference = copy.deepcopy(opt_last.state_dict())
    again.step()  # checked (this rank's own), then steps as the original would
    opt_last.step()
    for p, q in zip(again.state.values(), opt_last.state.values()):
        same(p, q, **EXACT)
    assert reference["param_groups"][0]["lr"] == 0.1 and type(again.param_groups[0]["lr"]) is float
    with pytest.raises(optimizer_names.OptimizerStateError, match="does not hold"):
        opt_first.load_state_dict(saved)  # the hooks: another rank's entries
    fresh = torch.optim.AdamW(first.parameters(), lr=0.1)
    fresh.load_state_dict(saved)  # torch maps it by position: the first step refuses
    first(torch.randn(3, 4)).sum().backward()
    before = params(first)
    for _ in range(2):
        with pytest.raises(optimizer_names.OptimizerStateError, match="another rank's"):
            fresh.step()
    same(params(first), before, **EXACT)


# ------------------------------------------------------------------- across processes (gloo)
needs_gloo = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")


def _two_launches(case: str, ranks: int, path: Any, limit: float) -> list:
    assert_all_ok(launch(f"{case}_save", ranks, limit=limit, args={"path": str(path)},
                         script="checkpoint_cases.py"))
    return assert_all_ok(launch(f"{case}_load", ranks, limit=limit, args={"path": str(path)},
                                script="checkpoint_cases.py"))


@needs_gloo
def test_distributed_pipe_resumes_bit_for_bit_in_new_processes(tmp_path):
    """2 ranks, a weight tied across them, dropout: fastpipe.checkpoint, each rank's
    optimizer.state_dict() through DCP, and torch's get/set_state_dict all resume bit for
    bit; an optimizer whose template had no state, and refused loads, raise on every rank."""
    results = _two_launches("resume", 2, tmp_path, limit=90)
    for rank, r in enumerate(results):
        assert r["checked"] == {"fastpipe_checkpoint": 8, "per_rank_state_dicts": 8,
                                "torch_state_dict_helpers": 8}
        assert r["fresh_template"].startswith("OptimizerStateError")
        errors = r["errors"]
        assert errors["incomplete"].startswith("IncompleteCheckpointError")
        assert errors["latest"] == "step-3"
        assert errors["other_model"].startswith("CheckpointMismatchError")  # only rank 1 saw it
        assert ("rank 1: " in errors["other_model"]) == (rank == 0)
        assert errors["different_directories"].startswith("ValueError: the ranks gave "
                                                          "different directory")
    first, last = (r["traced"] for r in results)  # the tied weight's one name on both ranks
    assert "state.embed.weight.exp_avg" in first and "state.embed.weight.exp_avg" in last
    assert "state.head.bias.exp_avg" in last and "state.head.weight.exp_avg" not in last


@needs_gloo
def test_distributed_pipe_resumes_at_other_layouts(tmp_path):
    """4 ranks: pipeline 2 x data 2 (tied weights) loaded at the same layout (bit for bit), at
    pipeline 4, at pipeline 2 x data 2 with interleaved virtual stages, into the plain model
    and back; pipeline 2 x tensor 2 loaded at the same layout and as pipeline 2 x FSDP 2, with
    fastpipe.checkpoint and with torch's get_state_dict / set_state_dict."""
    results = _two_launches("layouts", 4, tmp_path, limit=120)
    assert all(r == results[0] for r in results)
    assert len(results[0]) == 7
