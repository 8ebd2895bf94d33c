"""Inference through the pipeline: train/eval modes reach every stage on every front door
(Sequential and traced models, dropout and batch norm), so ``evaluate()`` and an eval-mode
forward under ``no_grad`` equal the plain model in eval mode bit for bit; state dicts follow
the module's own rules (non-persistent buffers stay out)."""
import pytest
import torch

import fastpipe
from dist_launch import assert_all_ok, launch
from inference_cases import Blocks, sequential

FRONT_DOORS = {"Pipe": fastpipe.Pipe, "GPipe": fastpipe.GPipe}


def _front_door(door: str, kind: str, x: torch.Tensor):
    model = Blocks() if kind == "traced" else sequential()
    kwargs = dict(split_points="auto", example_inputs=x) if kind == "traced" else {}
    return FRONT_DOORS[door](model, chunks=2, devices=["cpu", "cpu"], **kwargs)


@pytest.mark.parametrize("door", FRONT_DOORS)
@pytest.mark.parametrize("kind", ["sequential", "traced"])
def test_evaluate_and_eval_forward_equal_the_plain_model_in_eval_mode(door, kind):
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    plain = (Blocks() if kind == "traced" else sequential()).eval()
    pipe = _front_door(door, kind, x)
    pipe.train_step(x, torch.randn(6, 4), torch.nn.functional.mse_loss)  # moves statistics
    plain.load_state_dict(pipe.state_dict())  # the running statistics the step left
    with torch.no_grad():
        expected = plain(x)
    assert torch.equal(pipe.evaluate(x), expected)
    assert torch.equal(pipe.evaluate(x), expected)  # dropout off: the same every call
    assert pipe.training and all(m.training for m in pipe.modules())
    pipe.eval()
    with torch.no_grad():
        assert torch.equal(pipe(x), expected)
    pipe.train()
    assert all(m.training for stage in pipe._stages for m in stage.module.modules())


@pytest.mark.parametrize("kind", ["sequential", "traced", "gpt2"])
def test_modes_reach_every_stage_of_a_distributed_pipe(kind):
    """The traced stages of a DistributedPipe are not submodules of the pipe: eval() must still
    reach them (a GPT-2's dropout stayed on, and evaluate() drifted between calls)."""
    results = assert_all_ok(launch("modes", 2, limit=180, args={"kind": kind},
                                   script="inference_cases.py"))
    assert results[1]["found"]["evaluate"] == 0.0  # the last stage's rank: bit for bit


def test_a_llamas_non_persistent_buffers_stay_out_of_the_state_dict():
    results = assert_all_ok(launch("llama_state_dict", 2, limit=180,
                                   script="inference_cases.py"))
    assert all(r["keys"] > 0 for r in results)
