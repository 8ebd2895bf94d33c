"""The activation-memory estimate made before running agrees with what the meter measures."""
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import fastpipe
from fastpipe.balance import balance_by_size
from fastpipe.memory import SavedActivationMeter
from fastpipe.memory import estimate_activation_peaks
from fastpipe.policies.checkpoint import MODES, checkpoint_stop
from fastpipe.schedule import get_schedule
from fastpipe.schedule.simulator import activation_peaks, checkpointed_count

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from skip_models import model_with_skips  # noqa: E402

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2)]
ESTIMATED = ("never", "except_last", "always")


def mlp() -> nn.Sequential:
    """Deliberately unbalanced: the first half keeps wide activations, the second narrow ones."""
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 8), nn.Linear(8, 8))


MODELS = {"mlp": (mlp, 16, 8, ([4, 4], [2, 2, 2, 2])),
          "skips": (model_with_skips, 8, 4, ([3, 5], [2, 2, 2, 2]))}


def measured(pipe, x, y):
    with SavedActivationMeter.of_stages(pipe) as meter:
        pipe.train_step(x, y, nn.functional.mse_loss)
    return meter.peak_bytes


def assert_close(estimate, measure):
    assert len(estimate) == len(measure)
    for e, m in zip(estimate, measure):
        assert m > 0 and abs(e - m) <= 0.1 * m, (estimate, measure)


_KEPT_TO_THE_END = pytest.mark.xfail(
    strict=True, reason="under zero bubble a W backpropagates towards the weights only; the "
    "saved tensors of nodes on the input-gradient path alone (a ReLU at a skip stage's start) "
    "then live until the step ends, which the estimate does not model")
CASES = [pytest.param(name, schedule, virtual, mode, marks=[_KEPT_TO_THE_END] if
                      (name, schedule) == ("skips", "zb-h1") else [])
         for name in sorted(MODELS) for schedule, virtual in SCHEDULES for mode in ESTIMATED]


@pytest.mark.parametrize("name,schedule,virtual,mode", CASES)
def test_estimate_matches_the_meter(name, schedule, virtual, mode):
    make, width, out, balances = MODELS[name]
    torch.manual_seed(0)
    x, y = torch.randn(64, width), torch.randn(64, out)
    pipe = fastpipe.Pipe(make(), chunks=4, devices=["cpu"] * 2, balance=balances[virtual - 1],
                         checkpoint=mode, schedule=schedule, virtual_stages=virtual)
    estimate = estimate_activation_peaks(pipe, x)
    assert_close(estimate, measured(pipe, x, y))


def test_the_same_estimate_from_the_model_and_balance_before_a_pipe_exists():
    torch.manual_seed(0)
    x = torch.randn(64, 16)
    before = estimate_activation_peaks(mlp(), x, balance=[4, 4], schedule="1f1b", chunks=4,
                                       checkpoint="never")
    pipe = fastpipe.Pipe(mlp(), chunks=4, devices=["cpu"] * 2, balance=[4, 4],
                         checkpoint="never", schedule="1f1b")
    assert before == estimate_activation_peaks(pipe, x)
    # one micro-batch of 16 rows: stage 0 keeps ReLU's and Tanh's outputs (16 x 64 floats each)
    # for two micro-batches in flight, plus the batch once (its views are the stages' inputs)
    assert before[0] == 2 * 2 * 16 * 64 * 4 + 64 * 16 * 4


def test_uneven_microbatches_scale_with_their_rows():
    x = torch.randn(10, 16)
    even = estimate_activation_peaks(mlp(), x[:8], balance=[4, 4], chunks=2, checkpoint="never")
    uneven = estimate_activation_peaks(mlp(), x[:6], balance=[4, 4], chunks=2,
                                       checkpoint="never")
    assert uneven[1] == pytest.approx(even[1] * 6 / 8, rel=0.01)


