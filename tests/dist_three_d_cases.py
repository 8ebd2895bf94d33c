"""Distributed cases: 3-D parallelism (pipeline x data x tensor x FSDP, fastpipe.parallel).

Every schedule on a mesh against the plain model on the global batch (optimizer steps and
FSDP's gradient reductions included) for three kinds of model, torch.distributed.checkpoint
across 3-D layouts, bad 3-D arguments, PipeDream and token-mean losses on a mesh.
"""
from __future__ import annotations

from typing import Any, Dict, List

import torch
from dist_common import (TOL, WIDTH, DistributedPipe, check_full_grads, data, full, model,
                         padded, skip_model, tied_model, token_loss, token_mean_of, tp_plan)
from dist_schedule_cases import pipedream
from torch import nn

from fastpipe.distributed import init_mesh


def mlp_kind(depth: int, tensor: int) -> tuple:
    """The test model, its plan, and the width of its output."""
    return model(depth), (tp_plan(depth) if tensor > 1 else None), 4


def skip_kind(depth: int, tensor: int) -> tuple:
    """skip_model (skips across ranks) with two column/row-parallel pairs."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    plan = {"2": ColwiseParallel(), "4": RowwiseParallel(), "9": ColwiseParallel(),
            "11": RowwiseParallel()}
    return skip_model(), (plan if tensor > 1 else None), 4


def tied_kind(depth: int, tensor: int) -> tuple:
    """tied_model (first and last layer share a weight, on different ranks); the tied layers
    stay replicated across the tensor-parallel group, the others are split."""
    plan = tp_plan(depth)
    del plan["0.0"], plan["1.0"], plan[str(depth - 1)]
    return tied_model(), (plan if tensor > 1 else None), 2 * 4


batch_of = data  # three_d's argument ``data`` (the mesh's data size) hides data()

KINDS = {"mlp": mlp_kind, "skip": skip_kind, "tied": tied_kind}


def count_fsdp_reductions() -> List[int]:
    """Count FSDP2's gradient reductions (one per FSDP unit per reduction) from now on."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group_module
    calls = [0]
    original = group_module.foreach_reduce

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(*args, **kwargs)
    group_module.foreach_reduce = counted
    return calls


