"""Bad arguments give typed errors naming the argument, before any work, leaving the model as
it was; a failing stage stops the others."""
import copy
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import fastpipe
from helpers import mlp


def snapshot(model):
    return {n: (p.detach().clone(), None if p.grad is None else p.grad.clone(), p.device)
            for n, p in model.named_parameters()}


def assert_untouched(model, before):
    for name, p in model.named_parameters():
        value, grad, device = before[name]
        assert p.device == device
        torch.testing.assert_close(p.detach(), value, rtol=0, atol=0)
        if grad is None:
            assert p.grad is None
        else:
            torch.testing.assert_close(p.grad, grad, rtol=0, atol=0)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(balance=[3, 2]), ValueError, r"balance=\[3, 2\] sums to 5 but the module has 6 layers"),
    (dict(balance=[3, 0, 3]), ValueError, "has a stage with no layers"),
    (dict(balance=[2, 2, 2], devices=["cpu", "cpu"]), ValueError,
     "3 stages but devices lists only 2"),
    (dict(balance=[3, 3], devices=["cuda:0", "cpu"]), ValueError, "CUDA is not available"),
    (dict(balance=[3, 3], devices=["cpu", "tpu:0"]), ValueError, "devices holds 'tpu:0'"),
    (dict(chunks=0), ValueError, "chunks must be at least 1"),
    (dict(chunks=2.5), TypeError, "chunks must be an int"),
    (dict(schedule="zigzag"), ValueError, "schedule"),
    (dict(checkpoint="sometimes"), ValueError, "checkpoint='sometimes' is not a checkpoint mode"),
    (dict(timeout=0), ValueError, "timeout must be a positive number"),
    (dict(cpu_workers=0), ValueError, "cpu_workers must be None or a positive int"),
    (dict(balance=[3.0, 3]), TypeError, "balance must be a non-empty list of ints"),
    (dict(devices="cpu", balance=[3, 3]), TypeError, "devices must be a list"),
])
def test_constructor_errors(kwargs, error, match):
    if "cuda:0" in kwargs.get("devices", []) and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    model = mlp()
    model[0].weight.grad = torch.ones_like(model[0].weight)
    before = snapshot(model)
    with pytest.raises(error, match=match):
        fastpipe.Pipe(model, **kwargs)
    assert_untouched(model, before)


def test_non_sequential_module_is_a_type_error():
    with pytest.raises(TypeError, match="module must be an nn.Sequential"):
        fastpipe.Pipe(nn.Linear(2, 2))


def test_unknown_schedule_lists_valid_names():
    with pytest.raises(ValueError, match="gpipe") as info:
        fastpipe.Pipe(mlp(), schedule="zigzag")
    assert "1f1b" in str(info.value)


@pytest.mark.parametrize("call", ["train_step", "forward"])
def test_batch_errors_leave_model_untouched(call):
    model = mlp()
    pipe = fastpipe.Pipe(model, chunks=4, balance=[3, 3], devices=["cpu"] * 2)
    before = snapshot(model)
    run = (lambda x: pipe.train_step(x, torch.zeros(0, 4), nn.MSELoss())) if call == "train_step" \
        else pipe
    with pytest.raises(ValueError, match="empty"):
        run(torch.randn(0, 8))
    with pytest.raises(ValueError, match="different batch sizes"):
        run((torch.randn(8, 8), torch.randn(7, 8)))
    assert_untouched(model, before)


def test_target_batch_mismatch_and_bad_loss():
    model = mlp()
    pipe = fastpipe.Pipe(model, chunks=2, balance=[3, 3], devices=["cpu"] * 2)
    before = snapshot(model)
    with pytest.raises(ValueError, match="targets has batch size 5 but inputs has 8"):
        pipe.train_step(torch.randn(8, 8), torch.randn(5, 4), nn.MSELoss())
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        pipe.train_step(torch.randn(8, 8), torch.randn(8, 4), "mse")
    with pytest.raises(ValueError, match="loss_reduction"):
        pipe.train_step(torch.randn(8, 8), torch.randn(8, 4), nn.MSELoss(), loss_reduction="max")
    assert_untouched(model, before)


