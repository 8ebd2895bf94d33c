"""Checkpoint cases run by every rank of a gloo group (``dist_launch.launch(...,
script="checkpoint_cases.py")``): train, save, and in a second launch (new processes) load and
train on; each case raises on any mismatch and prints one ``RESULT <json>`` line.

A ``*_save`` case trains 3 steps, saves, trains 3 more and records every rank's parameters;
its ``*_load`` case loads into new pipes, trains the last 3 steps and compares: bit for bit
with the recording where the layout is the saving one, with the plain model's 6 steps (fp32
tolerance) where it is another.
"""
from __future__ import annotations

import os
import sys
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_state_dict)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dist_cases  # noqa: E402
from dist_cases import TOL, WIDTH, DistributedPipe, data, full, init_mesh, tp_plan  # noqa: E402
from fastpipe import checkpoint as ckpt  # noqa: E402

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
BATCH = 12  # the global batch; each data-parallel replica reads its slice
EXACT = dict(rtol=0, atol=0)


# ------------------------------------------------------------------------------ the models
def tied_model(dropout: float = 0.0) -> nn.Sequential:
    """8 layers, the first and the last sharing one weight (on different ranks)."""
    torch.manual_seed(1234)
    layers: List[nn.Module] = []
    for _ in range(7):
        block = [nn.Linear(WIDTH, WIDTH), nn.Tanh()] + ([nn.Dropout(dropout)] if dropout else [])
        layers.append(nn.Sequential(*block))
    layers.append(nn.Linear(WIDTH, WIDTH))
    layers[-1].weight = layers[0][0].weight
    return nn.Sequential(*layers)


def make(kind: str, dropout: float = 0.0) -> nn.Sequential:
    return tied_model(dropout) if kind == "tied" else dist_cases.model(8)


def batch(kind: str, step: int, size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    x, y = data(size, seed=100 + step)
    return x, (y.repeat(1, 2) if kind == "tied" else y)


def optimizer_of(model: nn.Module) -> Tuple[torch.optim.Optimizer, Any]:
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


# ------------------------------------------------------------------------------ the layouts
def build(kind: str, pipeline: int, data_: int = 1, tensor: int = 1, shard: int = 1,
          dropout: float = 0.0, schedule: str = "1f1b", virtual: int = 1) -> Tuple[Any, ...]:
    """A pipe of ``kind`` at a layout, its AdamW optimizer and StepLR scheduler."""
    mesh = None
    if pipeline != dist.get_world_size():
        mesh = init_mesh(pipeline=pipeline, data=data_, tensor=tensor, shard=shard, timeout=60)
    pipe = DistributedPipe(make(kind, dropout), chunks=2, schedule=schedule,
                           virtual_stages=virtual, mesh=mesh,
                           tensor_parallel=tp_plan(8) if tensor > 1 else None,
                           data_parallel="fsdp" if shard > 1 else "replicate", timeout=60)
    return (pipe, *optimizer_of(pipe))


def train(pipe: Any, opt: Any, sched: Any, kind: str, start: int, stop: int,
          step_optimizer: bool = True) -> None:
    replicas, replica = (pipe.mesh.replicas, pipe.mesh.replica) if pipe.mesh else (1, 0)
    last = len(pipe.balance) - 1
    for step in range(start, stop):
        x, y = batch(kind, step, BATCH)
        per = BATCH // replicas
        mine = slice(replica * per, (replica + 1) * per)
        opt.zero_grad(set_to_none=True)
        pipe.train_step(x[mine] if 0 in pipe.stages else None,
                        y[mine] if last in pipe.stages else None, nn.functional.mse_loss,
                        optimizer=opt if step_optimizer else None)
        if step_optimizer:
            sched.step()


def reference(kind: str, steps: int) -> nn.Module:
    """The plain model after ``steps`` steps on the global batch."""
    plain = make(kind)
    opt, sched = optimizer_of(plain)
    for step in range(steps):
        x, y = batch(kind, step, BATCH)
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(plain(x), y).backward()
        opt.step()
        sched.step()
    return plain


def snapshot(pipe: nn.Module) -> Dict[str, torch.Tensor]:
    return {n: full(p.detach()).clone() for n, p in pipe.named_parameters()}


def compare(got: Dict[str, torch.Tensor], expected: Any, where: str, **tol: Any) -> int:
    """Every parameter of ``got`` against ``expected`` (a dict, or a plain model)."""
    for name, value in got.items():
        want = expected[name] if isinstance(expected, dict) else expected.get_parameter(name)
        torch.testing.assert_close(value, want.detach(), **(tol or TOL),
                                   msg=lambda m: f"{where}: {name}: {m}")
    return len(got)


def rank_file(path: str, what: str) -> str:
    return os.path.join(path, f"{what}-rank{dist.get_rank()}.pt")


def raised(fn: Any) -> Optional[str]:
    """The type name of what ``fn()`` raised (``None`` if it returned)."""
    try:
        fn()
    except Exception as error:  # noqa: BLE001
        return f"{type(error).__name__}: {str(error)[:300]}"
    return None


# ------------------------------------------------------------- 2 ranks: resume at the same layout
def resume_save(path: str) -> Dict:
    """Tied weights and dropout at pipeline 2: saved after 3 steps three ways (fastpipe's
    checkpoint, each rank's optimizer.state_dict() through DCP, torch's get_state_dict), then
    3 more steps recorded."""
    pipe, opt, sched = build("tied", 2, dropout=0.2)
    torch.manual_seed(5)
    train(pipe, opt, sched, "tied", 0, 3)
    rng = torch.get_rng_state()
    ckpt.save(os.path.join(path, "ckpt", "step-3"), pipe, opt, sched, extra={"step": 3})
    torch.save({"rng": rng, "sched": sched.state_dict()}, rank_file(path, "rng"))
    dcp.save({"model": pipe.state_dict(), "optim": opt.state_dict()},
             checkpoint_id=os.path.join(path, "per-rank"))
    model_sd, optim_sd = get_state_dict(pipe, opt, options=FLAT)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(path, "dsd"))
    torch.set_rng_state(rng)  # as it was at the saves, whatever they drew
    train(pipe, opt, sched, "tied", 3, 6)
    torch.save(snapshot(pipe), rank_file(path, "uninterrupted"))
    return {"names": sorted(n for n, _ in pipe.named_parameters()),
            "optim_keys": sorted(k for k in optim_sd if k.endswith(".exp_avg"))}


