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


def reference_pipedream(stages, inputs, targets, schedule, vertical_sync, tie=None):
    """A sequential pure-PyTorch replay of ``schedule`` keeping every weight version.

    ``tie``: stage -> the name of one weight in that stage's module, all one tied weight (its
    value taken from the first such stage): it has versions of its own, updated with each
    micro-batch's gradient summed over its stages (in stage order) after the backward on its
    first stage, and every use by a micro-batch takes the version stage 0 tagged it with."""
    tie = tie or {}
    own = [[n for n, _ in s.named_parameters() if n != tie.get(i)] for i, s in enumerate(stages)]
    values = [dict(s.named_parameters()) for s in stages]
    versions = [[[values[i][n].detach().clone() for n in own[i]]] for i in range(len(stages))]
    tied = [values[min(tie)][tie[min(tie)]].detach().clone()] if tie else []
    tags, used, graphs, pending = {}, {}, {}, [list(row) for row in schedule.actions]
    acts, grads, shares = {}, {}, {}
    while any(pending):
        for s, row in enumerate(pending):
            if not row:
                continue
            a, mb = row[0], row[0].microbatch
            if a.kind.value == "F" and (s == 0 or (s - 1, mb) in acts):
                v = len(versions[s]) - 1
                if s == 0:
                    tags[mb] = v
                if vertical_sync:
                    v = tags[mb]
                weights = [w.clone().requires_grad_() for w in versions[s][v]]
                named = dict(zip(own[s], weights))
                if s in tie:
                    weights.append(tied[tags[mb]].clone().requires_grad_())
                    named[tie[s]] = weights[-1]
                h = (inputs[mb] if s == 0 else acts[(s - 1, mb)]).detach().requires_grad_(s > 0)
                out = torch.func.functional_call(stages[s], named, (h,))
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
                if s in tie:
                    shares[(s, mb)], found = found[-1], found[:-1]
                    if s == min(tie):
                        total = sum(shares[(u, mb)] for u in sorted(tie))
                        tied.append(tied[-1] - LR * total)
                live = versions[s][-1]
                versions[s].append([w - LR * d for w, d in zip(live, found)])
            else:
                continue
            row.pop(0)
    return [v[-1] for v in versions], used, tied


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
    expected, _, _ = reference_pipedream(parts, list(x.split(2)), list(y.split(2)),
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
    _, free, _ = reference_pipedream(parts, list(x.split(1)), list(y.split(1)), plan, False)
    _, synced, _ = reference_pipedream(parts, list(x.split(1)), list(y.split(1)), plan, True)
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


@pytest.mark.parametrize("vertical_sync", [False, True])
@pytest.mark.parametrize("stages,chunks,tied", [(3, 5, (0, 2)), (4, 6, (1, 3)), (2, 3, (0, 1)),
                                                 (4, 7, (0, 2, 3))])
def test_tied_weights_match_the_reference(stages, chunks, tied, vertical_sync):
    """A weight several stages share: one sequence of versions, updated after the backward on
    its first stage with each micro-batch's gradient summed over its stages, every use taking
    the micro-batch's tag; the other weights as without the tie."""
    torch.manual_seed(0)
    model = nn.Sequential(*[layer for _ in range(stages)
                            for layer in (nn.Linear(3, 3), nn.Tanh())])
    for s in tied[1:]:
        model[2 * s].weight = model[2 * tied[0]].weight
    parts = [copy.deepcopy(model[2 * s:2 * s + 2]) for s in range(stages)]
    x, y = torch.randn(chunks * 2 - 1, 3), torch.randn(chunks * 2 - 1, 3)  # uneven
    pipe = fastpipe.Pipe(model, chunks=chunks, balance=[2] * stages, devices=["cpu"] * stages,
                         schedule="pipedream", vertical_sync=vertical_sync,
                         checkpoint="except_last")
    opt = torch.optim.SGD(pipe.parameters(), lr=LR)
    assert [len(part) for part in x.chunk(chunks)] == [len(part) for part in x.split(2)]
    assert len({len(part) for part in x.split(2)}) > 1  # the last micro-batch is shorter
    pipe.train_step(x, y, sq_sum, loss_reduction="sum", optimizer=opt)
    expected, _, tie = reference_pipedream(parts, list(x.split(2)), list(y.split(2)),
                                           pipe.plan(chunks), vertical_sync,
                                           tie={s: f"{2 * s}.weight" for s in tied})
    torch.testing.assert_close(model[2 * tied[0]].weight.detach(), tie[-1], rtol=1e-5,
                               atol=1e-6)
    assert len(tie) == chunks + 1 and not torch.equal(tie[-1], tie[0])
    for s in range(stages):
        mine = [p for n, p in model[2 * s:2 * s + 2].named_parameters()
                if not (s in tied and n == f"{2 * s}.weight")]
        for p, q in zip(mine, expected[s]):
            torch.testing.assert_close(p.detach(), q, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"stage {s}: {m}")


class _NaNWeightGrad(torch.autograd.Function):
    """Identity on ``x`` whose weight ``p`` gets a NaN gradient on a micro-batch of one sample
    (the input gradient stays finite)."""

    @staticmethod
    def forward(ctx, x, p):
        ctx.bad = x.shape[0] == 1
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((1,), float("nan") if ctx.bad else 0.0)


class NaNWeightGrad(nn.Module):
    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.zeros(1))

    def forward(self, x):
        return _NaNWeightGrad.apply(x, self.p)


def test_vertical_sync_goes_on_after_a_call_stopped_by_a_non_finite_gradient():
    """Stage 1's weight gradient of the last micro-batch (one sample) is NaN: the call stops
    there, after stage 2's fourth update and before stage 1's, so the stages' update counts
    differ; the next call still gives each micro-batch one number of updates on every stage
    (it used to look for a version no stage had kept), a tied weight's included."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.Tanh()),
                          nn.Sequential(nn.Linear(4, 4), nn.Tanh(), NaNWeightGrad()),
                          nn.Sequential(nn.Linear(4, 4), nn.Tanh()))
    model[2][0].weight = model[0][0].weight
    pipe = fastpipe.Pipe(model, chunks=4, balance=[1, 1, 1], devices=["cpu"] * 3,
                         schedule="pipedream", vertical_sync=True)
    opt = torch.optim.SGD(pipe.parameters(), lr=LR)
    x, y = torch.randn(7, 4), torch.randn(7, 4)  # micro-batches of 2, 2, 2, 1
    with pytest.raises(fastpipe.NonFiniteError, match="stage 1 for micro-batch 3"):
        pipe.train_step(x, y, nn.MSELoss(), optimizer=opt)
    before = [v.version for v in pipe._pipedream.versions.values()]
    assert before[1:] == [3, 4], before
    x, y = torch.randn(8, 4), torch.randn(8, 4)  # micro-batches of 2: finite gradients
    pipe.train_step(x, y, nn.MSELoss(), optimizer=opt)
    assert [v.version for v in pipe._pipedream.versions.values()] == [b + 4 for b in before]
    assert all(torch.isfinite(p).all() for p in pipe.parameters())


def test_recommend_never_picks_pipedream():
    from fastpipe.schedule.recommend import recommend
    names = {r.name for r in recommend(4, 8)}
    assert "pipedream" not in names and "1f1b" in names
