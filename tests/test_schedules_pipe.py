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
