"""The schedule tools' fast paths agree with the plain definitions they replace.

Dependencies come from per-group tables, lowering and the simulator ask for them a group at a
time, and the lock-step deadlock simulation only revisits stages whose state changed. Each is
compared here, on random schedules (sound, reordered, incomplete, with W or not, any placement),
against a plain reference: the rule read action by action, and a lock-step run that scans
every stage every round.
"""

import gc
import random

import pytest

from fastpipe.schedule import (
    SCHEDULES,
    Action,
    Comm,
    CommGroup,
    CommKind,
    Payload,
    Schedule,
    ScheduleError,
    get_schedule,
    lower,
    run_lockstep,
    simulate,
    validate,
)
from fastpipe.schedule.ir import B, F, W
from fastpipe.schedule.simulator import Costs

SEEDS = range(120)


# -- plain references ------------------------------------------------------------------------


def plain_dependencies(schedule, action):
    """The dependency rule of :meth:`Schedule.dependencies`, action by action."""
    vs = schedule.virtual_stage_of(action)
    mb = action.microbatch
    if action.kind is F:
        return (schedule.action_at(F, vs - 1, mb),) if vs > 0 else ()
    if action.kind is W:
        return (Action(action.stage, B, mb, action.chunk),)
    deps = [Action(action.stage, F, mb, action.chunk)]
    if vs < schedule.num_virtual_stages - 1:
        deps.append(schedule.action_at(B, vs + 1, mb))
    return tuple(deps)


def plain_consumers(schedule, action):
    """The inverse rule of :meth:`Schedule.consumers`, action by action."""
    present = {a for row in schedule.actions for a in row}
    vs = schedule.virtual_stage_of(action)
    mb = action.microbatch
    if action.kind is F:
        out = [Action(action.stage, B, mb, action.chunk)]
        if vs < schedule.num_virtual_stages - 1:
            out.append(schedule.action_at(F, vs + 1, mb))
        return tuple(out)
    if action.kind is W:
        return ()
    out = [schedule.action_at(B, vs - 1, mb)] if vs > 0 else []
    weight = Action(action.stage, W, mb, action.chunk)
    return tuple(out + [weight] if weight in present else out)


def plain_lower(schedule, batched=True):
    """Lowering that asks :meth:`Schedule.dependencies` and :meth:`Schedule.consumers` of
    every action and builds every op through the checked constructors."""
    programs = []
    for row in schedule.actions:
        program, pending = [], []
        for action in row:
            vs = schedule.virtual_stage_of(action)
            pending += [Comm(CommKind.RECV, payload(d), d.stage, action.microbatch, vs)
                        for d in schedule.dependencies(action) if d.stage != action.stage]
            flush(program, pending, batched)
            program.append(action)
            pending = [Comm(CommKind.SEND, payload(action), u.stage, action.microbatch, vs)
                       for u in schedule.consumers(action) if u.stage != action.stage]
        flush(program, pending, batched)
        programs.append(tuple(program))
    return tuple(programs)


def payload(producer):
    return Payload.ACT if producer.kind is F else Payload.GRAD


def flush(program, pending, batched):
    if batched and pending:
        program.append(CommGroup(tuple(pending)))
    elif not batched:
        program.extend(CommGroup((op,)) for op in pending)
    pending.clear()


def plain_lockstep(schedule, programs, comm):
    """The deadlock model of :mod:`fastpipe.schedule.validate`, scanning every stage every
    round: post, match (or deliver) and complete until nothing changes, then compute."""
    buffered = comm == "buffered"
    n = len(programs)
    pc, pending = [0] * n, [None] * n
    mailbox, steps = [set() for _ in programs], [[] for _ in programs]

    def current(stage):
        return programs[stage][pc[stage]] if pc[stage] < len(programs[stage]) else None

    rounds = 0
    while True:
        changed = True
        while changed:
            changed = False
            for stage in range(n):
                if isinstance(current(stage), CommGroup) and pending[stage] is None:
                    pending[stage], changed = set(current(stage).ops), True
            for stage, ops in enumerate(pending):
                for op in list(ops or ()):
                    if buffered and op.kind is CommKind.SEND:
                        mailbox[op.peer].add(op.counterpart(stage))
                    elif buffered and op in mailbox[stage]:
                        mailbox[stage].discard(op)
                    elif not buffered and op.counterpart(stage) in (pending[op.peer] or ()):
                        pending[op.peer].discard(op.counterpart(stage))
                    else:
                        continue
                    ops.discard(op)
                    changed = True
            for stage, ops in enumerate(pending):
                if ops is not None and not ops:
                    pending[stage], changed = None, True
                    pc[stage] += 1
        if all(current(stage) is None for stage in range(n)):
            return tuple(tuple(row) for row in steps)
        ran = [stage for stage in range(n) if isinstance(current(stage), Action)]
        for stage in ran:
            steps[stage].append(rounds)
            pc[stage] += 1
        rounds += 1
        if not ran:
            raise ScheduleError(plain_deadlock(schedule, programs, rounds, pc, pending))


