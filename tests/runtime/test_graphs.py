"""cuda_graphs=True: eager fallback with one warning on the CPU, the graph cache logic (with a fake
capture, so it runs without a GPU), and exactness against eager on CUDA."""
import copy
import types
import warnings

import pytest
import torch
from torch import nn

import fastpipe
from fastpipe.policies.checkpoint import recomputing
from fastpipe.runtime import graphs
from fastpipe.runtime.graphs import FastpipeGraphWarning, GraphedCall, signature
from helpers import assert_same_grads, grads_of, mlp, reference


def test_cpu_stages_fall_back_with_one_warning_and_stay_exact():
    model = mlp(depth=6)
    plain = copy.deepcopy(model)
    x, y = torch.randn(13, 8), torch.randn(13, 4)
    expected_loss, expected = reference(plain, x, y, nn.MSELoss())
    with pytest.warns(FastpipeGraphWarning, match=r"stages \[0, 1\] run on the CPU"):
        pipe = fastpipe.Pipe(model, chunks=4, balance=[3, 3], devices=["cpu"] * 2,
                             schedule="1f1b", cuda_graphs=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FastpipeGraphWarning)  # no warning per step
        loss = pipe.train_step(x, y, nn.MSELoss())
    assert not any(isinstance(s.call, GraphedCall) for s in pipe._stages)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-7)
    assert_same_grads(grads_of(model), expected)


def test_cuda_graphs_must_be_a_bool():
    with pytest.raises(TypeError, match="cuda_graphs"):
        fastpipe.Pipe(mlp(), cuda_graphs="yes")


def test_signature():
    a, b = torch.zeros(2, 3), torch.ones(4, dtype=torch.int64)
    assert signature(a) == (((2, 3), torch.float32, False),)
    assert signature((a.requires_grad_(), b)) == (((2, 3), torch.float32, True),
                                                  ((4,), torch.int64, False))
    assert signature({"x": a}) is None and signature((a, 3)) is None and signature(()) is None


# --- the cache logic, with a fake capture -------------------------------------------------------


class FakeCapture:
    """Stands in for make_graphed_callables: counts captures and replays, computes eagerly."""

    def __init__(self, fail_for=()):
        self.captured, self.replays, self.fail_for = [], 0, set(fail_for)

    def __call__(self, call, module, sample):
        shape = tuple(sample[0].shape)
        if shape in self.fail_for:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.captured.append(shape)

        def replay(*inputs):
            self.replays += 1
            return call(inputs if len(inputs) > 1 else inputs[0])
        return replay


def _graphed(capture, max_signatures=4):
    module = nn.Linear(3, 2)
    stage = types.SimpleNamespace(index=0, module=module, deferred=None, device="cuda",
                                  rng=types.SimpleNamespace(stochastic=False))
    stage.call = GraphedCall(module, stage, max_signatures, capture)
    return stage


def _step(stage, inputs, train=True):
    graphs.before_step([stage], train)
    outs = [stage.call(x) for x in inputs]
    graphs.after_step([stage])
    return outs


def test_first_step_records_later_steps_replay_one_graph_per_slot():
    capture = FakeCapture()
    stage = _graphed(capture)
    xs = [torch.randn(4, 3), torch.randn(4, 3), torch.randn(2, 3)]
    eager = [stage.module(x) for x in xs]
    first = _step(stage, xs)
    assert capture.replays == 0 and capture.captured == [(4, 3), (4, 3), (2, 3)]
    second = _step(stage, xs)
    assert capture.replays == 3 and len(capture.captured) == 3  # nothing captured again
    for e, a, b in zip(eager, first, second):
        assert torch.equal(e, a) and torch.equal(e, b)
    assert all(p.grad is not None for p in stage.module.parameters())  # pre-allocated


