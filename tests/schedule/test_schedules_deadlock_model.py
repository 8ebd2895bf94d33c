"""Tests for the validator's deadlock models, and which schedules need buffered sends."""

import pytest

from fastpipe.schedule import (
    Schedule,
    ScheduleError,
    dualpipev,
    gpipe,
    interleaved,
    looped_bfs,
    lower,
    one_f_one_b,
    run_lockstep,
    validate,
    zb_h1,
    zbv,
)
from fastpipe.schedule.validate import COMM_MODELS


def passes(schedule, comm):
    try:
        validate(schedule, comm=comm)
    except ScheduleError as error:
        assert "deadlocks" in str(error)
        return False
    return True


# -- the option ----------------------------------------------------------------------------


def test_models_and_default():
    assert COMM_MODELS == ("rendezvous", "buffered", "nccl")
    schedule = one_f_one_b(3, 5)
    assert validate(schedule) == validate(schedule, comm="rendezvous")


def test_method_passes_the_model_through():
    schedule = zbv(3, 6)
    assert schedule.validate(comm="buffered") == validate(schedule, comm="buffered")
    with pytest.raises(ScheduleError, match="deadlocks"):
        schedule.validate()


@pytest.mark.parametrize("bad", ["mailbox", "", None, "Buffered"])
def test_unknown_model(bad):
    schedule = gpipe(2, 2)
    for call in (
        lambda: validate(schedule, comm=bad),
        lambda: run_lockstep(schedule, lower(schedule), comm=bad),
    ):
        with pytest.raises(ValueError) as info:
            call()
        message = str(info.value)
        assert f"comm={bad!r}" in message and "'rendezvous', 'buffered'" in message


@pytest.mark.parametrize("fn", [gpipe, one_f_one_b])
@pytest.mark.parametrize("p, m", [(1, 3), (2, 2), (3, 5), (4, 8)])
def test_models_agree_on_classic_schedules(fn, p, m):
    schedule = fn(p, m)
    assert validate(schedule, comm="buffered") == validate(schedule)


@pytest.mark.parametrize("p, m", [(2, 2), (2, 3), (4, 8), (3, 2)])
def test_buffered_sends_need_no_batching(p, m):
    # unbatched 1F1B deadlocks under rendezvous (see test_validate) but not with mailboxes
    schedule = one_f_one_b(p, m)
    steps = run_lockstep(schedule, lower(schedule, batched=False), comm="buffered")
    assert steps == validate(schedule).action_steps


def test_send_order_mismatch_is_fine_when_buffered():
    # stage 1 wants micro-batch 1 first; stage 0 sends micro-batch 0 first
    schedule = Schedule.from_strings("t", ["0F0 0F1 0B0 0B1", "1F1 1F0 1B0 1B1"])
    assert not passes(schedule, "rendezvous")
    report = validate(schedule, comm="buffered")
    assert report.action_steps == ((0, 1, 5, 6), (2, 3, 4, 5))


def test_dependency_cycle_deadlocks_when_buffered():
    # stage 1 runs F1 before F0; stage 0 only forwards micro-batch 1 after B0, which needs
    # stage 1's B0, which follows its F1: a cycle no buffering can break
    schedule = Schedule.from_strings("t", ["0F0 0B0 0F1 0B1", "1F1 1F0 1B0 1B1"])
    with pytest.raises(ScheduleError) as info:
        validate(schedule, comm="buffered")
    assert str(info.value) == (
        "schedule 't' deadlocks after 2 rounds; blocked stages and their pending ops:\n"
        "  stage 0: blocked after 0F0 at [send act0 v0->1 | recv grad0 v0<-1]: "
        "recv grad0 v0<-1 waits for stage 1 to post 'send grad0 v1->0'\n"
        "  stage 1: blocked before its first action at [recv act1 v1<-0]: "
        "recv act1 v1<-0 waits for stage 0 to post 'send act1 v0->1'"
    )


# -- which schedules pass rendezvous ---------------------------------------------------------------
#
# The lowering posts a receive only right before the action that needs it, so under
# rendezvous a sender blocks until the receiver gets there. Schedules that send well
# ahead of use -- across the round-robin wrap from the last stage to stage 0, or down
# the V -- deadlock there, though their orders are sound (they pass "buffered").


@pytest.mark.parametrize("p", [1, 2, 3, 5, 8])
def test_zb_h1_passes_rendezvous(p):
    for m in range(1, 4 * p + 1):
        assert passes(zb_h1(p, m), "rendezvous")


@pytest.mark.parametrize("p", [2, 3, 5])
@pytest.mark.parametrize("v", [2, 3])
def test_interleaved_rendezvous_needs_a_single_group(p, v):
    for m in range(1, p + 1):
        assert passes(interleaved(p, m, v), "rendezvous")
    for m in range(2 * p, 4 * p + 1, p):
        assert not passes(interleaved(p, m, v), "rendezvous")
        assert passes(interleaved(p, m, v), "buffered")


@pytest.mark.parametrize("p", [2, 3, 5])
@pytest.mark.parametrize("v", [2, 4])
def test_looped_bfs_rendezvous_needs_fewer_than_2p_microbatches(p, v):
    for m in range(p, 4 * p + 1):
        assert passes(looped_bfs(p, m, v), "rendezvous") == (m < 2 * p)


@pytest.mark.parametrize("p", [2, 3, 5])
def test_v_schedules_need_buffered_sends(p):
    for m in range(p + 1, 4 * p + 1):
        assert not passes(zbv(p, m), "rendezvous")
        assert not passes(dualpipev(p, m), "rendezvous")
