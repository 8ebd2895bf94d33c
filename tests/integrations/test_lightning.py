"""``fastpipe.integrations.lightning`` in one process: Lightning's ``Trainer`` with
``PipelineStrategy`` on a ``Pipe`` of 2 CPU stages equals Lightning's own run of the same module
and data (an MLP, a Llama, the Llama with LoRA adapters: every logged training loss and
validation metric, the final weights, a resumed run equal to the uninterrupted one); what the
strategy cannot honour raises before any work; the gradient window and the evaluation's
encoding on their own."""
from __future__ import annotations

import importlib
import sys

import pytest
import torch
from torch import nn

pytest.importorskip("lightning", reason="needs Lightning (pip install 'fastpipe[lightning]')")

import lightning.pytorch as L  # noqa: E402

from fastpipe.integrations.lightning import PipelineStrategy, evaluate, training_loss  # noqa: E402
from fastpipe.integrations.lightning import ranks  # noqa: E402
from fastpipe.integrations.lightning.window import GradientWindow  # noqa: E402
from lightning_cases import (MODELS, MODULES, MLPModule, checkpoint_path, fit,  # noqa: E402
                             fit_and_resume, pipe_options)
from lightning_compare import (after_epoch, assert_rows_close, assert_weights_close,  # noqa: E402
                               assert_weights_equal)

_REFERENCE: dict = {}


def reference(name: str, tmp_path_factory: pytest.TempPathFactory):
    """Lightning's own single-process run of module ``name`` (computed once per session)."""
    if name not in _REFERENCE:
        _REFERENCE[name] = fit(name, str(tmp_path_factory.mktemp(f"{name}-plain")))
    return _REFERENCE[name]


def pipe_strategy(name: str) -> PipelineStrategy:
    return PipelineStrategy(stage_devices=["cpu", "cpu"], **pipe_options(name))


@pytest.mark.parametrize("name", MODELS)
def test_a_pipe_under_lightning_equals_lightnings_own_run(name, tmp_path, tmp_path_factory):
    if name != "mlp":
        pytest.importorskip("transformers", reason="needs transformers (the Llama)")
    if name == "lora":
        pytest.importorskip("peft", reason="needs peft (the LoRA adapters)")
    plain = reference(name, tmp_path_factory)
    whole, resumed = fit_and_resume(name, str(tmp_path), lambda: pipe_strategy(name))
    assert any("val_loss" in m for _, m in plain.rows), "the validation loop logged nothing"
    assert_rows_close(whole.rows, plain.rows, f"{name} on a Pipe")
    assert_weights_close(whole.weights, plain.weights, f"{name} on a Pipe")
    assert_rows_close(resumed.rows, after_epoch(whole.rows, 1), f"{name} resumed", tol=0.0)
    assert_weights_equal(resumed.weights, whole.weights, f"{name} resumed")
    saved = torch.load(checkpoint_path(str(tmp_path / f"{name}-whole"), 0), weights_only=False)
    MODULES[name]().load_state_dict(saved["state_dict"])  # Lightning's own file, plain names
    assert (tmp_path / f"{name}-whole" / "last.ckpt").is_file()


# ------------------------------------------------------------------ refused before any work
@pytest.mark.parametrize("kwargs, error, match", [
    (dict(devices=["cpu"]), TypeError, "stage_devices"),
    (dict(process_group=None), TypeError, "data_parallel_size"),
    (dict(mesh=None), TypeError, "data_parallel_size"),
    (dict(tensor_parallel={}), NotImplementedError, "tensor parallelism"),
    (dict(data_parallel="fsdp"), NotImplementedError, "sharded"),
    (dict(schedule="pipedream"), NotImplementedError, "pipedream"),
    (dict(chunk=4), TypeError, "unknown argument 'chunk'"),
    (dict(data_parallel_size=0), ValueError, "data_parallel_size"),
    (dict(attribute="my model"), TypeError, "attribute"),
    (dict(stage_devices="cpu"), TypeError, "stage_devices"),
    (dict(stage_devices=["cpu"], data_parallel_size=2), ValueError, "data_parallel_size=2"),
    (dict(stage_devices=["cpu"], cpu_workers=1, p2p="tagged"), TypeError, "unknown argument 'p2p'"),
    (dict(process_group_timeout=30), TypeError, "timedelta"),
])
def test_the_strategy_refuses_what_it_cannot_honour(kwargs, error, match):
    with pytest.raises(error, match=match):
        PipelineStrategy(**kwargs)


