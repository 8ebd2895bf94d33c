"""torchgpipe programs after the import switch: ``GPipe``, the balance helpers, exceptions."""
import copy
from collections import OrderedDict

import pytest
import torch
from torch import nn

import fastpipe
from fastpipe import GPipe
from fastpipe.balance import balance_by_size, balance_by_time
from helpers import assert_same_grads, grads_of, mlp, reference


def test_readme_example_of_torchgpipe_runs_after_the_import_switch():
    # torchgpipe's README, with `from torchgpipe import GPipe` changed and CPU devices
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    plain = copy.deepcopy(model)
    model = GPipe(model, balance=[2, 3], devices=["cpu", "cpu"], chunks=8)
    x, y = torch.randn(32, 8), torch.randn(32, 4)
    output = model(x)
    loss = nn.functional.mse_loss(output, y)
    loss.backward()
    expected_loss, expected = reference(plain, x, y, nn.functional.mse_loss)
    torch.testing.assert_close(loss.detach(), expected_loss, rtol=1e-5, atol=1e-7)
    assert_same_grads(grads_of(model), expected)


def test_torchgpipe_readme_training_loop_runs_after_the_import_switch():
    # torchgpipe's README loop: inputs to the first device, targets to the last
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 3))
    model = GPipe(model, balance=[1, 1, 2], devices=["cpu"] * 3, chunks=8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    in_device = model.devices[0]
    out_device = model.devices[-1]
    data_loader = [(torch.randn(20, 8), torch.randint(0, 3, (20,))) for _ in range(3)]
    for input, target in data_loader:
        input = input.to(in_device, non_blocking=True)
        target = target.to(out_device, non_blocking=True)
        output = model(input)
        loss = nn.functional.cross_entropy(output, target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert torch.isfinite(loss)


def test_balance_is_the_second_positional_argument_and_the_rest_keyword_only():
    pipe = GPipe(mlp(depth=5), [3, 2], devices=["cpu", "cpu"], chunks=4)
    assert pipe.balance == [3, 2] and isinstance(pipe.balance, list)
    assert pipe.devices == [torch.device("cpu")] * 2 and isinstance(pipe.devices, list)
    assert pipe.chunks == 4 and pipe.checkpoint == "except_last"
    with pytest.raises(TypeError):
        GPipe(mlp(depth=5), [3, 2], ["cpu", "cpu"])  # devices is keyword-only, as in torchgpipe


def test_gpipe_behaves_like_the_sequential_it_wraps():
    layers = [nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)]
    pipe = GPipe(nn.Sequential(*layers), balance=[2, 2, 1], devices=["cpu"] * 3)
    assert len(pipe) == 5
    assert pipe[0] is layers[0] and pipe[4] is layers[4] and pipe[-1] is layers[-1]
    assert pipe[-3] is layers[2]
    assert list(pipe) == layers
    with pytest.raises(IndexError):
        pipe[5]
    assert isinstance(pipe.partitions, nn.ModuleList) and len(pipe.partitions) == 3
    assert [len(p) for p in pipe.partitions] == [2, 2, 1]
    assert pipe.partitions[1][0] is layers[2]
    assert isinstance(pipe, nn.Module) and isinstance(pipe, fastpipe.Pipe)


def test_devices_beyond_the_balance_are_left_unused_as_in_torchgpipe():
    pipe = GPipe(mlp(depth=4), balance=[2, 2], devices=["cpu"] * 4)
    assert pipe.devices == [torch.device("cpu")] * 2


def test_gpipe_checks_its_arguments_before_any_work():
    with pytest.raises(ValueError, match="checkpoint"):
        GPipe(mlp(depth=4), balance=[2, 2], devices=["cpu"] * 2, checkpoint="sometimes")
    with pytest.raises(ValueError, match="chunks"):
        GPipe(mlp(depth=4), balance=[2, 2], devices=["cpu"] * 2, chunks=0)
    with pytest.raises(ValueError, match="sums to 3"):
        GPipe(mlp(depth=4), balance=[2, 1], devices=["cpu"] * 2)
    with pytest.raises(TypeError, match="nn.Sequential"):
        GPipe(nn.Linear(2, 2), balance=[1], devices=["cpu"])


def test_deferred_batch_norm_and_checkpoint_modes_pass_through():
    model = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3))
    plain = copy.deepcopy(model)
    pipe = GPipe(model, balance=[2, 2], devices=["cpu"] * 2, chunks=4, checkpoint="always",
                 deferred_batch_norm=True)
    x = torch.randn(16, 6)
    pipe(x).sum().backward()
    plain(x).sum().backward()
    torch.testing.assert_close(model[1].running_mean, plain[1].running_mean)
    torch.testing.assert_close(model[1].running_var, plain[1].running_var)
    assert model[1].num_batches_tracked.item() == 1  # once per mini-batch, not per micro-batch


