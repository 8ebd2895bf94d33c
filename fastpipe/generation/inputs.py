"""The inputs of every forward of generation, as ``transformers``' ``generate`` makes them.

For the whole batch: the attention mask (the given one; else inferred from padding tokens,
else all ones), positions counted over the mask's tokens (``cumsum - 1``, 0 on padding), and the
mask passed to the forwards only when some token is padding (``generate`` drops an all-ones
mask). Each group of sequences then reads its rows: the prompt first, then one token at a time
with the next position and the mask grown by one (with a cache), or the whole sequence so far
(without). A :class:`Feeder` lives where the first stage runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch

from .protocol import Protocol


@dataclass
class Prompt:
    """The batch's prompt prepared for the forwards."""

    ids: torch.Tensor
    mask: Optional[torch.Tensor]  # the full mask, when the model takes one
    positions: Optional[torch.Tensor]  # (batch, length); (1, length) when shared
    passes_mask: bool  # whether forwards pass the mask (some token is padding)
    shared_positions: bool = False  # one row of positions for every sequence (no mask)

    def names(self, protocol: Protocol) -> Tuple[str, ...]:
        return protocol.names(self.passes_mask)


def prepare(ids: torch.Tensor, mask: Optional[torch.Tensor], protocol: Protocol,
            eos: Sequence[int], pad: Optional[int]) -> Prompt:
    """The prompt's mask and positions, and whether forwards pass the mask."""
    if protocol.family == "sequential":
        return Prompt(ids, None, None, False)
    if protocol.takes_mask and mask is None:
        mask = _inferred_mask(ids, eos, pad)
    positions = None
    if protocol.takes_positions:
        if mask is not None:
            positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
        else:
            positions = torch.arange(ids.shape[1], dtype=torch.long, device=ids.device)[None]
    passes = mask is not None and protocol.takes_mask and not bool((mask == 1).all())
    shared = positions is not None and mask is None
    return Prompt(ids, mask if protocol.takes_mask else None, positions, passes, shared)


def _inferred_mask(ids: torch.Tensor, eos: Sequence[int], pad: Optional[int]) -> torch.Tensor:
    """``generate``'s mask without one given: padding tokens masked when there are some and
    the padding token is no end-of-sequence token, else all ones."""
    if pad is not None and pad not in eos and bool((ids == pad).any()):
        return ids.ne(pad).long()
    return torch.ones(ids.shape, dtype=torch.long, device=ids.device)


class Feeder:
    """The inputs of one group's forwards, on the first stage's device."""

    def __init__(self, prompt: Prompt, rows: slice, names: Sequence[str], cached: bool,
                 device: torch.device) -> None:
        self.names = tuple(names)
        self.cached = cached
        self.ids = prompt.ids[rows].to(device)
        self.mask = prompt.mask[rows].to(device) if prompt.mask is not None else None
        positions = prompt.positions
        if positions is not None and not prompt.shared_positions:
            positions = positions[rows]
        self.positions = positions.to(device) if positions is not None else None

    def first(self) -> Tuple[torch.Tensor, ...]:
        """The prompt's forward."""
        return self._inputs(self.ids, self.positions)

    def next(self, tokens: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """The forward after ``tokens`` (one per sequence) were picked."""
        tokens = tokens.to(self.ids.device)[:, None]
        self.ids = torch.cat([self.ids, tokens], dim=-1)
        if self.mask is not None:
            self.mask = torch.cat([self.mask, self.mask.new_ones((self.mask.shape[0], 1))],
                                  dim=-1)
        if self.positions is not None:
            self.positions = torch.cat([self.positions, self.positions[..., -1:] + 1], dim=-1)
        if not self.cached:
            return self._inputs(self.ids, self.positions)
        positions = self.positions[..., -1:].clone() if self.positions is not None else None
        return self._inputs(self.ids[:, -1:].clone(), positions)

    def _inputs(self, ids: torch.Tensor, positions: Optional[torch.Tensor]
                ) -> Tuple[torch.Tensor, ...]:
        values = {"input_ids": ids, "position_ids": positions, "attention_mask": self.mask}
        return tuple(values[name] for name in self.names)
