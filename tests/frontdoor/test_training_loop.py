"""The training loop around a step: global gradient clipping, non-finite steps and gradient
accumulation, on ``Pipe`` (in this process) and on ``DistributedPipe`` (gloo ranks, every layout:
pipeline only, pipeline x data, pipeline x tensor, pipeline x FSDP), against the plain model."""
import copy
import math

import pytest
import torch
from torch import nn

import fastpipe
from dist_launch import assert_all_ok, launch
from helpers import assert_same_grads, grads_of

TOL = dict(rtol=1e-5, atol=1e-6)
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zbv", 2)]


def tied_model(width: int = 8) -> nn.Sequential:
    """First and last layers share one weight (an embedding and an LM head)."""
    torch.manual_seed(0)
    layers = [nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
              nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width)]
    layers[-1].weight = layers[0].weight
    return nn.Sequential(*layers)


def batch(seed: int, size: int = 10, width: int = 8) -> tuple:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(size, width, generator=g), torch.randn(size, width, generator=g)


def pipe_of(model: nn.Module, schedule: str = "1f1b", v: int = 1, **kwargs) -> fastpipe.Pipe:
    kwargs.setdefault("chunks", 4)
    return fastpipe.Pipe(model, devices=["cpu", "cpu"], schedule=schedule, virtual_stages=v,
                         **kwargs)


# ------------------------------------------------------------------------------ clipping
@pytest.mark.parametrize("schedule, v", SCHEDULES)
@pytest.mark.parametrize("checkpoint", ["never", "except_last"])
def test_max_grad_norm_clips_as_torch_does_on_the_plain_model(schedule, v, checkpoint):
    plain = tied_model()
    pipe = pipe_of(copy.deepcopy(plain), schedule, v, checkpoint=checkpoint)
    opt, opt_ref = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (pipe, plain))
    for step in range(2):
        x, y = batch(step, size=9)  # uneven micro-batches
        plain.zero_grad(set_to_none=True)
        nn.functional.mse_loss(plain(x), y).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05)
        pipe.zero_grad(set_to_none=True)
        pipe.train_step(x, y, nn.functional.mse_loss, optimizer=opt, max_grad_norm=0.05)
        opt_ref.step()
        assert pipe.last_step.grad_norm == pytest.approx(float(ref_norm), rel=1e-6)
        assert_same_grads(grads_of(pipe), grads_of(plain), **TOL)
    for (name, p), (_, q) in zip(pipe.named_parameters(), plain.named_parameters()):
        torch.testing.assert_close(p, q, **TOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.5, math.inf])
def test_clip_grad_norm_equals_torchs_for_every_norm(norm_type):
    plain = tied_model()
    pipe = pipe_of(copy.deepcopy(plain))
    x, y = batch(1)
    nn.functional.mse_loss(plain(x), y).backward()
    pipe.train_step(x, y, nn.functional.mse_loss)
    expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.1, norm_type)
    total = pipe.clip_grad_norm_(0.1, norm_type=norm_type)
    assert total.dtype == expected.dtype
    torch.testing.assert_close(total, expected, rtol=1e-6, atol=0)
    assert_same_grads(grads_of(pipe), grads_of(plain), **TOL)


def test_clip_grad_norm_does_not_amplify_and_counts_a_tied_weight_once():
    plain = tied_model()
    pipe = pipe_of(copy.deepcopy(plain))
    x, y = batch(2)
    nn.functional.mse_loss(plain(x), y).backward()
    pipe.train_step(x, y, nn.functional.mse_loss)
    before = grads_of(pipe)
    total = pipe.clip_grad_norm_(1e6)  # far above the norm: nothing changes
    assert_same_grads(grads_of(pipe), before, rtol=0, atol=0)
    unique = torch.stack([p.grad.norm() for p in plain.parameters()]).norm()  # tie once
    torch.testing.assert_close(total, unique)


def test_clip_grad_norm_error_if_nonfinite_raises_before_clipping():
    pipe = pipe_of(tied_model())
    pipe.train_step(*batch(3), nn.functional.mse_loss)
    first = next(pipe.parameters())
    first.grad[0, 0] = math.inf
    before = grads_of(pipe)
    with pytest.raises(fastpipe.NonFiniteError, match="'0.weight'") as caught:
        pipe.clip_grad_norm_(1.0, error_if_nonfinite=True)
    assert caught.value.parameter == "0.weight" and caught.value.stage == 0
    assert_same_grads(grads_of(pipe), before, rtol=0, atol=0)


def test_a_grad_scaler_unscales_before_clipping():
    plain = tied_model()
    pipe = pipe_of(copy.deepcopy(plain))
    opt, opt_ref = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (pipe, plain))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    x, y = batch(4)
    nn.functional.mse_loss(plain(x), y).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05)
    opt_ref.step()
    pipe.train_step(x, y, nn.functional.mse_loss, scaler=scaler, optimizer=opt,
                    max_grad_norm=0.05)
    assert pipe.last_step.grad_norm == pytest.approx(float(ref_norm), rel=1e-6)
    for p, q in zip(pipe.parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, **TOL)


