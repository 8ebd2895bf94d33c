"""Asynchronous PipeDream: per-micro-batch updates, weight stashing, vertical sync, memory."""
import copy

import pytest
import torch
from torch import nn

import fastpipe
from fastpipe.schedule import peak_inflight
from helpers import mlp

LR = 0.1


def scalar_stage(w: float) -> nn.Sequential:
    """h -> tanh(w * h): the weight gradient depends on the weight, so versions matter."""
    lin = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        lin.weight.fill_(w)
    return nn.Sequential(lin, nn.Tanh())


def sq_sum(out, y):
    return ((out - y) ** 2).sum()


def test_two_version_example_by_hand():
    """2 stages, 2 micro-batches (stage 0 runs F0 F1 B0 B1; stage 1 runs F0 B0 F1 B1): stage 1
    forwards micro-batch 1 with its updated weight, stage 0 backwards it with the weight its
    forward used (version 0), not the one its update after B0 made."""
    a0, b0 = 0.7, -1.3
    model = nn.Sequential(*scalar_stage(a0), *scalar_stage(b0))
    pipe = fastpipe.Pipe(model, chunks=2, balance=[2, 2], devices=["cpu"] * 2,
                         schedule="pipedream", checkpoint="never")
    x, y = torch.tensor([[0.5], [-0.9]]), torch.tensor([[0.2], [0.4]])
    opt = torch.optim.SGD(pipe.parameters(), lr=LR)
    pipe.train_step(x, y, sq_sum, loss_reduction="sum", optimizer=opt)

    t = torch.tanh
    dt = lambda z: 1 - t(z) ** 2  # noqa: E731
    h0, h1 = t(a0 * x[0, 0]), t(a0 * x[1, 0])  # both forwards on stage 0 use version 0
    # stage 1: micro-batch 0 with b0, update, micro-batch 1 with b1
    o0 = t(b0 * h0)
    g0 = 2 * (o0 - y[0, 0]) * dt(b0 * h0)
    b1 = b0 - LR * g0 * h0
    o1 = t(b1 * h1)
    g1 = 2 * (o1 - y[1, 0]) * dt(b1 * h1)
    b2 = b1 - LR * g1 * h1
    # stage 0: backward of 0 and of 1 both with a0 (the stashed version)
    a1 = a0 - LR * (g0 * b0) * dt(a0 * x[0, 0]) * x[0, 0]
    a2 = a1 - LR * (g1 * b1) * dt(a0 * x[1, 0]) * x[1, 0]
    without_stash = a1 - LR * (g1 * b1) * dt(a1 * x[1, 0]) * x[1, 0]
    torch.testing.assert_close(model[2].weight.item(), b2.item(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(model[0].weight.item(), a2.item(), rtol=1e-6, atol=1e-7)
    assert abs(a2 - without_stash) > 1e-4  # the example tells the two apart


def reference_pipedream(stages, inputs, targets, schedule, vertical_sync):
    """A sequential pure-PyTorch replay of ``schedule`` keeping every weight version."""
    versions = [[[p.detach().clone() for p in s.parameters()]] for s in stages]
    tags, used, graphs, pending = {}, {}, {}, [list(row) for row in schedule.actions]
    acts, grads = {}, {}
    while any(pending):
        for s, row in enumerate(pending):
            if not row:
                continue
            a, mb = row[0], row[0].microbatch
            if a.kind.value == "F" and (s == 0 or (s - 1, mb) in acts):
                v = len(versions[s]) - 1
                if vertical_sync:
                    v = tags.setdefault(mb, v) if s == 0 else tags[mb]
                weights = [w.clone().requires_grad_() for w in versions[s][v]]
                h = (inputs[mb] if s == 0 else acts[(s - 1, mb)]).detach().requires_grad_(s > 0)
                out = torch.func.functional_call(stages[s], dict(zip(
                    [n for n, _ in stages[s].named_parameters()], weights)), (h,))
                used[(s, mb)], graphs[(s, mb)] = v, (h, out, weights)
                acts[(s, mb)] = out.detach()
            elif a.kind.value == "B" and (s == len(stages) - 1 or (s + 1, mb) in grads):
                h, out, weights = graphs.pop((s, mb))
                if s == len(stages) - 1:
                    root, g = sq_sum(out, targets[mb]), torch.ones(())
                else:
                    root, g = out, grads[(s + 1, mb)]
                found = torch.autograd.grad(root, [h, *weights] if s else weights, g)
                if s:
                    grads[(s, mb)] = found[0]
                    found = found[1:]
                live = versions[s][-1]
                versions[s].append([w - LR * d for w, d in zip(live, found)])
            else:
                continue
            row.pop(0)
    return [v[-1] for v in versions], used


@pytest.mark.parametrize("vertical_sync", [False, True])
@pytest.mark.parametrize("stages,chunks", [(3, 5), (4, 6), (2, 3)])
def test_matches_sequential_reference(stages, chunks, vertical_sync):
    torch.manual_seed(0)
    model = nn.Sequential(*[layer for _ in range(stages)
                            for layer in (nn.Linear(3, 3), nn.Tanh())])
    parts = [copy.deepcopy(model[2 * s:2 * s + 2]) for s in range(stages)]
    x, y = torch.randn(chunks * 2, 3), torch.randn(chunks * 2, 3)
    pipe = fastpipe.Pipe(model, chunks=chunks, balance=[2] * stages, devices=["cpu"] * stages,
                         schedule="pipedream", vertical_sync=vertical_sync,
                         checkpoint="except_last")
    opt = torch.optim.SGD(pipe.parameters(), lr=LR)
    pipe.train_step(x, y, sq_sum, loss_reduction="sum", optimizer=opt)
    expected, _ = reference_pipedream(parts, list(x.split(2)), list(y.split(2)),
                                      pipe.plan(chunks), vertical_sync)
    actual = [list(model[2 * s:2 * s + 2].parameters()) for s in range(stages)]
    for s, (mine, theirs) in enumerate(zip(actual, expected)):
        for p, q in zip(mine, theirs):
            torch.testing.assert_close(p.detach(), q, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"stage {s}: {m}")


def test_vertical_sync_uses_one_version_index_per_micro_batch():
    model = nn.Sequential(*[nn.Linear(3, 3) for _ in range(3)])
    parts = [copy.deepcopy(model[s:s + 1]) for s in range(3)]
    x, y = torch.randn(6, 3), torch.randn(6, 3)
    plan = fastpipe.get_schedule("pipedream", 3, 6)
    _, free = reference_pipedream(parts, list(x.split(1)), list(y.split(1)), plan, False)
    _, synced = reference_pipedream(parts, list(x.split(1)), list(y.split(1)), plan, True)
    assert all(synced[(s, mb)] == synced[(0, mb)] for s in range(3) for mb in range(6))
    assert any(free[(s, mb)] != free[(0, mb)] for s in range(3) for mb in range(6))


@pytest.mark.parametrize("vertical_sync", [False, True])
def test_kept_versions_bounded_by_in_flight_micro_batches(vertical_sync):
    model = mlp(depth=8)
    pipe = fastpipe.Pipe(model, chunks=8, balance=[2, 2, 2, 2], devices=["cpu"] * 4,
                         schedule="pipedream", vertical_sync=vertical_sync)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.01)
    for _ in range(2):
        pipe.train_step(torch.randn(16, 8), torch.randn(16, 4), nn.MSELoss(), optimizer=opt)
    inflight = peak_inflight(pipe.plan(8))
    peaks = [v.peak for v in pipe._pipedream.versions.values()]
    # vertical sync also keeps the versions a downstream stage has moved past: at most p
    bound = [4] * 4 if vertical_sync else inflight
    assert all(1 <= p <= b for p, b in zip(peaks, bound)), (peaks, inflight)
    assert [v.version for v in pipe._pipedream.versions.values()] == [16] * 4


def test_converges_on_a_regression_task():
    torch.manual_seed(0)
    true = nn.Linear(8, 4)
    model = mlp(depth=4)
    pipe = fastpipe.Pipe(model, chunks=4, balance=[2, 2], devices=["cpu"] * 2,
                         schedule="pipedream")
    opt = torch.optim.Adam(pipe.parameters(), lr=0.01)
    x_test = torch.randn(64, 8)
    first = nn.MSELoss()(pipe(x_test), true(x_test)).item()
    for _ in range(60):
        x = torch.randn(32, 8)
        pipe.train_step(x, true(x).detach(), nn.MSELoss(), optimizer=opt)
    with torch.no_grad():
        last = nn.MSELoss()(pipe(x_test), true(x_test)).item()
    assert last < first / 5, (first, last)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_optimizer_argument_steps_once_after_the_flush(schedule):
    model = mlp()
    plain = copy.deepcopy(model)
    x, y = torch.randn(10, 8), torch.randn(10, 4)
    pipe = fastpipe.Pipe(model, chunks=3, balance=[3, 3], devices=["cpu"] * 2, schedule=schedule)
    opt = torch.optim.SGD(pipe.parameters(), lr=LR, momentum=0.9)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=LR, momentum=0.9)
    for _ in range(2):
        opt.zero_grad()
        plain_opt.zero_grad()
        pipe.train_step(x, y, nn.MSELoss(), optimizer=opt)
        nn.MSELoss()(plain(x), y).backward()
        plain_opt.step()
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_bad_arguments():
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    pipe = fastpipe.Pipe(mlp(), chunks=2, balance=[3, 3], devices=["cpu"] * 2,
                         schedule="pipedream")
    with pytest.raises(ValueError, match="pass optimizer="):
        pipe.train_step(x, y, nn.MSELoss())
    with pytest.raises(TypeError, match="optimizer must be"):
        pipe.train_step(x, y, nn.MSELoss(), optimizer="sgd")
    other = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ValueError, match="not the pipe's"):
        pipe.train_step(x, y, nn.MSELoss(), optimizer=other)
    with pytest.raises(NotImplementedError, match="LBFGS"):
        pipe.train_step(x, y, nn.MSELoss(), optimizer=torch.optim.LBFGS(pipe.parameters()))
    with pytest.raises(ValueError, match="vertical_sync"):
        fastpipe.Pipe(mlp(), chunks=2, balance=[3, 3], devices=["cpu"] * 2, vertical_sync=True)
    with pytest.raises(ValueError, match="virtual_stages"):
        fastpipe.Pipe(mlp(), chunks=2, devices=["cpu"] * 2, schedule="pipedream",
                      virtual_stages=2)


def test_tied_weights_are_refused():
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    model[2].weight = model[0].weight
    pipe = fastpipe.Pipe(model, chunks=2, balance=[2, 1], devices=["cpu"] * 2,
                         schedule="pipedream")
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    with pytest.raises(NotImplementedError, match="tied"):
        pipe.train_step(torch.randn(4, 4), torch.randn(4, 4), nn.MSELoss(), optimizer=opt)


def test_recommend_never_picks_pipedream():
    from fastpipe.schedule.recommend import recommend
    names = {r.name for r in recommend(4, 8)}
    assert "pipedream" not in names and "1f1b" in names
