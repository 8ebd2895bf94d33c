"""Token-mean losses: ``loss_fn`` returns ``(loss_sum, count)``; the step's loss and gradients
equal the plain model's mean over every counted element of the batch (padding excluded), on
every schedule, also with gradients accumulated over several steps."""
import copy
import math
import re
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fastpipe
from fastpipe.frontdoor import UncertainWeighting
from dist_launch import assert_all_ok, launch
from helpers import assert_same_grads, grads_of, mlp


def padded_batch(size=10, seed=0):
    """Inputs, and targets with a mask of how many positions of each sample count (as padded
    sequences of different lengths give)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(size, 8, generator=generator)
    y = torch.randn(size, 4, generator=generator)
    lengths = torch.randint(0, 5, (size,), generator=generator)
    mask = (torch.arange(4) < lengths[:, None]).float()
    mask[0] = 1.0  # at least one counted element
    return x, (y, mask)


def token_loss(output, targets):
    y, mask = targets
    return ((output - y) ** 2 * mask).sum(), mask.sum()


def plain_token_mean(model, x, targets):
    y, mask = targets
    return ((model(x) - y) ** 2 * mask).sum() / mask.sum()


SCHEDULES = [("gpipe", 1, "never"), ("1f1b", 1, "except_last"), ("interleaved", 2, "always"),
             ("zb-h1", 1, "selective"), ("zbv", 2, "offload"), ("dualpipev", 2, "never"),
             ("looped-bfs", 2, "except_last")]


@pytest.mark.parametrize("schedule,virtual,checkpoint", SCHEDULES)
def test_token_mean_is_exact_on_every_schedule(schedule, virtual, checkpoint):
    model = mlp(depth=8)
    plain = copy.deepcopy(model)
    x, targets = padded_batch()
    expected = plain_token_mean(plain, x, targets)
    expected.backward()
    pipe = fastpipe.Pipe(model, chunks=4 if virtual == 1 else 2, devices=["cpu"] * 2,
                         schedule=schedule, virtual_stages=virtual, checkpoint=checkpoint)
    loss = pipe.train_step(x, targets, token_loss)
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-7)
    assert_same_grads(grads_of(model), grads_of(plain))


def test_accumulated_steps_keep_earlier_gradients_apart():
    model = mlp(depth=6)
    plain = copy.deepcopy(model)
    pipe = fastpipe.Pipe(model, chunks=3, devices=["cpu"] * 2, schedule="1f1b")
    for seed in (1, 2, 3):  # no zero_grad: gradients accumulate over three steps
        x, targets = padded_batch(seed=seed)
        plain_token_mean(plain, x, targets).backward()
        pipe.train_step(x, targets, token_loss)
    assert_same_grads(grads_of(model), grads_of(plain))


def test_a_mean_loss_cannot_express_a_token_mean_and_says_so():
    """The trap the pair avoids: averaging per micro-batch and weighting by samples is not the
    token mean when micro-batches hold different numbers of tokens."""
    model = mlp(depth=6)
    x, targets = padded_batch()
    pipe = fastpipe.Pipe(model, chunks=3, devices=["cpu"] * 2)

    def per_microbatch_mean(output, t):
        total, count = token_loss(output, t)
        return total / count

    with pytest.warns(UncertainWeighting, match=r"\(loss_sum, token_count\)"):
        wrong = pipe.train_step(x, targets, per_microbatch_mean)  # 10 in 3: sizes 4, 4, 2
    assert not torch.allclose(wrong, plain_token_mean(copy.deepcopy(model), x, targets))


def test_even_micro_batches_do_not_warn():
    pipe = fastpipe.Pipe(mlp(depth=6), chunks=2, devices=["cpu"] * 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UncertainWeighting)
        pipe.train_step(torch.randn(8, 8), torch.randn(8, 4), nn.MSELoss())


@pytest.mark.parametrize("loss_fn,match", [
    (lambda o, t: (token_loss(o, t)[0], -1), "non-negative"),
    (lambda o, t: (token_loss(o, t)[0], token_loss(o, t)[0] * 0.1), "whole number"),
    (lambda o, t: (token_loss(o, t)[0], -t[1].sum()), "micro-batch 0 is -"),
    (lambda o, t: (token_loss(o, t)[0], t[1].sum() * math.nan), "micro-batch 0 is nan"),
    (lambda o, t: (token_loss(o, t)[0], t[1].sum() > 0), "tensor\\(True"),
    (lambda o, t: (token_loss(o, t)[0], t[1]), "one-element"),
    (lambda o, t: (*token_loss(o, t), 0), "returned 3 values"),
])
def test_bad_counts_are_typed_errors_that_leave_no_gradient(loss_fn, match):
    """A count given as a number or of a wrong shape is refused as it comes, before any
    backward; a count tensor stays on the device and is checked in the step's one read at its
    close, which then puts back the gradients from before the step."""
    model = mlp(depth=6)
    pipe = fastpipe.Pipe(model, chunks=2, devices=["cpu"] * 2)
    x, targets = padded_batch()
    with pytest.raises(fastpipe.LossFunctionError, match=match):
        pipe.train_step(x, targets, loss_fn)
    assert all(p.grad is None for p in model.parameters())


def test_a_step_refused_for_its_count_keeps_the_accumulated_gradients_exactly():
    model = mlp(depth=6)
    pipe = fastpipe.Pipe(model, chunks=2, devices=["cpu"] * 2)
    pipe.train_step(*padded_batch(seed=1), token_loss)
    before = grads_of(model)
    calls = []

    def second_negative(output, t):
        calls.append(1)
        total, count = token_loss(output, t)
        return total, (-count if len(calls) == 2 else count)

    with pytest.raises(fastpipe.LossFunctionError, match="micro-batch 1 is -"):
        pipe.train_step(*padded_batch(seed=2), second_negative)
    after = grads_of(model)
    assert after.keys() == before.keys()
    assert all(torch.equal(after[n], before[n]) for n in before)


def test_mixing_the_two_forms_is_an_error():
    pipe = fastpipe.Pipe(mlp(depth=6), chunks=2, devices=["cpu"], schedule="gpipe")
    calls = []

    def flip(output, t):
        calls.append(1)
        total, count = token_loss(output, t)
        return (total, count) if len(calls) == 1 else total / count

    with pytest.raises(fastpipe.LossFunctionError, match="one form throughout"):
        pipe.train_step(*padded_batch(), flip)


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                    reason="needs torch.distributed with gloo")
@pytest.mark.parametrize("p2p", ["grouped", "tagged"])
def test_a_count_tensor_that_is_no_count_fails_every_rank_in_the_same_step(p2p):
    """2 ranks: the last stage's rank raises the LossFunctionError at the step's close (its
    gradients untouched), the other stops in the same call naming it."""
    first, last = assert_all_ok(launch("refused_count", 2, limit=120, args={"p2p": p2p}))
    assert last["error"] == "LossFunctionError" and last["untouched"], last
    assert re.search(r"micro-batch 2 is 2\.[34]\d*; ", last["message"]), last
    assert first["error"] == "PipelineAborted", first
    assert "rank 1" in first["message"] and last["message"] in first["message"], first
