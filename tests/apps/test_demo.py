"""The demo's report, the progress bar and the saved-activation meter."""
import io
import re

import pytest
import torch
from torch import nn

from fastpipe.apps.demo import main, table
from fastpipe.memory import SavedActivationMeter, format_bytes
from fastpipe.apps.progress import LineProgress, progress


def test_demo_reports_table_bubble_memory_and_picture(capsys, tmp_path):
    picture = tmp_path / "timeline.png"
    main(["--steps", "3", "--layers", "2", "--batch", "8", "--seq", "8", "--chunks", "4",
          "--measure-steps", "2", "--picture", str(picture)])
    out = capsys.readouterr().out
    header, _, row = out[out.index("schedule  chunks"):].splitlines()[:3]
    assert "bubble measured" in header and "(p-1)/(m+p-1)" in header
    assert row.split()[:2] == ["1f1b", "4"]
    assert "20.0%" in row  # closed form for p=2, m=4
    assert len(re.findall(r"\d+\.\d (?:KB|MB)", row)) == 2  # one peak per stage
    assert "stage 1 |" in out  # the ASCII timeline
    pytest.importorskip("matplotlib")
    assert picture.stat().st_size > 0


def test_demo_with_auto_chunks_reports_measurements(capsys):
    main(["--steps", "8", "--layers", "2", "--batch", "8", "--seq", "8", "--chunks", "auto",
          "--measure-steps", "1", "--picture", ""])
    assert "chunks='auto' measured samples/s per count" in capsys.readouterr().out


def test_fused_demo_with_selective_recompute_learns_exactly_like_the_plain_one(capsys):
    """gpt(fused=True) has the same parameters and exact ops: the same loss trajectory."""
    args = ["--steps", "4", "--layers", "2", "--batch", "8", "--seq", "8", "--chunks", "2",
            "--measure-steps", "1", "--picture", ""]
    main(args)
    plain = re.search(r"loss (\S+) -> (\S+)", capsys.readouterr().out).groups()
    main(args + ["--fused", "--checkpoint", "selective"])
    fused = re.search(r"loss (\S+) -> (\S+)", capsys.readouterr().out).groups()
    assert [float(v) for v in fused] == pytest.approx([float(v) for v in plain], abs=1e-3)


def test_table_aligns_columns():
    assert table(["a", "bbb"], [["xx", "y"]]) == "a   bbb\n--  ---\nxx  y"


def test_meter_counts_saved_tensors_while_alive():
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    x = torch.randn(5, 8)
    with SavedActivationMeter([model]) as meter:
        y = model(x)  # Linear saves its input, Tanh its output
        assert meter.live_bytes == [2 * 5 * 8 * 4]
        y.sum().backward()
        del y
        assert meter.live_bytes == [0] and meter.peak_bytes == [2 * 5 * 8 * 4]
        with torch.no_grad():
            model(x)
    assert meter.peak_bytes == [320]
    model(x).sum().backward()  # the hooks are gone
    assert meter.peak_bytes == [320]


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_line_progress_rewrites_one_line_on_a_terminal(capsys):
    stream = Tty()
    bar = LineProgress(3, "steps", stream=stream)
    for k in range(3):
        bar.update(f"loss {k}")
    bar.close()
    text = stream.getvalue()
    assert text.count("\r") == 3 and "steps 3/3" in text and text.endswith("\n")
    quiet = io.StringIO()
    bar = LineProgress(3, stream=quiet)
    bar.update("x")
    bar.write("a line")
    assert quiet.getvalue() == "" and "a line" in capsys.readouterr().out


def test_progress_picks_tqdm_only_when_present():
    assert isinstance(progress(2, use_tqdm=False), LineProgress)
    pytest.importorskip("tqdm")
    bar = progress(2)
    assert not isinstance(bar, LineProgress)
    bar.close()


def test_format_bytes():
    assert [format_bytes(b) for b in (12, 2048, 3 * 2 ** 20)] == ["12 B", "2.0 KB", "3.0 MB"]
