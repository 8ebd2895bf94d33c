"""checkpoint='offload' keeps apart tensors that share memory: two same-shaped contiguous views
of one buffer (``h[0]`` and ``h[1]``), each saved for backward, come back as themselves, so the
gradients equal ``checkpoint='never'``'s."""
import copy

import pytest
import torch
from torch import nn

import fastpipe


class Halves(nn.Module):
    """Saves two views of one buffer for backward: ``sin`` saves ``h[0]``, ``cos`` ``h[1]``
    (same shape, stride, dtype and storage; only the offset differs)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x).view(-1, 2, 8).transpose(0, 1).contiguous()
        return torch.sin(h[0]) * torch.cos(h[1])


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Halves(), nn.Linear(8, 8), Halves(), nn.Linear(8, 4))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_views_of_one_buffer_are_offloaded_apart(schedule):
    x, y = torch.randn(12, 8), torch.randn(12, 4)
    grads = []
    for mode in ("never", "offload"):
        m = model()
        pipe = fastpipe.Pipe(m, chunks=3, balance=[2, 2], devices=["cpu"] * 2,
                             checkpoint=mode, schedule=schedule)
        pipe.train_step(x, y, nn.functional.mse_loss)
        grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
    for name, want in grads[0].items():
        torch.testing.assert_close(grads[1][name], want, rtol=0, atol=0,
                                   msg=lambda m: f"{name}: {m}")
