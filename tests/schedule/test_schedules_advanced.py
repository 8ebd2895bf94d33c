"""Tests for the interleaved, looped-BFS, ZB-H1, ZB-V and DualPipeV generators."""

from functools import lru_cache

import pytest

from fastpipe.schedule import (
    SCHEDULES,
    Schedule,
    dualpipev,
    get_schedule,
    gpipe,
    interleaved,
    looped_bfs,
    one_f_one_b,
    peak_inflight,
    validate,
    zb_h1,
    zbv,
)
from fastpipe.schedule.interleaved import interleaved_units, interleaved_warmup
from fastpipe.schedule.ir import B, W
from fastpipe.schedule.zbv import v_placement

NEW = {
    "interleaved": interleaved,
    "looped-bfs": looped_bfs,
    "zb-h1": zb_h1,
    "zbv": zbv,
    "dualpipev": dualpipev,
}


def rows(schedule):
    return [" ".join(row) for row in schedule.to_strings()]


@lru_cache(maxsize=None)
def buffered(schedule):
    """Validation under the buffered deadlock model (cached: schedules are immutable)."""
    return validate(schedule, comm="buffered")


def peak_until_weight(schedule):
    """Per stage, most (chunk, micro-batch) pairs forwarded and not yet finished, where a
    pair with a ``W`` finishes at its ``W`` and any other pair at its ``B``."""
    split = {a.with_kind(B) for row in schedule.actions for a in row if a.kind is W}
    peaks = []
    for row in schedule.actions:
        live = peak = 0
        for a in row:
            if a.kind.value == "F":
                live += 1
            elif a.kind is W or (a.kind is B and a not in split):
                live -= 1
            peak = max(peak, live)
        peaks.append(peak)
    return tuple(peaks)


def idle_rounds(report):
    return [report.num_steps - busy for busy in report.busy_steps]


# -- exact orders, derived by hand from each definition ----------------------------------


def test_interleaved_p2_m4_v2():
    # forward units (chunk, mb): (0,0) (0,1) (1,0) (1,1) (0,2) (0,3) (1,2) (1,3);
    # backward units: the same groups with chunks reversed; warm-up 4 on stage 0, 2 on stage 1
    assert rows(interleaved(2, 4, virtual_stages=2)) == [
        "0F0 0F1 0F0.1 0F1.1 0F2 0B0.1 0F3 0B1.1 0F2.1 0B0 0F3.1 0B1 0B2.1 0B3.1 0B2 0B3",
        "1F0 1F1 1F0.1 1B0.1 1F1.1 1B1.1 1F2 1B0 1F3 1B1 1F2.1 1B2.1 1F3.1 1B3.1 1B2 1B3",
    ]


def test_interleaved_p2_m2_v3():
    # stage 0's warm-up 2 + 2*2 = 6 is every forward; stage 1's is 4
    assert rows(interleaved(2, 2, virtual_stages=3)) == [
        "0F0 0F1 0F0.1 0F1.1 0F0.2 0F1.2 0B0.2 0B1.2 0B0.1 0B1.1 0B0 0B1",
        "1F0 1F1 1F0.1 1F1.1 1F0.2 1B0.2 1F1.2 1B1.2 1B0.1 1B1.1 1B0 1B1",
    ]


def test_interleaved_fewer_microbatches_than_stages():
    # one partial group of 2 micro-batches; every warm-up is capped at m*v = 4
    assert rows(interleaved(3, 2)) == [
        "0F0 0F1 0F0.1 0F1.1 0B0.1 0B1.1 0B0 0B1",
        "1F0 1F1 1F0.1 1F1.1 1B0.1 1B1.1 1B0 1B1",
        "2F0 2F1 2F0.1 2F1.1 2B0.1 2B1.1 2B0 2B1",
    ]


def test_looped_bfs_p2_m3_v2():
    assert rows(looped_bfs(2, 3)) == [
        "0F0 0F1 0F2 0F0.1 0F1.1 0F2.1 0B0.1 0B1.1 0B2.1 0B0 0B1 0B2",
        "1F0 1F1 1F2 1F0.1 1F1.1 1F2.1 1B0.1 1B1.1 1B2.1 1B0 1B1 1B2",
    ]


def test_zb_h1_p3_m4():
    # stage r: min(p-r-1, m) warm-up forwards, rounds F(j+w) B(j) W(j-r), then the rest of W
    assert rows(zb_h1(3, 4)) == [
        "0F0 0F1 0F2 0B0 0W0 0F3 0B1 0W1 0B2 0W2 0B3 0W3",
        "1F0 1F1 1B0 1F2 1B1 1W0 1F3 1B2 1W1 1B3 1W2 1W3",
        "2F0 2B0 2F1 2B1 2F2 2B2 2W0 2F3 2B3 2W1 2W2 2W3",
    ]


