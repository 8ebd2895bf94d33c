"""The timed simulator: cost semantics, closed forms, deadlocks, speed.

Notation: ``p`` stages, ``m`` micro-batches, ``f``/``b`` the cost of a forward and
of a full backward per stage, ``c`` the transfer latency between stages.
"""


import pytest

from fastpipe.schedule import SCHEDULES, Action, Schedule, ScheduleError, get_schedule
from fastpipe.schedule.ir import F
from fastpipe.schedule.recommend import make_schedule
from fastpipe.schedule.simulator import Costs, SimulationResult, simulate

SIZES = [(p, m) for p in (1, 2, 3, 4, 5, 8) for m in (1, 2, 3, 4, 7, 8, 16)]


def table(*rows, **kw):
    return Schedule.from_strings("hand", list(rows), **kw)


def times(result):
    return {str(e.action): (e.start, e.end) for e in result.timeline.events}


def registered(name, p, m, v=1):
    """The registered generator's schedule, or a skip while that generator does not exist."""
    if name not in SCHEDULES:
        pytest.skip(f"schedule {name!r} is not registered yet")
    return make_schedule(name, p, m, v)


# -- closed forms without latency -----------------------------------------------------------


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p, m", SIZES)
@pytest.mark.parametrize("f, b", [(1.0, 1.0), (1.0, 2.0), (0.5, 3.0)])
def test_gpipe_and_1f1b_closed_form(name, p, m, f, b):
    """Makespan ``(m+p-1)(f+b)``, bubble ``(p-1)/(m+p-1)``.

    GPipe: forward ``j`` ends on stage ``s`` at ``(s+j+1)f`` (a stage waits for
    the previous one by induction), so the last stage's forwards end at
    ``(m+p-1)f``; the backwards then sweep back, ``B_j`` on stage ``s`` ending at
    ``(m+p-1)f + (p-s+j)b``, so stage 0 ends at ``(m+p-1)(f+b)``. 1F1B reorders
    each stage but its critical path is the same length. Each stage is busy
    ``m(f+b)``, so the idle share is ``1 - m/(m+p-1) = (p-1)/(m+p-1)``.
    """
    result = get_schedule(name, p, m).simulate(Costs(forward=f, backward=b, weight=0.0))
    assert result.makespan == pytest.approx((m + p - 1) * (f + b), rel=1e-12)
    assert result.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), rel=1e-12, abs=1e-12)
    assert result.busy == pytest.approx([m * (f + b)] * p)


def test_backward_without_w_includes_the_weight_gradient():
    """No ``W`` in GPipe, so each ``B`` costs ``backward + weight``: ``f + b`` is 1 + (2 + 3)."""
    result = get_schedule("gpipe", 3, 4).simulate(Costs(forward=1, backward=2, weight=3))
    assert result.makespan == pytest.approx((4 + 3 - 1) * 6)


@pytest.mark.parametrize("p, m", SIZES)
def test_peak_inflight(p, m):
    assert get_schedule("gpipe", p, m).simulate().peak_inflight == (m,) * p
    one_f_one_b = get_schedule("1f1b", p, m).simulate()
    assert one_f_one_b.peak_inflight == tuple(min(p - r, m) for r in range(p))
    assert one_f_one_b.peak_memory == one_f_one_b.peak_inflight


# -- transfer latency -----------------------------------------------------------------------


@pytest.mark.parametrize("p, m", SIZES)
@pytest.mark.parametrize("f, b, c", [(1.0, 2.0, 0.25), (1.0, 1.0, 3.0), (2.0, 0.5, 0.1)])
def test_gpipe_with_latency(p, m, f, b, c):
    """``(m+p-1)(f+b) + 2(p-1)c``.

    Forward ``j`` on stage ``s`` ends at ``E(s,j) = s(f+c) + (j+1)f``: it starts at
    ``max(E(s,j-1), E(s-1,j) + c)``, and both are ``s(f+c) + jf``. The last
    stage's forwards end at ``T0 = (p-1)(f+c) + mf``, and its first backward
    needs only its own forward. Backwards mirror that: ``B_j`` on stage ``s`` ends
    at ``T0 + (p-1-s)(b+c) + (j+1)b`` (every stage finished its forwards by
    ``T0``). Stage 0 ends at ``T0 + (p-1)(b+c) + mb``: one latency per hop,
    down and up.
    """
    result = get_schedule("gpipe", p, m).simulate(Costs(f, b, 0.0, c))
    assert result.makespan == pytest.approx((m + p - 1) * (f + b) + 2 * (p - 1) * c)


