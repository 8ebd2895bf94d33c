"""Recomputation replays the forward exactly, random numbers included."""
import copy

import pytest
import torch
from torch import nn

import fastpipe
from fastpipe.policies.checkpoint import MODES, RngReplay, checkpoint_stop
from helpers import assert_same_grads, grads_of


def dropout_model():
    return nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.5), nn.ReLU(), nn.Linear(32, 32),
                         nn.Dropout(0.3), nn.Tanh(), nn.Linear(32, 4))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("checkpoint", ["except_last", "always"])
def test_dropout_recompute_matches_stored_activations(schedule, checkpoint):
    """Gradients with recompute equal those without: the recomputed masks are the original ones."""
    base = dropout_model()
    x, y = torch.randn(12, 16), torch.randn(12, 4)
    results = {}
    for mode in ("never", checkpoint):
        model = copy.deepcopy(base)
        pipe = fastpipe.Pipe(model, chunks=4, balance=[2, 3, 2], devices=["cpu"] * 3,
                             checkpoint=mode, schedule=schedule)
        torch.manual_seed(1234)
        loss = pipe.train_step(x, y, nn.MSELoss())
        results[mode] = (loss, grads_of(model))
        assert [s.rng.stochastic for s in pipe._stages] == [True, True, False]
    torch.testing.assert_close(results[checkpoint][0], results["never"][0], rtol=0, atol=0)
    assert_same_grads(results[checkpoint][1], results["never"][1], rtol=1e-6, atol=1e-7)


def test_dropout_is_seeded_by_the_global_seed_and_varies_by_step():
    model = dropout_model()
    pipe = fastpipe.Pipe(model, chunks=3, balance=[2, 5], devices=["cpu"] * 2)
    x, y = torch.randn(9, 16), torch.randn(9, 4)
    torch.manual_seed(7)
    a = pipe.train_step(x, y, nn.MSELoss())
    b = pipe.train_step(x, y, nn.MSELoss())
    torch.manual_seed(7)
    c = pipe.train_step(x, y, nn.MSELoss())
    assert a.item() == c.item()
    assert a.item() != b.item()


@pytest.mark.parametrize("other", [m for m in MODES if m != "never"])
def test_forward_path_recompute_replays_dropout(other):
    """pipe(x) then backward: every mode gives 'never''s gradients, dropout included."""
    base = dropout_model()
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    grads = []
    for mode in ("never", other):
        model = copy.deepcopy(base)
        pipe = fastpipe.Pipe(model, chunks=4, balance=[3, 4], devices=["cpu"] * 2, checkpoint=mode)
        torch.manual_seed(99)
        nn.MSELoss()(pipe(x), y).backward()
        grads.append(grads_of(model))
    assert_same_grads(grads[1], grads[0], rtol=1e-6, atol=1e-7)


class Recorder(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.flags = []

    def forward(self, x):
        self.flags.append((fastpipe.is_recomputing(), fastpipe.is_checkpointing()))
        return self.lin(x)


@pytest.mark.parametrize("checkpoint,expected", [
    ("never", [(False, False)] * 3),
    ("except_last", [(False, True)] * 2 + [(False, False)] + [(True, False)] * 2),
    ("always", [(False, True)] * 3 + [(True, False)] * 3),
])
def test_is_recomputing(checkpoint, expected):
    rec = Recorder()
    pipe = fastpipe.Pipe(nn.Sequential(nn.Linear(4, 4), rec), chunks=3, balance=[1, 1],
                         devices=["cpu"] * 2, checkpoint=checkpoint)
    pipe.train_step(torch.randn(6, 4), torch.randn(6, 4), nn.MSELoss())
    assert sorted(rec.flags) == sorted(expected)
    assert not fastpipe.is_recomputing()


def test_checkpoint_stop():
    assert [checkpoint_stop(m, 4) for m in ("never", "except_last", "always")] == [0, 3, 4]


def test_rng_replay_restores_the_outer_generator():
    replay = RngReplay(torch.device("cpu"))
    torch.manual_seed(3)
    expected = torch.rand(3)
    torch.manual_seed(3)
    with replay.scope(seed=11):
        inside = torch.rand(2)
    assert replay.stochastic is True
    torch.testing.assert_close(torch.rand(3), expected)  # the outer stream is untouched
    with replay.scope(seed=11):
        torch.testing.assert_close(torch.rand(2), inside)  # the same seed replays
    quiet = RngReplay(torch.device("cpu"))
    with quiet.scope(seed=1):
        torch.ones(2)
    assert quiet.stochastic is False


def test_each_microbatch_and_stage_draws_its_own_numbers():
    model = nn.Sequential(nn.Dropout(0.5), nn.Identity(), nn.Dropout(0.5))
    pipe = fastpipe.Pipe(model, chunks=4, balance=[1, 1, 1], devices=["cpu"] * 3)
    with torch.no_grad():
        out = pipe(torch.ones(4, 64))
    masks = [row != 0 for row in out]
    assert all(not torch.equal(masks[0], m) for m in masks[1:])
    with torch.no_grad():
        first = fastpipe.Pipe(nn.Sequential(nn.Dropout(0.5), nn.Identity()), chunks=1,
                              balance=[1, 1], devices=["cpu"] * 2)(torch.ones(1, 64))
    assert (first != 0).float().mean().item() not in (0.0, 1.0)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_recompute_does_not_count_batch_norm_statistics_twice(schedule):
    base = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8),
                         nn.BatchNorm1d(8), nn.Linear(8, 2))
    x, y = torch.randn(12, 6), torch.randn(12, 2)
    stats = {}
    for mode in ("never", "always"):
        model = copy.deepcopy(base)
        pipe = fastpipe.Pipe(model, chunks=3, balance=[3, 3], devices=["cpu"] * 2,
                             checkpoint=mode, schedule=schedule)
        for _ in range(2):
            pipe.train_step(x, y, nn.MSELoss())
        stats[mode] = {k: v.clone() for k, v in model.state_dict().items() if "running" in k
                       or "num_batches" in k}
    assert stats["always"]["1.num_batches_tracked"].item() == 6  # 3 micro-batches x 2 steps
    for key, value in stats["never"].items():
        torch.testing.assert_close(stats["always"][key], value, rtol=0, atol=0, msg=key)