def test_zb_h1_p4_m2_fewer_microbatches():
    assert rows(zb_h1(4, 2)) == [
        "0F0 0F1 0B0 0W0 0B1 0W1",
        "1F0 1F1 1B0 1B1 1W0 1W1",
        "2F0 2F1 2B0 2B1 2W0 2W1",
        "3F0 3B0 3F1 3B1 3W0 3W1",
    ]


def test_zbv_p2_m4():
    # stage 0: 3 F.0 | no F.1 F.0 pairs | 2 x F.1 B.1 W.1 | rounds F.0 B.0 W.0 F.1 B.1 W.1
    #          (F.0 only while one remains) | cool-down B.0 W
    # stage 1: 1 F.0 | 1 x F.1 F.0 | 1 x F.1 B.1 W.1 | 2 rounds | B.1 B.0, B.0 W(oldest), W W
    assert rows(zbv(2, 4)) == [
        "0F0 0F1 0F2 0F0.1 0B0.1 0W0.1 0F1.1 0B1.1 0W1.1 0F3 0B0 0W0 0F2.1 0B2.1 0W2.1 "
        "0B1 0W1 0F3.1 0B3.1 0W3.1 0B2 0W2 0B3 0W3",
        "1F0 1F0.1 1F1 1F1.1 1B0.1 1W0.1 1F2 1B0 1W0 1F2.1 1B1.1 1W1.1 1F3 1B1 1W1 "
        "1F3.1 1B2.1 1W2.1 1B3.1 1B2 1B3 1W3.1 1W2 1W3",
    ]


def test_dualpipev_p2_m4():
    # (B* = split backward, its W queued first-in first-out)
    # stage 0: F.0 F.0 | F.0 F.1 | B*.1 W F.1 | F.0 B.1 F.1 B.0 | B.1 F.1 B.0 | B.1 B*.0
    #          | W B*.0 | W
    # stage 1: F.0 F.1 x2 | F.0 B.1 F.1 B.0 x2 | B.1 B.0, B*.1 B*.0 | W W
    assert rows(dualpipev(2, 4)) == [
        "0F0 0F1 0F2 0F0.1 0B0.1 0W0.1 0F1.1 0F3 0B1.1 0F2.1 0B0 0B2.1 0F3.1 0B1 0B3.1 "
        "0B2 0W2 0B3 0W3",
        "1F0 1F0.1 1F1 1F1.1 1F2 1B0.1 1F2.1 1B0 1F3 1B1.1 1F3.1 1B1 1B2.1 1B2 1B3.1 "
        "1B3 1W3.1 1W3",
    ]


# -- definitions -----------------------------------------------------------------------------


