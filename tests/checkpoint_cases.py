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
        return f"{type(error).__name__}: {str(error)[:700]}"
    return None


# ------------------------------------------------------------- 2 ranks: resume at the same layout
def optimizer_state(pipe: nn.Module, opt: torch.optim.Optimizer) -> Dict[str, torch.Tensor]:
    """The optimizer's state (Adam's moments and step) by plain parameter name."""
    return {f"{name}.{key}": full(value.detach()).clone()
            for name, p in pipe.named_parameters() for key, value in opt.state[p].items()}


def recorded(pipe: nn.Module, opt: torch.optim.Optimizer) -> Dict[str, torch.Tensor]:
    """Parameters and optimizer state, for an exact comparison with the uninterrupted run."""
    return {**snapshot(pipe), **{f"optim.{k}": v for k, v in optimizer_state(pipe, opt).items()}}


def resume_save(path: str) -> Dict:
    """Tied weights and dropout at pipeline 2: saved after 3 steps four ways (fastpipe's
    checkpoint, each rank's own state dicts in its own file, torch's get_state_dict flattened
    and with its default options), then 3 more steps recorded; an untied model saved with
    torch's default options too."""
    pipe, opt, sched = build("tied", 2, dropout=0.2)
    torch.manual_seed(5)
    train(pipe, opt, sched, "tied", 0, 3)
    rng = torch.get_rng_state()
    ckpt.save(os.path.join(path, "ckpt", "step-3"), pipe, opt, sched, extra={"step": 3})
    torch.save({"rng": rng, "sched": sched.state_dict()}, rank_file(path, "rng"))
    torch.save({"model": pipe.state_dict(), "optim": opt.state_dict()}, rank_file(path, "own"))
    model_sd, optim_sd = get_state_dict(pipe, opt, options=FLAT)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(path, "dsd"))
    torch.set_rng_state(rng)  # as it was at the saves, whatever they drew
    train(pipe, opt, sched, "tied", 3, 6)
    torch.save(recorded(pipe, opt), rank_file(path, "uninterrupted"))
    _traced_save(path)
    untied, untied_opt, untied_sched = build("mlp", 2)
    train(untied, untied_opt, untied_sched, "mlp", 0, 3)
    model_sd, optim_sd = get_state_dict(untied, untied_opt)  # the optimizer state nested
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(path, "nested"))
    return {"names": sorted(n for n, _ in pipe.named_parameters()),
            "optim_keys": sorted(k for k in optim_sd["state"])}


def _resumed(path: str, load: Any) -> int:
    """New pipes, ``load(pipe, opt, sched)``, 3 more steps: bit for bit the recording,
    parameters and optimizer state."""
    torch.manual_seed(999)  # whatever the new process drew: the load restores it
    pipe, opt, sched = build("tied", 2, dropout=0.2)
    load(pipe, opt, sched)
    train(pipe, opt, sched, "tied", 3, 6)
    return compare(recorded(pipe, opt), torch.load(rank_file(path, "uninterrupted")),
                   load.__name__, **EXACT)


def resume_load(path: str) -> Dict:
    """Each way of loading, in new processes: exact; torch's default (nested) optimizer
    state refused where it lost a rank's groups; bad loads refused on every rank."""
    def fastpipe_checkpoint(pipe: Any, opt: Any, sched: Any) -> None:
        assert ckpt.load(ckpt.latest(os.path.join(path, "ckpt")), pipe, opt, sched) == \
            {"step": 3}

    def per_rank_files(pipe: Any, opt: Any, sched: Any) -> None:
        own = torch.load(rank_file(path, "own"), weights_only=True)  # torch's own format
        pipe.load_state_dict(own["model"])
        opt.load_state_dict(own["optim"])
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
               for f in (fastpipe_checkpoint, per_rank_files, torch_state_dict_helpers)}
    return {"checked": checked, "errors": _errors(path), "traced": _traced(),
            "traced_resumed": _traced_resumed(path),
            "no_global_hooks": _no_global_hooks(),
            "nested_in_this_process": _nested_handed_before(path),
            "nested_in_new_processes": _nested_refused_at_the_step(path)}


def _no_global_hooks() -> bool:
    """No optimizer-wide hook: fastpipe's checks are the optimizers' own."""
    from torch.optim import optimizer as torch_optimizer
    return not torch_optimizer._global_optimizer_pre_hooks and \
        not torch_optimizer._global_optimizer_post_hooks


