"""The timeline format shared by simulated and measured runs."""

import json

import pytest

from fastpipe.schedule import Action, get_schedule
from fastpipe.schedule.timeline import Event, Timeline


def measured():
    """Two stages, monotonic-clock seconds that do not start at zero."""
    return Timeline.from_intervals(2, [
        (0, "0F0", 100.0, 101.0),
        (1, Action.parse("1F0"), 101.5, 102.5),
        (1, "1B0", 102.5, 104.5),
        (0, "0B0", 105.0, 107.0),
    ])


def test_from_intervals_and_statistics():
    timeline = measured()
    assert timeline.source == "measured" and timeline.unit == "s"
    assert timeline.events[1] == Event(1, Action.parse("1F0"), 101.5, 102.5)
    assert timeline.makespan == pytest.approx(7.0)
    assert timeline.busy == (3.0, 3.0)
    assert timeline.bubble_fraction == pytest.approx(1 - 6 / 14)
    assert timeline.peak_inflight == (1, 1)


def test_by_stage_sorts_by_start():
    events = (Event(0, Action.parse("0B0"), 2, 3), Event(1, Action.parse("1F0"), 1, 2),
              Event(0, Action.parse("0F0"), 0, 1))
    timeline = Timeline(2, events)
    assert [[str(e.action) for e in lane] for lane in timeline.by_stage()] == [["0F0", "0B0"],
                                                                                ["1F0"]]


def test_peak_inflight_ends_at_w_when_split():
    events = [(0, "0F0", 0, 1), (0, "0F1", 1, 2), (0, "0B0", 2, 3), (0, "0F2", 3, 4),
              (0, "0W0", 4, 5), (0, "0B1", 5, 6), (0, "0B2", 6, 7)]
    # micro-batch 0 is in flight until its W, so 0, 1 and 2 overlap at 0F2
    assert Timeline.from_intervals(1, events).peak_inflight == (3,)
    without_w = [e for e in events if e[1] != "0W0"]
    assert Timeline.from_intervals(1, without_w).peak_inflight == (2,)


def test_peak_counts_chunk_microbatch_pairs_and_weights():
    events = [(0, "0F0", 0, 1), (0, "0F0.1", 1, 2), (0, "0B0.1", 2, 3), (0, "0B0", 3, 4)]
    timeline = Timeline.from_intervals(1, events)
    assert timeline.peak_inflight == (2,)
    assert timeline.peak_weighted(lambda a: 1.0 + a.chunk) == (3.0,)


def test_empty_timeline():
    timeline = Timeline(3, ())
    assert timeline.makespan == 0 and timeline.bubble_fraction == 0
    assert timeline.busy == (0, 0, 0) and timeline.peak_inflight == (0, 0, 0)


def test_json_round_trip():
    for timeline in (measured(), get_schedule("1f1b", 3, 4).simulate().timeline):
        data = json.loads(json.dumps(timeline.to_dict()))
        assert Timeline.from_dict(data) == timeline
    data = measured().to_dict()
    assert data["events"][0] == {"stage": 0, "action": "0F0", "start": 100.0, "end": 101.0}
    assert data["num_stages"] == 2 and data["unit"] == "s" and data["source"] == "measured"


@pytest.mark.parametrize("data", [{}, {"num_stages": 1}, {"num_stages": 1, "events": [{}]},
                                  {"num_stages": 1, "events": [{"stage": 0, "action": "0X0",
                                                                "start": 0, "end": 1}]}])
def test_from_dict_rejects_malformed(data):
    with pytest.raises(ValueError):
        Timeline.from_dict(data)


def test_rejects_bad_events():
    with pytest.raises(ValueError, match="outside 0..1"):
        Timeline.from_intervals(2, [(2, "2F0", 0, 1)])
    with pytest.raises(ValueError, match="ends .* before it starts"):
        Timeline.from_intervals(2, [(0, "0F0", 1, 0)])
    with pytest.raises(ValueError, match="num_stages"):
        Timeline(0, ())