@pytest.mark.parametrize("p, m", SIZES + [(3, 19), (6, 13)])
@pytest.mark.parametrize("f, b, c", [(1.0, 2.0, 0.25), (1.0, 1.0, 3.0), (3.0, 0.2, 0.1)])
def test_1f1b_with_latency(p, m, f, b, c):
    """``(m+p-1)(f+b) + 2c(p-1 + floor((m-1)(p-1)/p))``.

    The first micro-batch crosses ``p-1`` links down and ``p-1`` up. In the steady
    state stage 0 runs ``B_k`` right before ``F_{k+p}``, and ``B_k`` waits for
    micro-batch ``k`` to go down and come back: ``p(f+b) + 2(p-1)c`` per ``p``
    micro-batches, so each further micro-batch adds ``2c(p-1)/p`` on the
    critical path; whole hops only, hence the floor. Latency is not hidden:
    1F1B's warm-up leaves no slack to overlap transfers. (GPipe keeps only the
    start-up term.)
    """
    result = get_schedule("1f1b", p, m).simulate(Costs(f, b, 0.0, c))
    hops = 2 * (p - 1 + (m - 1) * (p - 1) // p)
    assert result.makespan == pytest.approx((m + p - 1) * (f + b) + hops * c)


def test_latency_only_between_stages():
    """Same-stage dependencies (F then B of one micro-batch) pay no latency."""
    result = simulate(table("0F0 0B0"), Costs(1, 1, 0, 100))
    assert result.makespan == 2


# -- zero-bubble cost semantics on hand-written schedules -----------------------------------


def test_w_splits_the_backward():
    """With ``W``: ``B`` costs ``backward`` and ``W`` costs ``weight``; hops add ``c``."""
    result = simulate(table("0F0 0B0 0W0", "1F0 1B0 1W0"), Costs(1, 2, 3, 0.5))
    assert times(result) == {
        "0F0": (0, 1), "1F0": (1.5, 2.5), "1B0": (2.5, 4.5), "1W0": (4.5, 7.5),
        "0B0": (5, 7), "0W0": (7, 10),
    }
    assert result.makespan == 10 and result.busy == (6, 6)
    assert result.bubble_fraction == pytest.approx(0.4)


def test_w_is_decided_per_microbatch():
    """Micro-batch 0 has a ``W`` (its ``B`` costs 2); micro-batch 1 does not (its ``B`` costs 5)."""
    result = simulate(table("0F0 0F1 0B0 0B1 0W0"), Costs(1, 2, 3))
    assert times(result) == {
        "0F0": (0, 1), "0F1": (1, 2), "0B0": (2, 4), "0B1": (4, 9), "0W0": (9, 12),
    }


def test_w_runs_off_the_critical_path():
    """ZB-style: stage 1 defers its ``W`` so stage 0 gets its gradients early.

    Split: stage 1 runs B0 at [2, 3] and B1 at [4, 5], so stage 0's B1 ends at 6
    and its two W at 8. Fused: stage 1's B1 ends at 7 and stage 0's at 9.
    """
    split = simulate(table("0F0 0F1 0B0 0B1 0W0 0W1", "1F0 1B0 1F1 1B1 1W0 1W1"))
    fused = simulate(table("0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1"))
    assert split.busy == fused.busy == (6, 6)
    assert times(split)["0B1"] == (5, 6) and times(fused)["0B1"] == (7, 9)
    assert split.makespan == 8 and fused.makespan == 9


def test_peak_inflight_lasts_until_w():
    result = simulate(table("0F0 0F1 0B0 0B1 0W0 0W1"))
    assert result.peak_inflight == (2,)
    result = simulate(table("0F0 0B0 0F1 0W0 0B1 0W1"))
    assert result.peak_inflight == (2,)  # micro-batch 0 still holds memory until its W
    assert simulate(table("0F0 0B0 0W0 0F1 0B1 0W1")).peak_inflight == (1,)


# -- per-chunk costs ------------------------------------------------------------------------


def test_costs_per_virtual_stage():
    schedule = table("0F0 0F0.1 0B0.1 0B0", "1F0 1F0.1 1B0.1 1B0", num_chunks=2)
    # virtual stages: 0 = (0, 0), 1 = (1, 0), 2 = (0, 1), 3 = (1, 1)
    result = simulate(schedule, Costs(forward=[1, 2, 3, 4], backward=0, weight=[1, 1, 1, 2],
                                      activation=[1, 1, 10, 10]))
    assert times(result) == {
        "0F0": (0, 1), "1F0": (1, 3), "0F0.1": (3, 6), "1F0.1": (6, 10),
        "1B0.1": (10, 12), "0B0.1": (12, 13), "1B0": (13, 14), "0B0": (14, 15),
    }
    assert result.peak_memory == (11, 11)
    assert result.peak_inflight == (2, 2)


def test_cost_sequence_must_match_virtual_stages():
    with pytest.raises(ValueError, match=r"costs.forward has 3 entries .* 2 virtual stages"):
        simulate(table("0F0 0B0", "1F0 1B0"), Costs(forward=[1, 2, 3]))


def test_schedule_simulate_and_overrides():
    schedule = get_schedule("1f1b", 3, 5)
    result = schedule.simulate(forward=2)
    assert isinstance(result, SimulationResult)
    assert result.costs == Costs(forward=2)
    assert result.makespan == simulate(schedule, Costs(2, 1, 1)).makespan == (5 + 2) * 4
    assert schedule.simulate(Costs(1, 1, 1), p2p=1).costs == Costs(1, 1, 1, 1)


def test_timeline_of_a_result():
    result = get_schedule("1f1b", 2, 3).simulate()
    timeline = result.timeline
    assert timeline.source == "simulated" and timeline.unit == "units"
    assert timeline.num_stages == 2 and len(timeline.events) == 12
    assert [str(e.action) for e in timeline.by_stage()[0]] == ["0F0", "0F1", "0B0", "0F2",
                                                               "0B1", "0B2"]
    assert all(e.stage == e.action.stage for e in timeline.events)


# -- Costs ----------------------------------------------------------------------------------


def test_costs_parse():
    assert Costs.parse("1,2,3") == Costs(1, 2, 3, 0)
    assert Costs.parse(" 1, 2.5 ,0,0.25") == Costs(1, 2.5, 0, 0.25)
    assert Costs.parse("1,2,3").is_uniform
    assert not Costs(forward=[1, 2]).is_uniform


@pytest.mark.parametrize("text", ["", "1,2", "1,2,3,4,5", "a,b,c", "1,,3", "1,-2,3", "nan,1,1",
                                  "1,inf,1"])
def test_costs_parse_rejects(text):
    with pytest.raises(ValueError, match="cannot parse costs"):
        Costs.parse(text)


@pytest.mark.parametrize("kw, error", [
    ({"forward": -1}, ValueError), ({"weight": [1, -0.5]}, ValueError),
    ({"p2p": "1"}, TypeError), ({"backward": True}, TypeError), ({"forward": [1, None]}, TypeError),
])
def test_costs_reject_bad_values(kw, error):
    with pytest.raises(error, match=next(iter(kw))):
        Costs(**kw)


# -- deadlocks and missing actions ----------------------------------------------------------


def test_cross_stage_deadlock_names_blocked_actions():
    schedule = table("0F0 0B0 0F1 0B1", "1F1 1B1 1F0 1B0")
    with pytest.raises(ScheduleError) as info:
        simulate(schedule)
    message = str(info.value)
    assert "'hand' cannot proceed" in message
    assert "stage 0: 0B0 at position 1 waits for 1B0" in message
    assert "stage 1: 1F1 at position 0 waits for 0F1" in message


def test_missing_dependency_is_named():
    with pytest.raises(ScheduleError, match=r"stage 1: 1B0 at position 0 waits for 1F0 "
                                            r"\(not in the schedule\)"):
        simulate(table("0F0 0B0", "1B0"))


def test_local_order_deadlock():
    with pytest.raises(ScheduleError, match="stage 0: 0B1 at position 1 waits for 0F1"):
        simulate(table("0F0 0B1 0F1 0B0"))


class _Throttled(Schedule):
    """Stage 0 may start micro-batch ``k`` only after stage 1 has forwarded ``k-1``."""

    def dependencies(self, action):
        deps = super().dependencies(action)
        if action.kind is F and action.stage == 0 and action.microbatch > 0:
            deps += (Action(1, F, action.microbatch - 1),)
        return deps


def test_uses_the_schedules_own_dependencies():
    """Whatever :meth:`Schedule.dependencies` says, including micro-batch-dependent extras."""
    base = table("0F0 0F1 0B0 0B1", "1F0 1F1 1B0 1B1")
    throttled = _Throttled("hand", 2, 2, base.actions)
    assert simulate(base, Costs(1, 1, 0)).makespan == 6
    result = simulate(throttled, Costs(1, 1, 0))
    assert times(result)["0F1"] == (2, 3)
    assert result.makespan == 7


# -- registered generators added elsewhere (skipped until they exist) ------------------------


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("v", [2, 3])
@pytest.mark.parametrize("groups", [1, 2, 3])
def test_interleaved_closed_form(p, v, groups):
    """Interleaved 1F1B, chunks costing ``f/v`` and ``b/v``: bubble ``(p-1)/(vm+p-1)``.

    Each stage is busy ``v * m * (f+b)/v = m(f+b)``. The first forward reaches
    the last stage after ``p-1`` chunk forwards (``(p-1)f/v``) and the last
    backward needs ``p-1`` chunk backwards to drain (``(p-1)b/v``); with ``m`` a
    multiple of ``p`` the steady state has no gaps, so the makespan is
    ``m(f+b) + (p-1)(f+b)/v`` and the idle share
    ``(p-1)(f+b)/v / (m(f+b) + (p-1)(f+b)/v) = (p-1)/(vm+p-1)``.
    """
    m = groups * p
    f, b = 1.0, 2.0
    result = registered("interleaved", p, m, v).simulate(Costs(f / v, b / v, 0.0))
    assert result.makespan == pytest.approx(m * (f + b) + (p - 1) * (f + b) / v)
    assert result.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 16), (8, 16), (8, 32)])
