"""A small GPT-style model written as an ``nn.Sequential``, for the demo and the benchmarks."""
from __future__ import annotations

import torch
from torch import nn

from ..nn import FusedLayerNorm, FusedMLP


class Embedding(nn.Module):
    """Token plus learned position embedding: ``(batch, seq)`` ids to ``(batch, seq, dim)``."""

    def __init__(self, vocab: int, dim: int, max_len: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(max_len, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.tokens(ids) + self.positions(positions)


class Block(nn.Module):
    """Pre-norm transformer block with causal self-attention and a GELU MLP. ``fused``: the
    norms and the MLP (with its residual add) are ``fastpipe.nn`` modules on fused ops."""

    def __init__(self, dim: int, heads: int, dropout: float = 0.0, fused: bool = False) -> None:
        super().__init__()
        norm = FusedLayerNorm if fused else nn.LayerNorm
        self.fused = fused
        self.norm1 = norm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, dropout=dropout, batch_first=True)
        self.norm2 = norm(dim)
        self.mlp = FusedMLP(dim, 4 * dim, dropout) if fused else nn.Sequential(
            nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        mask = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        if self.fused:
            return self.mlp(self.norm2(x), residual=x)
        return x + self.mlp(self.norm2(x))


class Head(nn.Module):
    """Final norm and projection to vocabulary logits."""

    def __init__(self, dim: int, vocab: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


def gpt(vocab: int = 64, dim: int = 64, heads: int = 4, layers: int = 4, max_len: int = 64,
        dropout: float = 0.0, fused: bool = False) -> nn.Sequential:
    """Embedding, ``layers`` transformer blocks and an LM head, as one ``nn.Sequential``;
    ``fused`` builds the blocks from fastpipe's fused modules (the same parameters; the MLP's
    linears are named ``mlp.fc1`` and ``mlp.fc2`` instead of ``mlp.0`` and ``mlp.2``)."""
    return nn.Sequential(Embedding(vocab, dim, max_len),
                         *[Block(dim, heads, dropout, fused) for _ in range(layers)],
                         Head(dim, vocab))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy averaged over every position of the batch."""
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def counting_task(batch: int, seq: int, vocab: int, generator: torch.Generator) -> tuple:
    """Synthetic sequences ``start, start+k, start+2k, ...`` (mod ``vocab``), ``k`` in 1..3.

    Each next token follows from the two before it, so a working model drives the loss well below
    the ``log(vocab)`` of guessing; nothing is downloaded.
    """
    start = torch.randint(0, vocab, (batch, 1), generator=generator)
    stride = torch.randint(1, 4, (batch, 1), generator=generator)
    ids = (start + stride * torch.arange(seq + 1)) % vocab
    return ids[:, :-1], ids[:, 1:]