def test_properties_and_plain_names():
    model = mlp()
    names = [n for n, _ in model.named_parameters()]
    pipe = fastpipe.Pipe(copy.deepcopy(model), chunks=3, balance=[1, 2, 3], devices=["cpu"] * 3,
                         schedule="1f1b")
    assert pipe.balance == (1, 2, 3)
    assert pipe.devices == (torch.device("cpu"),) * 3
    assert pipe.chunks == 3 and pipe.schedule == "1f1b" and pipe.checkpoint == "except_last"
    assert [len(p) for p in pipe.partitions] == [1, 2, 3]
    assert [n for n, _ in pipe.named_parameters()] == names
    assert list(pipe.state_dict()) == list(model.state_dict())
    with pytest.raises(AttributeError):
        pipe.balance = (3, 3)
    with pytest.raises(TypeError, match="cannot be moved"):
        pipe.to("cpu")  # a move, even to where the stages are (as torchgpipe refuses it)
    assert str(pipe.plan().actions[0][0]) == "0F0"


def test_automatic_balance_uses_every_layer():
    model = mlp(depth=6)
    pipe = fastpipe.Pipe(model, chunks=2, devices=["cpu"] * 3)
    assert sum(pipe.balance) == 6 and len(pipe.balance) == 3


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(chunks=10**6), ValueError, "chunks=1000000 is more than 4096"),
    (dict(chunks=10**9), ValueError, "use at most 4096"),
    (dict(balance=[3, 3], devices=["cpu"] * 3), ValueError,
     "devices lists 3 devices but the pipeline has 2 stages"),
    (dict(devices=["cpu"] * 7), ValueError, "devices lists 7 devices but the pipeline has 6"),
])
def test_constructor_errors_found_by_a_randomized_run(kwargs, error, match):
    model = mlp()
    before = snapshot(model)
    with pytest.raises(error, match=match):
        fastpipe.Pipe(model, **kwargs)
    assert_untouched(model, before)


def test_a_meta_model_is_a_clear_error():
    with torch.device("meta"):
        model = mlp()
    with pytest.raises(ValueError, match=r"on the meta device.*to_empty"):
        fastpipe.Pipe(model, chunks=2, balance=[3, 3], devices=["cpu"] * 2)


def test_an_optimizer_class_instead_of_an_instance_is_refused_before_work():
    model = mlp()
    pipe = fastpipe.Pipe(model, chunks=2, balance=[3, 3], devices=["cpu"] * 2)
    before = snapshot(model)
    with pytest.raises(TypeError, match=r"optimizer is the class torch.optim.sgd.SGD.*instance"):
        pipe.train_step(torch.randn(8, 8), torch.randn(8, 4), nn.MSELoss(),
                        optimizer=torch.optim.SGD)
    assert_untouched(model, before)


DETACHED = [("detached", lambda o, t: nn.functional.mse_loss(o, t).detach(), "without a gradient"),
            ("integer", lambda o, t: (o - t).abs().sum().long(), "torch.int64"),
            ("vector", lambda o, t: (o - t) ** 2, "0-dim tensor")]


@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always", "selective", "offload"])
@pytest.mark.parametrize("schedule,virtual", [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1),
                                              ("interleaved", 2)])
@pytest.mark.parametrize("kind,loss_fn,match", DETACHED, ids=[d[0] for d in DETACHED])
def test_a_loss_without_a_graph_is_a_type_error_before_any_gradient(
        kind, loss_fn, match, schedule, virtual, checkpoint):
    model = mlp(depth=8)
    pipe = fastpipe.Pipe(model, chunks=4, devices=["cpu"] * 2, schedule=schedule,
                         virtual_stages=virtual, checkpoint=checkpoint)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    before = snapshot(model)
    with pytest.raises(TypeError, match=f"loss_fn .*{match}") as info:
        pipe.train_step(torch.randn(10, 8), torch.randn(10, 4), loss_fn, optimizer=optimizer)
    assert isinstance(info.value, fastpipe.LossFunctionError)
    assert "micro-batch" in str(info.value)
    assert_untouched(model, before)
    assert optimizer.state_dict()["state"] == {}  # never stepped


