"""Building blocks for the pipeline tests: small models and plain-model references."""
from __future__ import annotations

import copy
from typing import Any, Callable, Dict, Tuple

import torch
from torch import nn


def mlp(width: int = 8, depth: int = 6, out: int = 4) -> nn.Sequential:
    layers = [nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width), nn.ReLU()]
    layers = (layers * ((depth + 3) // 4))[:depth - 1]
    layers = [copy.deepcopy(layer) for layer in layers]
    return nn.Sequential(*layers, nn.Linear(width, out))


def reference(module: nn.Module, inputs: Any, targets: Any,
              loss_fn: Callable) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Loss and gradients of the plain module on the whole batch."""
    module.zero_grad(set_to_none=True)
    loss = loss_fn(module(inputs), targets)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def grads_of(module: nn.Module) -> Dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}


def assert_same_grads(actual: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor],
                      rtol: float = 1e-5, atol: float = 1e-6) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name].cpu(), expected[name].cpu(), rtol=rtol, atol=atol,
                                   msg=lambda m: f"gradient of {name}: {m}")


def assert_cuda_steps_exact(checkpoint: str, width: int, steps: int) -> None:
    """Many training steps of a 2-stage pipe on one GPU (allocations freed and reused between
    stages and steps) each give the plain model's loss and gradients."""
    import fastpipe  # here: the helpers are imported by tests that do not need the package
    model = mlp(width=width, depth=8)
    plain = copy.deepcopy(model).cuda()
    pipe = fastpipe.Pipe(model, chunks=8, balance=[4, 4], devices=["cuda:0", "cuda:0"],
                         checkpoint=checkpoint, schedule="1f1b")
    for _ in range(steps):
        x, y = torch.randn(64, width), torch.randn(64, 4)
        pipe.zero_grad(set_to_none=True)
        expected_loss, expected = reference(plain, x.cuda(), y.cuda(), nn.MSELoss())
        loss = pipe.train_step(x, y, nn.MSELoss())
        torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
        assert_same_grads(grads_of(model), expected, rtol=1e-4, atol=1e-5)
