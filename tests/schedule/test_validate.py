"""Tests for schedule validation: every error branch, deadlocks, and the report."""

import pytest

from fastpipe.schedule import (
    Schedule,
    ScheduleError,
    ValidationReport,
    gpipe,
    lower,
    one_f_one_b,
    peak_inflight,
    run_lockstep,
    validate,
)


def table(*rows, **kw):
    return Schedule.from_strings("t", list(rows), **kw)


def error_of(schedule):
    with pytest.raises(ScheduleError) as info:
        validate(schedule)
    return str(info.value)


# -- built-in schedules pass -----------------------------------------------------------


@pytest.mark.parametrize("p", range(1, 7))
@pytest.mark.parametrize("m", range(1, 11))
def test_gpipe_validates(p, m):
    report = gpipe(p, m).validate()
    assert report.peak_inflight == (m,) * p
    assert report.num_steps == 2 * (m + p - 1)


@pytest.mark.parametrize("p", range(1, 7))
@pytest.mark.parametrize("m", range(1, 11))
def test_1f1b_validates(p, m):
    report = one_f_one_b(p, m).validate()
    assert report.peak_inflight == tuple(min(p - r, m) for r in range(p))
    assert report.num_steps == 2 * (m + p - 1)


def test_report_details_1f1b_p2_m2():
    report = validate(one_f_one_b(2, 2))
    assert isinstance(report, ValidationReport)
    assert report.action_steps == ((0, 1, 3, 5), (1, 2, 3, 4))
    assert report.num_steps == 6
    assert report.busy_steps == (4, 4)
    assert report.bubble_fraction == pytest.approx(1 - 8 / 12)


def test_peak_inflight_counts_chunk_microbatch_pairs():
    schedule = table("0F0 0F0.1 0F1 0B0.1 0B0 0F1.1 0B1.1 0B1", num_chunks=2)
    assert peak_inflight(schedule) == (3,)
    assert validate(schedule).peak_inflight == (3,)


def test_peak_inflight_ignores_weight_steps():
    schedule = table("0F0 0F1 0B0 0W0 0B1 0W1", "1F0 1B0 1W0 1F1 1B1 1W1")
    assert validate(schedule).peak_inflight == (2, 1)


def test_interleaved_hand_schedule_validates():
    schedule = table("0F0 0F0.1 0B0.1 0B0", "1F0 1F0.1 1B0.1 1B0", num_chunks=2)
    report = validate(schedule)
    assert report.peak_inflight == (2, 2)
    assert report.num_steps == 8  # one micro-batch snakes through 4 virtual stages and back


def test_v_shaped_hand_schedule_validates():
    schedule = table(
        "0F0 0F0.1 0B0.1 0B0", "1F0 1F0.1 1B0.1 1B0", num_chunks=2, placement=((0, 3), (1, 2))
    )
    assert validate(schedule).num_steps == 8


# -- completeness and range errors -------------------------------------------------------


def test_missing_backward():
    message = error_of(table("0F0 0F1 0B0", "1F0 1B0 1F1 1B1"))
    assert "stage 0" in message and "micro-batch 1" in message
    assert "no backward" in message and "0B1" in message


def test_missing_forward_on_a_chunk():
    message = error_of(table("0F0 0B0.1 0B0", "1F0 1F0.1 1B0.1 1B0", num_chunks=2))
    assert "stage 0" in message and "chunk 1" in message and "virtual stage 2" in message
    assert "no forward" in message and "0F0.1" in message


def test_duplicate_action():
    message = error_of(table("0F0 0F0 0B0"))
    assert "stage 0" in message and "0F0" in message
    assert "2 times" in message and "[0, 1]" in message


def test_duplicate_weight_step():
    message = error_of(table("0F0 0B0 0W0 0W0"))
    assert "0W0" in message and "2 times" in message


def test_microbatch_out_of_range():
    message = error_of(table("0F0 0F5 0B0 0B5", num_microbatches=4))
    assert "stage 0" in message and "0F5" in message and "position 1" in message
    assert "micro-batch 5" in message and "num_microbatches=4" in message


def test_chunk_out_of_range():
    message = error_of(table("0F0 0F0.2 0B0.2 0B0"))
    assert "0F0.2" in message and "chunk 2" in message and "num_chunks=1" in message


# -- per-stage order errors ----------------------------------------------------------------


