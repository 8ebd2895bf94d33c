"""The planner: layouts enumerated, pruned and ranked by simulated step time; its command line."""
import json

import pytest

from fastpipe.__main__ import main as fastpipe_main
from fastpipe.planning.costs import Work
from fastpipe.planning.hardware import H100, gpu
from fastpipe.planning.layout import Layout
from fastpipe.planning.model_shape import KNOWN
from fastpipe.planning.plan import GIB, plan
from fastpipe.planning.predict import predict

SMALL = dict(global_batch=64, seq=2048)


def test_layouts_come_ranked_by_simulated_step_time_and_fit_memory():
    result = plan("llama-3-8b", 32, "h100", **SMALL)
    times = [p.step_time for p in result.ranked]
    assert times == sorted(times) and len(times) > 3
    assert all(p.max_memory <= H100.memory for p in result.ranked)
    assert result.counts["simulated"] >= len(result.ranked)
    for p in result.ranked[:3]:  # each is the simulator's prediction of its layout
        again = predict(result.work, p.layout, H100)
        assert again.step_time == pytest.approx(p.step_time)
        assert p.tokens_per_gpu == pytest.approx(64 * 2048 / p.step_time / 32)
        assert 0 < p.mfu < 1


def test_fixed_knobs_are_held():
    fixed = {"tensor": 2, "pipeline": 4, "schedule": "interleaved", "micro_batch": 1}
    result = plan("llama-3-8b", 32, "h100", fixed=fixed, **SMALL)
    for p in result.ranked:
        assert (p.layout.tensor, p.layout.pipeline, p.layout.schedule, p.layout.micro_batch) == (
            2, 4, "interleaved", 1)
        assert p.layout.replicas == 4


def test_a_tight_memory_budget_drops_layouts_and_says_when_none_fits():
    roomy = plan("llama-3-8b", 8, "h100", **SMALL)
    tight = plan("llama-3-8b", 8, "h100", memory=30 * GIB, **SMALL)
    assert tight.counts["memory"] > roomy.counts["memory"]
    assert all(p.max_memory <= 30 * GIB for p in tight.ranked)
    hopeless = plan("llama-3-70b", 8, "h100", memory=1 * GIB, **SMALL)
    assert all(p.max_memory > 1 * GIB for p in hopeless.ranked)
    assert "NO" in hopeless.table()


def test_sixteen_thousand_gpus_are_planned_by_pruning_before_simulating():
    result = plan("llama-3-405b", 16384, "h100", global_batch=2048, seq=8192,
                  schedules=["1f1b", "interleaved"])
    assert result.counts["considered"] > 10 * result.counts["simulated"]
    assert result.best.layout.gpus == 16384
    assert result.best.max_memory <= H100.memory


def test_the_plan_as_json_holds_every_ranked_layout():
    result = plan("llama-3-8b", 16, "a100", **SMALL)
    data = json.loads(json.dumps(result.to_json()))
    assert len(data["ranked"]) == len(result.ranked)
    assert data["ranked"][0]["step_time"] == pytest.approx(result.best.step_time)
    assert data["calibrated"] == {"efficiency": gpu("a100").efficiency}


@pytest.mark.parametrize("kwargs, words", [
    (dict(gpus=0), "gpus"),
    (dict(gpu="tpu"), "not a known GPU"),
    (dict(global_batch=0), "global_batch"),
    (dict(global_batch=8, fixed={"replicas": 16}), "divide"),
    (dict(schedules=["nope"]), "unknown schedule"),
])
def test_bad_arguments_are_named(kwargs, words):
    args = {"model": "llama-3-8b", "gpus": 16, "gpu": "h100", **SMALL, **kwargs}
    with pytest.raises(ValueError, match=words):
        plan(**args)


def test_a_layout_the_batch_does_not_split_is_refused():
    with pytest.raises(ValueError, match="does not split"):
        predict(Work(KNOWN["llama-3-8b"], 2048, 6), Layout(pipeline=2, data=4), H100)


# -- the command line ---------------------------------------------------------------------


def test_the_command_prints_the_ranking_and_the_best_schedule_and_writes_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    code = fastpipe_main(["plan", "--model", "llama-3-8b", "--gpus", "16", "--gpu", "h100",
                          "--global-batch", "64", "--seq", "2048", "--top", "3",
                          "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 0
    assert "tok/s/GPU" in text and "best layout's schedule" in text and "stage 0 |" in text
    assert json.loads(out.read_text())["gpus"] == 16


def test_the_command_takes_dimensions_and_fixed_knobs(capsys):
    code = fastpipe_main(["plan", "--layers", "8", "--hidden", "1024", "--heads", "8",
                          "--vocab", "32000", "--gpus", "8", "--gpu", "a100",
                          "--global-batch", "32", "--seq", "1024", "--fix", "pipeline=4",
                          "--fix", "schedule=zb-h1"])
    assert code == 0
    assert "pp4" in capsys.readouterr().out


@pytest.mark.parametrize("argv, words", [
    (["--gpus", "8", "--global-batch", "8", "--seq", "64"], "give --model"),
    (["--model", "llama-3-8b", "--gpus", "8", "--global-batch", "8", "--seq", "64",
      "--fix", "colour=red"], "KNOB=VALUE"),
    (["--model", "nope", "--gpus", "8", "--global-batch", "8", "--seq", "64"], "known name"),
])
def test_bad_command_lines_are_one_line_errors(argv, words, capsys):
    assert fastpipe_main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1
