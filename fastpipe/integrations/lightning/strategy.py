"""``PipelineStrategy``: Lightning's ``Trainer`` trains a ``LightningModule``'s model through a
pipeline, with Lightning's own loop, logging, clipping, accumulation, schedulers and
checkpoints.

The module hands over its model as an attribute (``self.model``), and its ``training_step``
and ``validation_step`` compute through ``training_loss`` and ``evaluate``
(:mod:`fastpipe.integrations.lightning.steps`). At ``setup`` the strategy builds a ``Pipe``
(every stage in this process, ``stage_devices``) or a ``DistributedPipe`` (one rank per stage
and replica, the ranks launched by ``torchrun`` or another launcher that starts every process,
as Lightning's ``Trainer(devices=..., num_nodes=...)`` says); Lightning's hooks then map onto
the pipe: the batch's loss and gradients come from ``train_step`` inside ``training_step``, and
Lightning's backward places them (:mod:`.window`); ``accumulate_grad_batches`` runs the
window's earlier batches inside ``pipe.no_sync()``; ``gradient_clip_val`` clips by the whole
model's norm (:mod:`.precision`). The strategy's ranks and groups are :mod:`.launch`'s, its
collectives :mod:`.ranks`' (logged values reduced over the data-parallel replicas), its
checkpoints :mod:`.checkpoints`' (a ``DistributedPipe``'s: ``fastpipe.checkpoint``
directories). What it cannot honour raises when the strategy or the ``Trainer`` is
built, or when ``fit`` connects the module, naming the option.
"""
from __future__ import annotations

import contextlib
import datetime
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from ...model_call import as_call
from . import options, ranks, steps
from .checkpoints import Checkpointing
from .launch import Launch
from .precision import PipelinePrecision
from .ranks import Collectives
from .window import GradientWindow


@dataclass
class _Step:
    """One ``training_step`` under the strategy: where its batch sits in the accumulation
    window, and the loss ``training_loss`` computed (once)."""

    first: bool
    accumulating: bool
    loss: Optional[torch.Tensor] = None


