"""Mixed precision: autocast inside every stage (worker threads, recomputation) and GradScaler."""
import copy
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import fastpipe
from fastpipe.policies import amp

from helpers import assert_same_grads, grads_of, mlp, reference


class DtypeProbe(nn.Module):
    """Records the dtype a linear layer produces here (bf16/fp16 only under autocast)."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes = []

    def forward(self, x):
        self.dtypes.append(torch.mm(x.float(), torch.eye(x.shape[1])).dtype)
        return x


def loss_fn(out, y):
    return nn.functional.cross_entropy(out.float(), y)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("checkpoint", ["never", "always"])
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_autocast_step_close_to_plain_model(dtype, checkpoint, schedule):
    model = mlp(width=16, depth=6, out=4)
    pipe = fastpipe.Pipe(copy.deepcopy(model), chunks=3, balance=[3, 3], devices=["cpu", "cpu"],
                         checkpoint=checkpoint, schedule=schedule)
    x, y = torch.randn(11, 16), torch.randint(0, 4, (11,))
    with torch.autocast("cpu", dtype=dtype):
        expected_loss, expected = reference(model, x, y, loss_fn)
        loss = pipe.train_step(x, y, loss_fn)
    torch.testing.assert_close(loss, expected_loss, rtol=2e-2, atol=2e-2)
    assert_same_grads(grads_of(pipe.module), expected, rtol=5e-2, atol=2e-2)
    # and the step really ran in low precision (an fp32 step differs by more than rounding)
    fp32_loss, _ = reference(copy.deepcopy(model), x, y, loss_fn)
    assert loss != fp32_loss


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_autocast_reaches_worker_threads_and_recompute(checkpoint):
    probe = DtypeProbe()
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), probe, nn.Linear(8, 2))
    pipe = fastpipe.Pipe(model, chunks=2, balance=[1, 3], devices=["cpu", "cpu"],
                         checkpoint=checkpoint)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pipe.train_step(torch.randn(4, 8), torch.randint(0, 2, (4,)), loss_fn)
    runs = 2 if checkpoint == "never" else 4  # forward, then the recomputation
    assert probe.dtypes == [torch.bfloat16] * runs


def test_forward_recompute_outside_autocast_keeps_its_precision():
    """``pipe(x)`` under autocast, ``backward()`` after leaving it: the checkpointed forward is
    recomputed in the autocast region of its first run (else the dtypes would not even match)."""
    model = mlp(width=8, depth=5, out=2)
    pipe = fastpipe.Pipe(copy.deepcopy(model), chunks=2, balance=[2, 3], devices=["cpu", "cpu"],
                         checkpoint="always")
    x = torch.randn(6, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, ref = pipe(x), model(x)
    out.float().square().sum().backward()
    ref.float().square().sum().backward()
    assert_same_grads(grads_of(pipe.module), grads_of(model), rtol=5e-2, atol=2e-2)


def sgd_steps(module, step_fn, batches, scaler=None):
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    for x, y in batches:
        optimizer.zero_grad(set_to_none=True)
        step_fn(x, y)
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()


def test_grad_scaler_steps_equal_unscaled_steps():
    model = mlp(width=8, depth=6, out=3)
    pipe = fastpipe.Pipe(copy.deepcopy(model), chunks=3, balance=[2, 4], devices=["cpu", "cpu"],
                         schedule="1f1b")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    batches = [(torch.randn(7, 8), torch.randint(0, 3, (7,))) for _ in range(3)]
    seen = []

    def pipe_step(x, y):
        pipe.train_step(x, y, loss_fn, scaler=scaler)
        seen.append(next(pipe.parameters()).grad.clone())

    def plain_step(x, y):
        loss_fn(model(x), y).backward()
        seen.append(next(model.parameters()).grad.clone())

    sgd_steps(pipe, pipe_step, batches, scaler)
    sgd_steps(model, plain_step, batches)
    torch.testing.assert_close(seen[0], seen[3] * 2.0 ** 10)  # the backward saw the scaled loss
    for (name, actual), expected in zip(pipe.named_parameters(), model.parameters()):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=name)


def test_inf_gradient_on_one_stage_skips_the_step_everywhere():
    pipe = fastpipe.Pipe(mlp(width=8, depth=6, out=3), chunks=2, balance=[2, 4],
                         devices=["cpu", "cpu"])
    first = pipe.partitions[0][0].weight
    first.register_hook(lambda g: g * float("inf"))  # only stage 0 overflows
    before = copy.deepcopy(pipe.state_dict())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    pipe.train_step(torch.randn(4, 8), torch.randint(0, 3, (4,)), loss_fn, scaler=scaler)
    assert torch.isfinite(pipe.partitions[1][-1].weight.grad).all()  # stage 1 looks fine
    scaler.step(optimizer)
    scaler.update()
    for name, value in pipe.state_dict().items():
        assert torch.equal(value, before[name]), f"{name} changed in a skipped step"
    assert scaler.get_scale() == 2.0 ** 7


def test_scaler_argument_is_checked():
    pipe = fastpipe.Pipe(mlp(), chunks=2, balance=[3, 3], devices=["cpu", "cpu"])
    with pytest.raises(TypeError, match="scaler must be a torch.amp.GradScaler"):
        pipe.train_step(torch.randn(4, 8), torch.randint(0, 4, (4,)), loss_fn, scaler=2.0)


def _sync_worker(rank: int, path: str, results, idle_rank=None) -> None:
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    try:
        layer = nn.Linear(2, 2)
        if rank != idle_rank:  # the idle rank's stage took no gradient this step
            layer.weight.grad = torch.full((2, 2), float("inf") if rank == 0 else 1.0)
            layer.bias.grad = torch.ones(2)
        before = layer.weight.detach().clone()
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
        optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
        device = None if idle_rank is None else torch.device("cpu")  # the pipeline device
        amp.unscale_and_sync(scaler, optimizer, device=device)
        scaler.step(optimizer)
        scaler.update()
        results[rank] = (torch.equal(layer.weight, before), scaler.get_scale())
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("idle_rank", [None, 1], ids=["both-with-gradients", "one-without"])
def test_unscale_and_sync_skips_on_every_rank(idle_rank):
    """Two processes, each with its own stage's optimizer; only rank 0 overflows, yet both skip
    (also when the other rank has no gradient at all)."""
    with tempfile.TemporaryDirectory() as folder, mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_sync_worker, args=(os.path.join(folder, "store"), results,
                                               idle_rank),
                           nprocs=2, join=True, start_method="fork")
        assert dict(results) == {0: (True, 2.0), 1: (True, 2.0)}