def test_zb_h1_has_a_third_of_1f1b_bubble(p, m):
    """F = B = W: 1F1B idles ``(p-1)(f+b+w) = 3(p-1)`` per stage; ZB-H1 fills the
    drain with deferred ``W`` and idles about ``(p-1)(f+b-w) = p-1``."""
    zb = registered("zb-h1", p, m).simulate(Costs(1, 1, 1))
    baseline = get_schedule("1f1b", p, m).simulate(Costs(1, 1, 1))
    idle = lambda r: p * r.makespan - sum(r.busy)  # noqa: E731
    assert idle(zb) / idle(baseline) == pytest.approx(1 / 3, abs=0.07)
    assert zb.bubble_fraction < baseline.bubble_fraction


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 16), (8, 16), (8, 32)])
def test_zbv_bubble_is_near_zero(p, m):
    result = registered("zbv", p, m, 2).simulate(Costs(1, 1, 1))
    assert result.bubble_fraction < 0.1


# -- scale (speed itself is measured in benchmarks/simulator_scale.py) ------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_64_stages_512_microbatches(name):
    result = get_schedule(name, 64, 512).simulate(weight=0.0)
    assert result.bubble_fraction == pytest.approx(63 / (512 + 63))


# -- per-step costs: blocking sends, gradient reductions, the optimizer ----------------------


