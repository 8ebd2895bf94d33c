"""Tied weights across stages: one parameter, summed gradients, identical after updates."""
import copy

import pytest
import torch
from torch import nn

import fastpipe
from fastpipe.policies.tied import WithCopies, find
from helpers import assert_same_grads, grads_of, reference
from tied_models import DIM, VOCAB, batch, lm, loss_fn

@pytest.mark.parametrize("schedule,checkpoint", [("gpipe", "never"), ("1f1b", "always"),
                                                 ("zb-h1", "except_last")])
def test_shared_parameter_matches_plain_tied_model(schedule, checkpoint):
    model = lm()
    plain = copy.deepcopy(model)  # deepcopy keeps the sharing
    assert plain[5].weight is plain[0].weight
    x, y = batch()
    expected_loss, expected = reference(plain, x, y, loss_fn)
    pipe = fastpipe.Pipe(model, chunks=4, balance=[2, 2, 2], devices=["cpu"] * 3,
                         schedule=schedule, checkpoint=checkpoint)
    assert [t.stages for t in find(model, pipe.balance)] == [(0, 2)]
    loss = pipe.train_step(x, y, loss_fn)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-7)
    assert_same_grads(grads_of(model), expected)
    assert sum(p is model[0].weight for p in pipe.parameters()) == 1
    assert len(list(pipe.parameters())) == len(list(plain.parameters()))


@pytest.mark.parametrize("refs", ["names", "parameters"])
def test_tied_argument_ties_and_trains_like_the_plain_tied_model(refs):
    model = lm(tie=False)
    plain = copy.deepcopy(model)
    plain[5].weight = plain[0].weight
    tied = ([("0.weight", "5.weight")] if refs == "names"
            else [(model[0].weight, model[5].weight)])
    pipe = fastpipe.Pipe(model, chunks=3, balance=[3, 3], devices=["cpu"] * 2,
                         schedule="1f1b", tied=tied)
    assert model[5].weight is model[0].weight
    opt = torch.optim.Adam(pipe.parameters(), lr=0.05)
    plain_opt = torch.optim.Adam(plain.parameters(), lr=0.05)
    for _ in range(3):
        x, y = batch(10)
        opt.zero_grad()
        plain_opt.zero_grad()
        loss = pipe.train_step(x, y, loss_fn)
        expected = loss_fn(plain(x), y)
        expected.backward()
        torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
        assert_same_grads(grads_of(model), grads_of(plain))
        opt.step()
        plain_opt.step()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    assert torch.equal(model[5].weight, model[0].weight)


def test_forward_then_backward_sums_both_uses():
    model = lm()
    plain = copy.deepcopy(model)
    x, y = batch()
    _, expected = reference(plain, x, y, loss_fn)
    pipe = fastpipe.Pipe(model, chunks=2, balance=[1, 5], devices=["cpu"] * 2)
    loss_fn(pipe(x), y).backward()
    assert_same_grads(grads_of(model), expected)


def test_copy_on_another_device_carries_gradient_to_the_one_parameter():
    """The wrapper a stage on another device uses: its layer runs with ``param.to(device)``."""
    head = nn.Sequential(nn.Linear(DIM, VOCAB, bias=False))
    one = nn.Parameter(torch.randn(VOCAB, DIM))
    call = WithCopies(head, {"0.weight": one}, torch.device("cpu"))
    h = torch.randn(3, DIM)
    out = call(h)
    torch.testing.assert_close(out, h @ one.T)
    out.sum().backward()
    torch.testing.assert_close(one.grad, torch.ones(3, VOCAB).T @ h)
    assert head[0].weight.grad is None


@pytest.mark.parametrize("tied,error,match", [
    ("0.weight", TypeError, "list of groups"),
    ([("0.weight",)], ValueError, "at least two"),
    ([("0.weight", "9.weight")], ValueError, "not a parameter"),
    ([("0.weight", "1.weight")], ValueError, "same shape"),
    ([("0.weight", "5.weight"), ("5.weight", "3.weight")], ValueError, "one group"),
    ([("0.weight", nn.Parameter(torch.zeros(2)))], ValueError, "not in the module"),
    ([("0.weight", 3)], TypeError, "names"),
])
def test_bad_tied_argument_raises_before_anything_changes(tied, error, match):
    model = lm(tie=False)
    before = model[5].weight
    with pytest.raises(error, match=match):
        fastpipe.Pipe(model, chunks=2, balance=[3, 3], devices=["cpu"] * 2, tied=tied)
    assert model[5].weight is before


@pytest.mark.cuda
def test_tied_across_devices_matches_plain_model():
    model = lm()
    plain = copy.deepcopy(model)
    x, y = batch()
    expected_loss, expected = reference(plain, x, y, loss_fn)
    pipe = fastpipe.Pipe(model, chunks=4, balance=[2, 2, 2], devices=["cuda:0", "cpu", "cpu"],
                         schedule="1f1b")
    assert model[0].weight.device.type == "cuda"
    loss = pipe.train_step(x.cuda(), y, loss_fn)
    torch.testing.assert_close(loss.cpu(), expected_loss, rtol=1e-5, atol=1e-6)
    assert_same_grads(grads_of(model), expected, rtol=1e-4, atol=1e-5)
    model.zero_grad()
    loss_fn(pipe(x.cuda()), y).backward()
    assert_same_grads(grads_of(model), expected, rtol=1e-4, atol=1e-5)
