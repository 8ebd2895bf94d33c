"""checkpoint='selective': the plain model's loss and gradients on every schedule, exact dropout
replay, and matrix products kept (not recomputed) while the other ops are recomputed."""
from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import fastpipe
from fastpipe import nn as fnn
from fastpipe.policies.checkpoint import is_recomputing
from fastpipe.schedule import SCHEDULES
from fastpipe.policies.selective import selective_checkpoint
from helpers import assert_same_grads, grads_of, mlp, reference

CASES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zbv", 2)]


def _pipe(model, name, virtual, chunks=4, checkpoint="selective"):
    if name not in SCHEDULES:
        pytest.skip(f"schedule {name!r} is not registered")
    return fastpipe.Pipe(model, chunks=chunks, devices=["cpu"] * 2, checkpoint=checkpoint,
                         schedule=name, virtual_stages=virtual)


@pytest.mark.parametrize("batch", [16, 13], ids=["even", "uneven"])
@pytest.mark.parametrize("name,virtual", CASES)
def test_train_step_matches_plain_model(name, virtual, batch):
    model = mlp(depth=2 * virtual + 3)
    plain = copy.deepcopy(model)
    x, y = torch.randn(batch, 8), torch.randn(batch, 4)
    expected_loss, expected = reference(plain, x, y, nn.MSELoss())
    loss = _pipe(model, name, virtual).train_step(x, y, nn.MSELoss())
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-7)
    assert_same_grads(grads_of(model), expected)


class Residual(nn.Module):
    """x + dropout(fc2(gelu(fc1(norm(x))))) from fused modules, plus a plain nn.Dropout."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = fnn.FusedLayerNorm(dim)
        self.mlp = fnn.FusedMLP(dim, 2 * dim, dropout=0.3)
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        return self.drop(self.mlp(self.norm(x), residual=x))


def _dropout_model():
    return nn.Sequential(nn.Linear(8, 16), Residual(16), fnn.FusedRMSNorm(16), Residual(16),
                         nn.Linear(16, 4))


@pytest.mark.parametrize("name,virtual", [("1f1b", 1), ("zb-h1", 1), ("zbv", 2)])
def test_dropout_replays_exactly(name, virtual):
    """Selective recomputation draws the masks of a stored forward: same loss, same grads."""
    base = nn.Sequential(*_dropout_model(), *([nn.Identity()] if virtual == 2 else []))
    x, y = torch.randn(13, 8), torch.randn(13, 4)
    results = {}
    for mode in ("never", "selective"):
        model = copy.deepcopy(base)
        pipe = _pipe(model, name, virtual, checkpoint=mode)
        torch.manual_seed(21)
        results[mode] = (pipe.train_step(x, y, nn.MSELoss()), grads_of(model))
    torch.testing.assert_close(results["selective"][0], results["never"][0], rtol=0, atol=0)
    assert_same_grads(results["selective"][1], results["never"][1], rtol=1e-6, atol=1e-7)


def test_forward_path_matches_plain_model_and_replays_dropout():
    base = _dropout_model()
    x, y = torch.randn(10, 8), torch.randn(10, 4)
    grads = []
    for mode in ("never", "selective"):
        model = copy.deepcopy(base)
        pipe = fastpipe.Pipe(model, chunks=3, balance=[2, 3], devices=["cpu"] * 2,
                             checkpoint=mode)
        torch.manual_seed(4)
        nn.MSELoss()(pipe(x), y).backward()
        grads.append(grads_of(model))
    assert_same_grads(grads[1], grads[0], rtol=1e-6, atol=1e-7)
    with torch.no_grad():  # without autograd the mode changes nothing
        pipe.eval()
        torch.testing.assert_close(pipe(x), model.eval()(x))


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _op_counts(run):
    lin1, lin2 = nn.Linear(8, 32), nn.Linear(32, 8)
    x = torch.randn(4, 8, requires_grad=True)

    def block(v):
        return lin2(F.gelu(lin1(v))).tanh()
    with _Count() as count:
        run(block, x).sum().backward()
    return count.calls


def test_matrix_products_are_kept_and_the_rest_recomputed():
    plain = _op_counts(lambda fn, x: fn(x))
    selective = _op_counts(selective_checkpoint)
    assert selective["addmm"] == plain["addmm"]  # forward products replayed from the cache
    assert selective["gelu"] == 2 * plain["gelu"]  # recomputed in backward
    assert selective["tanh"] == 2 * plain["tanh"]


def test_recomputation_is_flagged():
    seen = []

    class Probe(nn.Module):
        def forward(self, x):
            seen.append(is_recomputing())
            return x.sin()
    x = torch.randn(3, requires_grad=True)
    selective_checkpoint(Probe(), x).sum().backward()
    assert seen == [False, True]


def test_a_kept_product_changed_in_place_raises_instead_of_replaying_the_change():
    lin = nn.Linear(4, 4)

    def scaled_in_place(x):
        h = lin(x)
        h.mul_(3.0)  # changes the cached addmm output after the forward kept it
        return torch.tanh(h)
    x = torch.randn(3, 4, requires_grad=True)
    out = selective_checkpoint(scaled_in_place, x).sum()
    with pytest.raises(RuntimeError, match="modified in place"):
        out.backward()
    # the out-of-place form replays fine and matches the plain gradient
    x.grad = None
    expected = torch.autograd.grad(torch.tanh(lin(x) * 3.0).sum(), x)[0]
    selective_checkpoint(lambda t: torch.tanh(lin(t) * 3.0), x).sum().backward()
    torch.testing.assert_close(x.grad, expected, rtol=1e-6, atol=1e-7)


def test_unknown_mode_lists_selective():
    with pytest.raises(ValueError, match="selective"):
        fastpipe.Pipe(mlp(), checkpoint="selectiv")
