"""Tests for the GPipe and 1F1B generators and the schedule registry."""

import pytest

from fastpipe.schedule import (
    SCHEDULES,
    Schedule,
    get_schedule,
    gpipe,
    one_f_one_b,
    register_schedule,
)


def rows(schedule):
    return [" ".join(row) for row in schedule.to_strings()]


# -- exact orders ----------------------------------------------------------------------


def test_gpipe_p3_m4():
    assert rows(gpipe(3, 4)) == [
        "0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3",
        "1F0 1F1 1F2 1F3 1B0 1B1 1B2 1B3",
        "2F0 2F1 2F2 2F3 2B0 2B1 2B2 2B3",
    ]


def test_gpipe_single_stage_single_microbatch():
    assert rows(gpipe(1, 1)) == ["0F0 0B0"]


def test_1f1b_p4_m8():
    assert rows(one_f_one_b(4, 8)) == [
        "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 0B5 0B6 0B7",
        "1F0 1F1 1F2 1B0 1F3 1B1 1F4 1B2 1F5 1B3 1F6 1B4 1F7 1B5 1B6 1B7",
        "2F0 2F1 2B0 2F2 2B1 2F3 2B2 2F4 2B3 2F5 2B4 2F6 2B5 2F7 2B6 2B7",
        "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5 3F6 3B6 3F7 3B7",
    ]


def test_1f1b_p2_m3():
    assert rows(one_f_one_b(2, 3)) == [
        "0F0 0F1 0B0 0F2 0B1 0B2",
        "1F0 1B0 1F1 1B1 1F2 1B2",
    ]


def test_1f1b_fewer_microbatches_than_stages():
    assert rows(one_f_one_b(4, 2)) == [
        "0F0 0F1 0B0 0B1",
        "1F0 1F1 1B0 1B1",
        "2F0 2F1 2B0 2B1",
        "3F0 3B0 3F1 3B1",
    ]


def test_1f1b_m_equals_p_minus_one():
    assert rows(one_f_one_b(4, 3)) == [
        "0F0 0F1 0F2 0B0 0B1 0B2",
        "1F0 1F1 1F2 1B0 1B1 1B2",
        "2F0 2F1 2B0 2F2 2B1 2B2",
        "3F0 3B0 3F1 3B1 3F2 3B2",
    ]


@pytest.mark.parametrize("p", [1, 2, 5])
def test_1f1b_single_microbatch(p):
    assert rows(one_f_one_b(p, 1)) == [f"{r}F0 {r}B0" for r in range(p)]


def test_1f1b_single_stage_alternates():
    assert rows(one_f_one_b(1, 3)) == ["0F0 0B0 0F1 0B1 0F2 0B2"]


@pytest.mark.parametrize("p", range(1, 7))
@pytest.mark.parametrize("m", range(1, 11))
def test_1f1b_structure(p, m):
    schedule = one_f_one_b(p, m)
    assert (schedule.name, schedule.num_stages, schedule.num_microbatches) == ("1f1b", p, m)
    for r, row in enumerate(schedule.actions):
        warmup = min(p - r - 1, m)
        kinds = "".join(a.kind.value for a in row)
        assert kinds == "F" * warmup + "FB" * (m - warmup) + "B" * warmup
        # forwards and backwards each run in micro-batch order
        assert [a.microbatch for a in row if a.kind.value == "F"] == list(range(m))
        assert [a.microbatch for a in row if a.kind.value == "B"] == list(range(m))


@pytest.mark.parametrize("fn", [gpipe, one_f_one_b])
def test_generators_round_trip_through_strings(fn):
    schedule = fn(3, 5)
    assert Schedule.from_strings(schedule.name, schedule.to_strings()) == schedule


@pytest.mark.parametrize("fn", [gpipe, one_f_one_b])
@pytest.mark.parametrize(
    "args, name, error",
    [
        ((0, 4), "num_stages", ValueError),
        ((2, 0), "num_microbatches", ValueError),
        ((-1, 4), "num_stages", ValueError),
        ((2.0, 4), "num_stages", TypeError),
        ((2, "4"), "num_microbatches", TypeError),
    ],
)
def test_generator_argument_checks(fn, args, name, error):
    with pytest.raises(error, match=name):
        fn(*args)


# -- registry ----------------------------------------------------------------------------


def test_registry_has_builtin_schedules():
    assert SCHEDULES["gpipe"] is gpipe
    assert SCHEDULES["1f1b"] is one_f_one_b
    assert get_schedule("1f1b", 4, 8) == one_f_one_b(4, 8)
    assert get_schedule("GPipe", 3, 4) == gpipe(3, 4)


@pytest.mark.parametrize("bad", ["pipedream-2bw", "", "1F1B-interleaved", None])
def test_get_schedule_unknown_name(bad):
    with pytest.raises(ValueError) as info:
        get_schedule(bad, 2, 2)
    message = str(info.value)
    assert f"schedule={bad!r}" in message
    assert "'1f1b'" in message and "'gpipe'" in message


@pytest.mark.parametrize(
    "args, name", [((0, 2), "num_stages"), ((2, 0), "num_microbatches")]
)
def test_get_schedule_argument_checks(args, name):
    with pytest.raises(ValueError, match=name):
        get_schedule("gpipe", *args)


def test_get_schedule_forwards_options():
    with pytest.raises(TypeError):
        get_schedule("gpipe", 2, 2, num_chunks=2)


def test_register_schedule_decorator():
    @register_schedule("Reversed-Test")
    def reversed_gpipe(num_stages, num_microbatches, *, tag="r"):
        base = gpipe(num_stages, num_microbatches)
        return Schedule(tag, num_stages, num_microbatches, base.actions)

    try:
        assert SCHEDULES["reversed-test"] is reversed_gpipe
        assert get_schedule("reversed-test", 2, 3, tag="t").name == "t"
        register_schedule("reversed-test")(reversed_gpipe)  # same function: no error
        with pytest.raises(ValueError, match="already registered"):
            register_schedule("reversed-test")(gpipe)
    finally:
        SCHEDULES.pop("reversed-test", None)


@pytest.mark.parametrize("bad", ["", None, 3])
def test_register_schedule_rejects_bad_names(bad):
    with pytest.raises(ValueError, match="non-empty string"):
        register_schedule(bad)
