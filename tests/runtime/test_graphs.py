"""cuda_graphs=True: eager fallback with one warning on the CPU; the graph cache logic and whole
pipes run through the real capture seam on the recording stream backend (which captures and
replays on CPU tensors), so replays are exercised without a GPU; exactness against eager on
CUDA."""
import copy
import types
import warnings

import pytest
import torch
from torch import nn

import fastpipe
from fastpipe.policies.checkpoint import RngReplay, recomputing
from fastpipe.runtime import graphs
from fastpipe.runtime.graphs import FastpipeGraphWarning, GraphedCall, signature
from fastpipe.streams.capture import IsolatedCapture
from helpers import assert_same_grads, grads_of, mlp, reference
from streams.recording_streams import RecordingStreams

EXACT = dict(rtol=0, atol=0)


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


def test_pipedream_with_cuda_graphs_is_refused_before_any_work():
    """PipeDream swaps weight versions into the stages; a graph reads the parameters it was
    captured with (and its gradients would be overwritten by the version's update)."""
    with pytest.raises(NotImplementedError,
                       match=r"schedule='pipedream' with cuda_graphs=True.*cuda_graphs=False"):
        fastpipe.Pipe(mlp(), chunks=2, balance=[3, 3], devices=["cpu"] * 2,
                      schedule="pipedream", cuda_graphs=True)


def test_tied_stages_run_eagerly_with_a_warning():
    """Stages sharing a parameter sum its gradient through autograd hooks (Python code) that a
    graph would not replay: they are not wrapped; the others are."""
    shared = nn.Linear(4, 4)
    modules = [nn.Sequential(shared), nn.Sequential(nn.Linear(4, 4)), nn.Sequential(shared)]
    stages = [types.SimpleNamespace(index=k, module=m, device=torch.device("cuda:0"), stream=None,
                                    call=m, rng=RngReplay(torch.device("cuda:0")))
              for k, m in enumerate(modules)]
    with pytest.warns(FastpipeGraphWarning, match=r"stages \[0, 2\] share parameters"):
        graphs.enable(stages)
    assert [isinstance(s.call, GraphedCall) for s in stages] == [False, True, False]


def test_signature():
    a, b = torch.zeros(2, 3), torch.ones(4, dtype=torch.int64)
    assert signature(a) == (((2, 3), torch.float32, False),)
    assert signature((a.requires_grad_(), b)) == (((2, 3), torch.float32, True),
                                                  ((4,), torch.int64, False))
    assert signature({"x": a}) is None and signature((a, 3)) is None and signature(()) is None


# --- the cache logic, through the capture seam on the recording backend ------------------------


class FailingCapture(IsolatedCapture):
    """The real seam, failing for some input shapes as a capture of an unsupported op would."""

    def __init__(self, backend, fail_for):
        super().__init__(torch.device("cuda:0"), None, backend)
        self.fail_for = set(fail_for)

    def capture(self, fn, params, sample, autocast=()):
        if tuple(sample[0].shape) in self.fail_for:
            raise RuntimeError("operation not permitted when stream is capturing")
        return super().capture(fn, params, sample, autocast)


def _graphed(module=None, max_signatures=4, index=0, capture=None):
    """A pretend CUDA stage whose call replays through the seam on a recording backend."""
    fake = RecordingStreams("cuda:0")
    module = module if module is not None else nn.Linear(3, 2)
    stage = types.SimpleNamespace(index=index, module=module, deferred=None,
                                  device=torch.device("cuda:0"),
                                  rng=types.SimpleNamespace(stochastic=False))
    stage.fake = fake
    stage.call = GraphedCall(module, stage, max_signatures,
                             capture or IsolatedCapture(torch.device("cuda:0"), None, fake))
    return stage


def _captured(stage):
    return sorted((tuple(key[0][0][0]), slot) for key, slot in stage.call.graphs)


def _step(stage, inputs, train=True):
    graphs.before_step([stage], train)
    outs = [stage.call(x) for x in inputs]
    for out in outs:
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.sum().backward()
    graphs.after_step([stage])
    return outs


def test_first_step_records_later_steps_replay_one_graph_per_slot():
    stage = _graphed()
    xs = [torch.randn(4, 3), torch.randn(4, 3), torch.randn(2, 3)]
    eager = [stage.module(x) for x in xs]
    first = _step(stage, xs)
    assert stage.call.replays == 0
    assert _captured(stage) == [((2, 3), 0), ((4, 3), 0), ((4, 3), 1)]
    second = _step(stage, xs)
    assert stage.call.replays == 3 and len(stage.fake.captures) == 6  # nothing captured again
    for e, a, b in zip(eager, first, second):
        assert torch.equal(e, a) and torch.equal(e, b)
    assert all(p.grad is not None for p in stage.module.parameters())  # pre-allocated
    assert len(stage.fake.pools) == 1  # one pool for every graph of the stage
    stage.fake.check()