class PipelineStrategy(Launch, Collectives, Checkpointing, ParallelStrategy):
    """Lightning's ``Trainer`` on a fastpipe pipeline.

    Args:
        stage_devices: the stages' devices (``['cuda:0', 'cuda:1']``, ``['cpu', 'cpu']``):
            every stage in this process (a ``Pipe``; ``Trainer(devices=1)``). Without it, one
            rank per stage (a ``DistributedPipe``), ``Trainer(devices=N, num_nodes=M)``
            processes launched by ``torchrun``.
        data_parallel_size: replicas of the pipeline (ranks ``r`` with the same ``r %
            data_parallel_size`` form one); each reads its own shard of the data, every rank
            of a replica the same batches.
        attribute: the ``LightningModule``'s attribute that holds the model (``'model'``).
        process_group_backend: the process group's backend (default: gloo on CPUs, torch's
            default on GPUs); process_group_timeout: a ``datetime.timedelta`` bounding
            Lightning's own collectives (default 30 minutes).
        pipe_options: the front door's arguments (``chunks``, ``schedule``, ``split_points``,
            ``layout``, ``balance``, ``checkpoint``, ``example_inputs``, ``output_reduction``,
            ``timeout``, ...); a traced model without ``example_inputs`` is traced on the
            module's ``example_input_array``.
    """

    def __init__(self, *, stage_devices: Optional[List[Any]] = None, data_parallel_size: int = 1,
                 attribute: str = "model", process_group_backend: Optional[str] = None,
                 process_group_timeout: Optional[datetime.timedelta] = None,
                 cluster_environment: Optional[ClusterEnvironment] = None,
                 checkpoint_io: Optional[CheckpointIO] = None, **pipe_options: Any) -> None:
        self._options = options.check(stage_devices, data_parallel_size, attribute,
                                      pipe_options)
        if process_group_timeout is not None and \
                not isinstance(process_group_timeout, datetime.timedelta):
            raise TypeError(f"process_group_timeout must be a datetime.timedelta, got "
                            f"{type(process_group_timeout).__name__}")
        super().__init__(cluster_environment=cluster_environment, checkpoint_io=checkpoint_io)
        self._num_nodes = 1
        self._backend = process_group_backend
        self._pg_timeout = process_group_timeout or datetime.timedelta(minutes=30)
        self._pipe: Any = None
        self._mesh: Any = None
        self._pipeline_group: Any = None
        self._data_group: Any = None
        self._last_rank: Optional[int] = None
        self._window: Optional[GradientWindow] = None
        self._step: Optional[_Step] = None  # during training_step
        self._stepped: Optional[_Step] = None  # until its backward
        self._accumulating = False  # inside block_backward_sync

    # ---------------------------------------------------------------- what the pipe is
    @property
    def pipe(self) -> Any:
        """The pipe built at ``setup`` (a ``Pipe`` or this rank's ``DistributedPipe``)."""
        if self._pipe is None:
            raise RuntimeError("PipelineStrategy builds its pipe when the Trainer sets up "
                               "(fit, validate, test); it has none yet")
        return self._pipe

    @property
    def precision_plugin(self) -> Precision:
        plugin = self.__dict__.get("_pipeline_precision")
        if plugin is None:
            plugin = self._pipeline_precision = PipelinePrecision(lambda: self.pipe)
        return plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        if isinstance(plugin, PipelinePrecision):
            self._pipeline_precision = plugin
        elif plugin is not None and type(plugin) is not Precision:
            raise ValueError(f"PipelineStrategy trains in fp32: Trainer(precision=...) or "
                             f"plugins=[...] gave {type(plugin).__name__}; use "
                             f"precision='32-true' (the default)")

    def model_to_device(self) -> None:
        """Once the pipe is built: a ``DistributedPipe`` rank's module goes to the rank's device,
        as DDP moves it (its model holds this rank's layers, there already); with
        ``stage_devices`` nothing moves, the pipe placed each stage."""
        module = self.lightning_module
        if not self._options.in_process and module is not None:
            module.to(self.root_device)

    # ---------------------------------------------------------------- setting up
    def connect(self, model: "pl.LightningModule") -> None:
        _check_module(model)
        super().connect(model)

    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None
        self._pipeline(module)
        _check_inside(module, self.pipe)
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            _check_optimizers(self.optimizers, self.pipe)
        self.setup_precision_plugin()
        self._window = GradientWindow(self.pipe.parameters())

    def _pipeline(self, module: "pl.LightningModule") -> None:
        """Build the pipe over the module's model (once; a later setup reuses it). A
        ``DistributedPipe``'s module keeps this rank's layers only, under their names."""
        name = self._options.attribute
        model = getattr(module, name, None)
        if not isinstance(model, nn.Module):
            raise TypeError(f"PipelineStrategy pipelines the LightningModule's {name!r} "
                            f"attribute (attribute=...), but {type(module).__name__}.{name} is "
                            f"{type(model).__name__}: assign the model to self.{name} in "
                            f"__init__ or configure_model")
        runner = steps.runner_of(model)
        if runner is self:
            return
        if runner is not None:
            raise ValueError(f"{type(module).__name__}.{name} is already pipelined by another "
                             f"PipelineStrategy: reuse that Trainer, or build a new module")
        example = options.example_inputs_for(self._options, model, module)
        pipe = options.build(self._options, model, example, device=self.root_device,
                             mesh=self._mesh)
        if not self._options.in_process:
            setattr(module, name, pipe.module)
        self._pipe = pipe
        steps.bind(pipe.module, self)
        if not self._options.in_process:
            self._last_rank = ranks.last_stage_rank(pipe, self._pipeline_group)

    # ---------------------------------------------------------------- training
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """The module's ``training_step``, in which ``training_loss`` runs the pipe's step;
        checked to return that loss, whose gradients Lightning's backward then places."""
        module = self.lightning_module
        assert module is not None
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        first = batch_idx % module.trainer.accumulate_grad_batches == 0
        self._step = _Step(first=first, accumulating=self._accumulating)
        try:
            with self.precision_plugin.train_step_context():
                output = module.training_step(*args, **kwargs)
            step = self._step
        finally:
            self._step = None
        self._check_output(step, output)
        self._stepped = step
        return output

    def run_training(self, inputs: Any, targets: Any,
                     loss_fn: Optional[Callable[..., Any]]) -> torch.Tensor:
        """``training_loss`` under the strategy: the pipe's step on the whole batch."""
        step = self._step
        if step is None:
            raise RuntimeError("training_loss(...) runs the pipeline's training step: call it "
                               "inside training_step, under Trainer.fit")
        if step.loss is not None:
            raise RuntimeError("training_loss(...) was called twice in one training_step: one "
                               "call computes the batch's loss and its gradients")
        assert self._window is not None
        self._window.before_step(step.first)
        try:
            step.loss = self.pipe.train_step(inputs, targets, loss_fn)
        finally:
            self._window.after_step(step.first)
        return step.loss

    def _check_output(self, step: _Step, output: Any) -> None:
        if step.loss is None:
            raise RuntimeError("training_step did not call training_loss(...): under "
                               "PipelineStrategy a batch's loss and gradients come from the "
                               "pipeline; compute the loss with fastpipe.integrations.lightning."
                               "training_loss(self.model, inputs, targets, loss_fn)")
        returned = output.get("loss") if isinstance(output, Mapping) else output
        if returned is not step.loss:
            assert self._window is not None
            self._window.discard()
            raise RuntimeError("training_step must return the loss training_loss(...) returned "
                               "(or a dict holding it under 'loss'): the pipeline computed the "
                               "gradients of that loss, no other")

    def backward(self, closure_loss: torch.Tensor, optimizer: Optional[Any], *args: Any,
                 **kwargs: Any) -> torch.Tensor:
        """Lightning's backward of a batch, its hooks included: the gradients the pipe computed
        in ``training_step`` go where ``loss.backward()`` would have put them."""
        module = self.lightning_module
        assert module is not None and self._window is not None
        step, self._stepped = self._stepped, None
        if step is None:
            raise RuntimeError("PipelineStrategy's backward runs after training_step only "
                               "(manual backward is not supported)")
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self._window.backward(step.first, not step.accumulating,
                              module.trainer.accumulate_grad_batches)
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """The batches of an accumulation window before its last: the pipe's ``no_sync()``
        (data-parallel and tied-weight syncs wait for the window's last batch)."""
        self._accumulating = True
        try:
            with self.pipe.no_sync():
                yield
        finally:
            self._accumulating = False

    # ---------------------------------------------------------------- evaluation
    def run_evaluation(self, inputs: Any, targets: Any,
                       metric_fn: Optional[Callable[..., Any]]) -> Any:
        """``evaluate`` under the strategy: the pipe's eval-mode forward of the batch, the
        value computed where the output is and handed to every rank of the pipeline."""
        call = as_call(inputs)
        output = self.pipe.evaluate(*call.args, **call.kwargs)
        if self._options.in_process:
            return steps.value_of(output, targets, metric_fn)
        assert self._last_rank is not None
        return ranks.share(self.pipe, self._pipeline_group, self._last_rank,
                           lambda: steps.value_of(output, targets, metric_fn))

    def teardown(self) -> None:
        """Lightning's teardown, without moving the module to the CPU: the stages stay on
        their devices, and the pipe stays usable for a later ``validate`` or ``test``."""
        self._step = self._stepped = None
        self.precision_plugin.teardown()
        if self.accelerator is not None:
            self.accelerator.teardown()
        self.checkpoint_io.teardown()
        if self.cluster_environment is not None:
            self.cluster_environment.teardown()


