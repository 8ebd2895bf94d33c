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
