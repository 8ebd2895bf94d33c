"""Pictures of timelines: text, Chrome trace, PNG."""

import json

import pytest

from fastpipe.schedule import get_schedule
from fastpipe.schedule import render
from fastpipe.schedule.timeline import Timeline


def simulated():
    return get_schedule("gpipe", 2, 2).simulate(weight=0).timeline  # makespan 6


def measured():
    return Timeline.from_intervals(2, [(0, "0F0", 10.0, 10.5), (1, "1F0", 10.5, 11.0),
                                       (1, "1B0.1", 11.0, 11.5), (0, "0B0", 11.5, 12.0)])


def test_ascii_rows_letters_and_idle():
    text = render.ascii(simulated(), width=12)
    header, stage0, stage1 = text.splitlines()
    assert "simulated timeline: 2 stages" in header
    assert "makespan 6 units" in header and "bubble 33.3%" in header
    assert stage0 == "stage 0 |F0F1....B0B1|"
    assert stage1 == "stage 1 |..F0F1B0B1..|"


def test_ascii_labels_where_room():
    wide = render.ascii(simulated(), width=24).splitlines()[1]
    assert wide == "stage 0 |F0  F1  ........B0  B1  |"
    narrow = render.ascii(simulated(), width=6).splitlines()[1]
    assert narrow == "stage 0 |FF..BB|"


def test_ascii_measured_shows_chunks_and_source():
    lines = render.ascii(measured(), width=20).splitlines()
    assert lines[0].startswith("measured timeline") and "makespan 2 s" in lines[0]
    assert lines[2] == "stage 1 |.....F0   B0.1 .....|"


def test_ascii_every_row_has_the_width():
    timeline = get_schedule("1f1b", 5, 7).simulate(forward=1, backward=0.01, weight=0).timeline
    for width in (1, 7, 50, 333):
        for line in render.ascii(timeline, width).splitlines()[1:]:
            assert len(line.split("|")[1]) == width


def test_ascii_rejects_bad_width():
    with pytest.raises(ValueError, match="width"):
        render.ascii(simulated(), width=0)


def test_chrome_trace_simulated(tmp_path):
    timeline = simulated()
    trace = render.chrome_trace(timeline)
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == len(timeline.events) == 8
    first = next(e for e in complete if e["name"] == "1F1")
    assert first["ts"] == 2000 and first["dur"] == 1000  # 1 unit = 1000 µs
    assert first["pid"] == 0 and first["tid"] == 1
    assert first["args"]["microbatch"] == 1 and first["args"]["kind"] == "F"
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {0: "stage 0", 1: "stage 1"}
    path = tmp_path / "trace.json"
    render.write_chrome_trace(timeline, path)
    assert json.loads(path.read_text()) == json.loads(json.dumps(trace))


def test_chrome_trace_measured_seconds():
    complete = [e for e in render.chrome_trace(measured())["traceEvents"] if e["ph"] == "X"]
    first = next(e for e in complete if e["name"] == "1B0.1")
    assert first["ts"] == pytest.approx(1e6) and first["dur"] == pytest.approx(5e5)
    assert first["args"]["chunk"] == 1


def test_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "timeline.png"
    render.png(simulated(), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    both = tmp_path / "both.png"
    render.png_side_by_side(simulated(), measured(), both)
    assert both.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_png_without_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(ImportError, match=r"pip install matplotlib.*pip install fastpipe\[plot\]"):
        render.png(simulated(), tmp_path / "x.png")


def test_default_ascii_of_an_interleaved_schedule_is_legible():
    """Without a width, every label has room and a space (no run-together ``F0F1FF3``), in
    bands of at most 100 columns."""
    timeline = get_schedule("interleaved", 2, 4, virtual_stages=2).simulate().timeline
    lines = render.ascii(timeline).splitlines()
    rows = [line.split("|")[1] for line in lines if line.startswith("stage")]
    assert all(len(row) <= render.BAND for row in rows)
    text = " ".join(rows)
    for event in timeline.events:
        assert render._full_label(event) in text
    assert "F0.1 F1.1" in rows[0]
    assert any("from" in line for line in lines)  # wrapped, each band says where it starts


def test_png_legend_names_the_chunk_shades(tmp_path):
    pytest.importorskip("matplotlib")
    timeline = get_schedule("interleaved", 2, 4, virtual_stages=2).simulate().timeline
    labels = [label for _, _, label in render.legend_labels(timeline)]
    assert "forward, model chunk 0" in labels and "forward, model chunk 1 (lighter)" in labels
    assert [label for _, _, label in render.legend_labels(simulated())] == [
        "forward", "backward", "weight"]
    render.png(timeline, tmp_path / "interleaved.png")
    assert (tmp_path / "interleaved.png").stat().st_size > 0