def _remote_consumers(schedule):
    """The actions another physical stage depends on, read from the dependency relation."""
    return {d for row in schedule.actions for a in row for d in schedule.dependencies(a)
            if d.stage != a.stage}


def test_without_per_step_costs_the_step_is_the_makespan():
    result = get_schedule("1f1b", 4, 8).simulate(Costs(1, 2, 0))
    assert result.stage_end == () and result.step_time == result.makespan


@pytest.mark.parametrize("name, v", [("1f1b", 1), ("interleaved", 2), ("zbv", 2)])
def test_a_blocking_send_lengthens_exactly_the_actions_another_stage_waits_for(name, v):
    schedule = registered(name, 4, 8, v)
    plain = times(schedule.simulate(Costs(1, 1, 1)))
    sending = schedule.simulate(Costs(1, 1, 1, send=0.25))
    sent = {str(a) for a in _remote_consumers(schedule)}
    assert sent
    for event in sending.timeline.events:
        base = plain[str(event.action)][1] - plain[str(event.action)][0]
        extra = 0.25 if str(event.action) in sent else 0.0
        assert event.duration == pytest.approx(base + extra)


@pytest.mark.parametrize("p", [2, 3, 5])
def test_one_microbatch_pays_each_send_once_each_way(p):
    """One micro-batch crosses ``p-1`` boundaries forward and ``p-1`` back, each a blocking
    send of ``s``: ``p(f+b) + 2(p-1)s``."""
    result = get_schedule("1f1b", p, 1).simulate(Costs(1.0, 2.0, 0.0, send=0.5))
    assert result.makespan == pytest.approx(p * 3.0 + 2 * (p - 1) * 0.5)


