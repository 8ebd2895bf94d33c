"""The Lightning runs the integration's tests compare: the same ``LightningModule`` and data
under Lightning's own single-process strategy and under ``PipelineStrategy``.

Three modules (an MLP on a loss function, a tiny random-init Llama on its own loss, the same
Llama with LoRA adapters, its base frozen) train for two epochs with
``accumulate_grad_batches=2``, ``gradient_clip_val`` (SGD with momentum: Adam would hide a
gradient's scale), a step-wise learning-rate schedule, a validation loop and a
``ModelCheckpoint`` every epoch (``last.ckpt`` too, replaced each time); a second run
resumes from the first epoch's checkpoint. Every rank writes what it logged and its weights.

Run under torchrun for the distributed layouts:
``torchrun --nproc_per_node=N lightning_cases.py OUT DATA_PARALLEL``.
"""
from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning.pytorch as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import Logger

from fastpipe.integrations.lightning import PipelineStrategy, evaluate, training_loss

MODELS = ("mlp", "llama", "lora")
GLOBAL_BATCH = 8  # samples per optimizer micro-step, over every replica
EPOCHS = 2
# Between the smallest and the largest gradient norm of each run: some steps clip, others do
# not, so both a wrong clip and a wrongly scaled gradient change the weights.
CLIP = {"mlp": 0.40, "llama": 0.78, "lora": 0.105}


