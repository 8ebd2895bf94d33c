"""Ranking schedules by simulated makespan under a memory limit."""

import pytest

from fastpipe.schedule import SCHEDULES, get_schedule
from fastpipe.schedule.recommend import (
    Recommendation,
    make_schedule,
    per_chunk_costs,
    recommend,
)
from fastpipe.schedule.simulator import Costs


def test_gpipe_and_1f1b_tie_on_time_and_1f1b_wins_on_memory():
    ranked = recommend(4, 8, Costs(1, 2, 0), schedules=["gpipe", "1f1b"])
    assert ranked == [
        Recommendation("1f1b", 1, 33.0, pytest.approx(3 / 11), 4.0),
        Recommendation("gpipe", 1, 33.0, pytest.approx(3 / 11), 8.0),
    ]


def test_latency_makes_gpipe_faster_until_memory_rules_it_out():
    costs = Costs(1, 2, 0, 0.5)
    ranked = recommend(4, 8, costs, schedules=["gpipe", "1f1b"])
    assert [r.name for r in ranked] == ["gpipe", "1f1b"]
    assert ranked[0].makespan == 33 + 2 * 3 * 0.5
    assert [r.name for r in recommend(4, 8, costs, memory_limit=4,
                                      schedules=["gpipe", "1f1b"])] == ["1f1b"]


def test_nothing_fits():
    with pytest.raises(ValueError, match=r"memory_limit=2.*smallest peak memory found is 4 "
                                         r"\(1f1b, virtual_stages=1\)"):
        recommend(4, 8, memory_limit=2, schedules=["gpipe", "1f1b"])


def test_default_ranks_every_registered_schedule_that_fits():
    ranked = recommend(4, 8)
    names = {r.name for r in ranked}
    assert {"gpipe", "1f1b"} <= names <= set(SCHEDULES)
    assert [r.makespan for r in ranked] == sorted(r.makespan for r in ranked)
    assert all(r.virtual_stages in (1, 2) for r in ranked)


def test_unsupported_combinations_are_skipped():
    # gpipe runs one chunk per stage: only virtual_stages=1 is simulated
    ranked = recommend(2, 3, schedules=["gpipe"], virtual_stages=(1, 2, 3))
    assert [(r.name, r.virtual_stages) for r in ranked] == [("gpipe", 1)]
    with pytest.raises(ValueError, match="none of the schedules"):
        recommend(2, 3, schedules=["gpipe"], virtual_stages=(2,))


def test_unknown_schedule_and_bad_sizes():
    with pytest.raises(ValueError, match="unknown schedule"):
        recommend(2, 3, schedules=["nope"])
    with pytest.raises(ValueError, match="stages"):
        recommend(0, 3)


def test_make_schedule_passes_virtual_stages():
    assert make_schedule("interleaved", 2, 4, 3).num_chunks == 3
    assert make_schedule("1f1b", 2, 3) == get_schedule("1f1b", 2, 3)
    with pytest.raises(ValueError, match="virtual_stages must be 1"):
        make_schedule("1f1b", 2, 3, 2)


def test_per_chunk_costs_split_stage_costs():
    schedule = get_schedule("1f1b", 2, 2)
    assert per_chunk_costs(Costs(2, 4, 6, 1, 8), schedule) == Costs(2, 4, 6, 1, 8)
    chunked = type(schedule)("x", 2, 1, ((), ()), num_chunks=2)  # virtual stages 0, 2 | 1, 3
    split = per_chunk_costs(Costs(forward=[2, 4], backward=4, p2p=[1, 3], activation=8), chunked)
    assert split == Costs(forward=[1, 2, 1, 2], backward=2, weight=0.5, p2p=[1, 3, 1, 3],
                          activation=4)
    with pytest.raises(ValueError, match="one per physical stage"):
        per_chunk_costs(Costs(forward=[1, 2, 3]), chunked)


def test_interleaved_uses_split_costs():
    if "interleaved" not in SCHEDULES:
        pytest.skip("schedule 'interleaved' is not registered yet")
    p, m, v = 4, 8, 2
    ranked = recommend(p, m, Costs(1, 2, 0), schedules=["interleaved", "1f1b"],
                       virtual_stages=(v,))
    best = next(r for r in ranked if r.name == "interleaved")
    assert best.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))
    assert best.makespan == pytest.approx(m * 3 + (p - 1) * 3 / v)
    assert best.peak_memory == max(make_schedule("interleaved", p, m, v).simulate()
                                   .peak_inflight) / v
