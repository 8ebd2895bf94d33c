"""The NCCL lowering and the validator's NCCL deadlock model (pure logic, no processes).

The model must reject the orders that hang pipelines on NCCL (two ranks that both send first,
a receive enqueued early ahead of a send on the same stream, ops between two ranks posted in
different orders) and accept the NCCL lowering of every schedule."""
import random

import pytest

from fastpipe.schedule import (SCHEDULES, Action, CommGroup, CommKind, ScheduleError,
                               SkipLink, get_schedule, lower, lower_nccl, run_lockstep, validate)
from fastpipe.schedule.lower import Comm, Payload
from fastpipe.schedule.nccl import pair_key
from fastpipe.schedule.lower import comm_fields

VIRTUAL = {"interleaved": (1, 2), "looped-bfs": (1, 2), "zbv": (2,), "dualpipev": (2,)}


def schedules(stages, microbatches):
    """Every schedule that builds for these sizes, with each virtual-stage count it takes."""
    for name in SCHEDULES:
        for v in VIRTUAL.get(name, (1,)):
            try:
                yield get_schedule(name, stages, microbatches,
                                   **({"virtual_stages": v} if name in VIRTUAL else {}))
            except (ValueError, ScheduleError):
                continue


@pytest.mark.parametrize("stages", range(2, 9))
def test_every_schedules_nccl_lowering_is_deadlock_free(stages):
    checked = 0
    for m in (1, 2, 3, 5, 8, 13, 32, 64):
        for schedule in schedules(stages, m):
            validate(schedule, comm="nccl")
            checked += 1
    assert checked >= 8 * 5  # every schedule at most of the sizes


def test_with_skip_connections_too():
    rng = random.Random(0)
    for stages in (2, 3, 4):
        for schedule in schedules(stages, 6):
            count = schedule.num_virtual_stages
            for _ in range(4):
                links = set()
                for k in range(rng.randint(1, 3)):
                    src = rng.randrange(count - 1)
                    links.add(SkipLink(f"s{k}", src, rng.randrange(src + 1, count)))
                validate(schedule, comm="nccl", skips=sorted(links))


def deadlocks(schedule, programs, comm="nccl"):
    with pytest.raises(ScheduleError, match="deadlocks under NCCL semantics") as info:
        run_lockstep(schedule, programs, comm=comm)
    return str(info.value)


def test_two_ranks_that_both_send_first_deadlock():
    schedule = get_schedule("1f1b", 2, 4)
    message = deadlocks(schedule, lower(schedule, batched=False))
    assert "stage 0" in message and "stage 1" in message
    assert "send act1 v0->1" in message and "send grad0 v1->0" in message


def early_receives(programs):
    """Every group's receives enqueued one action earlier, in a group of their own: before the
    previous action and the sends it makes (a receive prefetched onto the one stream)."""
    out = []
    for program in programs:
        ops = []
        for op in program:
            actions = [i for i, o in enumerate(ops) if isinstance(o, Action)]
            if not isinstance(op, CommGroup) or not actions:
                ops.append(op)
                continue
            receives = tuple(c for c in op.ops if c.kind is CommKind.RECV)
            sends = tuple(c for c in op.ops if c.kind is CommKind.SEND)
            if receives:
                ops.insert(actions[-1], CommGroup(receives))
            if sends:
                ops.append(CommGroup(sends))
        out.append(tuple(ops))
    return tuple(out)


def test_an_early_receive_ahead_of_a_send_on_the_stream_deadlocks_interleaved():
    """The cross-node interleaved pattern: each rank enqueues its next receive before the send
    its current action makes; the receive blocks the stream, the peer waits for the send."""
    schedule = get_schedule("interleaved", 4, 8, virtual_stages=2)
    programs = lower_nccl(schedule)
    run_lockstep(schedule, programs, comm="nccl")  # as lowered: fine
    message = deadlocks(schedule, early_receives(programs))
    assert "stream blocked at [recv" in message and "groups behind it" in message


@pytest.mark.parametrize("name, v", [("interleaved", 2), ("looped-bfs", 2), ("dualpipev", 2)])
def test_the_plain_batched_lowering_hangs_on_nccl_where_the_nccl_one_does_not(name, v):
    """``lower()``'s groups (sends after the producer, receives before the consumer, merged per
    pair of actions) are fine with buffered sends and hang under NCCL for these schedules."""
    schedule = get_schedule(name, 4, 8, virtual_stages=v)
    run_lockstep(schedule, lower(schedule), comm="buffered")
    with pytest.raises(ScheduleError, match="NCCL"):
        run_lockstep(schedule, lower(schedule), comm="nccl")
    validate(schedule, comm="nccl")


