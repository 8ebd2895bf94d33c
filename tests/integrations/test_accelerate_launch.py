"""``accelerate launch``: a ``DistributedPipe`` script runs as under ``torchrun`` (the same
losses and weights on every rank), and so does a ``PipelineTrainer`` script (the plain
``Trainer``'s logs and weights). On a machine without GPUs ``--multi_gpu`` selects
Accelerate's ``torchrun`` launcher (its plain launcher starts one process)."""
import json
import os
import signal
import subprocess
import sys

import pytest

pytest.importorskip("accelerate", reason="needs accelerate (pip install 'fastpipe[transformers]')")

from dist_launch import ROOT, free_port, torchrun  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "accelerate_cases.py")


def accelerate_launch(args, cwd, nproc=2, limit=300.0):
    """Run ``accelerate launch`` on ``accelerate_cases.py``; each process's result. Fails the
    test (killing every process) past ``limit`` seconds or on a non-zero exit."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
               f"--num_processes={nproc}", "--num_machines=1", "--mixed_precision=no",
               "--dynamo_backend=no", f"--main_process_port={free_port()}", SCRIPT, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    env.pop("ACCELERATE_CONFIG_FILE", None)
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=cwd, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"accelerate launch did not finish in {limit:g} s")
    assert proc.returncode == 0, out[-2000:] + err[-4000:]
    return _results(cwd)


def _results(folder):
    """Each rank's ``result-<rank>.json``, in rank order."""
    names = sorted(n for n in os.listdir(folder) if n.startswith("result-"))
    found = []
    for name in names:
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            found.append(json.load(f))
    return sorted(found, key=lambda r: r["rank"])


def test_a_distributed_pipe_script_runs_under_accelerate_launch_as_under_torchrun(tmp_path):
    (tmp_path / "accelerate").mkdir()
    (tmp_path / "torchrun").mkdir()
    launched = accelerate_launch(["pipe"], cwd=str(tmp_path / "accelerate"))
    torchrun(SCRIPT, ["pipe"], cwd=str(tmp_path / "torchrun"), nproc=2, limit=300.0)
    reference = _results(str(tmp_path / "torchrun"))
    assert [r["world"] for r in launched] == [2, 2]
    assert launched == reference  # the same losses and weights, bit for bit, on each rank


@pytest.mark.slow
def test_a_pipeline_trainer_script_runs_under_accelerate_launch(tmp_path):
    pytest.importorskip("transformers",
                        reason="needs transformers (pip install 'fastpipe[transformers]')")
    import hf_trainer_cases as cases
    from hf_compare import assert_same_logs, assert_same_weights

    plain = cases.train("llama", str(tmp_path / "plain"), max_steps=2)
    launched = accelerate_launch(["trainer", str(tmp_path / "piped")], cwd=str(tmp_path),
                                 limit=600.0)
    assert len(launched) == 2
    for result in launched:
        assert_same_logs(result["logs"], plain["logs"])
    assert_same_weights(launched[0]["final"], plain["final"])