def plain_deadlock(schedule, programs, rounds, pc, pending):
    lines = [f"schedule {schedule.name!r} deadlocks after {rounds} rounds; "
             "blocked stages and their pending ops:"]
    for stage, program in enumerate(programs):
        if pc[stage] >= len(program):
            lines.append(f"  stage {stage}: finished")
            continue
        done = [op for op in program[: pc[stage]] if isinstance(op, Action)]
        context = f"after {done[-1]}" if done else "before its first action"
        waiting = "; ".join(
            f"{c} waits for stage {c.peer} to post '{c.counterpart(stage)}'"
            for c in sorted(pending[stage] or (), key=str)
        )
        lines.append(f"  stage {stage}: blocked {context} at {program[pc[stage]]}: {waiting}")
    return "\n".join(lines)


class PerAction(Schedule):
    """The same schedule, but with dependencies redefined (identically), so that every
    tool must ask action by action instead of a group at a time."""

    def dependencies(self, action):
        return super().dependencies(action)

    def consumers(self, action):
        return super().consumers(action)


def per_action(schedule):
    return PerAction(schedule.name, schedule.num_stages, schedule.num_microbatches,
                     schedule.actions, schedule.num_chunks, schedule.placement)


# -- random schedules ------------------------------------------------------------------------


def random_schedule(seed, *, repeats=True):
    """A registered schedule, or a random complete one, then perhaps disturbed: neighbours
    swapped, an action dropped or (with ``repeats``) repeated."""
    rng = random.Random(seed)
    if rng.random() < 0.5:
        name = rng.choice(sorted(SCHEDULES))
        p, m = rng.randint(1, 4), rng.randint(1, 6)
        v = 2 if name in ("interleaved", "looped-bfs", "zbv", "dualpipev") else 1
        if name == "interleaved" and m > p:
            m -= m % p
        base = get_schedule(name, p, m, virtual_stages=v)
        rows = [list(row) for row in base.actions]
        placement, v = base.placement, base.num_chunks
    else:
        p, m, v = rng.randint(1, 3), rng.randint(1, 4), rng.randint(1, 3)
        order = list(range(p * v))
        rng.shuffle(order)
        placement = tuple(tuple(order[s * v:(s + 1) * v]) for s in range(p))
        rows = [complete_row(rng, stage, m, v) for stage in range(p)]
    disturb(rng, rows, repeats)
    return Schedule(f"s{seed}", p, m, rows, v, placement)


def complete_row(rng, stage, m, v):
    row = []
    for chunk in range(v):
        for mb in range(m):
            row += [Action(stage, F, mb, chunk), Action(stage, B, mb, chunk)]
            if rng.random() < 0.5:
                row.append(Action(stage, W, mb, chunk))
    rng.shuffle(row)
    return row


def disturb(rng, rows, repeats):
    for _ in range(rng.choice([0, 0, 1, 2])):
        row = rng.choice(rows)
        if len(row) < 2:
            continue
        what, i = rng.random(), rng.randrange(len(row) - 1)
        if what < 0.6:
            row[i], row[i + 1] = row[i + 1], row[i]
        elif what < 0.8:
            del row[i]
        elif repeats:
            row.insert(rng.randrange(len(row)), row[i])


def outcome(fn, *args, **kw):
    """What ``fn`` returns, or the type and text of the error it raises."""
    try:
        return fn(*args, **kw)
    except (ScheduleError, ValueError, KeyError) as error:
        return type(error), str(error)


# -- dependencies --------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_dependencies_follow_the_plain_rule(seed):
    schedule = random_schedule(seed)
    asked = {a for row in schedule.actions for a in row}
    asked |= {a.with_kind(kind) for a in list(asked) for kind in (F, B, W)}  # some absent
    for action in asked:
        assert schedule.dependencies(action) == plain_dependencies(schedule, action)
        assert schedule.consumers(action) == plain_consumers(schedule, action)


@pytest.mark.parametrize("seed", SEEDS)
def test_dependency_groups_hold_for_every_microbatch(seed):
    schedule = random_schedule(seed)
    for stage in range(schedule.num_stages):
        for chunk in range(schedule.num_chunks):
            for kind in (F, B, W):
                groups = schedule.dependency_groups(stage, kind, chunk)
                users = schedule.consumer_groups(stage, kind, chunk)
                for mb in range(schedule.num_microbatches + 1):
                    action = Action(stage, kind, mb, chunk)
                    deps = schedule.dependencies(action)
                    assert [(d.stage, d.kind, d.chunk) for d in deps] == list(groups)
                    assert all(d.microbatch == mb for d in deps)
                    found = [(u.stage, u.kind, u.chunk) for u in schedule.consumers(action)]
                    assert found == [g for g in users if g in found]