def test_ops_between_two_ranks_posted_in_different_orders_are_an_error():
    schedule = get_schedule("gpipe", 2, 2)
    act = [Comm(CommKind.SEND, Payload.ACT, 1, mb, 0) for mb in (0, 1)]
    programs = lower_nccl(schedule)
    zero = [op for op in programs[0] if not isinstance(op, CommGroup)]
    one = [op for op in programs[1] if not isinstance(op, CommGroup)]
    receives = [act[mb].counterpart(0) for mb in (1, 0)]  # the other order
    grads = [Comm(CommKind.SEND, Payload.GRAD, 0, mb, 1) for mb in (0, 1)]
    first = (zero[0], zero[1], CommGroup(tuple(act)), CommGroup(
        tuple(g.counterpart(1) for g in grads)), zero[2], zero[3])
    second = (CommGroup(tuple(receives)), one[0], one[1], one[2], one[3], CommGroup(tuple(grads)))
    with pytest.raises(ScheduleError, match="pairs the ops between two ranks in the order"):
        run_lockstep(schedule, (first, second), comm="nccl")


def test_group_ops_are_ordered_alike_on_both_ends():
    schedule = get_schedule("zbv", 3, 6)
    skips = [SkipLink("a", 0, 4), SkipLink("b", 1, 3)]
    programs = lower_nccl(schedule, skips=skips)
    seen = {}
    for stage, program in enumerate(programs):
        for op in program:
            if isinstance(op, CommGroup):
                keys = [pair_key(stage, comm_fields(c)) for c in op.ops]
                assert keys == sorted(keys)
                for c in op.ops:
                    seen.setdefault(c.kind, set()).add(pair_key(stage, comm_fields(c)))
    assert seen[CommKind.SEND] == seen[CommKind.RECV]  # every send has its receive


def test_one_group_per_round_sends_and_receives_together_and_no_local_transfer():
    """Megatron's send_forward_recv_backward, for every schedule: at most one group between
    two actions, holding this round's sends and receives; chunks of one rank exchange
    nothing over the wire."""
    schedule = get_schedule("1f1b", 2, 4)
    zero = lower_nccl(schedule)[0]
    assert [str(op) for op in zero[3:5]] == ["[send act1 v0->1 | recv grad0 v0<-1]", "0B0"]
    schedule = get_schedule("interleaved", 2, 4, virtual_stages=2)
    for stage, program in enumerate(lower_nccl(schedule)):
        for before, op in zip(program, program[1:]):
            assert not (isinstance(before, CommGroup) and isinstance(op, CommGroup))
            if isinstance(op, CommGroup):
                assert all(c.peer != stage for c in op.ops)


@pytest.mark.parametrize("stages", [2, 3, 5, 8])
def test_prefetched_programs_stay_deadlock_free_and_post_receives_a_step_early(stages):
    """``prefetch=True`` moves a group of receives ahead of the action before it: they are in
    flight while it computes; the streams see the same groups in the same order, and the model
    accepts every schedule."""
    moved = 0
    for m in (1, 4, 13, 64):
        for schedule in schedules(stages, m):
            plain, early = lower_nccl(schedule), lower_nccl(schedule, prefetch=True)
            run_lockstep(schedule, early, comm="nccl")
            for before, after in zip(plain, early):
                groups = [op for op in before if isinstance(op, CommGroup)]
                assert groups == [op for op in after if isinstance(op, CommGroup)]
                assert [op for op in before if isinstance(op, Action)] == \
                    [op for op in after if isinstance(op, Action)]
                moved += before != after
    assert moved > 0


def test_only_groups_of_receives_are_prefetched():
    schedule = get_schedule("gpipe", 2, 4)
    plain, early = lower_nccl(schedule), lower_nccl(schedule, prefetch=True)
    assert [str(op) for op in early[1][:4]] == [
        "[recv act0 v1<-0]", "[recv act1 v1<-0]", "1F0", "[recv act2 v1<-0]"]
    for before, after in zip(plain, early):
        for i, op in enumerate(after):
            if isinstance(op, CommGroup) and op not in before[i:i + 1]:
                assert all(c.kind is CommKind.RECV for c in op.ops)
