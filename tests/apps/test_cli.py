import re

from fastpipe.__main__ import main


def test_schedule_command_prints_the_table(capsys):
    assert main(["schedule", "1f1b", "--stages", "2", "--chunks", "3"]) == 0
    out = capsys.readouterr().out
    assert "stage 0 | 0F0 0F1 0B0 0F2 0B1 0B2" in out
    assert "peak in-flight (chunk, micro-batch) pairs per stage: [2, 1]" in out
    assert "bubble 25.0%" in out  # (p-1)/(m+p-1) with unit costs


def test_info_command(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "torch:" in out and "native library:" in out


def test_unknown_command_and_usage(capsys):
    assert main([]) == 2
    assert main(["frobnicate"]) == 2
    assert "unknown command" in capsys.readouterr().err


def test_demo_trains_and_reports(capsys):
    main(["demo", "--steps", "3", "--layers", "2", "--batch", "8", "--seq", "8"])
    out = capsys.readouterr().out
    assert "stage 0 on cpu" in out and "stage 1 on cpu" in out
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)  ", out)]
    assert len(losses) == 3 and all(loss > 0 for loss in losses)
    assert "samples/s" in out


def test_schedule_command_virtual_stages_and_errors(capsys):
    assert main(["schedule", "interleaved", "--stages", "2", "--chunks", "4", "--virtual", "2"]) == 0
    assert "0F0.1" in capsys.readouterr().out
    assert main(["schedule", "zbv", "--stages", "2", "--chunks", "4", "--virtual", "3"]) == 2
    assert "virtual_stages must be 2" in capsys.readouterr().err


def test_info_help_prints_help_not_the_info(capsys):
    import pytest
    with pytest.raises(SystemExit) as info:
        main(["info", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "usage: python -m fastpipe info" in out and "native library:" not in out


def test_demo_help_lists_choices_and_defaults(capsys):
    import pytest
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = capsys.readouterr().out
    assert "dualpipev" in out and "zbv" in out and "auto" in out  # schedule choices
    assert "--virtual" in out and "(default: 1f1b)" in out and "(default: 40)" in out


def test_demo_bad_options_are_usage_errors_not_tracebacks(capsys):
    import pytest
    for bad in (["--chunks", "0"], ["--schedule", "1fb1"], ["--steps", "-1"],
                ["--schedule", "zbv", "--virtual", "3"]):
        with pytest.raises(SystemExit) as info:
            main(["demo", *bad])
        assert info.value.code == 2, bad
        assert "error:" in capsys.readouterr().err


def test_demo_runs_v_shaped_pipedream_and_auto_schedules(capsys):
    for schedule in ("zbv", "pipedream", "auto"):
        main(["demo", "--steps", "2", "--layers", "2", "--batch", "8", "--seq", "8",
              "--schedule", schedule, "--picture", ""])
        out = capsys.readouterr().out
        if schedule == "auto":
            assert "schedule=auto (" in out and "schedule='auto' chose" in out
        else:
            assert f"schedule={schedule} " in out
    main(["demo", "--steps", "2", "--layers", "4", "--batch", "8", "--seq", "8",
          "--schedule", "interleaved", "--virtual", "2", "--picture", ""])
    assert "virtual_stages=2" in capsys.readouterr().out