def quiet_trainer(strategy: PipelineStrategy, **kwargs) -> L.Trainer:
    kwargs.setdefault("devices", 1)
    return L.Trainer(accelerator="cpu", strategy=strategy, logger=False,
                     enable_progress_bar=False, enable_model_summary=False,
                     enable_checkpointing=False, **kwargs)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(precision="bf16-mixed"), ValueError, "precision='32-true'"),
    (dict(precision="64-true"), ValueError, "precision='32-true'"),
    (dict(sync_batchnorm=True), ValueError, "sync_batchnorm"),
    (dict(devices=2), ValueError, "Trainer\\(devices=1\\)"),
])
def test_the_trainer_refuses_what_the_strategy_cannot_honour(kwargs, error, match):
    with pytest.raises(error, match=match):
        quiet_trainer(pipe_strategy("mlp"), **kwargs)


def test_several_ranks_need_a_launcher_that_starts_them(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="torchrun --nproc_per_node=2"):
        quiet_trainer(PipelineStrategy(chunks=2), devices=2)


class Manual(MLPModule):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False


class OwnBackward(MLPModule):
    def backward(self, loss, *args, **kwargs):
        loss.backward()


class PlainStep(MLPModule):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.model(x), y)


class OtherLoss(MLPModule):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return 2 * training_loss(self.model, x, y, nn.functional.cross_entropy)


class TwoCalls(MLPModule):
    def training_step(self, batch, batch_idx):
        x, y = batch
        training_loss(self.model, x, y, nn.functional.cross_entropy)
        return training_loss(self.model, x, y, nn.functional.cross_entropy)


class ExtraLayer(MLPModule):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(3, 3)


class ForeignOptimizer(MLPModule):
    def configure_optimizers(self):
        return torch.optim.SGD(list(self.parameters()) + [nn.Parameter(torch.zeros(2))], lr=0.1)


class NoModel(MLPModule):
    def __init__(self):
        super().__init__()
        self.net = self.model
        del self.model


@pytest.mark.parametrize("module, error, match", [
    (Manual, NotImplementedError, "automatic optimization"),
    (OwnBackward, NotImplementedError, "backward is overridden"),
    (PlainStep, RuntimeError, "did not call training_loss"),
    (OtherLoss, RuntimeError, "must return the loss training_loss"),
    (TwoCalls, RuntimeError, "called twice"),
    (ExtraLayer, ValueError, "outside the pipelined model.*head.weight"),
    (ForeignOptimizer, ValueError, "not the pipelined model's"),
    (NoModel, TypeError, "'model' attribute"),
])
def test_a_module_outside_the_contract_is_refused_before_it_trains(module, error, match):
    torch.manual_seed(0)
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    lit = module()
    before = {k: v.clone() for k, v in lit.state_dict().items()}
    with pytest.raises(error, match=match):
        quiet_trainer(pipe_strategy("mlp"), max_steps=2).fit(lit, loader)
    for k, v in lit.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed before the error"


def test_without_lightning_the_import_names_the_extra(monkeypatch):
    for name in [m for m in sys.modules if m.startswith("fastpipe.integrations.lightning")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "lightning", None)
    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)
    with pytest.raises(ImportError, match=r"pip install 'fastpipe\[lightning\]'"):
        importlib.import_module("fastpipe.integrations.lightning")


# ------------------------------------------------------------------ a traced model's example
class Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4))
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class TracedModule(MLPModule):
    def __init__(self):
        super().__init__()
        self.model = Blocks()
        self.example_input_array = torch.randn(4, 8)


