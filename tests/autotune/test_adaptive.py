"""Adaptive micro-batching: the pure search over fake timings, and one run on a real pipe."""
import logging

import pytest
import torch
from torch import nn

import fastpipe
from fastpipe.autotune.chunk_count import ChunkSearch, candidate_counts, first_count

from helpers import assert_same_grads, grads_of, mlp, reference


def drive(search: ChunkSearch, seconds, samples: int = 64, limit: int = 50):
    """Run the search to its end with step times ``seconds(count)``; the counts it tried."""
    tried = []
    while search.chosen is None and len(tried) < limit:
        count = search.next()
        tried.append(count)
        search.record(count, samples, seconds(count))
    return tried


CANDIDATES = [1, 2, 4, 8, 16, 32]


def test_climbs_up_to_the_peak():
    search = ChunkSearch(CANDIDATES, start=4)
    tried = drive(search, {1: 9, 2: 6, 4: 4, 8: 3, 16: 3.5, 32: 5}.__getitem__)
    assert tried == [4, 4, 8, 8, 16, 16]
    assert search.chosen == 8 and search.next() == 8
    assert search.throughput(8) == pytest.approx(64 / 3)


def test_turns_down_when_the_first_step_up_loses():
    search = ChunkSearch(CANDIDATES, start=4)
    tried = drive(search, {1: 1, 2: 2, 4: 3, 8: 4, 16: 5, 32: 6}.__getitem__)
    assert tried == [4, 4, 8, 8, 2, 2, 1, 1]
    assert search.chosen == 1


def test_stops_going_down_at_the_peak():
    search = ChunkSearch(CANDIDATES, start=8)
    tried = drive(search, {1: 9, 2: 2, 4: 3, 8: 4, 16: 5, 32: 6}.__getitem__)
    assert tried == [8, 8, 16, 16, 4, 4, 2, 2, 1, 1]
    assert search.chosen == 2


def test_start_at_the_top_goes_down():
    search = ChunkSearch([1, 2, 4], start=4)
    tried = drive(search, {1: 3, 2: 2, 4: 2.5}.__getitem__)
    assert tried == [4, 4, 2, 2, 1, 1]
    assert search.chosen == 2


def test_gain_below_threshold_is_not_better():
    search = ChunkSearch(CANDIDATES, start=4, min_gain=0.05)
    drive(search, {1: 5, 2: 4.1, 4: 4.0, 8: 3.9, 16: 3.8, 32: 3.7}.__getitem__)
    assert search.chosen == 4  # 8 is only 2.5% faster; 2 is slower


def test_best_of_repeats_absorbs_warm_up():
    times = iter([10.0, 2.0, 3.0, 3.0, 4.0, 4.0])  # the very first step is slow (warm-up)
    search = ChunkSearch([2, 4, 8], start=2, repeats=2)
    drive(search, lambda count: next(times))
    assert search.chosen == 2


def test_invalid_counts_are_skipped():
    valid = lambda count: count < 4 or count % 4 == 0  # noqa: E731
    search = ChunkSearch([1, 2, 3, 4, 6, 8, 12], start=4, valid=valid)
    tried = drive(search, lambda count: 10.0 / count)
    assert 6 not in tried and search.chosen == 12


def test_single_candidate_settles_on_it():
    search = ChunkSearch([4], start=4)
    assert drive(search, lambda count: 1.0) == [4, 4] and search.chosen == 4


def test_other_counts_are_ignored():
    search = ChunkSearch(CANDIDATES, start=4)
    search.record(8, 64, 1.0)
    assert search.measurements == {}


def test_candidate_counts_and_start():
    assert candidate_counts(3, 24) == [1, 2, 3, 4, 6, 8, 12, 16, 24]
    assert candidate_counts(2, 5) == [1, 2, 4]
    assert first_count(4, lambda c: True) == 8
    assert first_count(4, lambda c: c <= 4) == 4


def test_pipe_chunks_auto_settles_and_steps_exactly(caplog):
    model = mlp(width=8, depth=6, out=3)
    pipe = fastpipe.Pipe(nn.Sequential(*[layer for layer in model]), chunks="auto",
                         balance=[3, 3], devices=["cpu", "cpu"], schedule="1f1b")
    assert pipe.chunks == 4  # starts at twice the stage count
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    with caplog.at_level(logging.INFO, logger="fastpipe"):
        for _ in range(12):
            pipe.zero_grad(set_to_none=True)
            loss = pipe.train_step(x, y, nn.functional.cross_entropy)
            expected_loss, expected = reference(model, x, y, nn.functional.cross_entropy)
            torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
            assert_same_grads(grads_of(pipe.module), expected)
    search = pipe.chunk_search
    assert search.chosen is not None and pipe.chunks == search.chosen
    assert search.chosen in search.measurements
    assert any("chunks='auto' chose" in r.getMessage() for r in caplog.records)


def test_chunks_argument_is_checked():
    with pytest.raises(TypeError, match="chunks must be an int"):
        fastpipe.Pipe(mlp(), chunks="many", balance=[3, 3], devices=["cpu", "cpu"])