def _resumed(path: str, load: Any) -> int:
    """New pipes, ``load(pipe, opt, sched)``, 3 more steps: bit for bit the recording."""
    torch.manual_seed(999)  # whatever the new process drew: the load restores it
    pipe, opt, sched = build("tied", 2, dropout=0.2)
    load(pipe, opt, sched)
    train(pipe, opt, sched, "tied", 3, 6)
    return compare(snapshot(pipe), torch.load(rank_file(path, "uninterrupted")),
                   load.__name__, **EXACT)


def resume_load(path: str) -> Dict:
    """Each way of loading, in new processes: exact, or (an optimizer whose state dict was
    taken before it ever stepped) a typed error at its first step, on every rank."""
    def fastpipe_checkpoint(pipe: Any, opt: Any, sched: Any) -> None:
        assert ckpt.load(ckpt.latest(os.path.join(path, "ckpt")), pipe, opt, sched) == \
            {"step": 3}

    def per_rank_state_dicts(pipe: Any, opt: Any, sched: Any) -> None:
        _init_state(opt)  # state present in the template: DCP loads in place
        state = {"model": pipe.state_dict(), "optim": opt.state_dict()}
        dcp.load(state, checkpoint_id=os.path.join(path, "per-rank"))
        pipe.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        _restore(sched)

    def torch_state_dict_helpers(pipe: Any, opt: Any, sched: Any) -> None:
        model_sd, optim_sd = get_state_dict(pipe, opt, options=FLAT)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(path, "dsd"))
        set_state_dict(pipe, opt, model_state_dict=model_sd, optim_state_dict=optim_sd,
                       options=FLAT)
        _restore(sched)

    def _restore(sched: Any) -> None:
        saved = torch.load(rank_file(path, "rng"))
        sched.load_state_dict(saved["sched"])
        torch.set_rng_state(saved["rng"])

    checked = {f.__name__: _resumed(path, f)
               for f in (fastpipe_checkpoint, per_rank_state_dicts, torch_state_dict_helpers)}
    return {"checked": checked, "fresh_template": _fresh_template(path),
            "errors": _errors(path), "traced": _traced()}


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


