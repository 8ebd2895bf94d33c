"""Building on the meta device: only the tensors a process keeps get memory, ties stay ties,
and layers without reset_parameters are initialised by init_weights."""
import pytest
import torch
from torch import nn

from fastpipe import materialise


class NoReset(nn.Module):
    """A layer with its own weight and no reset_parameters (like GPT-2's Conv1D)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 4))

    def forward(self, x):
        return x @ self.weight


def meta_model():
    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(10, 4), NoReset(), nn.Linear(4, 4), nn.Linear(4, 10))
    model[3].weight = model[0].weight  # an LM head tied to the embedding
    return model


def test_only_the_kept_layers_get_memory_and_ties_survive():
    model = meta_model()
    new = materialise.materialise_used(model, [model[0], model[3]], torch.device("cpu"), None)
    assert not model[0].weight.is_meta and model[3].weight is model[0].weight
    assert model[1].weight.is_meta and model[2].weight.is_meta  # another process's layers
    assert len(new) == 2  # the tied weight once, and the head's bias


def test_a_layer_without_reset_parameters_needs_init_weights():
    model = meta_model()
    with pytest.raises(TypeError, match="init_weights="):
        materialise.materialise_used(model, [model[1]], torch.device("cpu"), None)
    model = meta_model()

    def init(module):
        if isinstance(module, NoReset):
            nn.init.eye_(module.weight)

    materialise.materialise_used(model, [model[1]], torch.device("cpu"), init)
    assert torch.equal(model[1].weight, torch.eye(4))


def test_init_weights_must_be_callable():
    with pytest.raises(TypeError, match="init_weights must be a function"):
        materialise.check_init_weights("normal")
