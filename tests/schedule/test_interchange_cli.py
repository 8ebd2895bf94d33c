"""``python -m fastpipe schedule --from-csv FILE``: a pipelining / torchtitan schedule drawn and
simulated, through ``fastpipe.__main__.main``."""
import os

import pytest

from fastpipe.__main__ import main

DATA = os.path.join(os.path.dirname(__file__), "data")


def test_from_csv_draws_and_simulates_the_file(capsys):
    path = os.path.join(DATA, "interleaved_comms_2ranks.csv")
    assert main(["schedule", "--from-csv", path, "--costs", "1,2,0", "--width", "80"]) == 0
    out = capsys.readouterr().out
    assert "interleaved_comms_2ranks: 2 stages, 4 micro-batches, 2 chunks" in out
    assert "stage 0 | 0F0   0F1   0F0.1 0F1.1" in out  # stage 2 is rank 0's chunk 1
    assert "placement: loop (rank 0 holds stages 0, 2; rank 1 holds stages 1, 3)" in out
    assert "peak in-flight (chunk, micro-batch) pairs per stage:" in out
    assert "simulated timeline: 2 stages" in out
    # every stage is busy 2 chunks x 4 micro-batches x (0.5 + 1) with costs 1,2 per stage
    assert [line.split()[1] for line in out.splitlines() if line[:2] in ("0 ", "1 ")] == \
        ["12", "12"]
    assert f"interleaved_comms_2ranks (from {path})" in out


def test_from_csv_reports_a_bad_file_with_its_line_and_column(tmp_path, capsys):
    bad = tmp_path / "bad.csv"
    bad.write_text("0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1Z1\n")
    assert main(["schedule", "--from-csv", str(bad)]) == 2
    assert f"error: {bad}, line 2, column 4 ('1Z1'): unknown action" in capsys.readouterr().err
    assert main(["schedule", "--from-csv", str(tmp_path / "absent.csv")]) == 2
    assert "No such file" in capsys.readouterr().err
    assert main(["schedule", "--from-csv", str(bad), "--costs", "x"]) == 2
    assert main(["schedule", "--from-csv", str(bad), "--width", "0"]) == 2
    assert "--width must be >= 1" in capsys.readouterr().err


def test_from_csv_or_a_name_not_both(capsys):
    with pytest.raises(SystemExit):
        main(["schedule", "1f1b", "--from-csv", os.path.join(DATA, "1f1b_2ranks.csv")])
    with pytest.raises(SystemExit):
        main(["schedule"])
    assert "give either a schedule name or --from-csv FILE" in capsys.readouterr().err