def test_gpipe_keeps_fastpipe_options_for_programs_that_outgrow_torchgpipe():
    model = mlp(depth=4)
    plain = copy.deepcopy(model)
    pipe = GPipe(model, [2, 2], devices=["cpu"] * 2, chunks=4, schedule="1f1b")
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    loss = pipe.train_step(x, y, nn.MSELoss())
    expected_loss, expected = reference(plain, x, y, nn.MSELoss())
    torch.testing.assert_close(loss, expected_loss)
    assert_same_grads(grads_of(model), expected)


# -- balance helpers with torchgpipe's signatures ----------------------------------------------


def test_balance_by_time_has_torchgpipe_signature():
    model = mlp(depth=6)
    balance = balance_by_time(2, model, torch.randn(4, 8), timeout=0.2, device="cpu")
    assert sum(balance) == 6 and len(balance) == 2
    pipe = GPipe(model, balance, devices=["cpu"] * 2)
    assert pipe.balance == balance


class Keeper(nn.Module):
    """Keeps four input-sized tensors for backward but returns a small output."""

    def forward(self, x):
        h = torch.sigmoid(x) * torch.tanh(x) * torch.exp(x) * torch.sin(x)
        return h.sum(dim=1, keepdim=True).expand_as(x)[:, :1]


def test_balance_by_size_counts_what_a_layer_keeps_for_backward():
    widen = nn.Linear(16, 16, bias=False)
    model = nn.Sequential(Keeper(), nn.Linear(1, 16, bias=False), widen, nn.Linear(16, 16))
    x = torch.randn(64, 16)
    before = copy.deepcopy(model.state_dict())
    sizes = fastpipe.balance.profile_saved_sizes(model, x[:16], param_scale=0.0)
    # the first layer keeps several 16x16 float tensors though its output is 16x1
    assert sizes[0] >= 4 * 16 * 16 * 4
    assert sizes[0] > 4 * sizes[1]
    assert balance_by_size(2, model, x, chunks=4, param_scale=0.0, device="cpu") == [1, 3]
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name])


def test_balance_by_size_uses_one_microbatch_and_scales_parameters():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    one = fastpipe.balance.profile_saved_sizes(model, torch.randn(2, 4), param_scale=1.0)
    none = fastpipe.balance.profile_saved_sizes(model, torch.randn(2, 4), param_scale=0.0)
    assert one[0] - none[0] == (16 + 4) * 4
    with pytest.raises(ValueError, match="chunks"):
        balance_by_size(1, model, torch.randn(2, 4), chunks=0)


# -- user exceptions keep their type ------------------------------------------------------------


class UserError(Exception):
    """A user's own exception type."""


class Raises(nn.Module):
    def __init__(self, at: int):
        super().__init__()
        self.at = at

    def forward(self, x):
        if x.shape[0] == self.at:
            raise UserError("bad sample")
        return x


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_a_user_exception_reaches_the_caller_with_its_own_type(schedule):
    model = nn.Sequential(nn.Linear(4, 4), Raises(at=1), nn.Linear(4, 4))
    pipe = fastpipe.Pipe(model, chunks=3, balance=[1, 1, 1], devices=["cpu"] * 3,
                         schedule=schedule)
    with pytest.raises(UserError) as info:
        pipe.train_step(torch.randn(5, 4), torch.randn(5, 4), nn.MSELoss())  # sizes 2, 2, 1
    assert str(info.value) == "bad sample"  # the message is the user's own
    assert info.value.__notes__ == ["raised in the pipeline at stage 1, action 1F2 "
                                    "(micro-batch 2)"]
    pipe.train_step(torch.randn(6, 4), torch.randn(6, 4), nn.MSELoss())  # still usable


