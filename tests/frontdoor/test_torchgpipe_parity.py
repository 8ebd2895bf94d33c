"""Side by side with torchgpipe 0.0.7 (when installed): the same program, with only its imports
switched, gives the same results, attributes and errors."""
import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import fastpipe
import fastpipe.balance
import fastpipe.skip

torchgpipe = pytest.importorskip("torchgpipe", reason="torchgpipe is not installed")
import torchgpipe.balance  # noqa: E402, F811
import torchgpipe.skip  # noqa: E402

LIBS = {
    "torchgpipe": SimpleNamespace(GPipe=torchgpipe.GPipe, skip=torchgpipe.skip,
                                  balance=torchgpipe.balance),
    "fastpipe": SimpleNamespace(GPipe=fastpipe.GPipe, skip=fastpipe.skip,
                                balance=fastpipe.balance),
}


def both(program, *args, **kwargs):
    """``program(lib, *args, **kwargs)`` under each library; the two results."""
    return [program(LIBS[name], *args, **kwargs) for name in ("torchgpipe", "fastpipe")]


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))


def train_once(lib, model, x, **kwargs):
    pipe = lib.GPipe(copy.deepcopy(model), **kwargs)
    out = pipe(x)
    out.pow(2).mean().backward()
    return out.detach(), [p.grad.clone() for p in pipe.parameters()], pipe


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("batch", [16, 13, 3])  # even, uneven, fewer samples than chunks
def test_same_outputs_and_gradients(checkpoint, batch):
    model, x = mlp(), torch.randn(batch, 8)
    (out_a, grads_a, a), (out_b, grads_b, b) = both(
        train_once, model, x, balance=[2, 3], devices=["cpu", "cpu"], chunks=4,
        checkpoint=checkpoint)
    torch.testing.assert_close(out_b, out_a)
    for ga, gb in zip(grads_a, grads_b):
        torch.testing.assert_close(gb, ga)
    assert (b.balance, b.devices, b.chunks, b.checkpoint, len(b)) == \
        (a.balance, a.devices, a.chunks, a.checkpoint, len(a))
    assert [type(layer) for layer in b] == [type(layer) for layer in a]
    assert type(b[-1]) is type(a[-1]) and [len(p) for p in b.partitions] == \
        [len(p) for p in a.partitions]


def skip_model(lib):
    skip = lib.skip

    @skip.skippable(stash=["skip"])
    class Stash(nn.Module):
        def forward(self, input):
            yield skip.stash("skip", input)
            return input

    @skip.skippable(pop=["skip"])
    class PopMul(nn.Module):
        def forward(self, input):
            s = yield skip.pop("skip")
            return input * s

    @skip.skippable(stash=["none"])
    class StashNone(nn.Module):
        def forward(self, input):
            yield skip.stash("none", None)
            return input

    @skip.skippable(pop=["none"])
    class PopNone(nn.Module):
        def forward(self, input):
            none = yield skip.pop("none")
            return input if none is None else input * 0

    torch.manual_seed(1)
    ns1, ns2, ns3 = skip.Namespace(), skip.Namespace(), skip.Namespace()
    # (torchgpipe 0.0.7 cannot mix namespaced and plain names in one pipe: all are isolated)
    return nn.Sequential(Stash().isolate(ns1), nn.Linear(8, 8), Stash().isolate(ns2),
                         StashNone().isolate(ns3), nn.Linear(8, 8), PopMul().isolate(ns2),
                         nn.Tanh(), PopNone().isolate(ns3), PopMul().isolate(ns1))


def run_skips(lib):
    model = skip_model(lib)
    lib.skip.verify_skippables(model)
    torch.manual_seed(2)
    x = torch.randn(6, 8)
    pipe = lib.GPipe(model, balance=[2, 3, 4], devices=["cpu"] * 3, chunks=3)
    out = pipe(x)
    out.sum().backward()
    return out.detach(), [p.grad.clone() for p in pipe.parameters()]


def test_skip_connections_with_yield_namespaces_and_none():
    (out_a, grads_a), (out_b, grads_b) = both(run_skips)
    torch.testing.assert_close(out_b, out_a)
    for ga, gb in zip(grads_a, grads_b):
        torch.testing.assert_close(gb, ga)


def verify_message(lib):
    skip = lib.skip

    @skip.skippable(stash=["a"])
    class StashA(nn.Module):
        def forward(self, input):
            yield skip.stash("a", input)
            return input

    @skip.skippable(pop=["a", "b"])
    class PopAB(nn.Module):
        def forward(self, input):
            a = yield skip.pop("a")
            b = yield skip.pop("b")
            return input + a + b

    @skip.skippable(stash=["c"], pop=["c"])
    class Both(nn.Module):
        def forward(self, input):
            yield skip.stash("c", input)
            c = yield skip.pop("c")
            return c

    with pytest.raises(TypeError) as info:
        skip.verify_skippables(nn.Sequential(StashA(), StashA(), PopAB(), Both(), StashA()))
    return str(info.value)


def test_verify_skippables_says_the_same():
    torchgpipe_message, fastpipe_message = both(verify_message)
    assert fastpipe_message == torchgpipe_message


