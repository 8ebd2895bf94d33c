"""Checkpoints use the plain module's names, so they move between the plain model and any layout."""
import copy

import pytest
import torch
from torch import nn

import fastpipe

LAYOUTS = {
    "2-stages": dict(balance=[3, 3], devices=["cpu"] * 2, schedule="gpipe"),
    "3-stages": dict(balance=[1, 2, 3], devices=["cpu"] * 3, schedule="1f1b"),
    "virtual": dict(balance=[2, 1, 2, 1], devices=["cpu"] * 2, schedule="interleaved",
                    virtual_stages=2),
}


def model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8),
                         nn.Tanh(), nn.Linear(8, 4))


def pipe_of(module: nn.Sequential, layout: str) -> fastpipe.Pipe:
    return fastpipe.Pipe(module, chunks=4, deferred_batch_norm=True, **LAYOUTS[layout])


def batches(count: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(11, 8, generator=g), torch.randint(0, 4, (11,), generator=g))
            for _ in range(count)]


def step(pipe: fastpipe.Pipe, optimizer: torch.optim.Optimizer, x, y) -> torch.Tensor:
    optimizer.zero_grad(set_to_none=True)
    loss = pipe.train_step(x, y, nn.functional.cross_entropy)
    optimizer.step()
    return loss


def assert_same_state(actual: dict, expected: dict) -> None:
    assert list(actual) == list(expected)
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_plain_to_pipe_and_back(layout):
    trained = model()
    trained(torch.randn(16, 8))  # non-default running statistics
    pipe = pipe_of(model(), layout)
    pipe.load_state_dict(trained.state_dict())
    assert_same_state(pipe.state_dict(), trained.state_dict())
    back = model()
    back.load_state_dict(pipe.state_dict())
    assert_same_state(back.state_dict(), trained.state_dict())
    x = torch.randn(8, 8)
    pipe.eval(), trained.eval()
    torch.testing.assert_close(pipe(x), trained(x))


@pytest.mark.parametrize("source,target", [("2-stages", "3-stages"), ("3-stages", "virtual"),
                                           ("virtual", "2-stages")])
def test_resume_with_another_layout_is_exact(source, target):
    """Train k steps on one layout, save, rebuild on another, load, step: the same loss and
    parameters as continuing without the interruption."""
    data = batches(4, seed=1)
    pipe = pipe_of(model(), source)
    optimizer = torch.optim.Adam(pipe.parameters(), lr=1e-2)
    for x, y in data[:3]:
        step(pipe, optimizer, x, y)
    saved = copy.deepcopy((pipe.state_dict(), optimizer.state_dict()))

    resumed = pipe_of(model(), target)  # freshly initialised, other layout
    resumed_optimizer = torch.optim.Adam(resumed.parameters(), lr=1e-2)
    resumed.load_state_dict(saved[0])
    resumed_optimizer.load_state_dict(saved[1])

    x, y = data[3]
    expected_loss = step(pipe, optimizer, x, y)
    actual_loss = step(resumed, resumed_optimizer, x, y)
    torch.testing.assert_close(actual_loss, expected_loss, rtol=1e-6, atol=1e-7)
    assert_same_state(resumed.state_dict(), pipe.state_dict())
    assert_same_state(resumed_optimizer.state_dict()["state"], optimizer.state_dict()["state"])


def test_pipe_checkpoint_resumes_plain_training():
    """A pipeline checkpoint (parameters, buffers, optimizer) continues in the plain model."""
    data = batches(3, seed=2)
    pipe = pipe_of(model(), "3-stages")
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    for x, y in data[:2]:
        step(pipe, optimizer, x, y)
    plain = model()
    plain.load_state_dict(pipe.state_dict())
    plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    plain_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # as if saved

    x, y = data[2]
    step(pipe, optimizer, x, y)
    plain_optimizer.zero_grad()
    # deferred batch norm normalises per micro-batch: the plain model does the same by hand
    loss = sum(nn.functional.cross_entropy(plain(xs), ys) * len(xs) / len(x)
               for xs, ys in zip(x.split(3), y.split(3)))
    loss.backward()
    plain_optimizer.step()
    for name, value in pipe.state_dict().items():
        if "running" not in name and "num_batches" not in name:
            torch.testing.assert_close(plain.state_dict()[name], value, rtol=1e-5, atol=1e-6)


def test_parameter_order_matches_plain_model():
    """Optimizer state is indexed by parameter order: a pipe lists parameters as the plain
    module does, whatever its layout."""
    plain = model()
    names = [n for n, _ in plain.named_parameters()]
    for layout in LAYOUTS:
        pipe = pipe_of(copy.deepcopy(plain), layout)
        assert [n for n, _ in pipe.named_parameters()] == names
        assert [p.shape for p in pipe.parameters()] == [p.shape for p in plain.parameters()]


def test_load_reports_wrong_keys():
    pipe = pipe_of(model(), "2-stages")
    state = {f"module.{k}": v for k, v in model().state_dict().items()}
    with pytest.raises(RuntimeError, match="Missing key"):
        pipe.load_state_dict(state)