def _last_backward_end(result, vs):
    where = result.schedule.placement
    return max(e.end for e in result.timeline.events if e.action.kind is not F
               and where[e.stage][e.action.chunk] == vs)


def test_a_reduction_starts_when_its_chunks_last_backward_ends():
    """1F1B on 2 stages: each stage's reduction ``r`` follows its own last backward, so the
    last stage's overlaps the first stage's drain; the optimizer ``o`` comes after both."""
    r, o = 1.5, 0.25
    result = get_schedule("1f1b", 2, 4).simulate(Costs(1, 1, 0, reduction=r, optimizer=o))
    plain = get_schedule("1f1b", 2, 4).simulate(Costs(1, 1, 0))
    assert result.makespan == plain.makespan  # reductions never delay an action
    for stage in (0, 1):
        done = max(e.end for e in result.timeline.by_stage()[stage])
        assert result.stage_end[stage] == pytest.approx(
            max(done, _last_backward_end(result, stage) + r) + o)
    assert result.step_time == pytest.approx(max(result.stage_end))
    assert result.stage_end[1] < result.stage_end[0]


def test_a_stages_reductions_take_turns_on_its_channel():
    """Interleaved, 2 chunks per stage: stage 0 holds virtual stages 0 and 2; the later
    chunk's gradients are final first, and the other's reduction waits for it to finish."""
    schedule = registered("interleaved", 2, 4, 2)
    r = 3.0
    result = schedule.simulate(Costs(1, 1, 0, reduction=r))
    first = min(_last_backward_end(result, 0), _last_backward_end(result, 2))
    second = max(_last_backward_end(result, 0), _last_backward_end(result, 2))
    assert result.stage_end[0] == pytest.approx(max(first + r, second) + r)


def test_a_reduction_lead_starts_it_during_the_last_backward():
    """Bucketed reduction: it may start ``lead`` before its last backward ends (not before
    that action starts) and ends no earlier than that action."""
    schedule = get_schedule("1f1b", 2, 2)
    for lead, r in ((0.5, 1.0), (5.0, 1.0), (5.0, 0.25)):
        result = schedule.simulate(Costs(1, 2, 0, reduction=r, reduction_lead=lead))
        last = max((e for e in result.timeline.by_stage()[0] if e.action.kind is not F),
                   key=lambda e: e.end)
        start = max(last.start, last.end - lead)
        assert result.stage_end[0] == pytest.approx(max(last.end, start + r))


def test_recommend_splits_reduction_and_optimizer_over_chunks_but_not_sends():
    from fastpipe.schedule.recommend import per_chunk_costs
    schedule = registered("interleaved", 2, 4, 2)
    chunked = per_chunk_costs(Costs(2, 2, 2, send=1.0, reduction=4.0, optimizer=6.0),
                              schedule)
    assert (chunked.reduction, chunked.optimizer, chunked.send) == (2.0, 3.0, 1.0)
