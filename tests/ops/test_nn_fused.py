"""fastpipe.nn: fused modules equal their plain PyTorch counterparts and save less for backward."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fastpipe import nn as fnn
from fastpipe.apps.models import gpt
from helpers import assert_same_grads, grads_of


def _grads_match(fused: nn.Module, plain: nn.Module, *inputs: torch.Tensor, rename=None) -> None:
    out_f, out_p = fused(*inputs), plain(*inputs)
    torch.testing.assert_close(out_f, out_p, rtol=1e-5, atol=1e-5)
    out_f.square().sum().backward()
    out_p.square().sum().backward()
    expected = {rename(k) if rename else k: v for k, v in grads_of(plain).items()}
    assert_same_grads(grads_of(fused), expected, rtol=1e-5, atol=1e-5)


class PlainMLP(nn.Module):
    def __init__(self, fused: fnn.FusedMLP) -> None:
        super().__init__()
        self.fc1, self.fc2 = copy.deepcopy(fused.fc1), copy.deepcopy(fused.fc2)
        self.p = fused.dropout

    def forward(self, x, residual):
        return residual + F.dropout(self.fc2(F.gelu(self.fc1(x))), self.p, self.training)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_mlp_matches_plain_layers(approximate):
    fused = fnn.FusedMLP(12, 40, approximate=approximate)
    plain = PlainMLP(fused)
    plain.forward = lambda x, r: r + plain.fc2(F.gelu(plain.fc1(x), approximate=approximate))
    x, r = torch.randn(3, 5, 12), torch.randn(3, 5, 12)
    _grads_match(fused, plain, x, r)


def test_norms_and_swiglu_match_plain_layers():
    x = torch.randn(6, 20) * 2 + 1
    ln = nn.LayerNorm(20)
    nn.init.normal_(ln.weight)
    nn.init.normal_(ln.bias)
    fused_ln = fnn.FusedLayerNorm(20)
    fused_ln.load_state_dict(ln.state_dict())
    _grads_match(fused_ln, ln, x)
    rms = nn.RMSNorm(20, eps=1e-6)
    nn.init.normal_(rms.weight)
    fused_rms = fnn.FusedRMSNorm(20)
    fused_rms.load_state_dict(rms.state_dict())
    _grads_match(fused_rms, rms, x)
    swiglu = fnn.FusedSwiGLU(20, 32)
    plain = copy.deepcopy(swiglu)
    plain.forward = lambda v, r: r + plain.down(F.silu(plain.gate(v)) * plain.up(v))
    _grads_match(swiglu, plain, x, x)


def _saved_bytes(module: nn.Module, *inputs: torch.Tensor) -> int:
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    inputs_ptrs = {t.untyped_storage().data_ptr() for t in inputs}
    storages = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in inputs_ptrs:  # activations only
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(*inputs)
    return sum(storages.values())


def test_fused_mlp_with_dropout_saves_fewer_activation_bytes():
    fused = fnn.FusedMLP(64, 256, dropout=0.1)
    plain = PlainMLP(fused)
    x = torch.randn(8, 32, 64, requires_grad=True)
    fused_bytes, plain_bytes = _saved_bytes(fused, x, x), _saved_bytes(plain, x, x)
    # plain keeps fc1's output, gelu's output and the dropout mask; fused drops the mask
    assert fused_bytes < plain_bytes
    assert plain_bytes - fused_bytes >= 8 * 32 * 64  # at least the one-byte-per-element mask


def test_fused_gpt_matches_plain_gpt():
    torch.manual_seed(0)
    plain, fused = gpt(layers=2), gpt(layers=2, fused=True)

    def rename(name: str) -> str:
        return name.replace("mlp.0", "mlp.fc1").replace("mlp.2", "mlp.fc2")
    fused.load_state_dict({rename(k): v for k, v in plain.state_dict().items()})
    ids = torch.randint(0, 64, (3, 16))
    _grads_match(fused, plain, ids, rename=rename)


def test_constructor_errors_name_the_argument():
    with pytest.raises(ValueError, match="hidden must be a positive int"):
        fnn.FusedMLP(8, 0)
    with pytest.raises(ValueError, match="dropout must be a float in \\[0, 1\\)"):
        fnn.FusedSwiGLU(8, 16, dropout=1.5)
    with pytest.raises(ValueError, match="approximate"):
        fnn.FusedMLP(8, 16, approximate="sigmoid")