def test_dependencies_return_the_schedules_own_actions():
    schedule = get_schedule("zbv", 3, 6)
    own = {id(a) for row in schedule.actions for a in row}
    for row in schedule.actions:
        for action in row:
            assert all(id(d) in own for d in schedule.dependencies(action))


def test_dependency_groups_defer_to_a_redefined_rule():
    schedule = per_action(get_schedule("1f1b", 2, 2))
    assert schedule.dependency_groups(0, F, 0) is None
    assert schedule.consumer_groups(0, F, 0) is None
    assert get_schedule("1f1b", 2, 2).dependency_groups(1, B, 0) == ((1, F, 0),)


def test_out_of_range_chunks_are_rejected_as_before():
    schedule = get_schedule("1f1b", 2, 2)
    for ask in (schedule.dependencies, schedule.consumers):
        with pytest.raises(ValueError, match=r"chunk=1 is out of range 0\.\.0"):
            ask(Action(0, F, 0, 1))


# -- lowering and validation ---------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("batched", [True, False])
def test_lowering_matches_the_plain_pass(seed, batched):
    schedule = random_schedule(seed)
    expected = outcome(plain_lower, schedule, batched)
    assert outcome(lower, schedule, batched=batched) == expected
    assert outcome(lower, per_action(schedule), batched=batched) == expected


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("comm", ["rendezvous", "buffered"])
@pytest.mark.parametrize("batched", [True, False])
def test_lockstep_matches_the_round_by_round_model(seed, comm, batched):
    # no repeated actions: a repeated op makes the plain model depend on its set order
    schedule = random_schedule(seed, repeats=False)
    programs = plain_lower(schedule, batched)
    expected = outcome(plain_lockstep, schedule, programs, comm)
    assert outcome(run_lockstep, schedule, programs, comm=comm) == expected


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("comm", ["rendezvous", "buffered"])
def test_validation_is_the_same_action_by_action(seed, comm):
    schedule = random_schedule(seed)
    assert outcome(validate, schedule, comm=comm) == outcome(
        validate, per_action(schedule), comm=comm)


@pytest.mark.parametrize("seed", SEEDS)
def test_validation_steps_are_the_plain_models(seed):
    schedule = random_schedule(seed, repeats=False)
    report = outcome(validate, schedule, comm="buffered")
    if isinstance(report, tuple):
        return  # an error, compared in test_validation_is_the_same_action_by_action
    assert report.action_steps == plain_lockstep(schedule, plain_lower(schedule), "buffered")


def test_lockstep_treats_unknown_ops_as_blocking():
    schedule = Schedule.from_strings("t", ["0F0 0B0", "1F0 1B0"])
    programs = lower(schedule)
    broken = (programs[0], ("not an op",) + programs[1])
    with pytest.raises(ScheduleError) as info:
        run_lockstep(schedule, broken)
    assert str(info.value) == outcome(plain_lockstep, schedule, broken, "rendezvous")[1]


def test_a_send_to_oneself_reaches_the_receive_of_its_group():
    send = Comm(CommKind.SEND, Payload.ACT, 0, 0, 0)
    recv = Comm(CommKind.RECV, Payload.ACT, 0, 0, 1)
    schedule = Schedule.from_strings("t", ["0F0"])
    for ops in [(send, recv), (recv, send)]:
        programs = ((CommGroup(ops), Action(0, F, 0)),)
        for comm in ("rendezvous", "buffered"):
            assert run_lockstep(schedule, programs, comm=comm) == ((0,),)


# -- simulation ----------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_simulation_is_the_same_action_by_action(seed):
    schedule = random_schedule(seed)
    costs = Costs(1.0, 2.0, 0.5, 0.25, 1.0)
    fast, plain = outcome(simulate, schedule, costs), outcome(simulate, per_action(schedule), costs)
    if isinstance(fast, tuple):
        assert fast == plain
    else:
        assert fast.timeline.events == plain.timeline.events
        assert fast.peak_memory == plain.peak_memory


# -- the garbage collector -----------------------------------------------------------------------


@pytest.mark.parametrize("enabled", [True, False])
def test_tools_restore_the_collectors_state(enabled):
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        schedule = get_schedule("zbv", 3, 6)
        schedule.validate(comm="buffered")
        schedule.simulate()
        lower(schedule)
        with pytest.raises(ScheduleError):
            Schedule.from_strings("t", ["0F0 0B1 0F1 0B0"]).validate()
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()
