"""Distributed cases of the wire format (``dist_launch.launch(..., script="wire_cases.py")``):
messages whose tensors have odd byte sizes, packed with padding between them, through both
transports in one launch."""
from __future__ import annotations

import os
import sys
from typing import Dict, Tuple

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dist_common import TOL, DistributedPipe, main  # noqa: E402


class Fork(nn.Module):
    """Ends a stage with three tensors of odd byte sizes per micro-batch of 2: float32 (2, 3)
    (24 bytes), float16 (2, 5) (20 bytes) and float32 (2, 8)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        h = self.lin(x)
        return h[:, :3] * 1.5, h[:, 3:].half(), torch.tanh(h)


class Join(nn.Module):
    """Starts the next stage from the three (each gets a gradient back: three again)."""

    def forward(self, parts: Tuple[torch.Tensor, ...]) -> torch.Tensor:
        a, b, c = parts
        return c * (1 + 0.1 * a.sum(-1, keepdim=True) + 0.1 * b.float().sum(-1, keepdim=True))


def model() -> nn.Sequential:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(8, 8), Fork(), Join(), nn.Linear(8, 4))


def odd_sizes() -> Dict:
    """The pipe's loss and gradients equal the plain model's on both transports."""
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
    plain = model()
    expected_loss = nn.functional.mse_loss(plain(x), y)
    expected_loss.backward()
    out = {}
    for p2p in ("tagged", "grouped"):
        m = model()
        pipe = DistributedPipe(m, chunks=3, balance=[2, 2], p2p=p2p, timeout=60)
        loss = pipe.train_step(x, y, nn.functional.mse_loss)
        torch.testing.assert_close(loss, expected_loss.detach(), **TOL)
        for name, p in pipe.named_parameters():
            torch.testing.assert_close(p.grad, plain.get_parameter(name).grad, **TOL,
                                       msg=lambda msg: f"{p2p}: {name}: {msg}")
        out[p2p] = sorted(n for n, _ in pipe.named_parameters())
    return out


CASES = {f.__name__: f for f in (odd_sizes,)}

if __name__ == "__main__":
    main(CASES)
