"""Schedules shared with PyTorch's pipelining and torchtitan: action lists and CSV files."""
import inspect
import os

import pytest

from fastpipe.schedule import (SCHEDULES, Schedule, from_actions, get_schedule, read_csv,
                               to_actions, write_csv)
from fastpipe.schedule.interchange import placement_kind

DATA = os.path.join(os.path.dirname(__file__), "data")
SIZES = [(2, 4, 1), (3, 5, 1), (2, 4, 2), (3, 6, 2), (4, 8, 2), (2, 6, 3)]


def registry_schedules():
    """Every registered schedule at several sizes (those it accepts)."""
    out = []
    for name in sorted(SCHEDULES):
        for stages, microbatches, virtual in SIZES:
            try:
                out.append(get_schedule(name, stages, microbatches, virtual_stages=virtual))
            except ValueError:
                continue  # a size this generator does not take (e.g. zbv with 3 chunks)
    return out


def test_every_registered_schedule_has_sizes_here():
    assert {s.name for s in registry_schedules()} == set(SCHEDULES)


@pytest.mark.parametrize("comms", [None, "lower", "nccl"])
def test_every_registered_schedule_round_trips_through_action_lists(comms):
    for schedule in registry_schedules():
        rows = to_actions(schedule, comms=comms)
        assert len(rows) == schedule.num_stages
        back = from_actions(rows, name=schedule.name)
        assert back == schedule, (schedule.name, comms)
        assert back.placement == schedule.placement


def test_every_registered_schedule_round_trips_through_csv(tmp_path):
    for i, schedule in enumerate(registry_schedules()):
        path = tmp_path / f"{i}.csv"
        write_csv(schedule, path, comms="nccl" if i % 2 else None)
        assert read_csv(path, name=schedule.name) == schedule, schedule.name
    assert read_csv(path).name == path.stem


def test_backward_is_pipelining_i_when_its_weight_gradient_is_separate():
    schedule = get_schedule("zb-h1", 2, 2)
    assert schedule.to_strings()[1] == ["1F0", "1B0", "1F1", "1B1", "1W0", "1W1"]
    assert to_actions(schedule)[1] == ["1F0", "1I0", "1F1", "1I1", "1W0", "1W1"]
    assert to_actions(get_schedule("1f1b", 2, 2)) == [["0F0", "0F1", "0B0", "0B1"],
                                                      ["1F0", "1B0", "1F1", "1B1"]]


def test_exported_transfers_are_the_nccl_programs_in_pipelinings_names():
    rows = to_actions(get_schedule("1f1b", 2, 2), comms="nccl")
    assert rows[0] == ["0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0", "0RECV_B1", "0B1"]
    assert rows[1][:3] == ["1RECV_F0", "1F0", "1B0"]
    assert rows[1].count("1SEND_B0") == 1 and rows[1].count("1SEND_B1") == 1
    with pytest.raises(ValueError, match="comms='mpi' is not a lowering"):
        to_actions(get_schedule("1f1b", 2, 2), comms="mpi")


def test_stage_indices_are_virtual_stages_of_the_inferred_placement():
    interleaved = get_schedule("interleaved", 2, 2, virtual_stages=2)
    assert placement_kind(interleaved) == "loop"
    assert to_actions(interleaved)[1][0] == "1F0" and "3F0" in to_actions(interleaved)[1]
    v = from_actions([["0F0", "3F0", "3B0", "0B0"], ["1F0", "2F0", "2B0", "1B0"]])
    assert v.placement == ((0, 3), (1, 2)) and placement_kind(v) == "v-shape"
    assert v.actions[0][1].chunk == 1  # stage 3 is rank 0's second chunk
    custom = from_actions([["0F0", "1F0", "3F0", "3B0", "1B0", "0B0"],
                           ["2F0", "4F0", "5F0", "5B0", "4B0", "2B0"]])
    assert custom.placement == ((0, 1, 3), (2, 4, 5)) and placement_kind(custom) == "custom"
    assert placement_kind(get_schedule("zbv", 3, 6)) == "v-shape"


def test_idle_cells_fsdp_actions_and_overlapped_pairs_are_read():
    schedule = from_actions([["0UNSHARD", "0F0", None, "", "(0F1;0B0)OVERLAP_F_B", "0B1",
                              "0RESHARD", "0REDUCE_GRAD"],
                             [" 1F0 ", "1B0", "1F1", "1B1"]])
    assert schedule == from_actions([["0F0", "0F1", "0B0", "0B1"],
                                     ["1F0", "1B0", "1F1", "1B1"]])
    assert schedule.name == "imported" and schedule.num_microbatches == 2


@pytest.mark.parametrize("name,ranks,microbatches,chunks,kind", [
    ("1f1b_2ranks", 2, 4, 1, "loop"), ("looped_zb_2ranks", 2, 4, 2, "loop"),
    ("interleaved_comms_2ranks", 2, 4, 2, "loop"), ("interleaved_zb_4ranks", 4, 6, 2, "loop")])
def test_torchtitan_style_files_import_and_validate_under_nccl(name, ranks, microbatches,
                                                                 chunks, kind):
    schedule = read_csv(os.path.join(DATA, f"{name}.csv"))
    assert isinstance(schedule, Schedule) and schedule.name == name
    assert (schedule.num_stages, schedule.num_microbatches, schedule.num_chunks) == (
        ranks, microbatches, chunks)
    assert placement_kind(schedule) == kind
    report = schedule.validate(comm="nccl")
    assert report.num_steps >= microbatches * chunks * 2
    again = from_actions(to_actions(schedule), name=name)
    assert again == schedule


def test_a_file_with_pipelinings_transfers_keeps_only_the_compute_actions():
    with_comms = read_csv(os.path.join(DATA, "interleaved_comms_2ranks.csv"))
    rows = [[t for t in row if "SEND" not in t and "RECV" not in t and "SHARD" not in t]
            for row in to_actions(with_comms)]
    assert from_actions(rows, name=with_comms.name) == with_comms
    assert to_actions(with_comms)[0][:4] == ["0F0", "0F1", "2F0", "2F1"]


def test_pipelinings_own_checks_and_lowering_take_fastpipes_schedules():
    """The exported lists pass pipelining's ``_validate_schedule``, and its ``_add_send_recv``
    lowering of them imports back (its transfers agree with fastpipe's)."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    private = {"_validate_schedule": 4, "_add_send_recv": 3}  # parameters as torch 2.13 has them
    for name, count in private.items():
        helper = getattr(schedules, name, None)
        if helper is None or len(inspect.signature(helper).parameters) != count:
            pytest.skip(f"this torch's private pipelining helper {name} differs from 2.13's")
    for schedule in registry_schedules():
        total = schedule.num_virtual_stages
        actions = {r: [schedules._Action.from_str(t) for t in row]
                   for r, row in enumerate(to_actions(schedule))}
        ranks = schedules._validate_schedule(actions, schedule.num_stages, total,
                                             schedule.num_microbatches)
        lowered = schedules._add_send_recv({r: list(a) for r, a in actions.items()},
                                           lambda s: ranks[s], total)
        rows = [[str(a) for a in lowered[r]] for r in range(schedule.num_stages)]
        assert any("SEND_F" in t for row in rows for t in row)
        assert from_actions(rows, name=schedule.name) == schedule, schedule.name
