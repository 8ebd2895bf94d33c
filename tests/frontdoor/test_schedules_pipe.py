"""Every schedule of the IR runs on the local executor with the plain model's loss and gradients."""
import copy

import pytest
import torch
from torch import nn

import fastpipe
from fastpipe.schedule import SCHEDULES, get_schedule
from helpers import assert_same_grads, grads_of, mlp, reference

CASES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3), ("looped-bfs", 2),
         ("zb-h1", 1), ("zbv", 2), ("dualpipev", 2)]
LAYOUTS = [(2, 4), (2, 5), (3, 6), (4, 8)]  # (stages, micro-batches)


def _supported(name, stages, microbatches, virtual):
    if name not in SCHEDULES:
        pytest.skip(f"schedule {name!r} is not registered")
    kwargs = {"virtual_stages": virtual} if virtual != 1 else {}
    try:
        get_schedule(name, stages, microbatches, **kwargs)
    except NotImplementedError as error:
        pytest.skip(f"{name}: {error}")
    except ValueError as error:
        return error
    return None


@pytest.mark.parametrize("stages,microbatches", LAYOUTS)
@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
@pytest.mark.parametrize("name,virtual", CASES)
def test_every_schedule_matches_plain_model(name, virtual, checkpoint, stages, microbatches):
    unsupported = _supported(name, stages, microbatches, virtual)
    model = mlp(depth=stages * virtual + 1)
    plain = copy.deepcopy(model)
    batch = 3 * microbatches - 1  # uneven: the last micro-batch is smaller
    x, y = torch.randn(batch, 8), torch.randn(batch, 4)
    if unsupported is not None:
        with pytest.raises(ValueError):
            pipe = fastpipe.Pipe(model, chunks=microbatches, devices=["cpu"] * stages,
                                 checkpoint=checkpoint, schedule=name, virtual_stages=virtual)
            pipe.train_step(x, y, nn.MSELoss())
        assert all(p.grad is None for p in model.parameters())
        return
    expected_loss, expected = reference(plain, x, y, nn.MSELoss())
    pipe = fastpipe.Pipe(model, chunks=microbatches, devices=["cpu"] * stages,
                         checkpoint=checkpoint, schedule=name, virtual_stages=virtual)
    assert len(pipe.partitions) == stages * virtual
    loss = pipe.train_step(x, y, nn.MSELoss())
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-7)
    assert_same_grads(grads_of(model), expected)
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), plain(x), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name,virtual", [c for c in CASES if c[0] in ("zb-h1", "zbv")])
def test_split_backward_with_dropout_replays(name, virtual):
    """B and W of a recomputed micro-batch see the same dropout masks as a stored forward."""
    if name not in SCHEDULES:
        pytest.skip(f"schedule {name!r} is not registered")
    base = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.3), nn.Linear(16, 16), nn.Dropout(0.3),
                         nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    results = []
    for mode in ("never", "always"):
        model = copy.deepcopy(base)
        pipe = fastpipe.Pipe(model, chunks=4, devices=["cpu"] * 2, checkpoint=mode,
                             schedule=name, virtual_stages=virtual, balance=None)
        torch.manual_seed(3)
        results.append((pipe.train_step(x, y, nn.MSELoss()), grads_of(model)))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=0, atol=0)
    assert_same_grads(results[1][1], results[0][1], rtol=1e-6, atol=1e-7)


def test_virtual_stage_errors():
    with pytest.raises(ValueError, match="virtual_stages must be a positive int"):
        fastpipe.Pipe(mlp(), virtual_stages=0)
    with pytest.raises(ValueError, match="not a multiple of virtual_stages=2"):
        fastpipe.Pipe(mlp(depth=6), balance=[2, 2, 2], devices=["cpu"] * 2, virtual_stages=2,
                      schedule="interleaved")
    with pytest.raises(ValueError, match="needs at least 4 layers"):
        fastpipe.Pipe(nn.Sequential(nn.Linear(2, 2)), virtual_stages=4)


def test_interleaved_places_chunks_round_robin():
    if "interleaved" not in SCHEDULES:
        pytest.skip("interleaved is not registered")
    pipe = fastpipe.Pipe(mlp(depth=8), chunks=4, balance=[2, 2, 2, 2], devices=["cpu"] * 2,
                         schedule="interleaved", virtual_stages=2)
    plan = pipe.plan()
    assert [plan.stage_of(k)[0] for k in range(4)] == [0, 1, 0, 1]
    assert pipe.virtual_stages == 2 and len(pipe.devices) == 2


