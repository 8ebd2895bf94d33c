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
from fastpipe.parallel import optimizer_loads

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
         "extra\\['f'\\] is a function: extra holds numbers, strings"),
        (lambda: ckpt.save(tmp_path / "x", m, opt, extra={"a": [1, {2: object()}]}), TypeError,
         "extra\\['a'\\]\\[1\\]\\[2\\] is a object"),
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


# ------------------------------------- a DistributedPipe rank's optimizer: what a load may do
def _stepped_adamw(m: nn.Module) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    m(batch(0)[0]).square().mean().backward()
    opt.step()
    return opt


def _lost_groups(state_dict: Dict[str, Any]) -> Dict[str, Any]:
    """What torch's set_state_dict hands a rank's optimizer when the checkpoint kept another
    rank's param_groups: this rank's state, groups without a hyperparameter."""
    return {"state": state_dict["state"],
            "param_groups": [{"params": g["params"]} for g in state_dict["param_groups"]]}


def test_a_load_that_lost_the_parameter_groups_is_refused_before_the_optimizer_changes():
    m = model()
    opt = _stepped_adamw(m)
    optimizer_loads.watch(opt)
    optimizer_loads.watch(opt)  # once per optimizer: one hook
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(optimizer_loads.OptimizerStateError, match="none of its hyperparameters"):
        opt.load_state_dict(_lost_groups(before))
    after = opt.state_dict()
    assert after["param_groups"] == before["param_groups"]
    for k, v in before["state"].items():
        same(after["state"][k], v, **EXACT)
    older = copy.deepcopy(before)  # torch's own, and one from a torch without a newer default
    del older["param_groups"][0]["decoupled_weight_decay"]
    opt.load_state_dict(older)
    assert opt.param_groups[0]["decoupled_weight_decay"] is True  # AdamW fills it back
    twin = _stepped_adamw(model())  # loaded before it was watched: its groups say so
    twin.load_state_dict(_lost_groups(twin.state_dict()))
    with pytest.raises(optimizer_loads.OptimizerStateError, match="has no 'lr', 'betas'"):
        optimizer_loads.check_groups(twin)
    optimizer_loads.check_groups(opt)


def test_a_watched_optimizer_keeps_torchs_state_dict_and_no_global_hook_exists():
    """The check is the optimizer's own pre-hook, on the optimizers fastpipe is handed: its
    state_dict() is torch's (indices, plain floats), and no optimizer-wide hook exists."""
    from torch.optim import optimizer as torch_optimizer
    pipes = [pipe_of(kind, model()) for kind in ("Pipe", "GPipe", "Pipe-3")]
    watched, plain = _stepped_adamw(model()), _stepped_adamw(model())
    optimizer_loads.watch(watched)
    ckpt_opt, sched = optimizer_of(pipes[0])
    train(pipes[0], ckpt_opt, sched, 0, 1)
    assert not torch_optimizer._global_optimizer_pre_hooks
    assert not torch_optimizer._global_optimizer_post_hooks
    mine, theirs = watched.state_dict(), plain.state_dict()
    assert mine["param_groups"] == theirs["param_groups"]
    assert all(type(g["lr"]) is float for g in mine["param_groups"])
    assert list(mine["state"]) == list(theirs["state"]) == list(range(len(theirs["state"])))
    for k, v in theirs["state"].items():
        same(mine["state"][k], v, **EXACT)


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
    """2 ranks, a weight tied across them, dropout: fastpipe.checkpoint, each rank's own
    state dicts in its own file, and torch's get/set_state_dict (flattened) resume bit for bit
    (parameters, Adam's moments and step); torch's default route, whose checkpoint keeps one
    rank's parameter groups, is refused on the rank that lost them (at set_state_dict when
    fastpipe was handed the optimizer before, else at the step), before the step changes
    anything; refused loads raise on every rank; no optimizer-wide hook exists."""
    results = _two_launches("resume", 2, tmp_path, limit=120)
    for rank, r in enumerate(results):
        assert r["checked"] == {"fastpipe_checkpoint": 32, "per_rank_files": 32,  # 8 + 8 x 3
                                "torch_state_dict_helpers": 32}
        assert r["no_global_hooks"]
        errors = r["errors"]
        assert errors["incomplete"].startswith("IncompleteCheckpointError")
        assert errors["latest"] == "step-3"
        assert errors["other_model"].startswith("CheckpointMismatchError")  # only rank 1 saw it
        assert ("rank 1: " in errors["other_model"]) == (rank == 0)
        assert errors["different_directories"].startswith("ValueError: the ranks gave "
                                                          "different directory")
    refused = [r["nested_in_this_process"] for r in results]
    assert sum(e is not None for e in refused) == 1, refused  # the rank whose groups were lost
    at_step = [r["nested_in_new_processes"] for r in results]
    lost = [e for e in at_step if e.startswith("OptimizerStateError")]
    assert len(lost) == 1 and "has no 'lr'" in lost[0] and "fastpipe.checkpoint" in lost[0]
    others = [e for e in at_step if not e.startswith("OptimizerStateError")]
    assert all(e.startswith("PipelineAborted") and "OptimizerStateError" in e for e in others)
    for r in results:  # the traced pipe: at its split bit for bit, at another as the plain Net
        assert len(r["traced_resumed"]) == 4 and all(n > 0 for n in r["traced_resumed"].values())
    first, last = (r["traced"] for r in results)  # the tied weight's one name on both ranks
    assert "state.embed.weight.exp_avg" in first and "state.embed.weight.exp_avg" in last
    assert "state.head.bias.exp_avg" in last and "state.head.weight.exp_avg" not in last


@needs_gloo
def test_distributed_pipe_resumes_at_other_layouts(tmp_path):
    """4 ranks: pipeline 2 x data 2 (tied weights), pipeline 2 x tensor 2 and pipeline 2 x
    FSDP 2, saved by fastpipe.checkpoint and torch's flattened and nested helpers.
    fastpipe.checkpoint and the flattened helpers resume at the same layout (bit for bit) and
    at others (pipeline 4, interleaved, FSDP from tensor parallel and back): parameters,
    Adam's moments and step; the nested route is refused, at the saving layout and at
    pipeline 4, on the ranks whose groups the checkpoint lost; a plain model's checkpoint
    (fastpipe's, torch's nested and flattened) loads into the pipes."""
    results = _two_launches("layouts", 4, tmp_path, limit=240)
    cells = [k for k in results[0] if " by " in k]
    assert len(cells) == 13 and all(set(r) == set(results[0]) for r in results)
    assert all(r[k] > 0 for r in results for k in cells)
    assert all(r["plain"] > 0 and len(r["plain_by_helpers"]) == 4
               and all(n > 0 for n in r["plain_by_helpers"].values()) for r in results)
    for name in ("dp", "dp at pipeline 4", "tp"):  # the ranks of the layers one stage lost
        refused = {rank for rank, r in enumerate(results) if r["nested"][name] is not None}
        assert refused in ({0, 1}, {2, 3}), (name, refused)
        assert all(results[rank]["nested"][name].startswith("OptimizerStateError")
                   for rank in refused)
