"""Deferred batch norm: mini-batch running statistics, per-micro-batch normalisation."""
import copy

import pytest
import torch
from torch import nn

import fastpipe
from fastpipe.policies.batchnorm import DeferredNorms

from helpers import assert_same_grads, grads_of


def bn1d_model(momentum=0.1) -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8, momentum=momentum), nn.ReLU(),
                         nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def bn2d_model(momentum=0.1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(),
                         nn.BatchNorm2d(4, momentum=momentum), nn.Conv2d(4, 4, 3, padding=1),
                         nn.Flatten(), nn.Linear(4 * 5 * 5, 3))


def assert_same_buffers(pipe_module: nn.Module, plain: nn.Module) -> None:
    actual, expected = dict(pipe_module.named_buffers()), dict(plain.named_buffers())
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"buffer {name}: {m}")


def train(model, pipe, batches, loss_fn=nn.functional.cross_entropy):
    for x, y in batches:
        model.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        pipe.zero_grad(set_to_none=True)
        pipe.train_step(x, y, loss_fn)


@pytest.mark.parametrize("factory,shape", [(bn1d_model, (11, 6)), (bn2d_model, (10, 3, 5, 5))],
                         ids=["bn1d", "bn2d"])
@pytest.mark.parametrize("momentum", [0.1, None], ids=["ema", "cumulative"])
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_running_stats_equal_plain_model(factory, shape, momentum, checkpoint):
    model = factory(momentum)
    pipe = fastpipe.Pipe(copy.deepcopy(model), chunks=4, balance=[2, len(model) - 2],
                         devices=["cpu", "cpu"], checkpoint=checkpoint, schedule="1f1b",
                         deferred_batch_norm=True)
    batches = [(torch.randn(*shape) * (k + 1) + k, torch.randint(0, 3, (shape[0],)))
               for k in range(3)]  # uneven micro-batches: 3, 3, 3, 2 (or 1)
    train(model, pipe, batches)
    assert_same_buffers(pipe.module, model)
    assert int(pipe.module.state_dict()[_bn_key(model)]) == 3  # num_batches_tracked


def _bn_key(model: nn.Sequential) -> str:
    index = next(i for i, m in enumerate(model) if isinstance(m, nn.modules.batchnorm._BatchNorm))
    return f"{index}.num_batches_tracked"


def test_without_deferral_running_stats_follow_micro_batches():
    """The control: without deferral the buffers are updated per micro-batch (and differ)."""
    model = bn1d_model()
    pipe = fastpipe.Pipe(copy.deepcopy(model), chunks=4, balance=[3, 3], devices=["cpu", "cpu"])
    train(model, pipe, [(torch.randn(12, 6) + 1, torch.randint(0, 3, (12,)))])
    assert int(pipe.module[1].num_batches_tracked) == 4
    assert not torch.allclose(pipe.module[1].running_var, model[1].running_var)


def test_gradients_use_micro_batch_statistics():
    """Normalisation stays per micro-batch: gradients equal the plain model run micro-batch by
    micro-batch (torchgpipe's semantics), and each step is exact in that sense."""
    model = bn1d_model()
    pipe = fastpipe.Pipe(copy.deepcopy(model), chunks=3, balance=[2, 4], devices=["cpu", "cpu"],
                         deferred_batch_norm=True)
    x, y = torch.randn(9, 6), torch.randint(0, 3, (9,))
    pipe.train_step(x, y, nn.functional.cross_entropy)
    for xs, ys in zip(x.split(3), y.split(3)):
        (nn.functional.cross_entropy(model(xs), ys) / 3).backward()
    assert_same_grads(grads_of(pipe.module), grads_of(model))


def test_state_dict_keys_unchanged():
    model = bn2d_model()
    pipe = fastpipe.Pipe(copy.deepcopy(model), chunks=2, balance=[3, 3], devices=["cpu", "cpu"],
                         deferred_batch_norm=True)
    pipe.train_step(torch.randn(4, 3, 5, 5), torch.randint(0, 3, (4,)),
                    nn.functional.cross_entropy)
    assert list(pipe.state_dict()) == list(model.state_dict())


def test_second_batch_norm_close_first_exact():
    """A batch norm fed by an earlier one sees per-micro-batch normalised inputs, so only the
    first matches the plain model exactly."""
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 6), nn.BatchNorm1d(6),
                          nn.Linear(6, 2))
    pipe = fastpipe.Pipe(copy.deepcopy(model), chunks=2, balance=[2, 3], devices=["cpu", "cpu"],
                         deferred_batch_norm=True)
    train(model, pipe, [(torch.randn(8, 4) * 3 + 2, torch.randint(0, 2, (8,)))])
    torch.testing.assert_close(pipe.module[1].running_mean, model[1].running_mean)
    torch.testing.assert_close(pipe.module[1].running_var, model[1].running_var)
    assert int(pipe.module[3].num_batches_tracked) == 1


def test_training_forward_commits_once():
    """``pipe(x)`` in training mode (torchgpipe style) also updates once per mini-batch."""
    model = bn1d_model()
    pipe = fastpipe.Pipe(copy.deepcopy(model), chunks=4, balance=[2, 4], devices=["cpu", "cpu"],
                         deferred_batch_norm=True)
    x = torch.randn(11, 6) * 2 + 1
    model(x).sum().backward()
    pipe(x).sum().backward()  # checkpointed micro-batches recompute in backward: no recount
    assert_same_buffers(pipe.module, model)


def test_failed_step_leaves_buffers():
    model = bn1d_model()
    pipe = fastpipe.Pipe(copy.deepcopy(model), chunks=2, balance=[2, 4], devices=["cpu", "cpu"],
                         deferred_batch_norm=True)
    before = copy.deepcopy(pipe.module.state_dict())

    def bad_loss(out, target):
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        pipe.train_step(torch.randn(4, 6), torch.randint(0, 3, (4,)), bad_loss)
    for name, value in pipe.module.state_dict().items():
        assert torch.equal(value, before[name]), name
    x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))
    pipe.train_step(x, y, nn.functional.cross_entropy)  # the failed step's stats are dropped
    model(x)
    assert_same_buffers(pipe.module, model)


def test_eval_mode_uses_running_stats_and_records_nothing():
    norms = DeferredNorms(bn1d_model().eval())
    with norms.deferring():
        pass
    norms.commit()
    assert int(norms.norms[0].num_batches_tracked) == 0


def test_deferred_flag_is_checked():
    with pytest.raises(TypeError, match="deferred_batch_norm must be True or False"):
        fastpipe.Pipe(bn1d_model(), chunks=2, balance=[3, 3], devices=["cpu", "cpu"],
                      deferred_batch_norm="yes")
