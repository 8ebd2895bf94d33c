"""Pipelined vs plain module: same output, loss and gradients, for every schedule and mode."""
import copy

import pytest
import torch
from torch import nn

import fastpipe
from helpers import assert_same_grads, grads_of, mlp, reference

SCHEDULES = ["gpipe", "1f1b"]
MODES = ["never", "except_last", "always"]
CHUNKS = [1, 2, 3, 4, 8]


@pytest.mark.parametrize("batch", [24, 13], ids=["even", "uneven"])
@pytest.mark.parametrize("chunks", CHUNKS)
@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_train_step_matches_plain_model(schedule, checkpoint, chunks, batch):
    model = mlp(depth=6)
    plain = copy.deepcopy(model)
    x, y = torch.randn(batch, 8), torch.randn(batch, 4)
    loss_fn = nn.MSELoss()
    expected_loss, expected = reference(plain, x, y, loss_fn)

    pipe = fastpipe.Pipe(model, chunks=chunks, balance=[2, 1, 3], devices=["cpu"] * 3,
                         checkpoint=checkpoint, schedule=schedule)
    loss = pipe.train_step(x, y, loss_fn)

    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-7)
    assert_same_grads(grads_of(model), expected)


@pytest.mark.parametrize("batch", [24, 13], ids=["even", "uneven"])
@pytest.mark.parametrize("chunks", CHUNKS)
@pytest.mark.parametrize("checkpoint", MODES)
def test_forward_then_backward_matches_plain_model(checkpoint, chunks, batch):
    model = mlp(depth=6)
    plain = copy.deepcopy(model)
    x, y = torch.randn(batch, 8), torch.randn(batch, 4)
    expected_out = plain(x)
    expected_loss, expected = reference(plain, x, y, nn.MSELoss())

    pipe = fastpipe.Pipe(model, chunks=chunks, balance=[3, 3], devices=["cpu", "cpu"],
                         checkpoint=checkpoint)
    out = pipe(x)
    torch.testing.assert_close(out, expected_out, rtol=1e-6, atol=1e-7)
    loss = nn.MSELoss()(out, y)
    loss.backward()
    torch.testing.assert_close(loss.detach(), expected_loss, rtol=1e-5, atol=1e-7)
    assert_same_grads(grads_of(model), expected)


@pytest.mark.parametrize("cpu_workers", [1, 2, None])
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("stages", [1, 2, 4, 7])
def test_stage_counts_and_worker_threads(schedule, stages, cpu_workers):
    model = mlp(depth=7)
    plain = copy.deepcopy(model)
    x, y = torch.randn(10, 8), torch.randn(10, 4)
    expected_loss, expected = reference(plain, x, y, nn.MSELoss())
    pipe = fastpipe.Pipe(model, chunks=4, devices=["cpu"] * stages, schedule=schedule,
                         cpu_workers=cpu_workers)
    assert len(pipe.partitions) == stages
    loss = pipe.train_step(x, y, nn.MSELoss())
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-7)
    assert_same_grads(grads_of(model), expected)


def test_sum_reduction_and_gradient_accumulation():
    model = mlp()
    plain = copy.deepcopy(model)
    x, y = torch.randn(11, 8), torch.randn(11, 4)
    loss_fn = nn.MSELoss(reduction="sum")
    # two steps accumulate, as two backward() calls do
    for _ in range(2):
        plain_loss = loss_fn(plain(x), y)
        plain_loss.backward()
    pipe = fastpipe.Pipe(model, chunks=3, balance=[3, 3], devices=["cpu"] * 2, schedule="1f1b")
    for _ in range(2):
        loss = pipe.train_step(x, y, loss_fn, loss_reduction="sum")
    torch.testing.assert_close(loss, plain_loss.detach(), rtol=1e-5, atol=1e-5)
    assert_same_grads(grads_of(model), grads_of(plain), atol=1e-5)


