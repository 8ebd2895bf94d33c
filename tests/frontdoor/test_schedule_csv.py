"""Schedules read from CSV files (PyTorch pipelining's / torchtitan's layout) run exactly, as
``schedule=``, on ``Pipe`` and on ``DistributedPipe`` over 2 gloo ranks."""
from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fastpipe
from fastpipe.schedule import from_actions, get_schedule, read_csv

from dist_launch import assert_all_ok, launch
from helpers import assert_same_grads, grads_of, mlp, reference

DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "schedule", "data")
FILES = ["1f1b_2ranks", "looped_zb_2ranks", "interleaved_comms_2ranks", "interleaved_zb_4ranks"]


@pytest.mark.parametrize("name", FILES)
def test_a_csv_schedule_runs_exactly_on_pipe(name):
    schedule = read_csv(os.path.join(DATA, f"{name}.csv"))
    m = schedule.num_microbatches
    model = mlp(depth=schedule.num_virtual_stages + 1)
    plain = copy.deepcopy(model)
    x, y = torch.randn(3 * m - 1, 8), torch.randn(3 * m - 1, 4)
    pipe = fastpipe.Pipe(model, chunks=m, devices=["cpu"] * schedule.num_stages,
                         schedule=schedule, checkpoint="except_last")
    assert pipe.schedule == name and pipe.virtual_stages == schedule.num_chunks
    assert pipe.plan() is schedule
    expected_loss, expected = reference(plain, x, y, nn.MSELoss())
    loss = pipe.train_step(x, y, nn.MSELoss())
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-7)
    assert_same_grads(grads_of(model), expected)
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), plain(x), rtol=1e-6, atol=1e-7)


def test_a_v_shaped_schedule_object_places_its_stages():
    """Rank 0 holds stages 0 and 3, rank 1 stages 1 and 2: the layers go where it says."""
    schedule = from_actions([["0F0", "0F1", "3F0", "3B0", "3F1", "3B1", "0B0", "0B1"],
                             ["1F0", "2F0", "1F1", "2B0", "2F1", "1B0", "2B1", "1B1"]], name="v")
    model = mlp(depth=5)
    plain = copy.deepcopy(model)
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    pipe = fastpipe.Pipe(model, chunks=2, devices=["cpu", "cpu"], schedule=schedule)
    expected_loss, expected = reference(plain, x, y, nn.MSELoss())
    torch.testing.assert_close(pipe.train_step(x, y, nn.MSELoss()), expected_loss)
    assert_same_grads(grads_of(model), expected)


def test_a_schedule_object_that_does_not_fit_the_pipe_is_refused_before_any_work():
    schedule = get_schedule("1f1b", 2, 4)
    with pytest.raises(ValueError, match="chunks=3, but the Schedule given as schedule= runs 4 "
                                         "micro-batches; pass chunks=4"):
        fastpipe.Pipe(mlp(), chunks=3, devices=["cpu"] * 2, schedule=schedule)
    with pytest.raises(ValueError, match="chunks='auto'"):
        fastpipe.Pipe(mlp(), chunks="auto", devices=["cpu"] * 2, schedule=schedule)
    with pytest.raises(ValueError, match="places 1 chunks per stage; pass virtual_stages=1"):
        fastpipe.Pipe(mlp(), chunks=4, devices=["cpu"] * 2, schedule=schedule, virtual_stages=2)
    with pytest.raises(ValueError, match="runs 2 stages, 4 micro-batches and 1 chunks per "
                                         "stage; this pipe needs 3, 4 and 1"):
        fastpipe.Pipe(mlp(), chunks=4, devices=["cpu"] * 3, schedule=schedule)
    model = mlp()
    pipe = fastpipe.Pipe(model, chunks=4, devices=["cpu"] * 2, schedule=schedule)
    with pytest.raises(ValueError, match="cannot run any micro-batch count for the batch of 3"):
        pipe.train_step(torch.randn(3, 8), torch.randn(3, 4), nn.MSELoss())
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                    reason="needs torch.distributed with gloo")
@pytest.mark.parametrize("p2p", ["tagged", "grouped"])
def test_csv_schedules_run_exactly_on_two_ranks(p2p):
    files = FILES[:3]
    results = assert_all_ok(launch("csv_schedules", 2, limit=180, args={"files": files},
                                   p2p=p2p, script="dist_interchange_cases.py"))
    for name in files:
        assert results[0][name] == results[1][name]
    assert results[0]["looped_zb_2ranks"] == {"schedule": "looped_zb_2ranks", "virtual": 2,
                                              "chunks": 4}
