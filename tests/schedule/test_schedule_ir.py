"""Tests for the schedule IR: actions, string forms, placement, dependencies, lowering."""

import pytest

from fastpipe.schedule import (
    Action,
    ActionKind,
    Comm,
    CommGroup,
    Schedule,
    ScheduleError,
    format_program,
    lower,
    one_f_one_b,
)
from fastpipe.schedule.ir import B, F, W

# -- Action ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "action, text",
    [
        (Action(0, F, 3), "0F3"),
        (Action(0, B, 0), "0B0"),
        (Action(1, F, 3, 1), "1F3.1"),
        (Action(1, B, 2, 1), "1B2.1"),
        (Action(12, W, 105, 3), "12W105.3"),
        (Action(7, W, 0), "7W0"),
        (Action(3, B, 10, 0), "3B10"),
    ],
)
def test_action_string_round_trip(action, text):
    assert str(action) == text
    assert Action.parse(text) == action
    assert Action.parse(str(action)) == action


@pytest.mark.parametrize("stage", [0, 1, 5])
@pytest.mark.parametrize("kind", list(ActionKind))
@pytest.mark.parametrize("microbatch", [0, 9, 31])
@pytest.mark.parametrize("chunk", [0, 1, 4])
def test_action_round_trip_grid(stage, kind, microbatch, chunk):
    action = Action(stage, kind, microbatch, chunk)
    assert Action.parse(str(action)) == action


def test_action_accepts_kind_letter_and_explicit_zero_chunk():
    assert Action(0, "F", 3) == Action(0, F, 3)
    assert Action.parse("2B4.0") == Action(2, B, 4)
    assert str(ActionKind.FORWARD) == "F"


@pytest.mark.parametrize(
    "text", ["", "F3", "0F", "0X3", "0f3", "0F3.", "0F3.1.2", "-1F3", "0F-3", "0 F 3", "a0F3"]
)
def test_action_parse_errors_name_string_and_form(text):
    with pytest.raises(ValueError) as info:
        Action.parse(text)
    message = str(info.value)
    assert repr(text) in message
    assert "<stage><F|B|W><micro-batch>[.<chunk>]" in message


def test_action_parse_rejects_non_string():
    with pytest.raises(ValueError, match="cannot parse action"):
        Action.parse(3)


@pytest.mark.parametrize(
    "args, error, field",
    [
        ((-1, F, 0), ValueError, "stage"),
        ((0, F, -2), ValueError, "microbatch"),
        ((0, F, 0, -1), ValueError, "chunk"),
        ((0.0, F, 0), TypeError, "stage"),
        ((0, F, True), TypeError, "microbatch"),
        ((0, "X", 0), ValueError, "kind"),
    ],
)
def test_action_field_validation(args, error, field):
    with pytest.raises(error, match=field):
        Action(*args)


def test_action_is_hashable_and_frozen():
    action = Action(0, F, 1)
    assert {action: 1}[Action.parse("0F1")] == 1
    with pytest.raises(AttributeError):
        action.stage = 2


# -- Schedule ----------------------------------------------------------------------


def test_from_strings_accepts_strings_and_lists():
    a = Schedule.from_strings("x", ["0F0 0F1 0B0 0B1", ["1F0", "1B0", "1F1", "1B1"]])
    assert a.num_stages == 2
    assert a.num_microbatches == 2
    assert a.actions[1][1] == Action(1, B, 0)
    assert a.to_strings() == [["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0", "1F1", "1B1"]]
    assert a == Schedule("x", 2, 2, a.actions)


def test_to_strings_from_strings_round_trip():
    schedule = one_f_one_b(3, 5)
    again = Schedule.from_strings(schedule.name, schedule.to_strings())
    assert again == schedule


def test_from_strings_explicit_microbatches_and_empty_table():
    schedule = Schedule.from_strings("x", ["0F0 0B0"], num_microbatches=3)
    assert schedule.num_microbatches == 3
    with pytest.raises(ValueError, match="num_microbatches"):
        Schedule.from_strings("x", [""])


def test_row_with_wrong_stage_index_is_rejected():
    with pytest.raises(ScheduleError) as info:
        Schedule.from_strings("bad", ["0F0 0B0", "1F0 0B0"])
    message = str(info.value)
    assert "stage 1 position 1" in message and "0B0" in message and "stage=1" in message
    assert isinstance(info.value, ValueError)


def test_row_count_must_match_num_stages():
    with pytest.raises(ScheduleError, match="2 action rows but num_stages=3"):
        Schedule("x", 3, 1, ((Action(0, F, 0),), (Action(1, F, 0),)))


def test_non_action_entries_are_rejected():
    with pytest.raises(TypeError, match="expected an Action"):
        Schedule("x", 1, 1, (("0F0",),))


@pytest.mark.parametrize(
    "name, value", [("num_stages", 0), ("num_microbatches", 0), ("num_chunks", 0)]
)
def test_schedule_sizes_are_checked(name, value):
    kwargs = dict(name="x", num_stages=1, num_microbatches=1, actions=((),), num_chunks=1)
    kwargs[name] = value
    with pytest.raises(ValueError, match=name):
        Schedule(**kwargs)