@pytest.mark.parametrize("virtual", [1, 2])
def test_auto_schedule_measures_then_chooses(virtual, caplog):
    model = mlp(depth=8)
    plain = copy.deepcopy(model)
    pipe = fastpipe.Pipe(model, chunks=4, devices=["cpu"] * 2, schedule="auto",
                         virtual_stages=virtual)
    assert pipe.schedule == ("1f1b" if virtual == 1 else "looped-bfs")
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    with caplog.at_level("INFO", logger="fastpipe"):
        loss = pipe.train_step(x, y, nn.MSELoss())
    expected_loss, expected = reference(plain, x, y, nn.MSELoss())
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-7)
    assert_same_grads(grads_of(model), expected)
    names = [r.name for r in pipe.auto_ranking]
    allowed = {"gpipe", "1f1b", "zb-h1"} if virtual == 1 else {"interleaved", "looped-bfs"}
    assert set(names) <= allowed and pipe.schedule == names[0]
    assert "schedule='auto' chose" in caplog.text
    model.zero_grad()
    plain.zero_grad()
    loss = pipe.train_step(x, y, nn.MSELoss())  # now on the chosen schedule, still exact
    expected_loss, expected = reference(plain, x, y, nn.MSELoss())
    assert_same_grads(grads_of(model), expected)


def test_auto_stage_costs_from_a_timeline():
    from fastpipe.autotune.schedule_choice import stage_costs
    from fastpipe.schedule import Timeline
    plan = get_schedule("1f1b", 2, 2)
    intervals = [(0, "0F0", 0, 1), (0, "0F1", 1, 2), (1, "1F0", 2, 5), (1, "1B0", 5, 11),
                 (0, "0B0", 11, 13), (1, "1F1", 11, 14), (1, "1B1", 14, 20), (0, "0B1", 20, 22)]
    costs = stage_costs(Timeline.from_intervals(2, intervals), plan)
    assert costs.forward == (1, 3) and costs.backward == (1, 3) and costs.weight == (1, 3)


class Twice(nn.Module):
    """One linear layer used twice along a path (its weight is reached two ways)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(torch.tanh(self.lin(x)))


@pytest.mark.parametrize("name,virtual", [("zb-h1", 1), ("zbv", 2), ("dualpipev", 2)])
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_split_backward_with_a_weight_used_twice(name, virtual, checkpoint):
    model = nn.Sequential(nn.Linear(8, 8), Twice(), nn.Tanh(), Twice(), nn.Linear(8, 8),
                          Twice(), nn.Tanh(), nn.Linear(8, 4))
    plain = copy.deepcopy(model)
    x, y = torch.randn(11, 8), torch.randn(11, 4)
    expected_loss, expected = reference(plain, x, y, nn.MSELoss())
    pipe = fastpipe.Pipe(model, chunks=4, devices=["cpu"] * 2, schedule=name,
                         virtual_stages=virtual, checkpoint=checkpoint)
    torch.testing.assert_close(pipe.train_step(x, y, nn.MSELoss()), expected_loss,
                               rtol=1e-5, atol=1e-7)
    assert_same_grads(grads_of(model), expected)


def test_b_leaves_weight_gradients_to_w():
    """In a split schedule no weight gradient exists between a micro-batch's B and its W."""
    from fastpipe.runtime import step as step_module
    seen = []
    original = step_module.weight_action

    def spy(step, stage, action):
        if action.microbatch == 0:
            seen.append(all(p.grad is None for p in stage.parameters()))
        original(step, stage, action)

    model = mlp(depth=4)
    pipe = fastpipe.Pipe(model, chunks=4, balance=[2, 2], devices=["cpu"] * 2, schedule="zb-h1",
                         checkpoint="never")
    executor = pipe._workers.executor()
    executor.handlers = {**executor.handlers, fastpipe.ActionKind.WEIGHT: spy}
    pipe.train_step(torch.randn(8, 8), torch.randn(8, 4), nn.MSELoss())
    assert seen == [True, True]  # the first W of each stage finds no gradient yet