def test_too_many_signatures_run_eagerly_with_one_warning():
    stage = _graphed(max_signatures=2)
    with pytest.warns(FastpipeGraphWarning, match="more than 2 input signatures"):
        _step(stage, [torch.randn(n, 3) for n in (1, 2, 3, 4)])
    assert _captured(stage) == [((1, 3), 0), ((2, 3), 0)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", FastpipeGraphWarning)
        _step(stage, [torch.randn(n, 3) for n in (1, 2, 3, 4)])
    assert stage.call.replays == 2


def test_failed_capture_falls_back_to_eager_for_good():
    fake = RecordingStreams("cuda:0")
    stage = _graphed(capture=FailingCapture(fake, fail_for={(4, 3)}))
    x = torch.randn(4, 3)
    with pytest.warns(FastpipeGraphWarning, match="capturing it failed"):
        _step(stage, [x])
    out = _step(stage, [x])
    assert stage.call.replays == 0 and torch.equal(out[0], stage.module(x))
    assert not stage.call.pending and not stage.call.graphs


@pytest.mark.parametrize("case", ["forward-only", "no-grad", "recompute", "stochastic"])
def test_ineligible_forwards_run_eagerly_and_capture_nothing(case):
    stage = _graphed()
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
    assert not stage.call.graphs and stage.call.replays == 0 and not stage.fake.captures


def test_a_stage_found_to_draw_random_numbers_is_not_captured():
    """Recorded before the probe answered (the first step), dropped when it found draws."""
    stage = _graphed()
    stage.rng.stochastic = None
    graphs.before_step([stage], True)
    stage.call(torch.randn(4, 3))
    assert stage.call.pending
    stage.rng.stochastic = True  # what the probe found during that forward
    with pytest.warns(FastpipeGraphWarning, match="draws random numbers"):
        graphs.after_step([stage])
    assert not stage.call.graphs and not stage.fake.captures


def test_only_graphed_stages_keep_their_random_number_probe_across_steps():
    """A probed forward cannot replay, so a graphed stage keeps the probe's answer from step
    to step, until a train/eval mode changes; other stages probe at every step, as before."""
    module = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5))
    rng = RngReplay(torch.device("cpu"))
    rng.refresh(module)
    rng.stochastic = True
    rng.refresh(module)
    assert rng.stochastic is None  # not graphed: every step
    stage = _graphed(module)
    stage.rng = rng
    stage.call = GraphedCall(module, stage, capture=stage.call.capture)
    assert rng.across_steps
    rng.refresh(module)
    rng.stochastic = True
    rng.refresh(module)
    assert rng.stochastic is True  # kept
    module.eval()
    rng.refresh(module)
    assert rng.stochastic is None  # the modes changed: probe again
    rng.stochastic = False
    module[1].train()
    rng.refresh(module)
    assert rng.stochastic is None


def test_training_batch_norm_runs_eagerly_and_eval_batch_norm_replays():
    """A capture's warm-up forwards would update running statistics again (and replay would
    bake in the cumulative-average factor): a stage with a training batch norm stays eager."""
    module = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    stage = _graphed(module)
    x = torch.randn(4, 3)
    _step(stage, [x])
    _step(stage, [x])
    assert not stage.call.graphs and stage.call.replays == 0
    module.eval()  # running statistics are only read: graphs are fine
    _step(stage, [x])
    out = _step(stage, [x])
    assert _captured(stage) == [((4, 3), 0)] and stage.call.replays == 1
    assert torch.equal(out[0], module(x))


def test_graphs_are_dropped_when_what_they_read_changes():
    """A cast replaces the parameters a graph reads at fixed addresses: recaptured, exact."""
    stage = _graphed()
    x = torch.randn(4, 3)
    _step(stage, [x])
    _step(stage, [x])
    assert stage.call.replays == 1
    stage.module.double()
    out = _step(stage, [x.double()])
    assert stage.call.replays == 1 and _captured(stage) == [((4, 3), 0)]
    assert torch.equal(out[0], stage.module(x.double()))
    _step(stage, [x.double()])
    assert stage.call.replays == 2