def test_round_robin_placement_is_the_default():
    schedule = Schedule("x", 3, 1, ((), (), ()), num_chunks=2)
    assert schedule.placement == ((0, 3), (1, 4), (2, 5))
    assert schedule.num_virtual_stages == 6
    assert [schedule.virtual_stage(1, c) for c in range(2)] == [1, 4]
    assert [schedule.stage_of(vs) for vs in range(6)] == [
        (0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)
    ]
    assert schedule == Schedule("x", 3, 1, ((), (), ()), 2, ((0, 3), (1, 4), (2, 5)))


def test_v_shaped_placement_fits():
    p = 3
    v_shape = tuple((r, 2 * p - 1 - r) for r in range(p))
    schedule = Schedule("zbv", p, 1, ((), (), ()), num_chunks=2, placement=v_shape)
    assert schedule.stage_of(5) == (0, 1)
    assert schedule.stage_of(3) == (2, 1)
    assert schedule.virtual_stage(2, 0) == 2


@pytest.mark.parametrize(
    "placement, message",
    [
        (((0, 1), (2, 3)), "3 rows"),
        (((0, 1), (2, 3), (4,)), "3 rows"),
        (((0, 1), (2, 3), (4, 4)), "exactly once"),
        (((0, 1), (2, 3), (4, 6)), "exactly once"),
    ],
)
def test_bad_placement_is_rejected(placement, message):
    with pytest.raises(ScheduleError, match=message):
        Schedule("x", 3, 1, ((), (), ()), num_chunks=2, placement=placement)


def test_placement_lookups_check_range():
    schedule = Schedule("x", 2, 1, ((), ()), num_chunks=2)
    with pytest.raises(ValueError, match="virtual_stage=4"):
        schedule.stage_of(4)
    with pytest.raises(ValueError, match="chunk=2"):
        schedule.virtual_stage(0, 2)
    with pytest.raises(ValueError, match="stage=2"):
        schedule.virtual_stage(2, 0)


def test_format_table_has_one_row_per_stage():
    text = str(Schedule.from_strings("demo", ["0F0 0F10 0B0 0B10", "1F0 1B0 1F10 1B10"]))
    assert text == (
        "demo: 2 stages, 11 micro-batches\n"
        "stage 0 | 0F0  0F10 0B0  0B10\n"
        "stage 1 | 1F0  1B0  1F10 1B10"
    )
    assert one_f_one_b(2, 1).format_table().splitlines()[0] == "1f1b: 2 stages, 1 micro-batches"


def test_format_table_mentions_chunks():
    schedule = Schedule.from_strings("i", ["0F0 0F0.1 0B0.1 0B0"], num_chunks=2)
    assert schedule.format_table().splitlines()[0] == "i: 1 stages, 1 micro-batches, 2 chunks"


# -- dependencies ------------------------------------------------------------------


def _deps(schedule, text):
    return [str(a) for a in schedule.dependencies(Action.parse(text))]


def _users(schedule, text):
    return [str(a) for a in schedule.consumers(Action.parse(text))]


def test_dependencies_single_chunk():
    schedule = one_f_one_b(3, 2)
    assert _deps(schedule, "0F1") == []
    assert _deps(schedule, "1F1") == ["0F1"]
    assert _deps(schedule, "2B0") == ["2F0"]
    assert _deps(schedule, "1B0") == ["1F0", "2B0"]
    assert _deps(schedule, "1W0") == ["1B0"]
    assert _users(schedule, "0F1") == ["0B1", "1F1"]
    assert _users(schedule, "2F1") == ["2B1"]
    assert _users(schedule, "1B0") == ["0B0"]
    assert _users(schedule, "0B0") == []


def test_dependencies_follow_placement_across_chunks():
    round_robin = Schedule("rr", 2, 1, ((), ()), num_chunks=2)  # v: 0->(0,0) 1->(1,0) 2->(0,1)
    assert _deps(round_robin, "0F0.1") == ["1F0"]
    assert _deps(round_robin, "1B0") == ["1F0", "0B0.1"]
    assert _users(round_robin, "1F0") == ["1B0", "0F0.1"]
    v_shape = Schedule("v", 2, 1, ((), ()), num_chunks=2, placement=((0, 3), (1, 2)))
    assert _deps(v_shape, "1F0.1") == ["1F0"]  # virtual stage 2 follows 1 on the same stage
    assert _deps(v_shape, "0F0.1") == ["1F0.1"]
    assert _deps(v_shape, "1B0") == ["1F0", "1B0.1"]


def test_consumers_include_w_only_when_scheduled():
    zb = Schedule.from_strings("zb", ["0F0 0B0 0W0", "1F0 1B0"])
    assert _users(zb, "0B0") == ["0W0"]
    assert _users(zb, "1B0") == ["0B0"]


# -- lowering ------------------------------------------------------------------------


