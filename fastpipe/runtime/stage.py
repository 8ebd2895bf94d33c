"""One pipeline stage: its layers, its device and stream, and how it runs a forward pass."""
from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Optional

import torch
from torch import nn

from ..checkpoint import RngReplay, checkpointed


class Stage:
    """A contiguous slice of the model placed on one device (a virtual stage of the pipeline)."""

    def __init__(self, index: int, module: nn.Sequential, device: torch.device) -> None:
        self.index = index
        self.module = module
        self.device = device
        self.rng = RngReplay(device)
        self.stream: Optional["torch.cuda.Stream"] = (
            torch.cuda.Stream(device) if device.type == "cuda" else None)

    def context(self) -> ContextManager[Any]:
        """The stream (CUDA) in which this stage's work is issued; a no-op on the CPU."""
        if self.stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.stream)

    def forward(self, inputs: Any, seed: int, checkpoint: bool) -> Any:
        """Run the stage on one micro-batch; with ``checkpoint`` keep only what recompute needs."""
        def run(x: Any) -> Any:
            if self.rng.stochastic is False:  # probed this step: draws no random numbers
                return self.module(x)
            with self.rng.scope(seed):
                return self.module(x)
        return checkpointed(run, inputs) if checkpoint else run(inputs)

    def __repr__(self) -> str:
        return f"Stage({self.index}, {len(self.module)} layers, {self.device})"