def three_d(pipeline: int, schedules: List[List[Any]], data: int = 1, tensor: int = 1,
            shard: int = 1, data_parallel: str = "replicate", per_replica: int = 7,
            chunks: int = 3, steps: int = 2, balance: Any = None, kind: str = "mlp",
            keep_gathered: bool = True) -> Dict:
    """Pipeline x data x shard x tensor on one mesh: for every (schedule, virtual_stages,
    checkpoint), ``steps`` optimizer steps whose loss and (gathered) gradients equal the plain
    model's on the global batch (each replica reads its slice; uneven micro-batches), and
    parameters that stay equal to the plain model's after each SGD step. With FSDP, the
    number of gradient reductions per step (one per FSDP unit when they are deferred)."""
    mesh = init_mesh(pipeline=pipeline, data=data, tensor=tensor, shard=shard, timeout=60)
    replicas, replica = mesh.replicas, mesh.replica
    reductions = count_fsdp_reductions() if data_parallel == "fsdp" else [0]
    worst, shapes, per_step, boundaries = 0.0, {}, {}, {}
    for name, v, mode in schedules:
        depth = max(8, 2 * pipeline * v)
        plain, _, width = KINDS[kind](depth, tensor)
        opt_ref = torch.optim.SGD(plain.parameters(), lr=0.1)
        source, plan, _ = KINDS[kind](depth, tensor)
        pipe = DistributedPipe(source, chunks=chunks, schedule=name, virtual_stages=v,
                               checkpoint=mode, balance=balance, mesh=mesh, tensor_parallel=plan,
                               data_parallel=data_parallel, timeout=60)
        if not keep_gathered:  # FSDP2's own policy: reshard and reduce every micro-batch
            pipe.parallel.sharded_stages.set_keep_gathered(False)
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        last = len(pipe.balance) - 1
        units = sum(1 for m in pipe.module.modules() if type(m).__name__.startswith("FSDP"))
        counts = []
        for step in range(steps):
            x, y = batch_of(replicas * per_replica, seed=step)
            y = y.repeat(1, width // 4)
            plain.zero_grad(set_to_none=True)
            ref_loss = nn.functional.mse_loss(plain(x), y)
            ref_loss.backward()
            ref = {n: p.grad.clone() for n, p in plain.named_parameters(remove_duplicate=False)}
            mine = slice(replica * per_replica, (replica + 1) * per_replica)
            opt.zero_grad(set_to_none=True)
            before = reductions[0]
            loss = pipe.train_step(x[mine] if 0 in pipe.stages else None,
                                   y[mine] if last in pipe.stages else None,
                                   nn.functional.mse_loss)
            counts.append(reductions[0] - before)
            where = f"{kind} {name} v={v} {mode} step {step}"
            torch.testing.assert_close(loss, ref_loss.detach(), **TOL,
                                       msg=lambda m: f"{where}: loss {m}")
            worst = max(worst, check_full_grads(pipe, ref, where))
            opt.step()
            opt_ref.step()
            after = dict(plain.named_parameters(remove_duplicate=False))
            for n, p in pipe.named_parameters():
                torch.testing.assert_close(full(p.detach()), after[n].detach(), **TOL,
                                           msg=lambda m: f"{where}: parameter {n}: {m}")
        out = pipe(x[mine])  # forward only: the last stage's output, replicated over TP
        if out is not None:
            torch.testing.assert_close(out, plain(x[mine]).detach(), **TOL)
        shapes[name] = sorted({str(tuple(getattr(p, "to_local", lambda: p)().shape))
                               for p in pipe.parameters()})
        per_step[name] = {"reductions": counts, "units": units}
        boundaries[name] = {str(k): b for k, b in pipe.parallel.report().items()}
    return {"worst": worst, "coordinates": mesh.coordinates, "local_shapes": shapes,
            "fsdp": per_step, "boundaries": boundaries}


def three_d_checkpoint(path: str) -> Dict:
    """torch.distributed.checkpoint across 3-D layouts (4 ranks): trained at pipeline 2 x
    tensor 2, saved (DTensor shards under plain names), loaded at pipeline 2 x FSDP 2, at
    pipeline 4 without a mesh and into the plain model; saved again from the FSDP layout and
    loaded back into a tensor-parallel one. A plain-model state dict loads into sharded
    parameters too (load_state_dict). Every loaded layout's next step equals the plain model's."""
    import torch.distributed.checkpoint as dcp
    depth = 8
    mesh_tp = init_mesh(pipeline=2, tensor=2, timeout=60)
    mesh_fsdp = init_mesh(pipeline=2, shard=2, timeout=60)
    trained = DistributedPipe(model(depth), chunks=2, mesh=mesh_tp,
                              tensor_parallel=tp_plan(depth), timeout=60)
    opt = torch.optim.SGD(trained.parameters(), lr=0.5)
    trained.train_step(*data(6), nn.functional.mse_loss, optimizer=opt)  # weights moved
    dcp.save(trained.state_dict(), checkpoint_id=f"{path}/tp")
    plain = model(depth)
    whole = plain.state_dict()
    dcp.load(whole, checkpoint_id=f"{path}/tp", no_dist=True)  # the plain model, alone
    plain.load_state_dict(whole)
    moved = not torch.equal(plain[0][0].weight, model(depth)[0][0].weight)
    x, y = data(6, seed=9)
    expected = nn.functional.mse_loss(plain(x), y).detach()
    sharded = DistributedPipe(model(depth), chunks=3, mesh=mesh_fsdp, data_parallel="fsdp",
                              timeout=60)
    state = sharded.state_dict()
    dcp.load(state, checkpoint_id=f"{path}/tp")
    sharded.load_state_dict(state)
    flat = DistributedPipe(model(depth), chunks=2, schedule="gpipe", balance=[2, 2, 2, 2],
                           timeout=60)
    state = flat.state_dict()
    dcp.load(state, checkpoint_id=f"{path}/tp")
    flat.load_state_dict(state)
    for n, p in flat.named_parameters():
        torch.testing.assert_close(p, plain.get_parameter(n), rtol=0, atol=0)
    for n, p in sharded.named_parameters():
        torch.testing.assert_close(full(p.detach()), plain.get_parameter(n), rtol=0, atol=0)
    dcp.save(sharded.state_dict(), checkpoint_id=f"{path}/fsdp")
    again = DistributedPipe(model(depth), chunks=2, mesh=mesh_tp, tensor_parallel=tp_plan(depth),
                            timeout=60)
    state = again.state_dict()
    dcp.load(state, checkpoint_id=f"{path}/fsdp")
    again.load_state_dict(state)
    from_plain = DistributedPipe(model(depth), chunks=2, mesh=mesh_fsdp, data_parallel="fsdp",
                                 timeout=60)
    from_plain.load_state_dict(plain.state_dict())  # full tensors cut into this rank's shards
    losses = {}
    for label, pipe, replicas in (("fsdp", sharded, 2), ("flat", flat, 1), ("tp", again, 1),
                                  ("plain into fsdp", from_plain, 2)):
        r = pipe.mesh.replica if pipe.mesh is not None else 0
        part = slice(r * 6 // replicas, (r + 1) * 6 // replicas)
        loss = pipe.train_step(x[part], y[part], nn.functional.mse_loss)
        torch.testing.assert_close(loss, expected, **TOL, msg=lambda m: f"{label}: {m}")
        losses[label] = loss.item()
    return {"moved": moved, "losses": losses, "expected": expected.item(),
            "keys": sorted(trained.state_dict())}


def bad_3d_arguments() -> Dict[str, tuple]:
    """The bad 3-D arguments ``three_d_errors`` tries: label -> (build(source), source model)."""
    from torch.distributed.tensor.parallel import ColwiseParallel
    mesh = init_mesh(pipeline=2, tensor=2, timeout=60)
    fsdp_mesh = init_mesh(pipeline=2, shard=2, timeout=60)
    pp, _ = init_mesh(pipeline=4)  # the two-group form still unpacks
    narrow = nn.Sequential(nn.Linear(WIDTH, 6), nn.Tanh(), nn.Linear(6, 4), nn.Tanh())
    cases = {
        "mesh_size": (lambda m: init_mesh(pipeline=3), None),
        "not_a_mesh": (lambda m: DistributedPipe(m, mesh=mesh.device_mesh,
                                                 tensor_parallel=tp_plan(8)), model()),
        "missing_submodule": (lambda m: DistributedPipe(
            m, mesh=mesh, tensor_parallel={"0.0": ColwiseParallel(), "9.0": ColwiseParallel()}),
            model()),
        "width": (lambda m: DistributedPipe(
            m, mesh=init_mesh(pipeline=1, tensor=4), tensor_parallel={"0": ColwiseParallel()}),
            narrow),
        "pipedream_fsdp": (lambda m: DistributedPipe(m, schedule="pipedream", mesh=fsdp_mesh,
                                                     data_parallel="fsdp"), model()),
        "mesh_and_group": (lambda m: DistributedPipe(m, mesh=mesh, process_group=pp,
                                                     tensor_parallel=tp_plan(8)), model()),
        "no_plan": (lambda m: DistributedPipe(m, mesh=mesh), model()),
        "shard_without_fsdp": (lambda m: DistributedPipe(m, mesh=fsdp_mesh), model()),
        "fsdp_tied": (lambda m: DistributedPipe(m, mesh=fsdp_mesh, data_parallel="fsdp"),
                      tied_model()),
        "tp_tied": (lambda m: DistributedPipe(m, mesh=mesh, tensor_parallel=tp_plan(8)),
                    tied_model()),
        "plan_without_mesh": (lambda m: DistributedPipe(m, tensor_parallel=tp_plan(8)),
                              model()),
        "bad_mode": (lambda m: DistributedPipe(m, mesh=fsdp_mesh, data_parallel="zero3"),
                     model()),
    }
    return cases


def three_d_errors() -> Dict:
    """Bad 3-D arguments (4 ranks): each raises a typed error naming the argument and the fix,
    before any work, with the model untouched (same parameter objects and values)."""
    cases = bad_3d_arguments()
    out = {}
    for label, (build, source) in cases.items():
        before = ([(p, p.detach().clone()) for p in source.parameters()]
                  if source is not None else [])
        try:
            build(source)
            out[label] = {"error": None}
            continue
        except Exception as error:  # noqa: BLE001 - reported to the test
            out[label] = {"error": type(error).__name__, "message": str(error)}
        if source is not None:
            now = list(source.parameters())
            out[label]["untouched"] = len(now) == len(before) and all(
                p is q and type(p) is nn.Parameter and torch.equal(p, v)
                for p, (q, v) in zip(now, before))
    return out


def three_d_pipedream(steps: int = 2) -> Dict:
    """schedule='pipedream' on pipeline 2 x tensor 2 (see ``pipedream``)."""
    return pipedream(steps, tensor=2)


def three_d_token_mean(tensor: int = 1, shard: int = 1) -> Dict:
    """(loss_sum, count) losses on a mesh: counts differ between the batch slices; the loss
    and the gathered gradients are the plain model's mean over every counted position."""
    mesh = init_mesh(pipeline=2, tensor=tensor, shard=shard, timeout=60)
    plain = model()
    x, targets = padded(12)
    ref_loss = token_mean_of(plain, x, targets)
    ref_loss.backward()
    pipe = DistributedPipe(model(), chunks=3, mesh=mesh,
                           tensor_parallel=tp_plan(8) if tensor > 1 else None,
                           data_parallel="fsdp" if shard > 1 else "replicate", timeout=60)
    part = 12 // mesh.replicas
    mine = slice(mesh.replica * part, (mesh.replica + 1) * part)
    loss = pipe.train_step(x[mine], (targets[0][mine], targets[1][mine]), token_loss)
    torch.testing.assert_close(loss, ref_loss.detach(), **TOL)
    check_full_grads(pipe, {n: p.grad for n, p in plain.named_parameters()}, "token mean")
    return {"ok": True}


def three_d_runs(runs: List[Dict[str, Any]]) -> Dict:
    """Several three_d runs in the same processes, each result kept (in order)."""
    return {"runs": [three_d(**args) for args in runs]}