def test_gpipe_forward_and_loss_errors_keep_their_type():
    pipe = GPipe(nn.Sequential(nn.Linear(4, 4), Raises(at=3)), [1, 1], devices=["cpu"] * 2,
                 chunks=2)
    with pytest.raises(UserError) as info:
        pipe(torch.randn(6, 4))
    assert "stage 1, action 1F0 (micro-batch 0)" in info.value.__notes__[0]

    def loss_fn(out, target):
        raise KeyError("no such target")

    with pytest.raises(KeyError):
        pipe.train_step(torch.randn(4, 4), torch.randn(4, 4), loss_fn)


def test_fastpipe_own_failures_stay_typed():
    class Slow(nn.Module):
        def forward(self, x):
            import time
            time.sleep(0.6)
            return x

    pipe = fastpipe.Pipe(nn.Sequential(Slow(), nn.Linear(4, 4)), chunks=2, balance=[1, 1],
                         devices=["cpu"] * 2, timeout=0.2)
    with pytest.raises(fastpipe.PipelineTimeout):
        pipe.train_step(torch.randn(4, 4), torch.randn(4, 4), nn.MSELoss())


# -- named children -----------------------------------------------------------------------------


def test_a_sequential_with_named_children_builds_and_trains():
    model = nn.Sequential(OrderedDict([("embed", nn.Linear(8, 8)), ("act", nn.ReLU()),
                                       ("head", nn.Linear(8, 4))]))
    plain = copy.deepcopy(model)
    pipe = GPipe(model, [1, 2], devices=["cpu"] * 2, chunks=2)
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    loss = pipe.train_step(x, y, nn.MSELoss())
    expected_loss, expected = reference(plain, x, y, nn.MSELoss())
    torch.testing.assert_close(loss, expected_loss)
    assert_same_grads(grads_of(model), expected)
    assert "embed.weight" in pipe.state_dict()


# -- skip connections in torchgpipe's generator form ---------------------------------------------

from fastpipe.skip import Namespace, pop, skippable, stash, verify_skippables  # noqa: E402


@skippable(stash=["1to3"])
class Layer1(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, input):
        yield stash("1to3", input)
        return torch.tanh(self.lin(input))


@skippable(pop=["1to3"])
class Layer3(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, input):
        skip_1to3 = yield pop("1to3")
        return self.lin(input) * skip_1to3


@skippable(stash=["skip"])
class Stash(nn.Module):
    def forward(self, input):
        yield stash("skip", input * 2)
        return input


@skippable(pop=["skip"])
class PopAdd(nn.Module):
    def forward(self, input):
        skip = yield pop("skip")
        return input + skip


@skippable(stash=["maybe"])
class StashNone(nn.Module):
    def forward(self, input):
        yield stash("maybe", None)
        return input


@skippable(pop=["maybe"])
class PopNone(nn.Module):
    def forward(self, input):
        maybe = yield pop("maybe")
        assert maybe is None
        return input


def _check_gpipe_transparent(model, balance, chunks=3, checkpoint="except_last"):
    plain = copy.deepcopy(model)
    x, y = torch.randn(7, 8), torch.randn(7, 8)
    expected_loss, expected = reference(plain, x, y, nn.MSELoss())
    pipe = GPipe(model, balance, devices=["cpu"] * len(balance), chunks=chunks,
                 checkpoint=checkpoint)
    loss = nn.MSELoss()(pipe(x), y)
    loss.backward()
    torch.testing.assert_close(loss.detach(), expected_loss, rtol=1e-5, atol=1e-7)
    assert_same_grads(grads_of(model), expected)


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_generator_skips_run_unsplit_and_in_a_pipe(checkpoint):
    model = nn.Sequential(Layer1(), nn.Linear(8, 8), Layer3(), nn.Linear(8, 8))
    verify_skippables(model)
    _check_gpipe_transparent(model, [1, 2, 1], checkpoint=checkpoint)