def test_lower_gpipe_two_stages():
    schedule = Schedule.from_strings("g", ["0F0 0F1 0B0 0B1", "1F0 1F1 1B0 1B1"])
    programs = [format_program(p) for p in lower(schedule)]
    assert programs == [
        "0F0 [send act0 v0->1] 0F1 [send act1 v0->1 | recv grad0 v0<-1] "
        "0B0 [recv grad1 v0<-1] 0B1",
        "[recv act0 v1<-0] 1F0 [recv act1 v1<-0] 1F1 1B0 [send grad0 v1->0] "
        "1B1 [send grad1 v1->0]",
    ]


def test_lower_1f1b_three_stages_batches_steady_state():
    programs = [format_program(p) for p in lower(one_f_one_b(3, 2))]
    assert programs == [
        "0F0 [send act0 v0->1] 0F1 [send act1 v0->1 | recv grad0 v0<-1] "
        "0B0 [recv grad1 v0<-1] 0B1",
        "[recv act0 v1<-0] 1F0 [send act0 v1->2 | recv act1 v1<-0] 1F1 "
        "[send act1 v1->2 | recv grad0 v1<-2] 1B0 [send grad0 v1->0 | recv grad1 v1<-2] "
        "1B1 [send grad1 v1->0]",
        "[recv act0 v2<-1] 2F0 2B0 [send grad0 v2->1 | recv act1 v2<-1] 2F1 2B1 "
        "[send grad1 v2->1]",
    ]


def test_lower_unbatched_gives_one_group_per_op():
    programs = lower(one_f_one_b(2, 2), batched=False)
    assert format_program(programs[1]) == (
        "[recv act0 v1<-0] 1F0 1B0 [send grad0 v1->0] [recv act1 v1<-0] 1F1 1B1 "
        "[send grad1 v1->0]"
    )
    groups = [op for program in programs for op in program if isinstance(op, CommGroup)]
    assert all(len(group.ops) == 1 for group in groups)


def test_lower_keeps_same_stage_chunks_local():
    # one physical stage holding two chunks: no communication at all
    schedule = Schedule.from_strings("local", ["0F0 0F0.1 0B0.1 0B0"], num_chunks=2)
    assert format_program(lower(schedule)[0]) == "0F0 0F0.1 0B0.1 0B0"


def test_lower_interleaved_round_robin():
    schedule = Schedule.from_strings(
        "i", ["0F0 0F0.1 0B0.1 0B0", "1F0 1F0.1 1B0.1 1B0"], num_chunks=2
    )
    assert [format_program(p) for p in lower(schedule)] == [
        "0F0 [send act0 v0->1 | recv act0 v2<-1] 0F0.1 [send act0 v2->1 | recv grad0 v2<-1] "
        "0B0.1 [send grad0 v2->1 | recv grad0 v0<-1] 0B0",
        "[recv act0 v1<-0] 1F0 [send act0 v1->0 | recv act0 v3<-0] 1F0.1 1B0.1 "
        "[send grad0 v3->0 | recv grad0 v1<-0] 1B0 [send grad0 v1->0]",
    ]


def test_lower_weight_actions_need_no_comm():
    schedule = Schedule.from_strings("zb", ["0F0 0B0 0W0", "1F0 1B0 1W0"])
    assert format_program(lower(schedule)[1]) == "[recv act0 v1<-0] 1F0 1B0 [send grad0 v1->0] 1W0"


@pytest.mark.parametrize(
    "comm, stage, expected",
    [
        (Comm("send", "act", 1, 3, 0), 0, "recv act3 v1<-0"),
        (Comm("recv", "act", 0, 3, 1), 1, "send act3 v0->1"),
        (Comm("send", "grad", 0, 2, 1), 1, "recv grad2 v0<-1"),
        (Comm("recv", "grad", 1, 2, 0), 0, "send grad2 v1->0"),
    ],
)
def test_comm_counterpart(comm, stage, expected):
    assert str(comm.counterpart(stage)) == expected
    assert comm.counterpart(stage).counterpart(comm.peer) == comm


def test_comm_field_validation():
    with pytest.raises(ValueError):
        Comm("put", "act", 0, 0, 0)
    with pytest.raises(ValueError, match="peer"):
        Comm("send", "act", -1, 0, 0)


def test_schedule_package_does_not_import_torch():
    import ast
    from pathlib import Path

    package = Path(__file__).resolve().parents[2] / "fastpipe" / "schedule"
    for path in sorted(package.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n.split(".")[0] == "torch" for n in names), path.name


def test_split_backwards_and_forward_actions_are_derived_from_the_rows():
    from fastpipe.schedule import get_schedule
    zb = get_schedule("zb-h1", 2, 3)
    assert zb.split_backwards == {(s, mb) for s in range(2) for mb in range(3)}
    assert get_schedule("1f1b", 2, 3).split_backwards == frozenset()
    inter = get_schedule("interleaved", 2, 2, virtual_stages=2)
    assert [[str(a) for a in row] for row in inter.forward_actions] == \
        [[str(a) for a in row if a.kind is ActionKind.FORWARD] for row in inter.actions]