def _nested_template(path: str, pipe: Any, opt: Any) -> Tuple[Dict, Dict]:
    """torch's default route: the template (torch initialises the optimizer's state), the
    checkpoint read into it."""
    model_sd, optim_sd = get_state_dict(pipe, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(path, "nested"))
    return model_sd, optim_sd


def _nested_handed_before(path: str) -> Optional[str]:
    """The optimizer was handed to fastpipe before (a rollback in a running job): on a rank
    whose groups the checkpoint lost, set_state_dict raises before the optimizer or the model
    changes; the other rank loads."""
    pipe, opt, sched = build("mlp", 2)
    train(pipe, opt, sched, "mlp", 0, 1)
    model_sd, optim_sd = _nested_template(path, pipe, opt)
    before = recorded(pipe, opt)
    groups = [dict(g) for g in opt.param_groups]
    error = raised(lambda: set_state_dict(pipe, opt, model_state_dict=model_sd,
                                          optim_state_dict=optim_sd))
    if error is not None:
        assert error.startswith("OptimizerStateError") and "none of its hyperparameters" in \
            error, error
        compare(recorded(pipe, opt), before, "a refused set_state_dict", **EXACT)
        assert [dict(g) for g in opt.param_groups] == groups
    dist.barrier()
    return error


def _nested_refused_at_the_step(path: str) -> Optional[str]:
    """New processes: save -> template -> load -> set -> step. The rank whose groups were
    lost refuses the step before it runs (the other rank's step is aborted); nothing
    trains. Run last: the aborted step leaves this pipe unusable."""
    pipe, opt, sched = build("mlp", 2)
    model_sd, optim_sd = _nested_template(path, pipe, opt)
    set_state_dict(pipe, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    before = recorded(pipe, opt)
    error = raised(lambda: train(pipe, opt, sched, "mlp", 3, 4))
    assert error is not None and "OptimizerStateError" in error, error
    compare(recorded(pipe, opt), before, "the refused step", **EXACT)
    return error


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


def traced_pipe(split_points: List[str]) -> Tuple[Any, ...]:
    """A traced DistributedPipe of :class:`Net` (its tie across ranks), optimizer, scheduler."""
    pipe = DistributedPipe(Net(), chunks=2, split_points=split_points,
                           example_inputs=batch("tied", 0, BATCH)[0], timeout=60)
    return (pipe, *optimizer_of(pipe))


def train_traced(pipe: Any, opt: Any, sched: Any, start: int, stop: int) -> None:
    for step in range(start, stop):
        x, y = batch("tied", step, BATCH)
        opt.zero_grad(set_to_none=True)
        pipe.train_step(x, y, nn.functional.mse_loss, optimizer=opt)
        sched.step()


def _traced_save(path: str) -> None:
    """The traced pipe, 3 steps, saved by fastpipe.checkpoint and torch's flattened helpers,
    3 more recorded; the plain Net's 6 steps too."""
    pipe, opt, sched = traced_pipe(["blocks.2"])
    train_traced(pipe, opt, sched, 0, 3)
    ckpt.save(os.path.join(path, "traced"), pipe, opt, sched)
    model_sd, optim_sd = get_state_dict(pipe, opt, options=FLAT)
    dcp.save({"model": model_sd, "optim": optim_sd, "sched": sched.state_dict()},
             checkpoint_id=os.path.join(path, "traced-flat"))
    train_traced(pipe, opt, sched, 3, 6)
    torch.save(recorded(pipe, opt), rank_file(path, "traced-uninterrupted"))


def _traced_resumed(path: str) -> Dict[str, int]:
    """The traced pipe in new processes, by both routes, at its split (bit for bit) and at
    another (the plain Net's 6 steps, fp32 tolerance)."""
    plain = Net()
    opt, sched = optimizer_of(plain)
    for step in range(6):
        x, y = batch("tied", step, BATCH)
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(plain(x), y).backward()
        opt.step()
        sched.step()
    expected = {**{n: p.detach() for n, p in plain.named_parameters(remove_duplicate=False)},
                **{f"optim.{n}.{k}": v for n, p in plain.named_parameters(remove_duplicate=False)
                   for k, v in opt.state[p].items()}}
    out = {}
    for split in (["blocks.2"], ["blocks.1"]):
        for route, source in (("fastpipe", "traced"), ("flat", "traced-flat")):
            pipe, opt, sched = traced_pipe(split)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ckpt.RngNotRestoredWarning)
                load_by(route, os.path.join(path, source), pipe, opt, sched, with_extra=False)
            train_traced(pipe, opt, sched, 3, 6)
            where = f"the traced pipe split at {split} by {route}"
            if split == ["blocks.2"]:
                compare(recorded(pipe, opt), torch.load(rank_file(path, "traced-uninterrupted")),
                        where, **EXACT)
            out[where] = compare(recorded(pipe, opt), expected, where)
    return out


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
    """Tied weights at pipeline 2 x data 2, tensor parallel at pipeline 2 x tensor 2 and FSDP
    at pipeline 2 x shard 2: saved after 3 steps (fastpipe.checkpoint; torch's get_state_dict
    flattened and nested), 3 more steps recorded."""
    out = {}
    for name, kind, layout in (("dp", "tied", dict(pipeline=2, data_=2)),
                               ("tp", "mlp", dict(pipeline=2, tensor=2)),
                               ("fsdp", "mlp", dict(pipeline=2, shard=2))):
        pipe, opt, sched = build(kind, **layout)
        train(pipe, opt, sched, kind, 0, 3)
        ckpt.save(os.path.join(path, name), pipe, opt, sched, extra={"step": 3})
        for route, options in (("flat", FLAT), ("nested", None)):
            model_sd, optim_sd = get_state_dict(pipe, opt, options=options)
            dcp.save({"model": model_sd, "optim": optim_sd, "sched": sched.state_dict()},
                     checkpoint_id=os.path.join(path, f"{name}-{route}"))
        train(pipe, opt, sched, kind, 3, 6)
        torch.save(recorded(pipe, opt), rank_file(path, f"{name}-uninterrupted"))
        out[name] = len(list(pipe.parameters()))
    return out