def test_non_tensor_input_warns_once():
    stage = _graphed(nn.Identity(), index=3)
    with pytest.warns(FastpipeGraphWarning, match="stage 3 runs eagerly.*not a tensor"):
        _step(stage, [{"x": torch.ones(1)}, {"x": torch.ones(1)}])
    assert not stage.call.graphs and not stage.fake.captures


# --- whole pipes, replaying through the seam on the recording backend --------------------------


def _replayed_pipe(model, fake, **kwargs):
    """A CPU pipe whose stages replay graphs captured by the seam on the recording backend
    (a pretend cuda:0), as ``cuda_graphs=True`` wraps CUDA stages."""
    pipe = fastpipe.Pipe(model, devices=["cpu"] * 2, **kwargs)
    for stage in pipe._stages:
        stage.call = GraphedCall(stage.call, stage,
                                 capture=IsolatedCapture(torch.device("cuda:0"), None, fake))
    return pipe


def _train(pipe, model, x, y, **kwargs):
    model.zero_grad(set_to_none=True)
    loss = pipe.train_step(x, y, nn.MSELoss(), **kwargs)
    return loss, grads_of(model)


@pytest.mark.parametrize("schedule,chunks", [("gpipe", 1), ("gpipe", 4), ("1f1b", 4),
                                             ("zb-h1", 4)])
def test_every_microbatch_replays_from_the_second_step_and_stays_exact(schedule, chunks):
    """The first micro-batch of a step (probed for random draws on the first step only) and
    chunks=1 replay too; zero-bubble's split backwards (B then W) replay each backward graph
    once; loss and gradients equal the eager pipe's, step after step."""
    base = mlp(depth=6)
    model, plain = copy.deepcopy(base), copy.deepcopy(base)
    fake = RecordingStreams("cuda:0")
    pipe = _replayed_pipe(model, fake, chunks=chunks, balance=[3, 3], checkpoint="never",
                          schedule=schedule)
    eager = fastpipe.Pipe(plain, chunks=chunks, balance=[3, 3], devices=["cpu"] * 2,
                          checkpoint="never", schedule=schedule)
    for step in range(3):
        x, y = torch.randn(12, 8), torch.randn(12, 4)
        before = len(fake.replays)
        loss, grads = _train(pipe, model, x, y)
        expected_loss, expected = _train(eager, plain, x, y)
        torch.testing.assert_close(loss, expected_loss, **EXACT)
        assert_same_grads(grads, expected, **EXACT)
        replays = [s.call.replays for s in pipe._stages]
        assert replays == [chunks * step] * 2, f"step {step}: forward replays {replays}"
        # per forward replay one backward replay, not two (zero-bubble's W replays nothing)
        assert len(fake.replays) - before == (0 if step == 0 else 2 * 2 * chunks)
    assert len(fake.pools) == 2  # one per stage
    fake.check()


def test_uneven_microbatches_replay_per_signature_and_stay_exact():
    base = mlp(depth=6)
    model, plain = copy.deepcopy(base), copy.deepcopy(base)
    fake = RecordingStreams("cuda:0")
    pipe = _replayed_pipe(model, fake, chunks=4, balance=[3, 3], checkpoint="never",
                          schedule="1f1b")
    eager = fastpipe.Pipe(plain, chunks=4, balance=[3, 3], devices=["cpu"] * 2,
                          checkpoint="never", schedule="1f1b")
    for _ in range(3):
        x, y = torch.randn(13, 8), torch.randn(13, 4)  # micro-batches of 4, 4, 4, 1
        loss, grads = _train(pipe, model, x, y)
        expected_loss, expected = _train(eager, plain, x, y)
        torch.testing.assert_close(loss, expected_loss, **EXACT)
        assert_same_grads(grads, expected, **EXACT)
    assert [s.call.replays for s in pipe._stages] == [8, 8]
    assert {key[0][0][0] for key, _ in pipe._stages[0].call.graphs} == {(4, 8), (1, 8)}


def test_autocast_steps_capture_in_the_callers_region_without_its_cache():
    """train_step inside the caller's autocast (cache on): the graphs are captured in that
    region with the cast cache off, replay, and match the eager pipe under the same region."""
    base = mlp(depth=6)
    model, plain = copy.deepcopy(base), copy.deepcopy(base)
    fake = RecordingStreams("cuda:0")
    pipe = _replayed_pipe(model, fake, chunks=2, balance=[3, 3], checkpoint="never")
    eager = fastpipe.Pipe(plain, chunks=2, balance=[3, 3], devices=["cpu"] * 2,
                          checkpoint="never")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FastpipeGraphWarning)  # no capture fails
        for _ in range(3):
            x, y = torch.randn(8, 8), torch.randn(8, 4)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss, grads = _train(pipe, model, x, y)
                expected_loss, expected = _train(eager, plain, x, y)
            torch.testing.assert_close(loss, expected_loss, **EXACT)
            assert_same_grads(grads, expected, **EXACT)
    assert [s.call.replays for s in pipe._stages] == [4, 4]
    assert fake.captures and all(not c.cache for c in fake.captures)
    assert all(("cpu", True, torch.bfloat16) in c.autocast for c in fake.captures)
    assert torch.is_autocast_cache_enabled()
    fake.check()