def _traced() -> List[str]:
    """A traced DistributedPipe: get_state_dict keys it by the module's own names (the tied
    weight by its first name on both ranks); the plain model's state, set through
    set_state_dict, is what the pipe then holds."""
    x, y = batch("tied", 0, BATCH)
    pipe = DistributedPipe(Net(), chunks=2, split_points=["blocks.2"], example_inputs=x,
                           timeout=60)
    opt, sched = optimizer_of(pipe)
    plain = Net()
    plain_opt, plain_sched = optimizer_of(plain)
    for step in range(2):
        x, y = batch("tied", step, BATCH)
        plain_opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(plain(x), y).backward()
        plain_opt.step()
    model_sd, optim_sd = get_state_dict(pipe, opt, options=FLAT)
    plain_sd, plain_optim_sd = get_state_dict(plain, plain_opt, options=FLAT)
    assert set(model_sd) <= set(plain_sd) and set(optim_sd) <= set(plain_optim_sd), \
        (sorted(set(model_sd) - set(plain_sd)), sorted(set(optim_sd) - set(plain_optim_sd)))
    set_state_dict(pipe, opt, model_state_dict=plain_sd, optim_state_dict=plain_optim_sd,
                   options=FLAT)
    compare(snapshot(pipe), plain, "traced pipe loaded with set_state_dict", **EXACT)
    for name, p in pipe.named_parameters():
        for key, value in opt.state[p].items():
            torch.testing.assert_close(value, plain_opt.state[plain.get_parameter(name)][key],
                                       **EXACT)
    return sorted(k for k in optim_sd if k.endswith(".exp_avg"))


def _init_state(opt: torch.optim.Optimizer) -> None:
    """Give a never-stepped optimizer its state: one step with zero gradients and lr 0."""
    lrs = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = 0.0
        for p in g["params"]:
            p.grad = torch.zeros_like(p)
    opt.step()
    for g, lr in zip(opt.param_groups, lrs):
        g["lr"] = lr
    opt.zero_grad(set_to_none=True)


def _fresh_template(path: str) -> Optional[str]:
    """The measured path as it was written: the template taken from an optimizer that never
    stepped holds no state, so DCP reads none; the optimizer's first step says so."""
    pipe, opt, _ = build("tied", 2)
    state = {"model": pipe.state_dict(), "optim": opt.state_dict()}
    dcp.load(state, checkpoint_id=os.path.join(path, "per-rank"))
    pipe.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    x, y = batch("tied", 3, BATCH)
    pipe.train_step(x, y, nn.functional.mse_loss)
    before = snapshot(pipe)
    error = raised(opt.step)
    assert raised(opt.step) == error  # refused again: nothing was let through
    compare(snapshot(pipe), before, "parameters after the refused steps", **EXACT)
    assert error is not None and error.startswith("OptimizerStateError"), error
    return error


def _errors(path: str) -> Dict[str, Optional[str]]:
    """Typed errors on every rank, agreed before anything changes: an interrupted save,
    a checkpoint of another model (its last layer has another shape: only the last rank
    sees it)."""
    crashed = os.path.join(path, "ckpt", "step-6")
    if dist.get_rank() == 0:
        os.makedirs(crashed, exist_ok=True)  # a save that died before its marker
    dist.barrier()
    pipe, opt, sched = build("tied", 2)
    before = snapshot(pipe)
    out = {"incomplete": raised(lambda: ckpt.load(crashed, pipe, opt, sched)),
           "latest": os.path.basename(ckpt.latest(os.path.join(path, "ckpt")))}
    other, other_opt, _ = build("mlp", 2)
    out["other_model"] = raised(
        lambda: ckpt.load(os.path.join(path, "ckpt", "step-3"), other, other_opt))
    out["different_directories"] = raised(  # each rank its own: refused before any write
        lambda: ckpt.save(os.path.join(path, f"mine-{dist.get_rank()}"), pipe, opt, sched))
    assert not any(n.startswith(("mine-", ".mine-")) for n in os.listdir(path))
    compare(snapshot(pipe), before, "the pipe after refused loads", **EXACT)
    assert not other_opt.state
    return out


