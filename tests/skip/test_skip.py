"""Skip connections across stages: transparency, schedules, checkpointing, and clear errors."""
import copy

import pytest
import torch
from torch import nn

import fastpipe
from fastpipe import skip
from fastpipe.skip.layout import plan
from helpers import assert_same_grads, grads_of, reference
from skip_models import AddD, AddX, StashDropout, StashX, model_with_skips


def check_transparent(model, schedule, checkpoint, balance, chunks=3, batch=13, virtual=1,
                      devices=3):
    plain = copy.deepcopy(model)
    x, y = torch.randn(batch, 8), torch.randn(batch, 4)
    expected_loss, expected = reference(plain, x, y, nn.MSELoss())
    pipe = fastpipe.Pipe(model, chunks=chunks, balance=balance, devices=["cpu"] * devices,
                         schedule=schedule, checkpoint=checkpoint, virtual_stages=virtual)
    loss = pipe.train_step(x, y, nn.MSELoss())
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-7)
    assert_same_grads(grads_of(model), expected)


@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_train_step_matches_plain_model(schedule, checkpoint):
    check_transparent(model_with_skips(), schedule, checkpoint, balance=[2, 3, 3])


@pytest.mark.parametrize("schedule,virtual,balance", [("interleaved", 2, [1, 1, 2, 1, 2, 1]),
                                                      ("zbv", 2, [1, 1, 2, 1, 2, 1])])
def test_multi_chunk_schedules(schedule, virtual, balance):
    check_transparent(model_with_skips(), schedule, "except_last", balance, chunks=6, batch=12,
                      virtual=virtual)


@pytest.mark.parametrize("batch,chunks", [(13, 4), (5, 4), (7, 1)])
def test_uneven_micro_batches(batch, chunks):
    check_transparent(model_with_skips(), "1f1b", "except_last", [3, 2, 3], chunks=chunks,
                      batch=batch)


def test_skip_within_one_stage_and_across_four():
    check_transparent(model_with_skips(), "1f1b", "always", [2, 2, 2, 2], devices=4)
    check_transparent(model_with_skips(), "gpipe", "never", [8], devices=1)


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_forward_then_backward_matches_plain_model(checkpoint):
    model = model_with_skips()
    plain = copy.deepcopy(model)
    x, y = torch.randn(10, 8), torch.randn(10, 4)
    expected_out = plain(x)
    _, expected = reference(plain, x, y, nn.MSELoss())
    pipe = fastpipe.Pipe(model, chunks=3, balance=[2, 3, 3], devices=["cpu"] * 3,
                         checkpoint=checkpoint)
    out = pipe(x)
    torch.testing.assert_close(out, expected_out, rtol=1e-6, atol=1e-7)
    nn.MSELoss()(out, y).backward()
    assert_same_grads(grads_of(model), expected)
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), expected_out, rtol=1e-6, atol=1e-7)


def test_recompute_replays_the_stash_and_sends_it_once():
    """A random stash is recomputed with the same numbers (the gradients equal those without
    checkpointing, same seeds) and is not sent a second time."""
    model = nn.Sequential(nn.Linear(8, 8), StashDropout(), nn.Linear(8, 8), AddD(),
                          nn.Linear(8, 4))
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    grads = {}
    for checkpoint in ["never", "always"]:
        copied = copy.deepcopy(model)
        pipe = fastpipe.Pipe(copied, chunks=2, balance=[2, 1, 2], devices=["cpu"] * 3,
                             checkpoint=checkpoint, schedule="1f1b")
        sent = []
        exchange = pipe._stages[0].skips
        original = exchange.send
        exchange.send = lambda step, mb, out, d: (sent.append(mb), original(step, mb, out, d))[1]
        torch.manual_seed(1)
        pipe.train_step(x, y, nn.MSELoss())
        assert sorted(sent) == [0, 1]
        grads[checkpoint] = grads_of(copied)
    assert_same_grads(grads["always"], grads["never"])
    assert grads["never"]["0.weight"].abs().sum() > 0


def test_plain_model_uses_per_thread_dictionary():
    model = model_with_skips()
    x = torch.randn(4, 8)
    assert torch.equal(model(x), model(x))
    with pytest.raises(skip.SkipError, match="before any stash"):
        AddX()(x)


def test_plan_lists_producers_and_consumers():
    stages = plan(model_with_skips(), [2, 3, 3])
    assert stages[0].sends == (("h", 2), ("x", 2))
    assert stages[2].receives == (("h", 0), ("x", 0))
    assert 1 not in stages
    assert plan(model_with_skips(), [8])[0].local == {"h", "x"}


@pytest.mark.parametrize("layers,match", [
    ([AddX(), nn.Linear(8, 8)], "no layer stashes"),
    ([StashX(), nn.Linear(8, 8)], "no layer pops"),
    ([StashX(), StashX(), AddX()], "stashed by layers"),
    ([AddX(), StashX(), nn.Linear(8, 8)], "before layer 1 stashes"),
    ([StashX(), AddX(), AddX()], "popped by layers"),
])
def test_inconsistent_declarations_raise_at_construction(layers, match):
    with pytest.raises(ValueError, match=match):
        fastpipe.Pipe(nn.Sequential(*layers), chunks=1, balance=[1] * len(layers),
                      devices=["cpu"] * len(layers))


def test_undeclared_or_missing_stash_fails_with_a_clear_error():
    @skip.skippable(stash=["x"])
    class Forgets(nn.Module):
        def forward(self, x):
            return x

    class Undeclared(nn.Module):
        def forward(self, x):
            skip.stash("y", x)
            return x

    x, y = torch.randn(4, 8), torch.randn(4, 8)
    pipe = fastpipe.Pipe(nn.Sequential(Forgets(), AddX()), balance=[1, 1], devices=["cpu"] * 2)
    with pytest.raises(skip.SkipError, match="not stashed"):
        pipe.train_step(x, y, nn.MSELoss())
    pipe = fastpipe.Pipe(nn.Sequential(StashX(), Undeclared(), AddX()), balance=[2, 1],
                         devices=["cpu"] * 2)
    with pytest.raises(skip.SkipError, match="do not declare"):
        pipe.train_step(x, y, nn.MSELoss())


def test_skippable_checks_its_arguments():
    with pytest.raises(TypeError, match="list of names"):
        skip.skippable(stash="x")
    with pytest.raises(ValueError, match="distinct"):
        skip.skippable(pop=["x", "x"])
    with pytest.raises(TypeError, match="nn.Module"):
        skip.skippable(stash=["x"])(int)


def test_namespace_copies_are_the_same_namespace():
    import pickle
    ns = skip.Namespace()
    for other in (copy.copy(ns), copy.deepcopy(ns), pickle.loads(pickle.dumps(ns))):
        assert other == ns and hash(other) == hash(ns) and other is not ns
    assert skip.Namespace() != ns and ns != "ns"
    assert sorted([skip.Namespace(), ns])[0] is ns


def test_a_skippable_layer_shows_as_skippable_once():
    @skip.skippable(stash=["x"])
    class Keep(nn.Module):
        def forward(self, x):
            skip.stash("x", x)
            return x

    @skip.skippable(stash=["x"])
    class KeepMore(Keep):
        pass

    assert repr(Keep()) == "@skippable(Keep())" and repr(KeepMore()) == "@skippable(KeepMore())"
    assert "(0): @skippable(Keep())" in repr(nn.Sequential(Keep()))
