"""The capture seam (fastpipe.streams.capture) on the recording backend: captures run under the
stage's device, on one side stream ordered both ways, in thread-local mode, into one pool per
stage, under the caller's autocast without its cache; replays compute what eager code does, and
a split backward (B, then W) replays the backward graph once."""
import contextlib

import pytest
import torch
from torch import nn

from fastpipe.streams.backend import CUDA, HOST
from fastpipe.streams.capture import CAPTURE_MODE, IsolatedCapture
from recording_streams import RecordingStreams


def _module():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.GELU(), nn.Linear(5, 2))


def _seam(device="cuda:1", main="cuda:0"):
    fake = RecordingStreams(main)
    stage = fake.new_stream(device, "stage")
    return fake, stage, IsolatedCapture(torch.device(device), stage, fake)


def _eager(module, x, grad):
    """Output and gradients (input, then parameters) of the plain module."""
    x = x.detach().clone().requires_grad_(x.requires_grad)
    out = module(x)
    surface = [t for t in (x, *module.parameters()) if t.requires_grad]
    return out.detach(), torch.autograd.grad(out, surface, grad)


def test_captures_under_the_stage_device_in_thread_local_mode_into_one_pool():
    """A stage on cuda:1 captured from a thread whose current device is another one: every
    capture (forward and backward of two signatures) sees cuda:1 current, runs on one side
    stream of cuda:1 and allocates from one pool of cuda:1, in thread-local mode."""
    fake, stage, seam = _seam("cuda:1")
    module = _module()
    with fake.on_device("cuda:0"):  # the caller's device
        for rows in (4, 2):
            sample = (fake.made(torch.randn(rows, 3), stage).requires_grad_(),)
            seam.capture(module, list(module.parameters()), sample)
        assert fake.device == torch.device("cuda:0")  # the caller's device is back
    assert len(fake.captures) == 4  # forward and backward, per signature
    assert {c.device for c in fake.captures} == {torch.device("cuda:1")}
    assert {c.mode for c in fake.captures} == {CAPTURE_MODE} == {"thread_local"}
    assert len(fake.pools) == 1 and {c.pool for c in fake.captures} == {fake.pools[0]}
    assert fake.pools[0].device == torch.device("cuda:1")
    streams = {c.stream for c in fake.captures}
    assert len(streams) == 1 and next(iter(streams)).device == torch.device("cuda:1")
    assert stage not in streams and fake.default("cuda:1") not in streams
    fake.check()


def test_capture_keeps_the_callers_autocast_regions_without_their_cache():
    """The regions given (the step's) are entered with the cast cache off; a region the calling
    thread has but the step had not is left; the caller's own state is back afterwards."""
    fake, stage, seam = _seam("cuda:0")
    module = _module()
    sample = (fake.made(torch.randn(4, 3), stage),)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the caller's region, cache on
        graphed = seam.capture(module, list(module.parameters()), sample,
                               autocast=[("cpu", torch.bfloat16)])
        assert torch.is_autocast_cache_enabled() and torch.is_autocast_enabled("cpu")
        eager = module(sample[0])
        with fake.using(stage):
            out = graphed(sample[0])
    assert [c.cache for c in fake.captures] == [False, False]
    assert {dict((k, (on, dt)) for k, on, dt in c.autocast)["cpu"]
            for c in fake.captures} == {(True, torch.bfloat16)}
    assert out.dtype == torch.bfloat16 and torch.equal(out, eager)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a step without autocast
        seam.capture(module, list(module.parameters()), (torch.randn(2, 3),), autocast=[])
    assert [c.autocast[0][1] for c in fake.captures[2:]] == [False, False]
    fake.check()