class Recorder(Logger):
    """Every logged row, in order: ``(step, {name: value})``."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: List[Tuple[int, Dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recorder"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: Dict[str, float], step: Optional[int] = None) -> None:
        self.rows.append((step, {k: float(v) for k, v in metrics.items()}))


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 3))


def llama_config() -> Any:
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                       max_position_embeddings=64, use_cache=False)


def llama() -> nn.Module:
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(llama_config())


def lora_llama() -> nn.Module:
    """The Llama with LoRA adapters (r=4) on ``q_proj`` and ``v_proj``, initialised at random
    (both adapter matrices get gradients from the first step); the base weights frozen."""
    import peft
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                             lora_dropout=0.0, init_lora_weights=False)
    return peft.get_peft_model(llama(), config)


class MLPModule(L.LightningModule):
    """A classifier on ``cross_entropy``: the model, its loss function, its metric."""

    def __init__(self) -> None:
        super().__init__()
        self.model = mlp()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = training_loss(self.model, x, y, nn.functional.cross_entropy)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        loss = evaluate(self.model, x, y, nn.functional.cross_entropy)
        self.log("val_loss", loss, sync_dist=True)
        self.log("val_samples", float(len(x)), reduce_fx="sum", sync_dist=True)  # every replica's
        self.log("val_gathered", self.all_gather(torch.tensor(len(x))).sum().float())  # all of them

    def configure_optimizers(self) -> Any:
        return optimizer_and_schedule(self.parameters())


class LlamaModule(L.LightningModule):
    """A causal LM on its own loss (labels in the batch, -100 where not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = llama()

    def training_step(self, batch: Dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = training_loss(self.model, batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", evaluate(self.model, batch), sync_dist=True)

    def configure_optimizers(self) -> Any:
        return optimizer_and_schedule(self.parameters())


class LoraModule(LlamaModule):
    """The Llama fine-tuned through its adapters: the optimizer holds the trained ones only."""

    def __init__(self) -> None:
        L.LightningModule.__init__(self)
        self.model = lora_llama()

    def configure_optimizers(self) -> Any:
        return optimizer_and_schedule(p for p in self.parameters() if p.requires_grad)


def optimizer_and_schedule(parameters: Any) -> Any:
    optimizer = torch.optim.SGD(parameters, lr=0.1, momentum=0.9)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return [optimizer], [{"scheduler": schedule, "interval": "step"}]


def data(name: str) -> Tuple[TensorDataset, TensorDataset]:
    """(training, validation) sets of ``GLOBAL_BATCH`` batches: the MLP's 8 and 4, the
    Llamas' 4 and 2."""
    g = torch.Generator().manual_seed(1)
    if name == "mlp":
        x, y = torch.randn(96, 8, generator=g), torch.randint(0, 3, (96,), generator=g)
        return TensorDataset(x[:64], y[:64]), TensorDataset(x[64:], y[64:])
    ids = torch.randint(0, 64, (48, 10), generator=g)
    labels = ids.clone()
    labels[:32:3, 6:] = -100  # training samples whose last tokens are not counted
    return _Dict(ids[:32], labels[:32]), _Dict(ids[32:], labels[32:])


class _Dict(TensorDataset):
    """Token ids and labels, each sample a dict as a Hugging Face collator gives it."""

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        ids, labels = super().__getitem__(index)
        return {"input_ids": ids, "labels": labels}


def example_batch(name: str) -> Any:
    train, _ = data(name)
    return next(iter(DataLoader(train, batch_size=2)))


def pipe_options(name: str) -> Dict[str, Any]:
    """How each model is cut: the MLP by layer counts, the Llama traced at a block."""
    if name == "mlp":
        return dict(chunks=4, balance=[3, 2], schedule="1f1b", timeout=120)
    split = "model.layers.1" if name == "llama" else "base_model.model.model.layers.1"
    return dict(chunks=2, split_points=[split], example_inputs=example_batch(name),
                schedule="1f1b", timeout=120)


MODULES = {"mlp": MLPModule, "llama": LlamaModule, "lora": LoraModule}


@dataclass
class Run:
    """What one rank of one fit logged, and its weights (its layers' on a DistributedPipe)."""

    rows: List[Tuple[int, Dict[str, float]]]
    weights: Dict[str, torch.Tensor]


def fit(name: str, folder: str, strategy: Any = None, resume: Optional[str] = None,
        devices: int = 1) -> Run:
    """Fit module ``name`` for ``EPOCHS`` epochs, checkpoints into ``folder``; from the
    checkpoint ``resume`` when given."""
    warnings.filterwarnings("ignore", module="lightning")
    module, recorder = MODULES[name](), Recorder()
    trainer = L.Trainer(
        max_epochs=EPOCHS, accelerator="cpu", devices=devices, logger=recorder,
        log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False,
        accumulate_grad_batches=2, gradient_clip_val=CLIP[name], num_sanity_val_steps=1,
        callbacks=[ModelCheckpoint(dirpath=folder, filename="{epoch}", save_top_k=-1,
                                   save_last=True)],
        **({"strategy": strategy} if strategy is not None else {}))
    train, valid = data(name)
    shards = trainer.distributed_sampler_kwargs  # None on Lightning's single device
    replicas = shards["num_replicas"] if shards else 1
    sampler = DistributedSampler(train, shuffle=False, **shards) if shards else None
    trainer.fit(module, DataLoader(train, batch_size=GLOBAL_BATCH // replicas, sampler=sampler),
                DataLoader(valid, batch_size=GLOBAL_BATCH // replicas), ckpt_path=resume)
    weights = {k: v.detach().clone() for k, v in module.model.state_dict().items()}
    return Run(recorder.rows, weights)


def checkpoint_path(folder: str, epoch: int) -> str:
    return os.path.join(folder, f"epoch={epoch}.ckpt")


def fit_and_resume(name: str, out: str, strategy: Any, devices: int = 1) -> Tuple[Run, Run]:
    """The uninterrupted run, then one resumed from its first epoch's checkpoint."""
    whole = fit(name, os.path.join(out, f"{name}-whole"), strategy(), devices=devices)
    resumed = fit(name, os.path.join(out, f"{name}-resumed"), strategy(), devices=devices,
                  resume=checkpoint_path(os.path.join(out, f"{name}-whole"), 0))
    return whole, resumed


class FailingMetric(MLPModule):
    """A validation metric that raises where it runs: on the last stage's rank."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        def metric(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            raise ValueError("a metric that fails")
        x, y = batch
        self.log("val", evaluate(self.model, x, y, metric))


def failing_metric(world: int, data_parallel_size: int) -> str:
    """What ``trainer.validate`` raises on this rank when the metric fails on another."""
    strategy = PipelineStrategy(data_parallel_size=data_parallel_size, **pipe_options("mlp"))
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, logger=False,
                        enable_progress_bar=False, enable_model_summary=False)
    try:
        trainer.validate(FailingMetric(), DataLoader(data("mlp")[1], batch_size=4))
    except (ValueError, RuntimeError) as error:
        return f"{type(error).__name__}: {error}"
    return "nothing raised"


def distributed(out: str, data_parallel_size: int) -> None:
    """Every model's runs on this rank (under torchrun), each rank's results in ``out``."""
    import torch.distributed as dist
    torch.set_num_threads(1)
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    for name in MODELS:
        def strategy(name: str = name) -> PipelineStrategy:
            return PipelineStrategy(data_parallel_size=data_parallel_size, **pipe_options(name))
        whole, resumed = fit_and_resume(name, out, strategy, devices=world)
        torch.save({"whole": whole.__dict__, "resumed": resumed.__dict__},
                   os.path.join(out, f"{name}-rank{rank}.pt"))
    with open(os.path.join(out, f"failure-rank{rank}.txt"), "w") as file:
        file.write(failing_metric(world, data_parallel_size))
    dist.destroy_process_group()


if __name__ == "__main__":
    distributed(sys.argv[1], int(sys.argv[2]))