def test_namespaces_isolate_two_uses_of_one_skippable_class():
    ns1, ns2 = Namespace(), Namespace()
    model = nn.Sequential(Stash().isolate(ns1), nn.Linear(8, 8), Stash().isolate(ns2),
                          nn.Linear(8, 8), PopAdd().isolate(ns2), nn.Linear(8, 8),
                          PopAdd().isolate(ns1))
    verify_skippables(model)
    _check_gpipe_transparent(model, [2, 2, 3])
    # without namespaces the same layers clash, and the pipe says so before any work
    clash = nn.Sequential(Stash(), Stash(), PopAdd(), PopAdd())
    with pytest.raises(ValueError, match="stashed by layers"):
        GPipe(clash, [2, 2], devices=["cpu"] * 2)


def test_stash_none_reaches_its_pop_across_stages():
    model = nn.Sequential(StashNone(), nn.Linear(8, 8), PopNone(), nn.Linear(8, 8))
    verify_skippables(model)
    _check_gpipe_transparent(model, [2, 2])
    pipe = fastpipe.Pipe(copy.deepcopy(model), chunks=2, balance=[1, 3], devices=["cpu"] * 2,
                         schedule="1f1b")
    pipe.train_step(torch.randn(4, 8), torch.randn(4, 8), nn.MSELoss())


def test_verify_skippables_lists_every_problem_as_torchgpipe_does():
    ns = Namespace()
    model = nn.Sequential(Stash(), Stash(), PopAdd().isolate(ns), Layer1())
    with pytest.raises(TypeError) as info:
        verify_skippables(model)
    assert str(info.value) == (
        "one or more pairs of stash and pop do not match:\n\n"
        "* '1' redeclared 'skip' as stashable but not isolated by namespace\n"
        "* '2' declared 'skip' as poppable but it was not stashed\n"
        "* no module declared '1to3' as poppable but stashed\n"
        "* no module declared 'skip' as poppable but stashed")


def test_isolate_only_some_names_and_reject_unknown_ones():
    ns = Namespace()
    layer = Stash().isolate(ns, only=["skip"])
    assert skip_declared(layer).stash == (f"skip@{ns.label}",)
    with pytest.raises(ValueError, match="does not declare"):
        Stash().isolate(ns, only=["other"])
    with pytest.raises(TypeError, match="Namespace"):
        Stash().isolate("ns")


def skip_declared(layer):
    return fastpipe.skip.declared(layer)


# -- short batches -------------------------------------------------------------------------------

SHORT_CASES = [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("pipedream", 1), ("interleaved", 2),
               ("looped-bfs", 2), ("zbv", 2), ("dualpipev", 2)]


@pytest.mark.parametrize("schedule, virtual", SHORT_CASES)
@pytest.mark.parametrize("batch", [3, 5, 13])
def test_a_short_batch_runs_fewer_microbatches_on_every_schedule(schedule, virtual, batch):
    """chunks=8 with a last batch of 3, 5 or 13 samples: the step runs (fewer micro-batches, or
    for interleaved schedules the nearest count they accept) and stays exact."""
    model = mlp(depth=8)
    plain = copy.deepcopy(model)
    x, y = torch.randn(batch, 8), torch.randn(batch, 4)
    expected_loss, expected = reference(plain, x, y, nn.MSELoss())
    pipe = fastpipe.Pipe(model, chunks=8, devices=["cpu"] * 2, schedule=schedule,
                         virtual_stages=virtual, balance=[2] * (2 * virtual) if virtual > 1
                         else [4, 4])
    if schedule == "pipedream":
        optimizer = torch.optim.SGD(pipe.parameters(), lr=0.0)  # updates nothing: lr 0
        loss = pipe.train_step(x, y, nn.MSELoss(), optimizer=optimizer)
        torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-7)
        return  # .grad holds the last micro-batch's gradient under PipeDream
    loss = pipe.train_step(x, y, nn.MSELoss())
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-7)
    assert_same_grads(grads_of(model), expected)
    out = pipe(x)  # the forward path too
    torch.testing.assert_close(out, plain(x), rtol=1e-5, atol=1e-6)