def reference_state(kind: str, steps: int) -> Dict[str, torch.Tensor]:
    """The plain model's parameters and optimizer state after ``steps`` steps, under every
    name a parameter has (a tied weight under each)."""
    plain = make(kind)
    opt, sched = optimizer_of(plain)
    for step in range(steps):
        x, y = batch(kind, step, BATCH)
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(plain(x), y).backward()
        opt.step()
        sched.step()
    out = {}
    for name, p in plain.named_parameters(remove_duplicate=False):
        out[name] = p.detach().clone()
        out.update({f"optim.{name}.{k}": v.clone() for k, v in opt.state[p].items()})
    return out


def load_by(route: str, path: str, pipe: Any, opt: Any, sched: Any,
            with_extra: bool = True) -> None:
    """``fastpipe.checkpoint.load`` (its ``extra``: ``{"step": 3}`` when ``with_extra``), or
    torch's helpers through DCP (``flat``, ``nested``)."""
    if route == "fastpipe":
        assert ckpt.load(path, pipe, opt, sched) == ({"step": 3} if with_extra else {})
        return
    options = FLAT if route == "flat" else None
    model_sd, optim_sd = get_state_dict(pipe, opt, options=options)
    state = {"model": model_sd, "optim": optim_sd, "sched": sched.state_dict()}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(pipe, opt, model_state_dict=model_sd, optim_state_dict=optim_sd,
                   options=options)
    sched.load_state_dict(state["sched"])


