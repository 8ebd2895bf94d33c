"""torchgpipe's rules on ``GPipe`` and the balancers, checked without torchgpipe installed (the
expectations of its test-suite): an empty model, balance advice, ``checkpoint`` and ``chunks``
as torchgpipe reads them, in-place changes under checkpointing, gradients before balancing."""
import pytest
import torch
from torch import nn

from fastpipe import GPipe
from fastpipe.balance import balance_by_size, balance_by_time
from helpers import mlp


def test_an_empty_sequential_with_an_empty_balance_is_the_identity_and_gradients_flow():
    pipe = GPipe(nn.Sequential(), [])
    x = torch.randn(3, 2, requires_grad=True)
    assert pipe(x) is x and pipe.evaluate(x) is x
    pipe(x).pow(2).sum().backward()
    torch.testing.assert_close(x.grad, 2 * x.detach())
    pair = (torch.tensor(42), {"mask": torch.ones(1)})
    assert pipe(pair) is pair
    with pytest.raises(TypeError, match="must be a tensor or tensors"):
        pipe(42)
    assert (pipe.balance, pipe.devices, len(pipe), list(pipe), list(pipe.state_dict())) == \
        ([], [], 0, [], [])
    pipe.to(torch.double)  # a cast is fine, a move is not
    with pytest.raises(TypeError, match="cannot be moved"):
        pipe.cpu()
    with pytest.raises(NotImplementedError, match="no layers"):
        pipe.train_step(x, x, nn.MSELoss())


@pytest.mark.parametrize("args,match", [
    ((nn.Sequential(),), "balance is required"),
    ((nn.Sequential(), [1]), r"module: 0, balance: \[1\]"),
    ((nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1)), [1]), "sums to 1 but the module has 2"),
    ((nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1)), [0, 2]), "has a stage with no layers"),
])
def test_a_wrong_balance_points_to_the_balancers(args, match):
    with pytest.raises(ValueError, match=match) as info:
        GPipe(*args, devices=["cpu"] * 2)
    assert "torchgpipe.balance's balancers" in str(info.value)
    assert "from fastpipe.balance import balance_by_time" in str(info.value)


def test_checkpoint_is_read_as_a_string_and_a_wrong_one_says_both_libraries_words():
    class Named:
        def __str__(self):
            return "always"

    pipe = GPipe(mlp(depth=2), [1, 1], devices=["cpu"] * 2, chunks=42.0, checkpoint=Named())
    assert (pipe.checkpoint, pipe.chunks, type(pipe.chunks)) == ("always", 42, int)
    with pytest.raises(ValueError, match=r"checkpoint='INVALID' is not a checkpoint mode: "
                                         r"checkpoint is not one of 'always', 'except_last', "
                                         r"or 'never'.*'offload', 'selective'"):
        GPipe(mlp(depth=2), [1, 1], devices=["cpu"] * 2, checkpoint="INVALID")


def test_an_in_place_change_of_a_checkpointed_stage_input_is_a_clear_error():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(inplace=True))
    y = GPipe(model, [1, 1], devices=["cpu"] * 2, checkpoint="always")(torch.rand(3, 2))
    with pytest.raises(RuntimeError, match=r"a leaf Variable that requires grad has been used "
                                           r"in an in-place operation.*inplace=False"):
        y.sum().backward()


@pytest.mark.parametrize("balancer", [balance_by_time, balance_by_size])
def test_the_balancers_refuse_a_module_holding_gradients(balancer):
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    model[1].weight.grad = torch.ones(3, 3)
    with pytest.raises(ValueError, match=r"some parameter already has gradient \('1.weight'\).*"
                                         r"zero_grad\(set_to_none=True\)"):
        balancer(1, model, torch.rand(2, 3), device="cpu")
    model.zero_grad(set_to_none=True)
    assert sum(balancer(2, model, torch.rand(2, 3), device="cpu")) == 2