def test_gpipe_batch_smaller_than_chunks_as_in_torchgpipe():
    model = mlp(depth=4)
    plain = copy.deepcopy(model)
    pipe = GPipe(model, [2, 2], devices=["cpu"] * 2, chunks=8)
    x = torch.randn(2, 8)
    torch.testing.assert_close(pipe(x), plain(x))


# -- tied weights: the gradient sum does not depend on thread timing ------------------------


class Delay(nn.Module):
    """Identity whose backward sleeps when ``slow`` is set: shifts the threads' interleaving."""

    def __init__(self):
        super().__init__()
        self.slow = False

    def forward(self, x):
        if self.slow and x.requires_grad:
            import time
            x.register_hook(lambda g: time.sleep(0.004))
        return x


def _tied_lm():
    vocab, dim = 50, 16
    model = nn.Sequential(nn.Embedding(vocab, dim), Delay(), nn.Linear(dim, dim), nn.Tanh(),
                          Delay(), nn.Linear(dim, vocab, bias=False))
    model[5].weight = model[0].weight
    return model


def test_tied_gradients_are_bitwise_identical_whatever_the_thread_timing():
    torch.manual_seed(0)
    model = _tied_lm()
    x, y = torch.randint(0, 50, (64,)), torch.randint(0, 50, (64,))
    pipe = fastpipe.Pipe(model, chunks=16, balance=[2, 2, 2], devices=["cpu"] * 3,
                         schedule="1f1b", checkpoint="never", cpu_workers=3)
    results = []
    for slow in [None, 1, 4, None]:
        for i in (1, 4):
            model[i].slow = i == slow
        pipe.zero_grad(set_to_none=True)
        pipe.train_step(x, y, nn.functional.cross_entropy)
        results.append(model[0].weight.grad.clone())
    for grad in results[1:]:
        assert torch.equal(grad, results[0])
    plain = copy.deepcopy(model)
    _, expected = reference(plain, x, y, nn.functional.cross_entropy)
    assert_same_grads(grads_of(model), expected)


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev", "ZBV"])
def test_v_shaped_schedules_infer_two_virtual_stages(schedule):
    model = mlp(depth=8)
    plain = copy.deepcopy(model)
    pipe = fastpipe.Pipe(model, chunks=4, devices=["cpu"] * 2, schedule=schedule)
    assert pipe.virtual_stages == 2 and len(pipe.balance) == 4
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    expected_loss, expected = reference(plain, x, y, nn.MSELoss())
    torch.testing.assert_close(pipe.train_step(x, y, nn.MSELoss()), expected_loss)
    assert_same_grads(grads_of(model), expected)
    with pytest.raises(ValueError, match="must be 2, got 3"):  # an explicit count is checked
        fastpipe.Pipe(mlp(depth=8), chunks=4, devices=["cpu"] * 2, schedule=schedule,
                      virtual_stages=3)
    assert fastpipe.Pipe(mlp(depth=8), devices=["cpu"] * 2).virtual_stages == 1


def test_balance_helpers_profile_models_with_skip_connections():
    ns = Namespace()
    model = nn.Sequential(Layer1(), Stash().isolate(ns), nn.Linear(8, 8), PopAdd().isolate(ns),
                          Layer3())
    x = torch.randn(8, 8)
    assert sum(balance_by_time(2, model, x, timeout=0.1, device="cpu")) == 5
    assert sum(balance_by_size(2, model, x, chunks=2, device="cpu")) == 5
    assert sum(fastpipe.balance.by_size(2, model, x)) == 5
    torch.testing.assert_close(model(x), copy.deepcopy(model)(x))  # unsplit runs still pair up
