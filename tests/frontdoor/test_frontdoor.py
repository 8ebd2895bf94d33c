"""The front doors' shared lifecycle: the frozen layout of checked arguments, the loss weights,
and the in-process driver that ``Pipe`` runs its steps through."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import fastpipe
from fastpipe.frontdoor import Layout, loss_weights, parse_layout
from fastpipe.runtime.drivers.in_process import InProcessDriver


def test_parse_layout_checks_and_freezes_the_arguments():
    layout = parse_layout("auto", "always", "auto", 2, 5, True)
    assert (layout.chunks, layout.auto_chunks, layout.checkpoint) == (1, True, "always")
    assert layout.auto_schedule and layout.first_schedule == "looped-bfs"
    assert (layout.virtual_stages, layout.timeout, layout.deferred_batch_norm) == (2, 5.0, True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.chunks = 4  # type: ignore[misc]
    assert layout.with_balance([2, 1]).balance == (2, 1) and layout.balance == ()
    fixed = parse_layout(4, "never", "1f1b", 1, 300.0, False)
    assert not fixed.auto_chunks and not fixed.auto_schedule and fixed.first_schedule == "1f1b"


@pytest.mark.parametrize("arguments, error, match", [
    (("many", "never", "1f1b", 1, 1.0, False), TypeError, "chunks"),
    ((2, "sometimes", "1f1b", 1, 1.0, False), ValueError, "checkpoint"),
    ((2, "never", "no-such-schedule", 1, 1.0, False), ValueError, "schedule"),
    ((2, "never", "1f1b", 0, 1.0, False), ValueError, "virtual_stages"),
    ((2, "never", "1f1b", 1, -1.0, False), ValueError, "timeout"),
    ((2, "never", "1f1b", 1, 1.0, "yes"), TypeError, "deferred_batch_norm"),
])
def test_parse_layout_names_the_bad_argument(arguments, error, match):
    with pytest.raises(error, match=match):
        parse_layout(*arguments)


def test_loss_weights_are_shares_of_the_batch_or_ones():
    assert loss_weights([3, 3, 2], "mean") == [3 / 8, 3 / 8, 2 / 8]
    assert loss_weights([3, 3, 2], "sum") == [1.0, 1.0, 1.0]


def test_pipe_runs_its_steps_through_the_in_process_driver():
    pipe = fastpipe.Pipe(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)), chunks=2,
                         balance=[2, 1], devices=["cpu", "cpu"], schedule="1f1b")
    assert isinstance(pipe._driver, InProcessDriver) and pipe._driver.local == [0, 1]
    assert isinstance(pipe.layout, Layout) and pipe.balance == (2, 1)
    seen = []
    run = pipe._driver.run
    pipe._driver.run = lambda programs, step, schedule: (seen.append(step.train),
                                                         run(programs, step, schedule))
    pipe.train_step(torch.randn(4, 4), torch.randn(4, 2), nn.functional.mse_loss)
    pipe.evaluate(torch.randn(4, 4))
    assert seen == [True, False]
