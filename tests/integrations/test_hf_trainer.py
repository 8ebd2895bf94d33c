"""``PipelineTrainer`` against Hugging Face's own ``Trainer`` on the same script: a Llama causal
LM, a T5 and a BERT classifier with gradient accumulation 2, clipping, a learning-rate schedule,
evaluations and checkpoints, on a ``Pipe`` (2 CPU stages, in this process), a
``DistributedPipe`` (2 gloo ranks) and 2 pipeline x 2 data ranks; and a resume in the middle
equal to the uninterrupted run."""
import os

import pytest

pytest.importorskip("transformers",
                    reason="needs transformers (pip install 'fastpipe[transformers]')")
pytest.importorskip("accelerate",
                    reason="needs accelerate (pip install 'fastpipe[transformers]')")

from dist_launch import assert_all_ok, launch  # noqa: E402
from fastpipe.checkpoint import RngNotRestoredWarning  # noqa: E402
import hf_trainer_cases as cases  # noqa: E402
from hf_compare import assert_same_logs, assert_same_weights, logs_after  # noqa: E402

PIPE = {"chunks": 2, "devices": ["cpu", "cpu"]}
SCRIPT = "integrations/hf_trainer_cases.py"


def _needs(kind):
    if kind == "lora":
        pytest.importorskip("peft", reason="needs peft (pip install 'fastpipe[peft]')")


@pytest.fixture(scope="module")
def plain_runs(tmp_path_factory):
    """The plain ``Trainer``'s run of each model, in this process (computed once)."""
    found = {}

    def run(kind):
        if kind not in found:
            found[kind] = cases.train(kind, str(tmp_path_factory.mktemp(f"plain-{kind}")))
        return found[kind]

    return run


@pytest.mark.parametrize("kind", cases.KINDS)
def test_pipe_trains_as_the_trainer_does(kind, plain_runs, tmp_path):
    _needs(kind)
    plain = plain_runs(kind)
    piped = cases.train(kind, str(tmp_path / "piped"), PIPE)
    assert_same_logs(piped["logs"], plain["logs"])
    assert_same_weights(piped["final"], plain["final"])
    assert any("eval_accuracy" in entry for entry in piped["logs"])


def test_pipe_resumes_at_another_layout_as_if_never_stopped(plain_runs, tmp_path):
    """Saved on 2 stages after 2 of 4 steps, resumed on 3 stages with 3 micro-batches: the
    logs after the checkpoint and the final weights are the uninterrupted plain run's."""
    plain = plain_runs("llama")
    first = cases.train("llama", str(tmp_path / "first"), PIPE, stop_after=2)
    checkpoint = tmp_path / "first" / "checkpoint-2"
    assert sorted(os.listdir(checkpoint / "pipeline"))  # the pipeline state beside HF's files
    with pytest.warns(RngNotRestoredWarning):  # no dropout here: nothing drawn differs
        resumed = cases.train("llama", str(tmp_path / "resumed"),
                              {"chunks": 3, "devices": ["cpu"] * 3}, resume=str(checkpoint))
    assert_same_logs(logs_after(resumed["logs"], 2), logs_after(plain["logs"], 2))
    assert_same_logs(first["logs"][:3], plain["logs"][:3])
    assert_same_weights(resumed["final"], plain["final"])


@pytest.mark.parametrize("kind", ["llama", pytest.param("bert", marks=pytest.mark.slow),
                                  pytest.param("t5", marks=pytest.mark.slow),
                                  pytest.param("lora", marks=pytest.mark.slow)])
def test_distributed_pipe_on_two_ranks_trains_and_resumes_as_the_trainer(kind, plain_runs,
                                                                          tmp_path):
    _needs(kind)
    plain = plain_runs(kind)
    out, again = str(tmp_path / "run"), str(tmp_path / "resumed")
    results = assert_all_ok(launch("run_on_ranks", 2, limit=600, script=SCRIPT, args=dict(
        kind=kind, out=out, pipeline={"chunks": 2}, resume_out=again)))
    for result in results:  # every rank logged the same
        assert_same_logs(result["run"]["logs"], plain["logs"])
    assert_same_weights(out + "/final", plain["final"])
    assert_same_logs(logs_after(results[0]["resumed"]["logs"], 2), logs_after(plain["logs"], 2))
    assert_same_weights(again + "/final", out + "/final", tolerance=0.0)


@pytest.mark.parametrize("kind", ["llama", pytest.param("bert", marks=pytest.mark.slow),
                                  pytest.param("t5", marks=pytest.mark.slow),
                                  pytest.param("lora", marks=pytest.mark.slow)])
def test_two_pipeline_by_two_data_ranks_train_as_the_trainer_under_ddp(kind, tmp_path):
    """The pipelined run's 2 replicas against the plain ``Trainer`` on 2 DDP processes (the
    same per-device batches). For a model that takes loss keywords but ignores the count
    (T5, BERT), the ``Trainer`` under DDP scales the loss by its process count, so DDP is the
    reference, not one process with twice the batch."""
    _needs(kind)
    ddp = assert_all_ok(launch("run_on_ranks", 2, limit=600, script=SCRIPT, args=dict(
        kind=kind, out=str(tmp_path / "ddp"))))[0]["run"]
    results = assert_all_ok(launch("run_on_ranks", 4, limit=900, script=SCRIPT, args=dict(
        kind=kind, out=str(tmp_path / "piped"), pipeline={"chunks": 2, "data_parallel": 2})))
    for result in results:
        assert_same_logs(result["run"]["logs"], ddp["logs"])
    assert_same_weights(str(tmp_path / "piped" / "final"), ddp["final"])