def test_side_stream_is_ordered_after_the_stage_and_the_caller_and_they_after_it():
    """Samples made on the stage's stream and parameters written on the caller's are read by the
    capture's stream (its warm-up); the next update on the caller's stream and replays on the
    stage's come after it. The recording backend checks every hazard and record_stream."""
    fake, stage, seam = _seam("cuda:0")
    module = _module()
    params = list(module.parameters())
    caller = fake.current("cuda:0")
    fake.compute(caller, writes=params, what="optimizer step")
    fake.wait_stream(stage, caller)  # the step starts after the caller's work
    sample = (fake.made(torch.randn(4, 3), stage, "sample"),)
    fake.wait_stream(caller, stage)  # and ends before it
    graphed = seam.capture(module, params, sample)
    fake.compute(caller, writes=params, what="next optimizer step")
    fake.wait_stream(stage, caller)
    with fake.using(stage):
        graphed(torch.randn(4, 3))
    fake.check()


def test_a_failed_capture_still_orders_the_callers_stream_after_its_warm_up():
    """A stage whose capture fails (here: it returns a number) ran its warm-up on the side
    stream all the same: the caller's next update of the parameters waits for it."""
    fake, stage, seam = _seam("cuda:0")
    module = _module()
    params = list(module.parameters())
    with pytest.raises(TypeError, match="tensors"):
        seam.capture(lambda x: (module(x), 3), params, (fake.made(torch.randn(4, 3), stage),))
    fake.wait_stream(fake.current("cuda:0"), stage)  # the step's end
    fake.compute(fake.current("cuda:0"), writes=params, what="optimizer step")
    fake.check()


def test_replays_compute_what_eager_code_computes():
    """New inputs are copied into the static ones; outputs, input and parameter gradients
    equal the plain module's, replay after replay; None outputs and outputs without a
    gradient pass through."""
    fake, stage, seam = _seam("cuda:0")
    module = _module()

    def fn(x):
        y = module(x)
        return {"y": y, "none": None, "argmax": y.argmax(dim=1)}

    graphed = seam.capture(fn, list(module.parameters()),
                           (torch.randn(4, 3).requires_grad_(),))
    for _ in range(3):
        x, grad = torch.randn(4, 3, requires_grad=True), torch.randn(4, 2)
        expected, (dx, *dparams) = _eager(module, x, grad)
        module.zero_grad(set_to_none=True)
        with fake.using(stage):
            out = graphed(x)
            out["y"].backward(grad)
        assert out["none"] is None and not out["argmax"].requires_grad
        assert torch.equal(out["argmax"], expected.argmax(dim=1))
        torch.testing.assert_close(out["y"], expected, rtol=0, atol=0)
        torch.testing.assert_close(x.grad, dx, rtol=0, atol=0)
        for p, d in zip(module.parameters(), dparams):
            torch.testing.assert_close(p.grad, d, rtol=0, atol=0)
    fake.check()


def test_a_split_backward_replays_the_backward_graph_once():
    """B (input gradient, graph kept) then W (weight gradients): one backward replay; the input
    gradient B handed on is not rewritten by W; both equal the plain module's."""
    fake, stage, seam = _seam("cuda:0")
    module = _module()
    params = list(module.parameters())
    graphed = seam.capture(module, params, (torch.randn(4, 3).requires_grad_(),))
    forward, backward = fake.captures[0].graph, fake.captures[1].graph
    x, grad = torch.randn(4, 3, requires_grad=True), torch.randn(4, 2)
    _, (dx, *dparams) = _eager(module, x, grad)
    module.zero_grad(set_to_none=True)
    with fake.using(stage):
        out = graphed(x)
        (handed,) = torch.autograd.grad(out, [x], grad, retain_graph=True)  # B
        kept = handed.clone()
        torch.autograd.backward(out, grad, inputs=params)  # W
    assert fake.replays == [forward, backward]
    assert torch.equal(handed, kept) and torch.equal(handed, dx)
    for p, d in zip(params, dparams):
        torch.testing.assert_close(p.grad, d, rtol=0, atol=0)
    fake.check()