def _check_module(module: "pl.LightningModule") -> None:
    """What a module may not ask of the strategy, before any work."""
    if not module.automatic_optimization:
        raise NotImplementedError("PipelineStrategy runs Lightning's automatic optimization "
                                  "only; set automatic_optimization = True")
    if type(module).backward is not pl.LightningModule.backward:
        raise NotImplementedError(f"{type(module).__name__}.backward is overridden: under "
                                  f"PipelineStrategy the pipeline computes the gradients in "
                                  f"training_step, so the override would never run")


def _check_inside(module: "pl.LightningModule", pipe: Any) -> None:
    inside = {id(p) for p in pipe.parameters()}
    outside = [name for name, p in module.named_parameters() if id(p) not in inside]
    if outside:
        raise ValueError(f"{type(module).__name__} has parameters outside the pipelined "
                         f"model, e.g. {outside[:3]}: the pipeline would never train them; put "
                         f"every trained layer in the model")


def _check_optimizers(optimizers: List[Any], pipe: Any) -> None:
    if len(optimizers) > 1:
        raise NotImplementedError(f"configure_optimizers gave {len(optimizers)} optimizers: "
                                  f"PipelineStrategy steps one")
    inside = {id(p) for p in pipe.parameters()}
    for optimizer in optimizers:
        if any(id(p) not in inside for g in optimizer.param_groups for p in g["params"]):
            raise ValueError("the optimizer holds parameters that are not the pipelined "
                             "model's: build it on self.parameters() or "
                             "self.model.parameters() in configure_optimizers")