def test_a_traced_model_is_traced_on_the_modules_example_input_array():
    torch.manual_seed(3)
    x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    weights = []
    for strategy in (None, PipelineStrategy(stage_devices=["cpu", "cpu"], chunks=2,
                                            split_points=["blocks.2"])):
        lit = TracedModule()
        kwargs = dict(strategy=strategy) if strategy is not None else {}
        L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False,
                  enable_progress_bar=False, enable_model_summary=False,
                  enable_checkpointing=False, **kwargs).fit(lit, loader)
        weights.append(lit.model.state_dict())
    assert_weights_close(weights[1], weights[0], "traced on example_input_array")


def test_evaluate_and_training_loss_run_the_model_as_it_is_without_the_strategy():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    expected = nn.functional.mse_loss(model(x), y)
    assert torch.equal(training_loss(model, x, y, nn.functional.mse_loss), expected)
    assert torch.equal(evaluate(model, x, y, nn.functional.mse_loss), expected)
    pair = training_loss(model, x, y, lambda out, t: (((out - t) ** 2).sum(), t.numel()))
    torch.testing.assert_close(pair, expected)
    with pytest.raises(TypeError, match="targets given without loss_fn"):
        training_loss(model, x, y)
    dropping = nn.Sequential(nn.Dropout(0.5), model).train()
    value = evaluate(dropping, x, y, nn.functional.mse_loss)  # eval mode: no dropout
    assert torch.equal(value, expected) and not value.requires_grad and dropping.training
    with pytest.raises(TypeError, match="loss_fn must be a function"):
        training_loss(model, x, y, "mse")


# ------------------------------------------------------------------ the gradient window
def lightning_window(batches, accumulate, zero):
    """Lightning's own order on one parameter: per batch, training_step (the forward), then on
    a window's first batch the zeroing, then backward of loss / accumulate."""
    w = nn.Parameter(torch.tensor([1.0, -2.0, 0.5]))
    w.grad = torch.full((3,), 7.0)  # the previous window's
    for i, x in enumerate(batches):
        loss = (w * x).sum() ** 2
        if i % accumulate == 0:
            zero(w)
        (loss / accumulate).backward()
    return w.grad


def pipelined_window(batches, accumulate, zero):
    """The same through the window: the pipe's step inside training_step, then the zeroing,
    then the strategy's backward."""
    w = nn.Parameter(torch.tensor([1.0, -2.0, 0.5]))
    w.grad = torch.full((3,), 7.0)
    window = GradientWindow([w])
    for i, x in enumerate(batches):
        first, last = i % accumulate == 0, (i + 1) % accumulate == 0 or i == len(batches) - 1
        window.before_step(first)
        ((w * x).sum() ** 2).backward()  # what the pipe's train_step adds
        window.after_step(first)
        if first:
            zero(w)
        window.backward(first, last, accumulate)
    return w.grad


def to_none(w):
    w.grad = None


def to_zeros(w):
    w.grad.zero_()


def keep(w):
    pass


@pytest.mark.parametrize("accumulate, count", [(1, 2), (2, 4), (2, 3), (3, 3)])
@pytest.mark.parametrize("zero", [to_none, to_zeros, keep])
def test_the_window_gives_lightnings_accumulated_gradients(accumulate, count, zero):
    g = torch.Generator().manual_seed(accumulate * 10 + count)
    batches = [torch.randn(3, generator=g) for _ in range(count)]
    expected = lightning_window(batches, accumulate, zero)
    got = pipelined_window(batches, accumulate, zero)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------ an evaluation's value
def test_an_evaluations_value_travels_as_data():
    value = {"loss": torch.tensor(0.25), "acc": 0.75, "per_class": [torch.arange(3.0), 2],
             "flags": torch.tensor([True, False])}
    meta, payload = ranks.encode(value)
    back = ranks.decode(meta, payload, torch.device("cpu"))
    assert back["acc"] == 0.75 and back["per_class"][1] == 2
    assert torch.equal(back["loss"], value["loss"]) and back["loss"].dtype == torch.float32
    assert torch.equal(back["per_class"][0], value["per_class"][0])
    assert torch.equal(back["flags"], value["flags"])
    assert b"pickle" not in meta and meta.decode("utf-8").startswith("{")
    with pytest.raises(TypeError, match="metric_fn returned a str"):
        ranks.encode({"name": "accuracy"})