# --------------------------------------------------------- 4 ranks: resume at other layouts
def layouts_save(path: str) -> Dict:
    """Tied weights at pipeline 2 x data 2, and tensor parallel at pipeline 2 x tensor 2:
    saved after 3 steps, 3 more steps recorded."""
    out = {}
    for name, kind, layout in (("dp", "tied", dict(pipeline=2, data_=2)),
                               ("tp", "mlp", dict(pipeline=2, tensor=2))):
        pipe, opt, sched = build(kind, **layout)
        train(pipe, opt, sched, kind, 0, 3)
        ckpt.save(os.path.join(path, name), pipe, opt, sched, extra={"step": 3})
        model_sd, optim_sd = get_state_dict(pipe, opt, options=FLAT)
        dcp.save({"model": model_sd, "optim": optim_sd, "sched": sched.state_dict()},
                 checkpoint_id=os.path.join(path, f"{name}-dsd"))
        train(pipe, opt, sched, kind, 3, 6)
        torch.save(snapshot(pipe), rank_file(path, f"{name}-uninterrupted"))
        out[name] = len(list(pipe.parameters()))
    return out


def layouts_load(path: str) -> Dict:
    """The same layouts (bit for bit), other ones (pipeline 4; FSDP from tensor parallel),
    the plain model, and back from the plain model into a pipe."""
    out: Dict[str, Any] = {}
    expected = {kind: reference(kind, 6) for kind in ("tied", "mlp")}
    cases = (("dp", "tied", dict(pipeline=2, data_=2), True),
             ("dp", "tied", dict(pipeline=4), False),
             ("dp", "tied", dict(pipeline=2, data_=2, schedule="interleaved", virtual=2),
              False),
             ("tp", "mlp", dict(pipeline=2, tensor=2), True),
             ("tp", "mlp", dict(pipeline=2, shard=2), False))
    for name, kind, layout, same in cases:
        pipe, opt, sched = build(kind, **layout)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert ckpt.load(os.path.join(path, name), pipe, opt, sched) == {"step": 3}
        rng_warned = any(w.category is ckpt.RngNotRestoredWarning for w in caught)
        assert rng_warned == (not same and dist.get_rank() == 0), \
            (name, layout, [str(w.message) for w in caught])
        train(pipe, opt, sched, kind, 3, 6)
        where = f"{name} loaded at {layout}"
        got = snapshot(pipe)
        if same:
            compare(got, torch.load(rank_file(path, f"{name}-uninterrupted")), where, **EXACT)
        compare(got, expected[kind], where + " (plain model)")
        out[f"{name} at {layout}"] = len(got)
    out["plain"] = _plain_and_back(path, expected["tied"])
    out["helpers"] = _helpers_across_layouts(path, expected["mlp"])
    return out


def _helpers_across_layouts(path: str, expected: nn.Module) -> int:
    """torch's get_state_dict / set_state_dict on the pipes: saved at pipeline 2 x tensor 2,
    loaded at pipeline 2 x FSDP 2."""
    pipe, opt, sched = build("mlp", pipeline=2, shard=2)
    model_sd, optim_sd = get_state_dict(pipe, opt, options=FLAT)
    state = {"model": model_sd, "optim": optim_sd, "sched": sched.state_dict()}
    dcp.load(state, checkpoint_id=os.path.join(path, "tp-dsd"))
    set_state_dict(pipe, opt, model_state_dict=model_sd, optim_state_dict=optim_sd,
                   options=FLAT)
    sched.load_state_dict(state["sched"])
    train(pipe, opt, sched, "mlp", 3, 6)
    return compare(snapshot(pipe), expected, "torch's helpers, tensor parallel into FSDP")


def _plain_and_back(path: str, expected: nn.Module) -> int:
    """Into the plain model (each rank in its own process), 3 steps; rank 0 saves the plain
    model, and a pipeline of 4 loads that and ends where the plain model does."""
    plain = make("tied")
    opt, sched = optimizer_of(plain)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ckpt.RngNotRestoredWarning)
        assert ckpt.load(os.path.join(path, "dp"), plain, opt, sched) == {"step": 3}
    replay = os.path.join(path, "from-plain")
    if dist.get_rank() == 0:
        ckpt.save(replay, plain, opt, sched, extra={"step": 3})
    for step in range(3, 6):
        x, y = batch("tied", step, BATCH)
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(plain(x), y).backward()
        opt.step()
        sched.step()
    compare(snapshot(plain), expected, "the plain model")
    dist.barrier()
    pipe, opt, sched = build("tied", 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ckpt.RngNotRestoredWarning)
        ckpt.load(replay, pipe, opt, sched)
    train(pipe, opt, sched, "tied", 3, 6)
    return compare(snapshot(pipe), expected, "from the plain model into pipeline 4")


CASES = {f.__name__: f for f in (resume_save, resume_load, layouts_save, layouts_load)}

if __name__ == "__main__":
    dist_cases.main(CASES)