class UserError(Exception):
    pass


class Raises(nn.Module):
    def forward(self, x):
        if x.shape[0] == 1:
            raise UserError("bad micro-batch")
        return x


def raised(lib):
    pipe = lib.GPipe(nn.Sequential(nn.Linear(4, 4), Raises()), balance=[1, 1],
                     devices=["cpu", "cpu"], chunks=3)
    with pytest.raises(Exception) as info:
        pipe(torch.randn(5, 4))
    return type(info.value), str(info.value)


def test_user_exceptions_reach_the_caller_alike():
    a, b = both(raised)
    assert a == b == (UserError, "bad micro-batch")


def deferred(lib):
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3))
    pipe = lib.GPipe(model, balance=[2, 2], devices=["cpu", "cpu"], chunks=4,
                     deferred_batch_norm=True)
    pipe(torch.randn(16, 6)).sum().backward()
    return model[1].running_mean.clone(), model[1].running_var.clone()


def test_deferred_batch_norm_alike():
    """Same running mean; the running variance is the plain model's (unbiased batch variance),
    where torchgpipe 0.0.7 averages the biased one: they differ by the factor n / (n - 1)."""
    (mean_a, var_a), (mean_b, var_b) = both(deferred)
    torch.testing.assert_close(mean_b, mean_a)
    momentum, n = 0.1, 16
    torch.testing.assert_close((var_b - (1 - momentum)) * (n - 1) / n, var_a - (1 - momentum))


def argument_errors(lib):
    errors = []
    for kwargs in ({"chunks": 0}, {"checkpoint": "sometimes"}):
        with pytest.raises(Exception) as info:
            lib.GPipe(mlp(), balance=[2, 3], devices=["cpu", "cpu"], **kwargs)
        errors.append(type(info.value))
    with pytest.raises(Exception) as info:
        lib.GPipe(nn.Linear(2, 2), balance=[1], devices=["cpu"])
    errors.append(type(info.value))
    return errors


def test_argument_errors_have_the_same_types():
    a, b = both(argument_errors)
    assert [issubclass(e, t) for e, t in zip(b, a)] == [True] * len(a)


def test_balance_by_time_has_the_same_signature():
    import inspect
    ours = inspect.signature(fastpipe.balance.balance_by_time).parameters
    theirs = inspect.signature(torchgpipe.balance.balance_by_time).parameters
    assert list(ours) == list(theirs)
    assert [p.kind for p in ours.values()] == [p.kind for p in theirs.values()]
    ours = inspect.signature(fastpipe.balance.balance_by_size).parameters
    theirs = inspect.signature(torchgpipe.balance.balance_by_size).parameters
    assert list(ours) == list(theirs)
    assert [p.kind for p in ours.values()] == [p.kind for p in theirs.values()]
    ours = inspect.signature(fastpipe.GPipe.__init__).parameters
    theirs = inspect.signature(torchgpipe.GPipe.__init__).parameters
    assert list(ours)[:len(theirs)] == list(theirs)


# -- casts and moves ---------------------------------------------------------------------------
CASTS = {"double()": lambda m: m.double(), "half()": lambda m: m.half(),
         "float()": lambda m: m.double().float(), "to(torch.double)": lambda m: m.to(torch.double),
         "to(dtype=torch.half)": lambda m: m.to(dtype=torch.half)}


def cast(lib, how):
    pipe = lib.GPipe(mlp(), balance=[2, 3], devices=["cpu", "cpu"], chunks=2)
    assert CASTS[how](pipe) is pipe
    return [[p.dtype for p in part.parameters()] for part in pipe.partitions]


@pytest.mark.parametrize("how", CASTS)
def test_a_cast_reaches_every_partition_alike(how):
    theirs, ours = both(cast, how)
    assert ours == theirs and len({d for part in ours for d in part}) == 1


MOVES = {"cuda()": lambda m: m.cuda(), "cpu()": lambda m: m.cpu(),
         "to('cpu')": lambda m: m.to("cpu"), "to(device=0)": lambda m: m.to(device=0),
         "to(tensor)": lambda m: m.to(torch.ones(1)),
         "to(tensor=)": lambda m: m.to(tensor=torch.ones(1, dtype=torch.double))}


def move(lib, how):
    pipe = lib.GPipe(mlp(), balance=[2, 3], devices=["cpu", "cpu"])
    with pytest.raises(TypeError):
        MOVES[how](pipe)
    return [p.dtype for p in pipe.parameters()]


@pytest.mark.parametrize("how", MOVES)
def test_a_move_is_denied_alike(how):
    theirs, ours = both(move, how)
    assert ours == theirs == [torch.float32] * 6


# -- an empty nn.Sequential --------------------------------------------------------------------
def empty(lib):
    pipe = lib.GPipe(nn.Sequential(), [])
    x = torch.randn(3, 2, requires_grad=True)
    out = pipe(x)
    (out * torch.arange(6.0).view(3, 2)).sum().backward()
    pair = (torch.tensor(42), torch.ones(2))
    with pytest.raises(TypeError):
        pipe(42)
    return (out is x, x.grad, pipe(pair) is pair, pipe(torch.tensor(42)).item(), pipe.balance,
            pipe.devices, len(pipe), list(pipe), len(pipe.partitions))


