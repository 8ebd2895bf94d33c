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
import torchgpipe.balance  # noqa: E402
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
