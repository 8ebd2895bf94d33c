"""``python -m fastpipe simulate``."""

import json
import re

import pytest

from fastpipe.__main__ import main as fastpipe_main
from fastpipe.apps.cli_simulate import closed_form, main
from fastpipe.schedule import SCHEDULES
from fastpipe.schedule.simulator import Costs


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def row(out, label):
    return re.search(rf"^{label}\s+(\S+)\s+(\S+)$", out, re.MULTILINE).groups()


def test_1f1b_prints_timeline_and_table(capsys):
    code, out, err = run(capsys, "--schedule", "1f1b", "--stages", "4", "--chunks", "8",
                         "--costs", "1,2,0", "--width", "66")
    assert code == 0 and err == ""
    assert "simulated timeline: 4 stages, makespan 33 units, bubble 27.3%" in out
    assert re.search(r"^stage 3 \|.{66}\|$", out, re.MULTILINE)
    assert row(out, "makespan") == ("33", "33")
    assert row(out, "bubble fraction") == ("27.27%", "27.27%")
    peaks = re.findall(r"^(\d)\s+24\s+(\d)\s+\S+$", out, re.MULTILINE)
    assert peaks == [("0", "4"), ("1", "3"), ("2", "2"), ("3", "1")]


def test_latency_closed_form(capsys):
    code, out, _ = run(capsys, "--schedule", "gpipe", "--stages", "3", "--chunks", "5",
                       "--costs", "1,1,0,0.5")
    assert code == 0
    assert row(out, "makespan") == ("16", "16")  # (5+3-1)*2 + 2*2*0.5


def test_no_closed_form_is_a_dash(capsys):
    if "zb-h1" not in SCHEDULES:
        pytest.skip("schedule 'zb-h1' is not registered yet")
    code, out, _ = run(capsys, "--schedule", "zb-h1", "--stages", "4", "--chunks", "8")
    assert code == 0
    assert row(out, "bubble fraction")[1] == "-"


def test_interleaved_closed_form(capsys):
    if "interleaved" not in SCHEDULES:
        pytest.skip("schedule 'interleaved' is not registered yet")
    code, out, _ = run(capsys, "--schedule", "interleaved", "--stages", "4", "--chunks", "8",
                       "--virtual", "2")
    assert code == 0
    simulated, expected = row(out, "bubble fraction")
    assert simulated == expected == f"{3 / (2 * 8 + 3):.2%}"


def test_closed_form_function():
    assert closed_form("1f1b", 4, 8, 1, Costs(1, 2, 0)) == (33, pytest.approx(3 / 11))
    assert closed_form("1f1b", 4, 8, 1, Costs(1, 2, 0, 0.5))[0] == 33 + 0.5 * 2 * (3 + 5)
    assert closed_form("interleaved", 4, 8, 2, Costs(1, 2, 0))[1] == pytest.approx(3 / 19)
    assert closed_form("interleaved", 4, 6, 2, Costs(1, 2, 0)) is None
    assert closed_form("interleaved", 4, 8, 2, Costs(1, 2, 0, 1)) is None
    assert closed_form("gpipe", 4, 8, 1, None) is None
    assert closed_form("zbv", 4, 8, 2, Costs()) is None


@pytest.mark.parametrize("argv, message", [
    (["--schedule", "nope"], "unknown schedule 'nope'"),
    (["--stages", "0"], "--stages must be >= 1"),
    (["--chunks", "-1"], "--chunks must be >= 1"),
    (["--stages", "two"], "invalid int value"),
    (["--costs", "1,2"], "cannot parse costs"),
    (["--costs", "1,x,3"], "cannot parse costs"),
    (["--schedule", "gpipe", "--virtual", "3"], "virtual_stages"),
    (["--width", "0"], "--width must be >= 1"),
    (["--frobnicate"], "unrecognized arguments"),
])
def test_bad_arguments_exit_2_with_one_line(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and message in err
    assert err.startswith("python -m fastpipe simulate: error: ")
    assert "Traceback" not in err


def test_help_exits_0(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0 and "--costs" in out and "--trace" in out


def test_trace_has_one_event_per_action(capsys, tmp_path):
    path = tmp_path / "trace.json"
    code, out, _ = run(capsys, "--schedule", "1f1b", "--stages", "3", "--chunks", "5",
                       "--trace", str(path))
    assert code == 0 and str(path) in out
    trace = json.loads(path.read_text())
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == 3 * 5 * 2
    assert {e["tid"] for e in complete} == {0, 1, 2}


def test_png(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "timeline.png"
    code, _, _ = run(capsys, "--stages", "2", "--chunks", "3", "--png", str(path))
    assert code == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unwritable_output_is_one_line_exit_1(capsys, tmp_path):
    code, _, err = run(capsys, "--trace", str(tmp_path / "missing" / "trace.json"))
    assert code == 1 and err.count("\n") == 1


def test_dispatch_from_fastpipe_main(capsys):
    assert fastpipe_main(["simulate", "--stages", "2", "--chunks", "2"]) == 0
    assert "simulated timeline: 2 stages" in capsys.readouterr().out
    assert fastpipe_main(["simulate", "--stages", "0"]) == 2
    fastpipe_main(["--help"])
    assert "simulate" in capsys.readouterr().out