@pytest.mark.parametrize("p, v, m", [(2, 2, 4), (3, 2, 9), (4, 3, 8), (2, 4, 6)])
def test_interleaved_units_follow_megatron_chunk_ids(p, v, m):
    forward = interleaved_units(p, m, v)
    backward = interleaved_units(p, m, v, reverse=True)
    for k in range(m * v):
        mb = (k // (p * v)) * p + k % p
        assert forward[k] == ((k // p) % v, mb)
        assert backward[k] == (v - 1 - (k // p) % v, mb)


@pytest.mark.parametrize("p, m, v", [(4, 8, 2), (4, 4, 3), (3, 12, 4), (2, 1, 2)])
def test_interleaved_warmup_and_steady_state(p, m, v):
    schedule = interleaved(p, m, v)
    forward = interleaved_units(p, m, v)
    for r, row in enumerate(schedule.actions):
        warmup = interleaved_warmup(r, p, m, v)
        assert warmup == min((p - r - 1) * 2 + (v - 1) * p, m * v)
        kinds = "".join(a.kind.value for a in row)
        total = m * v
        assert kinds == "F" * warmup + "FB" * (total - warmup) + "B" * warmup
        assert [(a.chunk, a.microbatch) for a in row if a.kind.value == "F"] == forward


@pytest.mark.parametrize("p", range(1, 7))
@pytest.mark.parametrize("m", range(1, 11))
def test_interleaved_with_one_chunk_is_1f1b(p, m):
    schedule = interleaved(p, m, virtual_stages=1)
    reference = one_f_one_b(p, m)
    assert schedule.actions == reference.actions
    assert (schedule.num_chunks, schedule.placement) == (1, reference.placement)


@pytest.mark.parametrize("fn", [interleaved, looped_bfs])
def test_round_robin_placement(fn):
    schedule = fn(4, 8, virtual_stages=3)
    assert schedule.num_chunks == 3
    assert schedule.placement == ((0, 4, 8), (1, 5, 9), (2, 6, 10), (3, 7, 11))


@pytest.mark.parametrize("fn", [zbv, dualpipev])
def test_v_placement(fn):
    schedule = fn(4, 8)
    assert schedule.num_chunks == 2
    assert schedule.placement == v_placement(4) == ((0, 7), (1, 6), (2, 5), (3, 4))


@pytest.mark.parametrize("p", range(1, 6))
@pytest.mark.parametrize("m", range(1, 13))
def test_zero_bubble_schedules_split_every_backward(p, m):
    for schedule in (zb_h1(p, m), zbv(p, m)):
        for row in schedule.actions:
            assert sorted(map(str, (a for a in row if a.kind is W))) == sorted(
                str(a.with_kind(W)) for a in row if a.kind is B
            )


@pytest.mark.parametrize("p", range(1, 6))
def test_dualpipev_splits_p_backwards_per_stage(p):
    # DeepSeek's DualPipeV defers exactly p weight gradients per stage (phases 3 and 6-8
    # pair them up), all the other backwards are full
    for m in (2 * p, 3 * p + 1):
        for row in dualpipev(p, m).actions:
            weights = [a for a in row if a.kind is W]
            assert len(weights) == (p - 1 - row[0].stage) + p


# -- validation over the supported ranges -----------------------------------------------------


def supported_microbatches(name, p, v):
    if name == "interleaved" and v > 1:
        return range(p, 4 * p + 1, p)
    return range(p, 4 * p + 1)


GRID = [
    (name, p, v)
    for name in NEW
    for p in range(2, 9)
    for v in ((1, 2, 3, 4) if name in ("interleaved", "looped-bfs") else (None,))
]


@pytest.mark.parametrize("name, p, v", GRID, ids=[f"{n}-p{p}-v{v}" for n, p, v in GRID])
def test_validates_buffered_over_supported_range(name, p, v):
    kw = {} if v is None else {"virtual_stages": v}
    for m in supported_microbatches(name, p, v or 1):
        schedule = get_schedule(name, p, m, **kw)
        report = buffered(schedule)
        assert report.busy_steps == tuple(len(row) for row in schedule.actions)


@pytest.mark.parametrize("name", ["zbv", "dualpipev", "zb-h1", "looped-bfs"])
@pytest.mark.parametrize("p", [1, 2, 3, 5])
def test_validates_below_the_range(name, p):
    for m in range(1, 2 * p + 1):
        buffered(get_schedule(name, p, m))


@pytest.mark.parametrize("p", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("v", [2, 3, 4])
def test_interleaved_fewer_microbatches_than_stages_validates(p, v):
    for m in range(1, p):
        buffered(interleaved(p, m, v))


@pytest.mark.parametrize("fn", list(NEW.values()))
def test_round_trip_through_strings(fn):
    schedule = fn(3, 6)
    again = Schedule.from_strings(
        schedule.name,
        schedule.to_strings(),
        num_microbatches=6,
        num_chunks=schedule.num_chunks,
        placement=schedule.placement,
    )
    assert again == schedule


# -- peak in-flight ----------------------------------------------------------------------------


@pytest.mark.parametrize("p", range(1, 9))
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 13, 24])
def test_zb_h1_peak_inflight(p, m):
    schedule = zb_h1(p, m)
    # counted until B, exactly 1F1B's: min(p - r, m)
    assert peak_inflight(schedule) == peak_inflight(one_f_one_b(p, m))
    assert peak_inflight(schedule) == tuple(min(p - r, m) for r in range(p))
    # counted until W: min(p, m) on every stage, 1F1B's peak (its stage 0's)
    assert peak_until_weight(schedule) == (min(p, m),) * p


@pytest.mark.parametrize("p", range(1, 9))
def test_zbv_peak_inflight(p):
    for m in range(2 * p - 1, 4 * p + 1):
        # 2p half-size chunk activations per stage: 1F1B's p full ones
        assert peak_until_weight(zbv(p, m)) == (2 * p,) * p
    for m in range(1, 2 * p - 1):
        assert max(peak_until_weight(zbv(p, m))) <= 2 * p


@pytest.mark.parametrize("p", range(1, 9))
def test_dualpipev_peak_inflight(p):
    for m in range(2 * p, 4 * p + 1):
        assert peak_until_weight(dualpipev(p, m)) == (2 * p + 1,) * p


@pytest.mark.parametrize("p, m, v", [(2, 4, 2), (4, 8, 2), (4, 16, 3), (3, 12, 4), (4, 2, 2)])
def test_interleaved_peak_inflight(p, m, v):
    expected = tuple(min(interleaved_warmup(r, p, m, v) + 1, m * v) for r in range(p))
    assert buffered(interleaved(p, m, v)).peak_inflight == expected


@pytest.mark.parametrize("p, m, v", [(2, 3, 2), (4, 8, 3)])
def test_looped_bfs_peak_inflight(p, m, v):
    assert buffered(looped_bfs(p, m, v)).peak_inflight == (m * v,) * p


# -- unit-time bubbles (every F, B and W one round) ------------------------------------------------


@pytest.mark.parametrize("p", range(2, 9))
def test_zb_h1_bubble_is_a_third_of_1f1b(p):
    # 1F1B idles (p-1)(t_F + t_B) per stage: 2(p-1) rounds here with t_B = 1, and
    # 3(p-1) units when its full backward costs B + W = 2; ZB-H1 idles p - 1
    for m in range(p, 4 * p + 1):
        zb = buffered(zb_h1(p, m))
        one = validate(one_f_one_b(p, m))
        assert zb.num_steps == 3 * m + p - 1
        assert idle_rounds(zb) == [p - 1] * p
        assert idle_rounds(one) == [2 * (p - 1)] * p
        assert zb.bubble_fraction < one.bubble_fraction


@pytest.mark.parametrize("p", range(2, 9))
def test_zbv_bubble_is_minimal_from_2p(p):
    # stage p-1 cannot start before round p-1, so 6m + p - 1 rounds is the least possible
    for m in range(2 * p, 4 * p + 1):
        report = buffered(zbv(p, m))
        assert report.num_steps == 6 * m + p - 1
        assert report.bubble_fraction < buffered(zb_h1(p, m)).bubble_fraction


@pytest.mark.parametrize("p", range(2, 9))
def test_interleaved_and_looped_bfs_bubble(p):
    one = validate(one_f_one_b(p, 2 * p)).bubble_fraction
    for v in (2, 3, 4):
        for fn in (interleaved, looped_bfs):
            report = buffered(fn(p, 2 * p, v))
            assert report.num_steps == 2 * (v * 2 * p + p - 1)
            assert report.bubble_fraction == pytest.approx((p - 1) / (v * 2 * p + p - 1))
            assert report.bubble_fraction < one


@pytest.mark.parametrize("p", range(2, 9))
def test_dualpipev_bubble(p):
    for m in (2 * p, 4 * p):
        report = buffered(dualpipev(p, m))
        assert report.bubble_fraction < buffered(zb_h1(p, m)).bubble_fraction
        assert report.bubble_fraction < 0.05


# -- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize("p, m, suggestion", [(4, 5, "4 or 8"), (3, 7, "6 or 9"), (2, 3, "2 or 4")])
def test_interleaved_rejects_partial_groups(p, m, suggestion):
    with pytest.raises(ValueError) as info:
        interleaved(p, m, virtual_stages=2)
    message = str(info.value)
    assert f"num_microbatches={m}" in message and "virtual_stages=2" in message
    assert f"multiple of num_stages={p}" in message and suggestion in message


@pytest.mark.parametrize(
    "fn, name, bad",
    [
        (gpipe, "gpipe", 2),
        (one_f_one_b, "1f1b", 2),
        (zb_h1, "zb-h1", 2),
        (zbv, "zbv", 1),
        (zbv, "zbv", 3),
        (dualpipev, "dualpipev", 4),
    ],
)
def test_fixed_virtual_stages(fn, name, bad):
    with pytest.raises(ValueError) as info:
        fn(4, 8, virtual_stages=bad)
    message = str(info.value)
    assert name in message and "virtual_stages must be" in message and str(bad) in message


@pytest.mark.parametrize("fn", [gpipe, one_f_one_b, *NEW.values()])
@pytest.mark.parametrize(
    "args, kw, name, error",
    [
        ((0, 4), {}, "num_stages", ValueError),
        ((2, 0), {}, "num_microbatches", ValueError),
        ((2.0, 4), {}, "num_stages", TypeError),
        ((2, 4), {"virtual_stages": 0}, "virtual_stages", ValueError),
        ((2, 4), {"virtual_stages": "2"}, "virtual_stages", TypeError),
        ((2, 4), {"virtual_stages": True}, "virtual_stages", TypeError),
    ],
)
def test_argument_checks(fn, args, kw, name, error):
    with pytest.raises(error, match=name):
        fn(*args, **kw)


# -- registry ----------------------------------------------------------------------------------


def test_registry_names():
    for name, fn in NEW.items():
        assert SCHEDULES[name] is fn
    assert get_schedule("Interleaved", 4, 8, virtual_stages=3) == interleaved(4, 8, 3)
    assert get_schedule("ZB-H1", 3, 5) == zb_h1(3, 5)
    assert get_schedule("gpipe", 2, 2, virtual_stages=1) == gpipe(2, 2)


@pytest.mark.parametrize("name", sorted(NEW) + ["gpipe", "1f1b"])
def test_every_schedule_builds_for_one_stage_one_microbatch(name):
    # Pipe checks a schedule name with get_schedule(name, 1, 1)
    schedule = get_schedule(name, 1, 1)
    assert schedule.name == name
    buffered(schedule)