def test_training_several_steps_tracks_plain_model():
    model = mlp()
    plain = copy.deepcopy(model)
    pipe = fastpipe.Pipe(model, chunks=4, balance=[2, 2, 2], devices=["cpu"] * 3, schedule="1f1b")
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    for step in range(5):
        x, y = torch.randn(16, 8), torch.randn(16, 4)
        opt.zero_grad()
        plain_opt.zero_grad()
        loss = pipe.train_step(x, y, nn.MSELoss())
        plain_loss = nn.MSELoss()(plain(x), y)
        plain_loss.backward()
        opt.step()
        plain_opt.step()
        torch.testing.assert_close(loss, plain_loss.detach(), rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


class Embed(nn.Module):
    """Takes a dict with integer tokens and a float scale; returns a tuple with a mask."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8)

    def forward(self, batch):
        h = self.emb(batch["tokens"]) * batch["scale"]
        return h, batch["tokens"] > 3


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, pair):
        h, mask = pair
        return torch.tanh(self.lin(h)) * mask.unsqueeze(-1), mask


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 3)

    def forward(self, pair):
        return {"logits": self.lin(pair[0].mean(1))}


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("checkpoint", MODES)
def test_nested_inputs_and_outputs(schedule, checkpoint):
    model = nn.Sequential(Embed(), Masked(), Masked(), Head())
    plain = copy.deepcopy(model)
    batch = {"tokens": torch.randint(0, 20, (9, 5)), "scale": 0.5}
    target = {"y": torch.randint(0, 3, (9,))}

    def loss_fn(out, tgt):
        return nn.functional.cross_entropy(out["logits"], tgt["y"])

    expected_loss, expected = reference(plain, batch, target, loss_fn)
    pipe = fastpipe.Pipe(model, chunks=4, balance=[1, 2, 1], devices=["cpu"] * 3,
                         checkpoint=checkpoint, schedule=schedule)
    loss = pipe.train_step(batch, target, loss_fn)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-7)
    assert_same_grads(grads_of(model), expected)
    with torch.no_grad():
        torch.testing.assert_close(pipe(batch)["logits"], plain(batch)["logits"])


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_autocast_reaches_the_stage_threads(schedule):
    model = mlp(width=16)
    plain = copy.deepcopy(model)
    x, y = torch.randn(12, 16), torch.randn(12, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected_out = plain(x)
        expected_loss, expected = reference(plain, x, y, nn.MSELoss())
        pipe = fastpipe.Pipe(model, chunks=3, balance=[3, 3], devices=["cpu"] * 2,
                             schedule=schedule)
        loss = pipe.train_step(x, y, nn.MSELoss())
        with torch.no_grad():
            out = pipe(x)
    assert out.dtype == expected_out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected_out, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(loss, expected_loss, rtol=2e-2, atol=2e-2)
    assert_same_grads(grads_of(model), expected, rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("cpu_workers", [1, 2])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_executor_holds_what_the_schedule_promises(schedule, cpu_workers):
    """Peak micro-batches held per stage equal the validator's figure: 1F1B really bounds memory."""
    pipe = fastpipe.Pipe(mlp(depth=8), chunks=8, balance=[2, 2, 2, 2], devices=["cpu"] * 4,
                         schedule=schedule, cpu_workers=cpu_workers)
    seen = []
    observe = pipe._workers.observe
    pipe._workers.observe = lambda step: (seen.append(dict(step.peak_inflight)), observe(step))
    pipe.train_step(torch.randn(16, 8), torch.randn(16, 4), nn.MSELoss())
    expected = pipe.plan().validate().peak_inflight
    assert tuple(seen[0][s] for s in range(4)) == tuple(expected)
    assert expected == ((8, 8, 8, 8) if schedule == "gpipe" else (4, 3, 2, 1))


def test_balance_by_time_feeds_pipe():
    model = mlp(depth=6)
    plain = copy.deepcopy(model)
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    balance = fastpipe.balance.by_time(3, model, x[:2])
    assert sum(balance) == 6 and len(balance) == 3
    pipe = fastpipe.Pipe(model, chunks=2, balance=balance, devices=["cpu"] * 3)
    expected_loss, expected = reference(plain, x, y, nn.MSELoss())
    torch.testing.assert_close(pipe.train_step(x, y, nn.MSELoss()), expected_loss)
    assert_same_grads(grads_of(model), expected)