def test_memory_model_counts_recomputation_and_weight_actions():
    zb = get_schedule("zb-h1", 2, 4)
    assert activation_peaks(zb, [1.0, 1.0]) == (2.0, 2.0)
    assert activation_peaks(get_schedule("gpipe", 2, 4), [1.0, 2.0]) == (4.0, 8.0)
    # everything recomputed: one micro-batch at a time under GPipe, kept until W under ZB
    assert activation_peaks(get_schedule("gpipe", 2, 4), [1.0, 2.0], checkpointed=4) == (1, 2)
    assert activation_peaks(zb, [1.0, 1.0], checkpointed=4) == (1.0, 2.0)
    assert activation_peaks(get_schedule("gpipe", 2, 4), [1.0, 1.0], shared=[5.0, 0.0]) == (9, 4)


def test_checkpoint_modes_agree_with_the_runtime():
    for mode in MODES:
        for m in range(1, 6):
            assert checkpointed_count(mode, m) == checkpoint_stop(mode, m)


def test_bad_arguments_are_refused_before_any_work():
    model = mlp()
    x = torch.randn(8, 16)
    with pytest.raises(TypeError, match="balance is required"):
        estimate_activation_peaks(model, x)
    with pytest.raises(ValueError, match="add up to 8"):
        estimate_activation_peaks(model, x, balance=[4, 3])
    with pytest.raises(ValueError, match="checkpoint='sometimes'"):
        estimate_activation_peaks(model, x, balance=[4, 4], checkpoint="sometimes")
    with pytest.raises(NotImplementedError, match="offload"):
        estimate_activation_peaks(model, x, balance=[4, 4], checkpoint="offload")
    with pytest.raises(ValueError, match="chunks"):
        estimate_activation_peaks(model, x, balance=[4, 4], chunks=0)
    with pytest.raises(TypeError, match="Pipe or an nn.Sequential"):
        estimate_activation_peaks(nn.Linear(2, 2), x, balance=[1])
    with pytest.raises(ValueError, match="schedule="):
        estimate_activation_peaks(model, x, balance=[4, 4], schedule="nope")


def test_balance_by_size_no_longer_double_counts_a_layer_output():
    # Linear then ReLU: the ReLU's output is the next Linear's saved input, counted once
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                          nn.Linear(32, 8), nn.ReLU())
    sizes = fastpipe.balance.profile_saved_sizes(model, torch.randn(4, 8), param_scale=0.0)
    assert sizes == [4 * 8 * 4, 4 * 32 * 4, 0, 4 * 32 * 4, 0, 4 * 8 * 4]
    assert balance_by_size(2, model, torch.randn(16, 8), chunks=4, param_scale=0.0,
                           device="cpu") == [2, 4]


def _gpt2():
    transformers = pytest.importorskip("transformers")
    transformers.utils.logging.set_verbosity_error()
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50,
                                     n_positions=16, use_cache=False, resid_pdrop=0.1,
                                     embd_pdrop=0.1, attn_pdrop=0.1)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def _gpt2_case(schedule, mode):
    ids = torch.randint(0, 50, (8, 8), generator=torch.Generator().manual_seed(1))
    pipe = fastpipe.Pipe(_gpt2(), chunks=4, devices=["cpu"] * 2, split_points="auto",
                         example_inputs={"input_ids": ids[:2]}, checkpoint=mode,
                         schedule=schedule)
    estimate = estimate_activation_peaks(pipe, {"input_ids": ids})
    with SavedActivationMeter.of_stages(pipe) as meter:
        pipe.train_step({"input_ids": ids}, ids,
                        lambda out, _y: out["logits"].float().square().mean())
    assert_close(estimate, meter.peak_bytes)


def test_gpt2_estimate_matches_the_meter():
    _gpt2_case("1f1b", "except_last")


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("mode", ESTIMATED)
def test_gpt2_estimate_matches_the_meter_for_every_schedule_and_mode(schedule, mode):
    _gpt2_case(schedule, mode)
