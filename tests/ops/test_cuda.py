"""The same exactness on GPUs: CUDA stages, mixed CPU/CUDA stages, streams and transfers."""
import copy

import pytest
import torch
from torch import nn

import fastpipe
from helpers import assert_cuda_steps_exact, assert_same_grads, grads_of, mlp, reference

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(120)]

LAYOUTS = {
    "one-gpu-two-stages": ["cuda:0", "cuda:0"],
    "cpu-then-gpu": ["cpu", "cuda:0"],
    "gpu-then-cpu": ["cuda:0", "cpu"],
}


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_train_step_on_cuda_matches_plain_model(layout, checkpoint, schedule):
    devices = LAYOUTS[layout]
    model = mlp(width=32, depth=6)
    plain = copy.deepcopy(model).cuda()
    x, y = torch.randn(13, 32), torch.randn(13, 4)
    expected_loss, expected = reference(plain, x.cuda(), y.cuda(), nn.MSELoss())
    pipe = fastpipe.Pipe(model, chunks=4, balance=[3, 3], devices=devices,
                         checkpoint=checkpoint, schedule=schedule)
    loss = pipe.train_step(x, y, nn.MSELoss())
    assert loss.device == torch.device(devices[-1])
    torch.testing.assert_close(loss.cpu(), expected_loss.cpu(), rtol=1e-5, atol=1e-6)
    assert_same_grads(grads_of(model), expected)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_forward_backward_on_cuda(layout):
    devices = LAYOUTS[layout]
    model = mlp(width=32, depth=6)
    plain = copy.deepcopy(model).cuda()
    x, y = torch.randn(16, 32), torch.randn(16, 4)
    expected_loss, expected = reference(plain, x.cuda(), y.cuda(), nn.MSELoss())
    pipe = fastpipe.Pipe(model, chunks=4, balance=[3, 3], devices=devices)
    out = pipe(x)
    assert out.device == torch.device(devices[-1])
    nn.MSELoss()(out, y.to(out.device)).backward()
    assert_same_grads(grads_of(model), expected)


def test_dropout_replay_on_cuda():
    base = nn.Sequential(nn.Linear(32, 64), nn.Dropout(0.5), nn.Linear(64, 64), nn.Dropout(0.5),
                         nn.Linear(64, 4))
    x, y = torch.randn(12, 32), torch.randn(12, 4)
    grads = []
    for mode in ("never", "always"):
        model = copy.deepcopy(base)
        pipe = fastpipe.Pipe(model, chunks=3, balance=[2, 3], devices=["cuda:0", "cuda:0"],
                             checkpoint=mode, schedule="1f1b")
        torch.manual_seed(5)
        pipe.train_step(x, y, nn.MSELoss())
        grads.append(grads_of(model))
    assert_same_grads(grads[1], grads[0], rtol=1e-6, atol=1e-7)


def test_many_steps_no_corruption():
    """Repeated steps with allocations freed and reused between stages stay exact."""
    assert_cuda_steps_exact("never", width=256, steps=20)