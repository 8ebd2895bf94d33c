"""Evaluation: eval mode and a forward-only path that neither checkpoints nor keeps activations."""
import copy
import weakref

import pytest
import torch
from torch import nn

import fastpipe


class Probe(nn.Module):
    """Identity that records, per call, the grad mode and checkpoint flags, and a weak reference
    to its output (alive only while something, e.g. an autograd graph, keeps it)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = []
        self.outputs = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append((torch.is_grad_enabled(), fastpipe.is_checkpointing(),
                           fastpipe.is_recomputing()))
        y = x * 1.0
        self.outputs.append(weakref.ref(y))
        return y


def model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.ReLU(),
                         nn.Linear(8, 8), nn.Dropout(0.3), nn.Linear(8, 3))


def trained_pipe(plain: nn.Sequential, **kwargs) -> fastpipe.Pipe:
    pipe = fastpipe.Pipe(copy.deepcopy(plain), devices=["cpu", "cpu"], **kwargs)
    pipe.train_step(torch.randn(12, 6) + 1, torch.randint(0, 3, (12,)),
                    nn.functional.cross_entropy)
    return pipe


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_eval_output_equals_plain_model(checkpoint, schedule):
    pipe = trained_pipe(model(), chunks=3, balance=[3, 4], checkpoint=checkpoint,
                        schedule=schedule)
    plain = copy.deepcopy(pipe.module).eval()
    x = torch.randn(7, 6)  # uneven: 3, 3, 1
    expected = plain(x)
    torch.testing.assert_close(pipe.evaluate(x), expected, rtol=1e-5, atol=1e-6)
    pipe.eval()
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), expected, rtol=1e-5, atol=1e-6)


def test_evaluate_holds_nothing_and_restores_mode():
    probe = Probe()
    plain = nn.Sequential(nn.Linear(6, 8), probe, nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    pipe = fastpipe.Pipe(plain, chunks=4, balance=[3, 2], devices=["cpu", "cpu"],
                         checkpoint="always")
    out = pipe.evaluate(torch.randn(8, 6))
    assert not out.requires_grad and out.grad_fn is None
    assert probe.calls == [(False, False, False)] * 4  # once per micro-batch: no recompute
    assert all(ref() is None for ref in probe.outputs)  # no graph keeps an activation alive
    assert pipe.training and probe.training  # the previous mode is back


def test_training_forward_keeps_activations_the_control():
    """The control for the test above: a training forward with grad keeps its graph."""
    probe = Probe()
    plain = nn.Sequential(nn.Linear(6, 8), probe, nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    pipe = fastpipe.Pipe(plain, chunks=4, balance=[3, 2], devices=["cpu", "cpu"],
                         checkpoint="never")
    out = pipe(torch.randn(8, 6))
    assert out.requires_grad
    assert probe.calls == [(True, False, False)] * 4
    assert any(ref() is not None for ref in probe.outputs)


def test_eval_mode_with_grad_skips_checkpoint():
    """``pipe.eval()`` alone (grad still on, e.g. for input gradients) never checkpoints."""
    probe = Probe()
    plain = nn.Sequential(nn.Linear(6, 8), probe, nn.Tanh(), nn.Linear(8, 3))
    pipe = fastpipe.Pipe(plain, chunks=2, balance=[2, 2], devices=["cpu", "cpu"],
                         checkpoint="always")
    pipe.eval()
    pipe(torch.randn(4, 6)).sum().backward()
    assert probe.calls == [(True, False, False)] * 2


def test_eval_mode_leaves_running_stats():
    pipe = trained_pipe(model(), chunks=2, balance=[3, 4], deferred_batch_norm=True)
    before = copy.deepcopy(pipe.state_dict())
    pipe.evaluate(torch.randn(6, 6))
    for name, value in pipe.state_dict().items():
        assert torch.equal(value, before[name]), name