def test_a_stage_whose_dropout_is_turned_back_on_is_probed_again():
    """Graphs captured in eval mode (dropout off); model.train() turns dropout on: the stage is
    probed again, runs eagerly with seeded draws, and equals the eager pipe with the same
    seeds (its checkpointed micro-batches recompute the same masks)."""
    base = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Tanh(), nn.Linear(8, 4))
    model, plain = copy.deepcopy(base), copy.deepcopy(base)
    fake = RecordingStreams("cuda:0")
    pipe = _replayed_pipe(model, fake, chunks=3, balance=[2, 2], checkpoint="except_last")
    eager = fastpipe.Pipe(plain, chunks=3, balance=[2, 2], devices=["cpu"] * 2,
                          checkpoint="except_last")
    pipe.eval(), eager.eval()
    for step in range(4):
        if step == 2:
            pipe.train(), eager.train()
        x, y = torch.randn(9, 8), torch.randn(9, 4)
        torch.manual_seed(100 + step)
        loss, grads = _train(pipe, model, x, y)
        torch.manual_seed(100 + step)
        expected_loss, expected = _train(eager, plain, x, y)
        torch.testing.assert_close(loss, expected_loss, **EXACT)
        assert_same_grads(grads, expected, **EXACT)
    first, second = pipe._stages
    assert first.rng.stochastic is True and second.rng.stochastic is False
    # the last micro-batch of steps 1 and 3 (checkpointed forwards never replay; step 2
    # records anew after the modes changed)
    assert first.call.replays == 1 and second.call.replays == 2


# --- CUDA ---------------------------------------------------------------------------------------


def _cuda_runs(base, devices, schedule, batch, steps, amp):
    """Loss and gradients of each step, eager then with graphs, and the pipe with graphs."""
    results, pipes = {}, {}
    for use in (False, True):
        model = copy.deepcopy(base)
        pipe = fastpipe.Pipe(model, chunks=4, balance=[4, 4], devices=devices,
                             checkpoint="never", schedule=schedule, cuda_graphs=use)
        torch.manual_seed(0)
        runs = []
        for _ in range(steps):
            x, y = torch.randn(batch, 64), torch.randn(batch, 4)
            model.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
                loss = pipe.train_step(x, y, nn.MSELoss())
            runs.append((loss.float(), grads_of(model)))
        results[use], pipes[use] = runs, pipe
    return results, pipes[True]


@pytest.mark.cuda
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("amp", [False, True])
def test_cuda_graphs_match_eager(schedule, amp):
    """Uneven micro-batches (30 rows in 4: 8, 8, 8, 6), with and without autocast: every step's
    loss and gradients equal eager execution's, and every forward replays from step 2 on."""
    torch.backends.cuda.matmul.allow_tf32 = False
    base = mlp(width=64, depth=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FastpipeGraphWarning)
        results, pipe = _cuda_runs(base, ["cuda:0"] * 2, schedule, 30, 3, amp)
    tol = dict(rtol=1e-2, atol=1e-3) if amp else dict(rtol=1e-6, atol=1e-7)
    for (loss, grads), (expected_loss, expected) in zip(results[True], results[False]):
        torch.testing.assert_close(loss, expected_loss, **tol)
        assert_same_grads(grads, expected, **tol)
    assert [s.call.replays for s in pipe._stages] == [8, 8]


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_cuda_graphs_on_a_second_device_replay_and_match_eager():
    """Stages on cuda:0 and cuda:1 (the second not the current device when it is captured)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    with warnings.catch_warnings():
        warnings.simplefilter("error", FastpipeGraphWarning)
        results, pipe = _cuda_runs(mlp(width=64, depth=8), ["cuda:0", "cuda:1"], "1f1b", 32,
                                   3, False)
    for (loss, grads), (expected_loss, expected) in zip(results[True], results[False]):
        torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=1e-7)
        assert_same_grads(grads, expected, rtol=1e-6, atol=1e-7)
    assert [s.call.replays for s in pipe._stages] == [8, 8]