# ------------------------------------------------------------------------------ non-finite
def nan_batch(seed: int = 5) -> tuple:
    x, y = batch(seed)
    x[7, 3] = math.nan  # micro-batch 2 of 4 (sizes 3, 3, 3, 1)
    return x, y


def test_a_nan_loss_raises_before_the_optimizer_step():
    pipe = pipe_of(tied_model())
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in pipe.parameters()]
    with pytest.raises(fastpipe.NonFiniteError, match="micro-batch 2") as caught:
        pipe.train_step(*nan_batch(), nn.functional.mse_loss, optimizer=opt)
    assert caught.value.microbatch == 2 and caught.value.stage == 1
    assert not opt.state
    assert all(torch.equal(a, b) for a, b in zip(before, pipe.parameters()))
    pipe.zero_grad(set_to_none=True)  # the pipe goes on
    assert math.isfinite(float(pipe.train_step(*batch(6), nn.functional.mse_loss,
                                               optimizer=opt)))


def test_skip_leaves_weights_and_optimizer_alone_and_counts_the_step():
    plain = tied_model()
    pipe = pipe_of(copy.deepcopy(plain))
    opt, opt_ref = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (pipe, plain))
    loss = pipe.train_step(*nan_batch(), nn.functional.mse_loss, optimizer=opt,
                           nonfinite="skip")
    assert math.isnan(float(loss))
    assert pipe.last_step.skipped and pipe.skipped_steps == 1 and not opt.state
    for step in range(2):  # then it trains as the plain model that never saw that batch
        x, y = batch(10 + step)
        opt.zero_grad(set_to_none=True)
        opt_ref.zero_grad(set_to_none=True)
        pipe.train_step(x, y, nn.functional.mse_loss, optimizer=opt, nonfinite="skip")
        nn.functional.mse_loss(plain(x), y).backward()
        opt_ref.step()
        assert not pipe.last_step.skipped
    assert pipe.skipped_steps == 1
    for p, q in zip(pipe.parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, **TOL)