def test_backward_before_forward():
    message = error_of(table("0F0 0B1 0F1 0B0"))
    assert "stage 0" in message and "0B1" in message and "micro-batch 1" in message
    assert "before 0F1" in message and "backward must follow its forward" in message


def test_weight_before_backward():
    message = error_of(table("0F0 0W0 0B0"))
    assert "0W0" in message and "before 0B0" in message and "weight-gradient" in message


def test_same_stage_chunk_order_is_checked():
    # one stage holds both chunks, so chunk-to-chunk dependencies are local (no receive
    # enforces them) and are checked against the row order
    message = error_of(table("0F0.1 0F0 0B0.1 0B0", num_chunks=2))
    assert "0F0.1" in message and "before 0F0" in message and "activation" in message
    message = error_of(table("0F0 0F0.1 0B0 0B0.1", num_chunks=2))
    assert "0B0 " in message and "before 0B0.1" in message and "gradient" in message


def test_wrong_stage_index_in_a_row():
    with pytest.raises(ScheduleError, match=r"stage 1 position 0: action 2F0"):
        table("0F0 0B0", "2F0 1B0")


# -- deadlocks --------------------------------------------------------------------------------


def test_unbatched_1f1b_deadlocks():
    schedule = one_f_one_b(2, 2)
    with pytest.raises(ScheduleError) as info:
        run_lockstep(schedule, lower(schedule, batched=False))
    assert str(info.value) == (
        "schedule '1f1b' deadlocks after 4 rounds; blocked stages and their pending ops:\n"
        "  stage 0: blocked after 0F1 at [send act1 v0->1]: "
        "send act1 v0->1 waits for stage 1 to post 'recv act1 v1<-0'\n"
        "  stage 1: blocked after 1B0 at [send grad0 v1->0]: "
        "send grad0 v1->0 waits for stage 0 to post 'recv grad0 v0<-1'"
    )


@pytest.mark.parametrize("p, m", [(2, 3), (4, 8), (3, 2)])
def test_unbatched_1f1b_deadlocks_whenever_it_has_a_steady_state(p, m):
    schedule = one_f_one_b(p, m)
    with pytest.raises(ScheduleError, match="deadlocks"):
        run_lockstep(schedule, lower(schedule, batched=False))
    run_lockstep(schedule, lower(schedule))  # batched: fine


def test_unbatched_gpipe_is_fine():
    schedule = gpipe(3, 4)
    steps = run_lockstep(schedule, lower(schedule, batched=False))
    assert steps == validate(schedule).action_steps


def test_mismatched_backward_order_deadlocks():
    message = error_of(table("0F0 0F1 0B1 0B0", "1F0 1F1 1B0 1B1"))
    assert "deadlocks" in message
    assert "stage 0: blocked after 0F1 at [send act1 v0->1 | recv grad1 v0<-1]" in message
    assert "recv grad1 v0<-1 waits for stage 1 to post 'send grad1 v1->0'" in message
    assert "stage 1: blocked after 1B0 at [send grad0 v1->0]" in message


def test_forward_out_of_upstream_order_deadlocks():
    # stage 1 wants micro-batch 1 first; stage 0 sends micro-batch 0 first
    message = error_of(
        table("0F0 0F1 0B0 0B1", "1F1 1F0 1B0 1B1", "2F0 2B0 2F1 2B1")
    )
    assert "stage 0: blocked after 0F0 at [send act0 v0->1]" in message
    assert "stage 1: blocked before its first action at [recv act1 v1<-0]" in message
    assert "stage 2: blocked before its first action at [recv act0 v2<-1]" in message


def test_deadlock_message_reports_finished_stages():
    schedule = Schedule.from_strings("t", ["0F0 0B0", "1F0 1B0"])
    programs = lower(schedule)
    # drop stage 1's final gradient send: stage 1 finishes, stage 0 waits forever
    broken = (programs[0], programs[1][:-1])
    with pytest.raises(ScheduleError) as info:
        run_lockstep(schedule, broken)
    message = str(info.value)
    assert "stage 1: finished" in message
    assert "stage 0: blocked after 0F0 at [send act0 v0->1 | recv grad0 v0<-1]: " in message
    assert "waits for stage 1 to post 'send grad0 v1->0'" in message


def test_validate_is_a_method():
    assert one_f_one_b(3, 3).validate() == validate(one_f_one_b(3, 3))