def test_an_empty_sequential_runs_as_the_identity_alike():
    theirs, ours = both(empty)
    assert ours[0] is theirs[0] is True
    torch.testing.assert_close(ours[1], torch.arange(6.0).view(3, 2))
    torch.testing.assert_close(ours[1], theirs[1])
    assert ours[2:] == theirs[2:] == (True, 42, [], [], 0, [], 0)


def balance_errors(lib):
    messages = []
    for args in [(nn.Sequential(),), (nn.Sequential(), [1]),
                 (nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1)), [1])]:
        with pytest.raises(ValueError, match="torchgpipe.balance") as info:
            lib.GPipe(*args)
        messages.append(str(info.value))
    return messages


def test_a_wrong_balance_recommends_the_balancers_alike():
    theirs, ours = both(balance_errors)
    assert len(ours) == len(theirs)
    assert all("fastpipe.balance import balance_by_time" in m for m in ours)
    assert "sums to 1 but the module has 2 layers" in ours[2]  # fastpipe's own words first


# -- constructor arguments ---------------------------------------------------------------------
class Named:
    def __init__(self, value):
        self.value = value

    def __str__(self):
        return self.value


def attributes(lib):
    pipe = lib.GPipe(nn.Sequential(nn.Linear(1, 1)), balance=(1,), devices=("cpu",),
                     chunks=42.0, checkpoint=Named("always"))
    return pipe.chunks, type(pipe.chunks), pipe.checkpoint, type(pipe.checkpoint)


def test_a_whole_float_chunks_and_a_str_like_checkpoint_are_taken_alike():
    theirs, ours = both(attributes)
    assert ours == theirs == (42, int, "always", str)


def test_a_fractional_chunks_is_still_an_error():
    with pytest.raises(TypeError, match=r"chunks must be an int .* got 42\.5; a float is taken "
                                        r"only when it is whole"):
        fastpipe.GPipe(nn.Sequential(nn.Linear(1, 1)), [1], devices=["cpu"], chunks=42.5)


def invalid_checkpoint(lib):
    with pytest.raises(ValueError, match="checkpoint is not one of 'always', 'except_last', or "
                                         "'never'") as info:
        lib.GPipe(nn.Sequential(nn.Linear(1, 1)), [1], devices=["cpu"], checkpoint="INVALID")
    return str(info.value)


def test_an_invalid_checkpoint_mode_says_the_same_and_more():
    _, ours = both(invalid_checkpoint)
    assert ours.startswith("checkpoint='INVALID' is not a checkpoint mode")
    assert "'offload'" in ours and "'selective'" in ours


def too_few_devices(lib):
    model = nn.Sequential(*[nn.Linear(1, 1) for _ in range(4)])
    with pytest.raises(IndexError) as info:
        lib.GPipe(model, balance=[1, 1, 1, 1], devices=["cpu"])
    return info.value


def test_too_few_devices_is_an_index_error_alike_and_a_value_error_here():
    _, ours = both(too_few_devices)
    assert isinstance(ours, ValueError) and isinstance(ours, fastpipe.errors.TooFewDevices)
    assert "4 stages but devices lists only 1" in str(ours)


# -- balancers ---------------------------------------------------------------------------------
def holding_gradients(lib, balancer):
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    sample = torch.rand(2, 3)
    model(sample).norm().backward()
    before = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="some parameter already has gradient") as info:
        getattr(lib.balance, balancer)(1, model, sample, device="cpu")
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), before))
    return str(info.value)


@pytest.mark.parametrize("balancer", ["balance_by_time", "balance_by_size"])
def test_the_balancers_refuse_a_module_holding_gradients(balancer):
    """Side by side for ``balance_by_time``; torchgpipe's ``balance_by_size`` runs on CUDA
    only, so on the CPU it is fastpipe's alone."""
    if balancer == "balance_by_time":
        both(holding_gradients, balancer)
    ours = holding_gradients(LIBS["fastpipe"], balancer)
    assert "'0.weight' and 3 more" in ours and "zero_grad(set_to_none=True)" in ours


# -- an in-place operation on a checkpointed stage's input -------------------------------------
LEAF_IN_PLACE = "a leaf Variable that requires grad (is being|has been) used in an in-place " \
                "operation."


def in_place(lib, checkpoint):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(inplace=True))
    pipe = lib.GPipe(model, [1, 1], devices=["cpu", "cpu"], checkpoint=checkpoint)
    y = pipe(torch.rand(3, 2))
    if checkpoint == "never":
        y.sum().backward()
        return [p.grad for p in model.parameters()]
    with pytest.raises(RuntimeError, match=LEAF_IN_PLACE) as info:
        y.sum().backward()
    return str(info.value)


def test_an_in_place_change_of_a_checkpointed_input_is_refused_alike():
    _, ours = both(in_place, "always")
    assert "inplace=False" in ours  # fastpipe says what to change


def test_an_in_place_first_layer_runs_as_the_plain_model_without_checkpointing():
    theirs, ours = both(in_place, "never")
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b)