def test_what_outlives_a_replay_stays_allocated():
    """The pool is shared safely because a capture frees only replay-local temporaries: the
    activations the forward graph saves for the backward graph stay held (the capture's
    autograd graph is kept), as do the static inputs, outputs and gradient buffers."""
    fake, stage, seam = _seam("cuda:0")
    module = _module()
    graphed = seam.capture(module, list(module.parameters()),
                           (torch.randn(4, 3).requires_grad_(),))
    captured = graphed.captured
    (output,) = captured.outputs
    surface = [captured.inputs[0], *captured.params]
    # the saved activations are still there: backpropagating through them again works
    torch.autograd.grad(output, surface, torch.ones_like(output), retain_graph=True)
    assert all(g is not None for g in captured.grads) and captured.grad_outputs


@pytest.mark.parametrize("fault", ["wrong device", "default stream", "autocast cache",
                                   "host read"])
def test_the_recording_backend_refuses_what_cuda_refuses_in_a_capture(fault):
    """The checks the seam tests rely on do fail: a capture without the device guard, on a
    default stream, under autocast with its cache on, or reading a value on the host."""
    fake = RecordingStreams("cuda:0")
    side = fake.default("cuda:1") if fault == "default stream" else fake.new_stream("cuda:1")
    device = "cuda:0" if fault == "wrong device" else "cuda:1"
    region = (torch.autocast("cpu", dtype=torch.bfloat16) if fault == "autocast cache"
              else contextlib.nullcontext())
    x = torch.randn(3)
    with fake.on_device(device), region:
        with fake.capturing(fake.new_graph(), side, fake.graph_pool("cuda:1"), CAPTURE_MODE):
            y = x * 2
            if fault == "host read":
                y.sum().item()
    with pytest.raises(AssertionError, match="stream protocol violated"):
        fake.check()


def test_the_recording_backend_leaves_captured_memory_unwritten_until_a_replay():
    """As on a GPU, a capture computes nothing that lasts: its outputs read NaN until the
    graph is replayed (a seam that forgot to replay would hand out garbage)."""
    fake = RecordingStreams("cuda:0")
    graph, x = fake.new_graph(), torch.ones(3)
    with fake.on_device("cuda:0"):
        with fake.capturing(graph, fake.new_stream("cuda:0"), fake.graph_pool("cuda:0"),
                            CAPTURE_MODE):
            y = x * 2
    assert torch.isnan(y).all()
    x.fill_(5)
    fake.replay(graph)
    assert torch.equal(y, torch.full((3,), 10.0))
    fake.check()


def test_cuda_backend_captures_with_the_pool_and_mode_given_and_no_cache_emptying(monkeypatch):
    """The CUDA backend's capture is capture_begin(pool, capture_error_mode=mode) on the given
    stream, without the synchronisation and cache emptying torch.cuda.graph adds per capture."""
    calls = []

    class Graph:
        def capture_begin(self, *args, **kwargs):
            calls.append(("begin", args, kwargs))

        def capture_end(self):
            calls.append(("end",))

        def replay(self):
            calls.append(("replay",))

    @contextlib.contextmanager
    def stream(s):
        calls.append(("stream", s))
        yield

    def refuse(*args, **kwargs):
        raise AssertionError("no synchronisation or cache emptying per capture")

    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "empty_cache", refuse)
    monkeypatch.setattr(torch.cuda, "synchronize", refuse)
    graph = Graph()
    with CUDA.capturing(graph, "side", "pool", "thread_local"):
        calls.append(("work",))
    CUDA.replay(graph)
    begin = ("begin", ("pool",), {"capture_error_mode": "thread_local"})
    assert calls == [("stream", "side"), begin, ("work",), ("end",), ("replay",)]


def test_host_backend_has_no_graphs():
    with pytest.raises(NotImplementedError, match="CUDA device"):
        HOST.graph_pool(torch.device("cpu"))
    with pytest.raises(NotImplementedError, match="CUDA device"):
        HOST.capturing(None, None, None, CAPTURE_MODE)
