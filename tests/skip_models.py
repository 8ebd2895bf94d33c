"""Skippable layers and a model with two skip connections, shared by the skip, lowering and
cast tests."""
import torch
from torch import nn

from fastpipe import skip


@skip.skippable(stash=["x"])
class StashX(nn.Module):
    def forward(self, x):
        skip.stash("x", x)
        return x


@skip.skippable(pop=["x"])
class AddX(nn.Module):
    def forward(self, h):
        return h + skip.pop("x")


@skip.skippable(stash=["h"])
class StashTanh(nn.Module):
    """Stashes a computed tensor (not its input): the gradient must reach this layer's graph."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        skip.stash("h", h * 2)
        return h


@skip.skippable(pop=["h"])
class MixH(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, y):
        return self.lin(y) * skip.pop("h")


@skip.skippable(stash=["d"])
class StashDropout(nn.Module):
    def forward(self, x):
        skip.stash("d", nn.functional.dropout(x, 0.5, self.training))
        return x


@skip.skippable(pop=["d"])
class AddD(nn.Module):
    def forward(self, x):
        return x + skip.pop("d")


def model_with_skips() -> nn.Sequential:
    """Two skips: 'h' from layer 1 to layer 5 (crossing stages), 'x' from 0 to 6."""
    return nn.Sequential(StashX(), StashTanh(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8),
                         MixH(), AddX(), nn.Linear(8, 4))