@pytest.mark.filterwarnings("ignore:Using a target size")
def test_a_loss_fn_failure_names_loss_fn_and_the_shapes():
    pipe = fastpipe.Pipe(mlp(), chunks=2, balance=[3, 3], devices=["cpu"] * 2)
    with pytest.raises(Exception, match=r"loss_fn\(output, targets\).*\(4, 4\).*\(4, 5\)"):
        pipe.train_step(torch.randn(8, 8), torch.randn(8, 5), nn.functional.mse_loss)


def test_selective_checkpointing_pays_its_imports_at_construction():
    """The first step of a selective pipe imports nothing new (torch._dynamo was loaded by the
    constructor), so a short timeout measures the step alone."""
    code = (
        "import sys, torch, fastpipe\n"
        "from torch import nn\n"
        "model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))\n"
        "pipe = fastpipe.Pipe(model, chunks=2, devices=['cpu'], checkpoint='selective')\n"
        "before = set(sys.modules)\n"
        "pipe.train_step(torch.randn(4, 4), torch.randn(4, 4), nn.functional.mse_loss)\n"
        "print(sorted(m for m in set(sys.modules) - before if 'dynamo' in m))\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=env, cwd=root)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


class _Failed(Exception):
    pass


class _Tagged(nn.Module):
    """Records the micro-batches (by their value) it runs; on micro-batch ``fail_on`` it raises
    once ``events[0]`` is set; on ``hold_on`` it sets ``events[0]`` and waits for
    ``events[1]`` (the step has recorded a failure)."""

    def __init__(self, seen, events, fail_on=None, hold_on=None):
        super().__init__()
        self.seen, self.events, self.fail_on, self.hold_on = seen, events, fail_on, hold_on

    def forward(self, x):
        tag = int(x[0, 0])
        self.seen.append(tag)
        holding, tripped = self.events
        if tag == self.fail_on:
            assert holding.wait(timeout=30), "the other worker never started its action"
            raise _Failed(f"micro-batch {tag}")
        if tag == self.hold_on:
            holding.set()
            assert tripped.wait(timeout=30), "the failure was never recorded"
        return x


def test_after_a_failure_no_worker_starts_another_action(monkeypatch):
    """torchgpipe's early stop: once a stage fails, a worker that is still busy stops before
    its next action. Two workers run stages (0, 1) and (2, 3); stage 1 fails on micro-batch 2
    while stage 3 holds micro-batch 0 until the failure is recorded. Micro-batch 1 is ready on
    stage 2 by then (the same worker's next action), and must not run."""
    import threading
    from fastpipe.runtime.transport.mailbox import Abort
    events, trip = (threading.Event(), threading.Event()), Abort.trip

    def tripping(self, reason):
        trip(self, reason)
        events[1].set()

    monkeypatch.setattr(Abort, "trip", tripping)
    seen = {k: [] for k in range(4)}
    model = nn.Sequential(_Tagged(seen[0], events), _Tagged(seen[1], events, fail_on=2),
                          _Tagged(seen[2], events), _Tagged(seen[3], events, hold_on=0))
    pipe = fastpipe.GPipe(model, [1, 1, 1, 1], devices=["cpu"] * 4, chunks=4, cpu_workers=2,
                          checkpoint="never")
    with pytest.raises(_Failed, match="micro-batch 2"):
        pipe(torch.arange(4.0).view(4, 1))
    assert seen[1] == [0, 1, 2]
    assert seen[2] == [0] and seen[3] == [0]


def test_a_whole_float_chunks_is_its_int_and_too_few_devices_is_also_an_index_error():
    pipe = fastpipe.Pipe(mlp(), chunks=4.0, balance=[3, 3], devices=["cpu"] * 2)
    assert pipe.chunks == 4 and type(pipe.chunks) is int
    with pytest.raises(IndexError, match="3 stages but devices lists only 2") as info:
        fastpipe.Pipe(mlp(), balance=[2, 2, 2], devices=["cpu"] * 2)
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, fastpipe.errors.TooFewDevices)
