"""Picking each next token on the last stage, as ``transformers``' ``generate`` picks it.

The last position's logits in float32; greedy: their argmax. Sampling: temperature, then top-k,
then top-p (``generate``'s order and code), a softmax, and ``torch.multinomial``'s draw, which
for one sample is the argmax of the probabilities over exponential noise. The noise is drawn
once per step for the whole batch (every group takes its rows), so the draws are those of
``generate`` on the whole batch: under the same seed on the same device, the same tokens. A
sequence that produced an end-of-sequence token gets the padding token from then on; a group
whose sequences all finished stops.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

from .arguments import Request


def warp(scores: torch.Tensor, request: Request) -> torch.Tensor:
    """Temperature, top-k and top-p as ``generate`` applies them (in that order)."""
    if request.temperature != 1.0:
        scores = scores / request.temperature
    if request.top_k:
        k = min(max(request.top_k, 1), scores.size(-1))
        remove = scores < torch.topk(scores, k)[0][..., -1, None]
        scores = scores.masked_fill(remove, -float("inf"))
    if request.top_p < 1.0:
        sorted_logits, sorted_indices = torch.sort(scores, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        sorted_remove = cumulative <= (1 - request.top_p)
        sorted_remove[..., -1:] = 0
        remove = sorted_remove.scatter(1, sorted_indices, sorted_remove)
        scores = scores.masked_fill(remove, -float("inf"))
    return scores


class Picker:
    """The next tokens of every group, and each group's tokens so far."""

    def __init__(self, request: Request, sizes: Sequence[int], device: torch.device) -> None:
        self.request = request
        self.offsets = [sum(sizes[:m]) for m in range(len(sizes))]
        self.sizes = list(sizes)
        self.batch = sum(sizes)
        self.device = device
        self.generator: Optional[torch.Generator] = None
        if request.do_sample and request.seed is not None:
            self.generator = torch.Generator(device).manual_seed(request.seed)
        self.noise: Dict[int, torch.Tensor] = {}  # step -> the batch's noise
        self.tokens: List[List[torch.Tensor]] = [[] for _ in sizes]
        self.unfinished = [torch.ones(n, dtype=torch.long, device=device) for n in sizes]

    def pick(self, group: int, step: int, logits: torch.Tensor) -> Optional[torch.Tensor]:
        """The group's tokens of ``step`` from its logits (recorded); ``None`` when the group
        has finished (every sequence produced an end-of-sequence token)."""
        scores = logits[:, -1].to(dtype=torch.float32, device=self.device, copy=True)
        if self.request.do_sample:
            probs = torch.softmax(warp(scores, self.request), dim=-1)
            tokens = (probs / self._noise(group, step, probs)).argmax(dim=-1)
        else:
            tokens = torch.argmax(scores, dim=-1)
        request = self.request
        if request.eos:
            unfinished = self.unfinished[group]
            tokens = tokens * unfinished + request.pad * (1 - unfinished)
            eos = torch.tensor(request.eos, device=tokens.device)
            self.unfinished[group] = unfinished & ~torch.isin(tokens, eos)
        self.tokens[group].append(tokens)
        self.noise.pop(step - 1, None)
        if request.eos and not bool(self.unfinished[group].any()):
            return None
        return tokens

    def _noise(self, group: int, step: int, probs: torch.Tensor) -> torch.Tensor:
        """This group's rows of the step's exponential noise, drawn for the whole batch."""
        if step not in self.noise:
            shape = (self.batch, probs.shape[-1])
            self.noise[step] = torch.empty(shape, dtype=probs.dtype, device=probs.device
                                           ).exponential_(1, generator=self.generator)
        start = self.offsets[group]
        return self.noise[step][start:start + self.sizes[group]]

    def generated(self) -> torch.Tensor:
        """Every sequence's new tokens, (batch, steps): a group that finished early is padded
        to the longest group's count, as ``generate`` pads finished sequences."""
        steps = max(len(tokens) for tokens in self.tokens)
        rows = []
        for tokens, size in zip(self.tokens, self.sizes):
            done = torch.stack(tokens, dim=1)
            if done.shape[1] < steps:
                fill = done.new_full((size, steps - done.shape[1]), self.request.pad or 0)
                done = torch.cat([done, fill], dim=1)
            rows.append(done)
        return torch.cat(rows, dim=0)