def test_too_many_signatures_run_eagerly_with_one_warning():
    capture = FakeCapture()
    stage = _graphed(capture, max_signatures=2)
    with pytest.warns(FastpipeGraphWarning, match="more than 2 input signatures"):
        _step(stage, [torch.randn(n, 3) for n in (1, 2, 3, 4)])
    assert capture.captured == [(1, 3), (2, 3)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", FastpipeGraphWarning)
        _step(stage, [torch.randn(n, 3) for n in (1, 2, 3, 4)])
    assert capture.replays == 2


def test_failed_capture_falls_back_to_eager_for_good():
    capture = FakeCapture(fail_for={(4, 3)})
    stage = _graphed(capture)
    x = torch.randn(4, 3)
    with pytest.warns(FastpipeGraphWarning, match="capturing it failed"):
        _step(stage, [x])
    out = _step(stage, [x])
    assert capture.replays == 0 and torch.equal(out[0], stage.module(x))
    assert not stage.call.pending


@pytest.mark.parametrize("case", ["forward-only", "no-grad", "recompute", "stochastic"])
def test_ineligible_forwards_run_eagerly_and_record_nothing(case):
    capture = FakeCapture()
    stage = _graphed(capture)
    stage.rng.stochastic = True if case == "stochastic" else False
    x = torch.randn(4, 3)
    for _ in range(2):
        graphs.before_step([stage], train=case != "forward-only")
        if case == "no-grad":
            with torch.no_grad():
                stage.call(x)
        elif case == "recompute":
            with recomputing():
                stage.call(x)
        else:
            stage.call(x)
        graphs.after_step([stage])
    assert capture.captured == [] and capture.replays == 0


def test_training_batch_norm_runs_eagerly_and_eval_batch_norm_replays():
    """A capture's warm-up forwards would update running statistics again (and replay would
    bake in the cumulative-average factor): a stage with a training batch norm stays eager."""
    capture = FakeCapture()
    module = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    stage = types.SimpleNamespace(index=0, module=module, deferred=None, device="cuda",
                                  rng=types.SimpleNamespace(stochastic=False))
    stage.call = GraphedCall(module, stage, capture=capture)
    x = torch.randn(4, 3)
    _step(stage, [x])
    _step(stage, [x])
    assert capture.captured == [] and capture.replays == 0
    module.eval()  # running statistics are only read: graphs are fine
    _step(stage, [x])
    _step(stage, [x])
    assert capture.captured == [(4, 3)] and capture.replays == 1


def test_non_tensor_input_warns_once():
    capture = FakeCapture()
    module = nn.Identity()
    stage = types.SimpleNamespace(index=3, module=module, deferred=None,
                                  rng=types.SimpleNamespace(stochastic=False))
    stage.call = GraphedCall(module, stage, 4, capture)
    with pytest.warns(FastpipeGraphWarning, match="stage 3 runs eagerly.*not a tensor"):
        _step(stage, [{"x": torch.ones(1)}, {"x": torch.ones(1)}])
    assert capture.captured == []


# --- CUDA ---------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_cuda_graphs_match_eager(schedule):
    torch.backends.cuda.matmul.allow_tf32 = False
    base = mlp(width=64, depth=8)
    x, y = torch.randn(30, 64), torch.randn(30, 4)
    grads, losses = {}, {}
    for use in (False, True):
        model = copy.deepcopy(base)
        pipe = fastpipe.Pipe(model, chunks=4, balance=[4, 4], devices=["cuda:0"] * 2,
                             checkpoint="never", schedule=schedule, cuda_graphs=use)
        for _ in range(3):  # step 1 records, step 2 captures before it runs, 3 replays
            model.zero_grad(set_to_none=True)
            losses[use] = pipe.train_step(x, y, nn.MSELoss())
        grads[use] = grads_of(model)
        if use:
            assert all(s.call.graphs for s in pipe._stages)
    torch.testing.assert_close(losses[True], losses[False], rtol=1e-6, atol=1e-7)
    assert_same_grads(grads[True], grads[False])
