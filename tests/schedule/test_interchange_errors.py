"""Bad action lists and CSV files: each a typed error naming the row and index (line, column)."""
import re

import pytest

from fastpipe.schedule import (InterchangeError, ScheduleError, from_actions, get_schedule,
                               read_csv, to_actions, write_csv)

GOOD = [["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0", "1F1", "1B1"]]


def edited(row, index, text):
    """GOOD with one cell replaced (``text=None`` removes it)."""
    rows = [list(r) for r in GOOD]
    if text is None:
        del rows[row][index]
    else:
        rows[row][index] = text
    return rows


def raises_at(rows, row, index, pattern, **kw):
    with pytest.raises(InterchangeError, match=pattern) as info:
        from_actions(rows, **kw)
    assert isinstance(info.value, ScheduleError)
    assert (info.value.row, info.value.index) == (row, index)
    prefix = f"row {row}" if index is None else f"row {row}, index {index}"
    assert str(info.value).startswith(prefix), str(info.value)
    return str(info.value)


def test_an_unknown_action_string_names_its_cell():
    raises_at(edited(1, 2, "1X1"), 1, 2, "unknown action '1X1'")
    raises_at(edited(0, 0, "F0"), 0, 0, "unknown action 'F0'")
    raises_at(edited(0, 3, "(0F1;0SEND_F1)OVERLAP_F_B"), 0, 3, "compute actions only")
    raises_at(edited(0, 1, 7), 0, 1, "expected an action string or None, got int")
    raises_at(edited(0, 1, "0F"), 0, 1, "needs its micro-batch index")


def test_a_stage_or_micro_batch_out_of_range_names_its_cell():
    raises_at(edited(1, 2, "5F1"), 1, 2, re.escape("stage 5 is out of range: the actions run 3 "
                                                   "stages, so stage indices are 0..2 "
                                                   "(stages [2, 3, 4] run nothing)"))
    raises_at(edited(0, 3, "0B7"), 0, 3, "micro-batch 7 is out of range: the actions name 3")
    raises_at(GOOD, 0, 1, "micro-batch 1 is out of range: num_microbatches=1",
              num_microbatches=1)


def test_a_missing_action_names_the_row_of_its_stage():
    raises_at(edited(1, 3, None), 1, None, re.escape("stage 1 has no backward of micro-batch 1 "
                                                     "('1B1', or '1I1' with '1W1', is missing)"))
    raises_at(GOOD, 0, None, "stage 0 has no forward of micro-batch 2", num_microbatches=3)
    split = [["0F0", "0I0", "0W0"], ["1F0", "1I0"]]
    raises_at(split, 1, 1, "needs its backward weight '1W0'")
    full = [["0F0", "0B0", "0W0"], ["1F0", "1B0"]]
    raises_at(full, 0, 2, "'0B0' is a full backward")


def test_a_repeated_action_or_a_stage_on_two_ranks_names_the_cell():
    raises_at(edited(1, 2, "1B0"), 1, 2, r"repeats row 1, index 1")
    raises_at(edited(0, 3, "0I0"), 0, 3, r"repeats row 0, index 2")
    raises_at([["0F0", "1F0", "1B0", "0B0"], ["1F1"]], 1, 0, "stage 1 runs on row 0, index 1")
    raises_at([["0F0", "1F0", "2F0", "2B0", "1B0", "0B0"], ["3F0", "3B0"]], 1, None,
              "fastpipe places the same number of stages")
    raises_at([["0F0", "0B0"], ["1UNSHARD", None]], 1, None, "this rank runs no compute action")


def test_an_action_before_its_input_on_the_same_rank_names_its_cell():
    raises_at([["0F0", "0I0", "0W0", "0F1", "0W1", "0I1"], ["1F0", "1B0", "1F1", "1B1"]],
              0, 4, re.escape("runs before '0I1' (index 5), whose result it takes"))
    raises_at([["1F0", "0F0", "1B0", "0B0"], ["2F0", "3F0", "3B0", "2B0"]], 0, 0,
              re.escape("runs before '0F0' (index 1)"))


def test_a_deadlock_under_the_nccl_model_names_the_blocked_cells_rank_and_round():
    crossed = [["0F0", "0B0", "0F1", "0B1"], ["1F1", "1B1", "1F0", "1B0"]]
    message = raises_at(crossed, 0, 1, "deadlock under the NCCL model")
    assert "row 0, index 1 ('0B0') and row 1, index 0 ('1F1')" in message
    assert re.search(r"deadlocks after \d+ rounds", message)
    assert "stage 0: blocked" in message and "stage 1: blocked" in message


def test_transfers_must_be_those_of_fastpipes_lowering():
    rows = to_actions(get_schedule("1f1b", 2, 2), comms="nccl")
    assert rows[0][1] == "0SEND_F0"
    extra = [list(r) for r in rows]
    extra[0].insert(2, "0SEND_B0")
    raises_at(extra, 0, 2, "no \\(further\\) transfer '0SEND_B0' on this rank")
    twice = [list(r) for r in rows]
    twice[0].insert(2, "0SEND_F0")
    raises_at(twice, 0, 2, "no \\(further\\) transfer '0SEND_F0'")
    missing = [list(r) for r in rows]
    del missing[0][1]
    raises_at(missing, 0, None, "the transfer '0SEND_F0' of fastpipe's lowering is missing")
    early = [list(r) for r in rows]
    early[0][0], early[0][1] = early[0][1], early[0][0]
    raises_at(early, 0, 0, "comes before the action that makes it \\(index 1\\)")
    late = [list(r) for r in rows]
    assert late[1][:2] == ["1RECV_F0", "1F0"]
    late[1][0], late[1][1] = late[1][1], late[1][0]
    raises_at(late, 1, 1, "comes after the action that takes it \\(index 0\\)")


def test_csv_errors_name_the_file_line_and_column(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("0F0,0F1,0B0,0B1\n1F0,,1B0,1Q1,1B1\n")
    with pytest.raises(InterchangeError) as info:
        read_csv(path)
    assert str(info.value).startswith(f"{path}, line 2, column 4 ('1Q1'): unknown action")
    assert (info.value.row, info.value.index) == (1, 3)
    path.write_text("0F0,0F1,0B0,0B1\n1F0,1B0,1F1\n")
    with pytest.raises(InterchangeError, match=f"^{re.escape(str(path))}, line 2: stage 1 "):
        read_csv(path)


def test_wrong_argument_types_are_named():
    with pytest.raises(TypeError, match="rows must be a list of rows"):
        from_actions("0F0 0B0")
    with pytest.raises(TypeError, match="row 1: expected a list of action strings"):
        from_actions([["0F0"], "1F0"])
    with pytest.raises(InterchangeError, match="rows is empty"):
        from_actions([])
    with pytest.raises(TypeError, match="name must be a non-empty string"):
        from_actions(GOOD, name="")
    with pytest.raises(ValueError, match="num_microbatches must be >= 1"):
        from_actions(GOOD, num_microbatches=0)
    with pytest.raises(TypeError, match="path must be a str or os.PathLike"):
        read_csv(3)
    with pytest.raises(TypeError, match="schedule must be a fastpipe Schedule"):
        write_csv(GOOD, "x.csv")