class InfGradient(nn.Module):
    """Multiplies by a weight whose gradient is inf; the input's gradient stays finite."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return _Inf.apply(x, self.scale)


class _Inf(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        return x * scale

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((1,), math.inf)


def test_an_inf_gradient_on_the_first_stage_is_named():
    pipe = pipe_of(nn.Sequential(InfGradient(), *tied_model()))
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    before = [p.detach().clone() for p in pipe.parameters()]
    with pytest.raises(fastpipe.NonFiniteError, match="'0.scale'") as caught:
        pipe.train_step(*batch(7), nn.functional.mse_loss, optimizer=opt)
    assert caught.value.parameter == "0.scale" and caught.value.stage == 0
    assert all(torch.equal(a, b) for a, b in zip(before, pipe.parameters()))
    pipe.zero_grad(set_to_none=True)
    pipe.train_step(*batch(7), nn.functional.mse_loss, optimizer=opt, nonfinite="ignore")
    assert not bool(torch.isfinite(pipe.module[0].scale).all())  # 'ignore' lets it through


def test_a_nan_under_pipedream_stops_the_stage_before_its_update():
    pipe = pipe_of(tied_model_untied(), "pipedream", chunks=4)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    with pytest.raises(fastpipe.NonFiniteError, match="micro-batch 2"):
        pipe.train_step(*nan_batch(), nn.functional.mse_loss, optimizer=opt)
    assert all(bool(torch.isfinite(p).all()) for p in pipe.parameters())


def tied_model_untied() -> nn.Sequential:
    model = tied_model()
    model[-1].weight = nn.Parameter(model[-1].weight.detach().clone())
    return model


# ------------------------------------------------------------------------------ accumulation
@pytest.mark.parametrize("schedule, v", SCHEDULES)
def test_gradients_accumulate_over_calls_as_the_plain_models(schedule, v):
    plain = tied_model()
    pipe = pipe_of(copy.deepcopy(plain), schedule, v)
    for call in range(3):
        x, y = batch(20 + call, size=7)
        nn.functional.mse_loss(plain(x), y).backward()
        if call < 2:
            with pipe.no_sync():  # changes nothing in one process
                pipe.train_step(x, y, nn.functional.mse_loss)
        else:
            pipe.train_step(x, y, nn.functional.mse_loss, max_grad_norm=0.1)
    torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.1)
    assert_same_grads(grads_of(pipe), grads_of(plain), **TOL)


# ------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("kwargs, error, match", [
    (dict(max_grad_norm=0), ValueError, "max_grad_norm must be a positive"),
    (dict(max_grad_norm=-1.0), ValueError, "max_grad_norm must be a positive"),
    (dict(max_grad_norm=math.nan), ValueError, "max_grad_norm must be a positive"),
    (dict(max_grad_norm=True), ValueError, "max_grad_norm must be a positive"),
    (dict(nonfinite="warn"), ValueError, "nonfinite='warn'"),
    (dict(nonfinite="skip"), ValueError, "needs optimizer"),
])
def test_bad_arguments_are_refused_before_any_work(kwargs, error, match):
    pipe = pipe_of(tied_model())
    with pytest.raises(error, match=match):
        pipe.train_step(*batch(8), nn.functional.mse_loss, **kwargs)
    assert all(p.grad is None for p in pipe.parameters())
    pipe.train_step(*batch(8), nn.functional.mse_loss)  # and the pipe still works


@pytest.mark.parametrize("max_norm, norm_type", [(0.0, 2.0), (-1, 2.0), (1.0, 0), (1.0, "l2")])
def test_clip_grad_norm_refuses_bad_arguments(max_norm, norm_type):
    pipe = pipe_of(tied_model())
    with pytest.raises(ValueError, match="max_norm|norm_type"):
        pipe.clip_grad_norm_(max_norm, norm_type=norm_type)


def test_no_sync_refuses_an_optimizer_and_nesting():
    pipe = pipe_of(tied_model())
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    with pipe.no_sync():
        with pytest.raises(ValueError, match="inside pipe.no_sync"):
            pipe.train_step(*batch(9), nn.functional.mse_loss, optimizer=opt)
        with pytest.raises(RuntimeError, match="already active"):
            with pipe.no_sync():
                pass
    assert all(p.grad is None for p in pipe.parameters())


def test_pipedream_refuses_clipping_and_skipping():
    pipe = pipe_of(tied_model_untied(), "pipedream")
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    with pytest.raises(NotImplementedError, match="max_grad_norm"):
        pipe.train_step(*batch(9), nn.functional.mse_loss, optimizer=opt, max_grad_norm=1.0)
    with pytest.raises(NotImplementedError, match="nonfinite='skip'"):
        pipe.train_step(*batch(9), nn.functional.mse_loss, optimizer=opt, nonfinite="skip")


# ------------------------------------------------------------------------------ across ranks
def run(world: int, runs: list, p2p: str = "auto", limit: float = 180.0) -> list:
    results = assert_all_ok(launch("several", world, limit=limit, args={"runs": runs}, p2p=p2p,
                                   script="train_loop_cases.py"))
    return [r["runs"] for r in results]


@pytest.mark.parametrize("world, layout, p2p", [
    (2, "pipeline", "tagged"), (2, "pipeline", "grouped"), (4, "pipeline", "auto"),
    (4, "data", "auto"), (4, "tensor", "auto"), (4, "fsdp", "auto")])
def test_clipping_across_ranks_uses_the_whole_models_norm(world, layout, p2p):
    runs = [["clipping", {"layout": layout}]]
    if layout == "pipeline" and world == 4:
        runs.append(["clipping", {"layout": layout, "norm_type": math.inf}])
    per_rank = run(world, runs, p2p)
    for results in zip(*per_rank):  # every rank the same norms
        assert all(r == results[0] for r in results)


def test_nonfinite_steps_across_two_ranks_raise_or_skip_alike():
    runs = [["nonfinite", {"layout": "pipeline", "where": where, "mode": mode}]
            for where in ("input", "stage0") for mode in ("raise", "skip")]
    per_rank = run(2, runs)
    for rank_runs in per_rank:
        nan_raise, nan_skip, inf_raise, inf_skip = rank_runs
        assert nan_raise["found"]["microbatch"] == 2 and nan_raise["found"]["rank"] == 1
        assert "never arrived" not in nan_raise["found"]["message"]
        assert inf_raise["found"]["parameter"] == "0.scale" and inf_raise["found"]["rank"] == 0
        assert nan_skip["skipped"] and inf_skip["skipped"]
        assert not nan_skip["found"] and not inf_skip["found"]
    assert per_rank[0] == per_rank[1]


def test_nonfinite_with_data_parallel_replicas_agrees_on_every_rank():
    runs = [["nonfinite", {"layout": "data", "where": "input", "mode": mode}]
            for mode in ("raise", "skip")]
    per_rank = run(4, runs)
    raised = [rank_runs[0]["found"] for rank_runs in per_rank]
    assert all(found for found in raised)  # every rank raised
    assert raised[2]["microbatch"] == 2 and raised[2]["rank"] == 2  # the NaN's last stage
    assert all(rank_runs[1]["skipped"] for rank_runs in per_rank)


@pytest.mark.parametrize("world, layout, variants", [
    (2, "pipeline", [dict(), dict(no_sync=True)]),
    (4, "data", [dict(no_sync=True), dict(tokens=True), dict(no_sync=True, tokens=True)]),
    (4, "tensor", [dict(no_sync=True), dict(no_sync=True, tokens=True)]),
    (4, "fsdp", [dict(), dict(no_sync=True), dict(tokens=True)]),
])
def test_accumulation_across_ranks_equals_the_plain_model(world, layout, variants):
    run(world, [["accumulation", dict(layout=layout, **v)] for v in variants])


def test_accumulation_on_the_grouped_transport():
    run(2, [["accumulation", {"layout": "pipeline", "no_sync": True}]], p2p="grouped")


def test_bad_arguments_across_ranks_keep_the_pipe_usable():
    for rank_runs in run(2, [["misuse", {}]]):
        assert rank_runs[0]["errors"] == ["ValueError"] * 4 + ["RuntimeError"]
