"""TRL's ``SFTTrainer`` through ``PipelineTrainerMixin`` (``class PipelineSFTTrainer(
PipelineTrainerMixin, SFTTrainer)``) against the plain ``SFTTrainer`` on a small in-memory
dataset: the same logged losses, evaluations and final weights on a ``Pipe``, a
``DistributedPipe`` and 2 pipeline x 2 data ranks, and a resume in the middle equal to the
uninterrupted run; SFT's own metrics (entropy, token accuracy, token count) logged alike."""
import pytest

pytest.importorskip("trl", reason="needs trl (pip install 'fastpipe[trl]')")

from fastpipe.integrations.transformers import UnsupportedTrainerOption  # noqa: E402

from dist_launch import assert_all_ok, launch  # noqa: E402
from hf_compare import assert_same_logs, assert_same_weights, logs_after  # noqa: E402
import sft_cases as cases  # noqa: E402

PIPE = {"chunks": 2, "devices": ["cpu", "cpu"]}
SCRIPT = "integrations/sft_cases.py"


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return cases.train(str(tmp_path_factory.mktemp("plain")))


def test_sft_trainer_on_a_pipe_trains_and_resumes_as_the_plain_one(plain, tmp_path):
    piped = cases.train(str(tmp_path / "piped"), PIPE)
    assert_same_logs(piped["logs"], plain["logs"])
    assert_same_weights(piped["final"], plain["final"])
    resumed = cases.train(str(tmp_path / "resumed"), PIPE,
                          resume=str(tmp_path / "piped" / "checkpoint-2"))
    assert_same_logs(logs_after(resumed["logs"], 2), logs_after(plain["logs"], 2),
                     ignored=["num_tokens"])  # SFTTrainer counts again from 0 when resumed
    assert_same_weights(resumed["final"], piped["final"], tolerance=0.0)


@pytest.mark.parametrize("option, value", [("loss_type", "dft"), ("padding_free", True),
                                           ("activation_offloading", True), ("bf16", True)])
def test_sft_options_the_pipe_cannot_honour_raise_naming_them(option, value, tmp_path):
    with pytest.raises(UnsupportedTrainerOption, match=f"TrainingArguments.{option}="):
        cases.PipelineSFTTrainer(model=cases.model(), args=cases.config(str(tmp_path),
                                                                        **{option: value}),
                                 train_dataset=cases.texts(8, 1), eval_dataset=cases.texts(4, 2),
                                 processing_class=cases.tokenizer(), pipeline=PIPE)


@pytest.mark.slow
def test_sft_trainer_on_a_distributed_pipe_trains_and_resumes_as_the_plain_one(plain, tmp_path):
    out, again = str(tmp_path / "run"), str(tmp_path / "resumed")
    results = assert_all_ok(launch("run_on_ranks", 2, limit=600, script=SCRIPT, args=dict(
        out=out, pipeline={"chunks": 2}, resume_out=again)))
    for result in results:
        assert_same_logs(result["run"]["logs"], plain["logs"])
    assert_same_weights(out + "/final", plain["final"])
    assert_same_weights(again + "/final", out + "/final", tolerance=0.0)


@pytest.mark.slow
def test_sft_trainer_on_two_pipeline_by_two_data_ranks_trains_as_under_ddp(tmp_path):
    ddp = assert_all_ok(launch("run_on_ranks", 2, limit=600, script=SCRIPT,
                               args=dict(out=str(tmp_path / "ddp"))))[0]["run"]
    results = assert_all_ok(launch("run_on_ranks", 4, limit=900, script=SCRIPT, args=dict(
        out=str(tmp_path / "piped"), pipeline={"chunks": 2, "data_parallel": 2})))
    for result in results:
        assert_same_logs(result["run"]["logs"], ddp["logs"])
    assert_same_weights(str(tmp_path / "piped" / "final"), ddp["final"])