def layouts_load(path: str) -> Dict:
    """fastpipe.checkpoint and torch's flattened helpers at the same layouts (bit for bit)
    and other ones (pipeline 4; interleaved; FSDP from tensor parallel), parameters and
    optimizer state; torch's nested route refused where a rank's groups were lost; the plain
    model, and back from the plain model into pipes."""
    out: Dict[str, Any] = {}
    expected = {kind: reference_state(kind, 6) for kind in ("tied", "mlp")}
    cases = (("dp", "tied", dict(pipeline=2, data_=2), True, ("fastpipe", "flat")),
             ("dp", "tied", dict(pipeline=4), False, ("fastpipe", "flat")),
             ("dp", "tied", dict(pipeline=2, data_=2, schedule="interleaved", virtual=2),
              False, ("fastpipe",)),
             ("tp", "mlp", dict(pipeline=2, tensor=2), True, ("fastpipe", "flat")),
             ("tp", "mlp", dict(pipeline=2, shard=2), False, ("fastpipe", "flat")),
             ("fsdp", "mlp", dict(pipeline=2, shard=2), True, ("fastpipe", "flat")),
             ("fsdp", "mlp", dict(pipeline=2, tensor=2), False, ("fastpipe", "flat")))
    for name, kind, layout, same, routes in cases:
        for route in routes:
            pipe, opt, sched = build(kind, **layout)
            source = os.path.join(path, name if route == "fastpipe" else f"{name}-{route}")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                load_by(route, source, pipe, opt, sched)
            if route == "fastpipe":
                rng_warned = any(w.category is ckpt.RngNotRestoredWarning for w in caught)
                assert rng_warned == (not same and dist.get_rank() == 0), \
                    (name, layout, [str(w.message) for w in caught])
            train(pipe, opt, sched, kind, 3, 6)
            where = f"{name} loaded at {layout} by {route}"
            got = recorded(pipe, opt)
            if same:
                compare(got, torch.load(rank_file(path, f"{name}-uninterrupted")), where,
                        **EXACT)
            out[where] = compare(got, expected[kind], where + " (plain model)")
    out["nested"] = {name: _nested_refused(path, source, kind, layout)
                     for name, source, kind, layout in
                     (("dp", "dp", "tied", dict(pipeline=2, data_=2)),
                      ("dp at pipeline 4", "dp", "tied", dict(pipeline=4)),
                      ("tp", "tp", "mlp", dict(pipeline=2, tensor=2)))}
    out["plain"] = _plain_and_back(path, expected["tied"])
    out["plain_by_helpers"] = _plain_by_helpers(path, expected["mlp"])
    return out


def _nested_refused(path: str, name: str, kind: str, layout: Dict[str, Any]) -> Optional[str]:
    """torch's nested route (checkpoint ``name``) at ``layout``, the optimizer handed to
    fastpipe by a step: a rank whose groups the checkpoint lost refuses in set_state_dict,
    before its optimizer changes (its replicas and tensor-parallel peers hold the same names:
    they agree)."""
    pipe, opt, sched = build(kind, **layout)
    train(pipe, opt, sched, kind, 0, 1)
    model_sd, optim_sd = get_state_dict(pipe, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(
        path, f"{name}-nested"))
    groups = [dict(g) for g in opt.param_groups]
    error = raised(lambda: set_state_dict(pipe, opt, model_state_dict=model_sd,
                                          optim_state_dict=optim_sd))
    assert error is None or error.startswith("OptimizerStateError"), error
    if error is not None:
        assert [dict(g) for g in opt.param_groups] == groups
    dist.barrier()
    return error


def _plain_by_helpers(path: str, expected: Dict[str, torch.Tensor]) -> Dict[str, int]:
    """A plain model's checkpoint (torch's helpers, nested and flattened, written by one
    process) loaded into pipeline 4 and pipeline 2 x tensor 2 with the same helpers."""
    plain = make("mlp")
    opt, sched = optimizer_of(plain)
    for step in range(3):
        x, y = batch("mlp", step, BATCH)
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(plain(x), y).backward()
        opt.step()
        sched.step()
    for route, options in (("flat", FLAT), ("nested", None)):
        if dist.get_rank() == 0:
            model_sd, optim_sd = get_state_dict(plain, opt, options=options)
            dcp.save({"model": model_sd, "optim": optim_sd, "sched": sched.state_dict()},
                     checkpoint_id=os.path.join(path, f"plain-{route}"), no_dist=True)
    dist.barrier()
    out = {}
    for route in ("flat", "nested"):
        for layout in (dict(pipeline=4), dict(pipeline=2, tensor=2)):
            pipe, opt, sched = build("mlp", **layout)
            load_by(route, os.path.join(path, f"plain-{route}"), pipe, opt, sched)
            train(pipe, opt, sched, "mlp", 3, 6)
            where = f"the plain model's {route} checkpoint into {layout}"
            out[where] = compare(recorded(pipe, opt), expected, where)
    return out


def _plain_and_back(path: str, expected: Dict[str, torch.Tensor]) -> int:
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
    compare(recorded(plain, opt), expected, "the plain model")
    dist.barrier()
    pipe, opt, sched = build("tied", 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ckpt.RngNotRestoredWarning)
        ckpt.load(replay, pipe, opt, sched)
    train(pipe, opt, sched, "tied", 3, 6)
    return compare(recorded(pipe, opt), expected, "from the plain model into pipeline 4")


CASES = {f.__name__: f for f in (resume_save, resume_load, layouts_save, layouts_load)}

if __name__ == "__main__":
    dist_cases.main(CASES)
