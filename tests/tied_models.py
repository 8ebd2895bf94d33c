"""A small language model whose LM head shares the embedding matrix, shared by the tied-weight
and cast tests."""
import torch
from torch import nn

VOCAB, DIM = 11, 6


def lm(tie: bool = True) -> nn.Sequential:
    """Embedding, three blocks, LM head; the head shares the embedding matrix when ``tie``."""
    model = nn.Sequential(nn.Embedding(VOCAB, DIM), nn.Linear(DIM, DIM), nn.Tanh(),
                          nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, VOCAB, bias=False))
    if tie:
        model[5].weight = model[0].weight
    return model


def loss_fn(logits, target):
    return nn.functional.cross_entropy(logits, target)


def batch(n: int = 13):
    return torch.randint(0, VOCAB, (n,)), torch.randint(0, VOCAB, (n,))
