"""``PipelineTrainer``: Hugging Face's ``Trainer`` training its model as a pipe.

``PipelineTrainerMixin`` goes first in the bases of any ``Trainer`` subclass (TRL's
``SFTTrainer``: ``class PipelineSFTTrainer(PipelineTrainerMixin, SFTTrainer)``); the
``Trainer``'s own loop stays in charge (epochs, gradient accumulation, clipping, the optimizer
and scheduler steps, logging, evaluation, checkpoints, resuming), and the mixin swaps in the
pipe where the loop touches the model:

- after the ``Trainer`` (and its subclass) built and prepared the model, it is traced and cut
  into a ``Pipe`` (one process) or a ``DistributedPipe`` (``torchrun`` / ``accelerate
  launch``), which becomes ``trainer.model``; the model itself stays ``trainer.plain_model``;
- ``training_step``: one ``pipe.train_step`` on the model's own loss, scaled as the
  ``Trainer`` scales it (``loss.py``); inside an accumulation window Accelerate enters
  ``pipe.no_sync()``, as it enters DDP's;
- clipping and the logged gradient norm: the pipe's global norm, over every stage and rank;
- ``prediction_step``: ``pipe.evaluate``; the last stage's outputs reach its pipeline's other
  ranks, and the metrics are gathered over the replicas (``data.py``);
- data loaders sharded over the pipeline's replicas, not over the processes (``data.py``);
- ``save_model``: the Hugging Face format from every rank's share
  (``fastpipe.checkpoint.save_pretrained``); each checkpoint also holds a ``fastpipe.checkpoint``
  of the model, optimizer and scheduler (``pipeline/``), which resuming loads, at any layout.

The ``Trainer``'s private methods overridden here, each because the installed ``transformers``
(5.x) offers no public hook for it, are named where they are defined: ``_clip_grad_norm``,
``_get_grad_norm``, ``_save_optimizer_and_scheduler``, ``_load_from_checkpoint``,
``_load_optimizer_and_scheduler``; ``_set_signature_columns_if_needed`` is called (its
``_signature_columns`` read) so that the columns kept are the model's, and
``_train_batch_size`` read as ``get_total_train_batch_size`` reads it. Accelerate's model
preparation (which would wrap the pipe in DDP) is skipped through its ``_is_accelerate_prepared``
mark on the pipe; ``sft.py`` writes TRL's ``_metrics`` and ``_total_train_tokens`` as
``SFTTrainer.compute_loss`` writes them. The tests run all of it on the installed versions, and
a ``Trainer`` lacking one of the methods is refused (``HOOKS``).
"""
from __future__ import annotations

import inspect
import os
import shutil
import sys
from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn
from transformers import Trainer
from transformers.trainer_pt_utils import nested_detach

from ...checkpoint import api as checkpoints, hf_format
from ...checkpoint.directory import is_complete
from ...checkpoint.gather import full_state_dict
from ...checkpoint.ranks import Ranks
from . import sft
from .arguments import PipelineArguments
from .build import build, example_batch, world_size
from .data import example_features, metrics_gatherer, replica_loaders
from .loss import LossSemantics, evaluation_scale, micro_step
from .options import UnsupportedTrainerOption, refuse_arguments, refuse_state

PIPELINE_STATE = "pipeline"  # the fastpipe.checkpoint inside each checkpoint-N directory
# the Trainer's methods overridden here, which its loop must call (private ones included)
HOOKS = ("training_step", "get_batch_samples", "_clip_grad_norm", "_get_grad_norm",
         "create_optimizer", "create_scheduler", "get_decay_parameter_names",
         "get_total_train_batch_size", "floating_point_ops", "get_train_dataloader",
         "get_eval_dataloader", "get_test_dataloader", "evaluation_loop", "prediction_step",
         "save_model", "_save_optimizer_and_scheduler", "_load_from_checkpoint",
         "_load_optimizer_and_scheduler", "_set_signature_columns_if_needed")


class PipelineTrainerMixin:
    """Makes a ``Trainer`` (or a subclass, first in its bases) train its model as a pipe.

    ``pipeline``: ``PipelineArguments`` (or a dict of its fields): split points or a layout
    string, chunks, schedule, checkpoint mode, devices (one process) or data-parallel replicas
    (several). Every other argument is the ``Trainer``'s (or its subclass's), with its meaning;
    an option that cannot keep it raises ``UnsupportedTrainerOption`` here.
    """

    def __init__(self, *args: Any, pipeline: Any = None, **kwargs: Any) -> None:
        _check_hooks()
        settings = PipelineArguments.of(pipeline if pipeline is not None else {})
        given = inspect.signature(super().__init__).bind_partial(*args, **kwargs).arguments
        training_args = given.get("args")
        world = training_args.world_size if training_args is not None else world_size()
        ranks = settings.pipeline_ranks(world)
        if training_args is not None:  # before the Trainer touches anything
            refuse_arguments(training_args, given, ranks)
        super().__init__(*args, **kwargs)
        refuse_arguments(self.args, given, ranks)  # as the subclass completed them
        refuse_state(self)
        self._check_optimizer_class()
        self._become_pipe(settings)

    def _become_pipe(self, settings: PipelineArguments) -> None:
        """Trace and cut the model the ``Trainer`` (and its subclass) prepared; the pipe
        becomes ``self.model``, the model ``self.plain_model``."""
        self._set_signature_columns_if_needed()  # from the model's forward, before the swap
        plain = self.model
        example = settings.example_inputs
        if example is None:
            example = self._example_inputs()
        pipe, replicas = build(plain, settings, example, self.args.device)
        _show_model(pipe, plain)
        self.plain_model, self.pipe, self.pipeline_replicas = plain, pipe, replicas
        self._pipeline_loss = LossSemantics(
            accepts_loss_kwargs=bool(self.model_accepts_loss_kwargs),
            scaled_for_ga=getattr(self, "loss_is_scaled_for_ga", None),
            average_tokens=bool(self.args.average_tokens_across_devices),
            replicas=replicas.replicas, evaluation_count=not sft.is_sft(self))
        self._sft_metrics = sft.is_sft(self) and hasattr(self, "_metrics")
        self.model = self.model_wrapped = pipe
        self.callback_handler.model = pipe
        if self.optimizer is not None:
            _check_optimizer(self.optimizer, pipe, "optimizers")

    # ------------------------------------------------------------------ construction helpers
    def _example_inputs(self) -> Any:
        """The first ``per_device_train_batch_size`` examples of the train (else eval)
        dataset, collated as the loaders collate them."""
        dataset = self.train_dataset if self.train_dataset is not None else self.eval_dataset
        if isinstance(dataset, dict):
            dataset = next(iter(dataset.values()), None)
        if dataset is None:
            raise ValueError("a pipelined Trainer traces its model on an example batch: give a "
                             "train_dataset or an eval_dataset, or PipelineArguments("
                             "example_inputs=...)")
        columns = self._signature_columns if self.args.remove_unused_columns else None
        features = example_features(dataset, self.args.per_device_train_batch_size)
        return example_batch(features, self.data_collator, columns)

    def _check_optimizer_class(self) -> None:
        """The optimizer ``optim`` names: one that steps the parameters it is given."""
        if self.optimizer is not None or self.optimizer_cls_and_kwargs is not None:
            return
        cls, options = self.get_optimizer_cls_and_kwargs(self.args, self.model)
        special = sorted({"params", "model", "optimizer_dict"} & set(options))
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)) or special:
            raise UnsupportedTrainerOption(
                f"TrainingArguments.optim={self.args.optim!r} is not supported by a pipelined "
                f"Trainer: it builds its optimizer from the whole model (or is no "
                f"torch.optim.Optimizer); use an optimizer of the parameters, such as "
                f"'adamw_torch'")

    # ------------------------------------------------------------------ training
    def training_step(self, model: nn.Module, inputs: Dict[str, Any],
                      num_items_in_batch: Any = None) -> torch.Tensor:
        """One batch of an accumulation window through the pipe: the ``Trainer``'s loss and
        gradients of it (accumulated in ``.grad``), its loss returned for logging."""
        self.pipe.train()
        if callable(getattr(self.optimizer, "train", None)):
            self.optimizer.train()
        inputs = dict(inputs)
        window = getattr(self, "current_gradient_accumulation_steps",
                         self.args.gradient_accumulation_steps)
        step = micro_step(self.pipe, inputs, num_items_in_batch, window, self._pipeline_loss)
        loss_fn, statistics = step.loss_fn, None
        if self._sft_metrics:  # SFTTrainer's own metrics, from each micro-batch's logits
            loss_fn, statistics = _observed(step.loss_fn)
        loss = self.pipe.train_step(inputs, step.targets, loss_fn, loss_reduction="sum",
                                    nonfinite="ignore")  # the Trainer filters its logs itself
        if statistics is not None:
            sft.record(self, statistics, "train", inputs)
        steps = self.args.torch_empty_cache_steps
        if steps is not None and self.state.global_step % steps == 0:
            from accelerate.utils import clear_device_cache
            clear_device_cache()
        return loss.detach().to(self.args.device)

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int,
                          device: torch.device) -> Tuple[list, Any]:
        """The window's batches and label count; the ``Trainer`` sums the count over every
        process, and each replica's batches are read by all its pipeline ranks: the sum
        divided by their number is the count over the replicas, as DDP's."""
        batches, count = super().get_batch_samples(epoch_iterator, num_batches, device)
        ranks = self.pipeline_replicas.pipeline_ranks
        if count is not None and ranks > 1 and self.args.average_tokens_across_devices:
            count = count / ranks
        return batches, count

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        """``Trainer._clip_grad_norm`` (private, no public hook for clipping): clip by the
        whole model's gradient norm, over every stage and rank; returns the norm before."""
        return self.pipe.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        """``Trainer._get_grad_norm`` (private): the logged norm, the whole model's."""
        if grad_norm is None:  # measured without clipping: a bound that scales by 1
            grad_norm = self.pipe.clip_grad_norm_(sys.float_info.max)
        return grad_norm

    def create_optimizer(self, model: Optional[nn.Module] = None) -> torch.optim.Optimizer:
        """The ``Trainer``'s optimizer, over this process's parameters of the pipe."""
        optimizer = super().create_optimizer(model)
        _check_optimizer(optimizer, self.pipe, "optim")
        return optimizer

    def create_scheduler(self, num_training_steps: int,
                         optimizer: Optional[torch.optim.Optimizer] = None) -> Any:
        """The ``Trainer``'s scheduler, on the torch optimizer inside Accelerate's wrapper (the
        same parameter groups): a checkpoint holds the optimizer its scheduler steps."""
        if optimizer is None:
            optimizer = _torch_optimizer(self.optimizer)
        return super().create_scheduler(num_training_steps, optimizer)

    def get_decay_parameter_names(self, model: nn.Module) -> list:
        """Weight decay by the model's own modules and names (the pipe's names are its)."""
        return super().get_decay_parameter_names(
            self.plain_model if model is self.__dict__.get("pipe") else model)

    def get_total_train_batch_size(self, args: Any) -> int:
        """Samples per optimizer step: per replica, not per process."""
        return (self._train_batch_size * args.gradient_accumulation_steps
                * self.pipeline_replicas.replicas)

    def floating_point_ops(self, inputs: Dict[str, Any]) -> float:
        """The ``Trainer``'s estimate for the model (6 x input tokens x parameters without
        embeddings), shared by the pipeline ranks of a replica: the ``Trainer`` adds every
        process's count."""
        main = getattr(self.plain_model, "main_input_name", "input_ids")
        counter = getattr(self.plain_model, "num_parameters", None)
        if main not in inputs or not callable(counter):
            return 0
        flos = 6 * inputs[main].numel() * counter(exclude_embeddings=True)
        return flos / self.pipeline_replicas.pipeline_ranks

    # ------------------------------------------------------------------ data
    def get_train_dataloader(self) -> Any:
        """The ``Trainer``'s train loader, sharded over the pipeline's replicas."""
        with replica_loaders(self, self.pipeline_replicas):
            return super().get_train_dataloader()

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        """The ``Trainer``'s evaluation loader, sharded over the pipeline's replicas."""
        with replica_loaders(self, self.pipeline_replicas):
            return super().get_eval_dataloader(eval_dataset)

    def get_test_dataloader(self, test_dataset: Any) -> Any:
        """The ``Trainer``'s prediction loader, sharded over the pipeline's replicas."""
        with replica_loaders(self, self.pipeline_replicas):
            return super().get_test_dataloader(test_dataset)

    # ------------------------------------------------------------------ evaluation
    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        """The ``Trainer``'s loop, its outputs gathered over the pipeline's replicas."""
        if self.pipeline_replicas.distributed:
            self.gather_function = metrics_gatherer(self.pipeline_replicas,
                                                    self.accelerator.gradient_state)
        return super().evaluation_loop(*args, **kwargs)

    def prediction_step(self, model: nn.Module, inputs: Dict[str, Any],
                        prediction_loss_only: bool, ignore_keys: Optional[list] = None
                        ) -> Tuple[Any, Any, Any]:
        """``Trainer.prediction_step`` through ``pipe.evaluate``: the loss (scaled as the
        ``Trainer`` scales it), the outputs but the ignored keys, and the labels; every rank of
        the pipeline returns the last stage's."""
        has_labels = bool(self.label_names) and all(inputs.get(k) is not None
                                                    for k in self.label_names)
        return_loss = inputs.get("return_loss")
        return_loss = self.can_return_loss if return_loss is None else return_loss
        with_loss = has_labels or (not self.label_names and return_loss)
        inputs = {k: _to(v, self.args.device) for k, v in inputs.items()}
        if ignore_keys is None:
            ignore_keys = _ignored_at_inference(self.plain_model)
        labels = None
        if with_loss:
            labels = nested_detach(tuple(inputs.get(name) for name in self.label_names))
            labels = labels[0] if len(labels) == 1 else labels
        scale = self._evaluation_scale(inputs) if with_loss else 1.0
        with torch.no_grad():
            output = self.pipe.evaluate(**inputs)
        if self._sft_metrics and with_loss:  # SFTTrainer's own metrics of the batch
            sft.record_evaluation(self, output, inputs)
        found = None if output is None else _split_output(output, with_loss, ignore_keys, scale)
        loss, logits = self.pipeline_replicas.share_from_last_stage(
            found, self.args.device, "the outputs of an evaluation batch")
        if prediction_loss_only:
            return loss, None, None
        logits = nested_detach(logits)
        return loss, (logits[0] if len(logits) == 1 else logits), labels

    def _evaluation_scale(self, inputs: Dict[str, Any]) -> float:
        """The factor from the model's loss on an evaluation batch to ``prediction_step``'s
        (every rank computes it: the label count is summed over the replicas)."""
        replicas = self.pipeline_replicas
        distributed = self.args.world_size > 1
        return evaluation_scale(
            self.pipe.output_rules.rule_for("loss"), inputs, self._pipeline_loss,
            lambda count: replicas.sum_over_replicas(count, self.args.device,
                                                     "the label count of an evaluation batch")
            if distributed else count)

    # ------------------------------------------------------------------ saving and resuming
    def save_model(self, output_dir: Optional[str] = None, _internal_call: bool = False) -> None:
        """The model in the Hugging Face format (config and safetensors, gathered from every
        rank's share: ``from_pretrained`` loads it; a model without ``save_pretrained``: its
        state dict in ``model.safetensors``), with the processing class and the training
        arguments, as ``Trainer.save_model`` writes them."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        timeout = self.pipeline_replicas.timeout
        if callable(getattr(self.plain_model, "save_pretrained", None)):
            hf_format.save_pretrained(output_dir, self.pipe, self.plain_model, timeout=timeout)
        else:  # a model of one's own: its state dict, as the Trainer saves it
            _save_state_dict(output_dir, self.pipe, timeout)
        if not self.args.should_save:
            return
        tokenizer = self.processing_class
        if tokenizer is None:
            tokenizer = getattr(self.data_collator, "tokenizer", None)
        if tokenizer is not None:
            tokenizer.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, "training_args.bin"))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """``Trainer._save_optimizer_and_scheduler`` (private, called by its checkpoints, on
        every process): the pipe's model, optimizer and scheduler as a
        ``fastpipe.checkpoint`` (every rank's share, atomic, loadable at any layout)."""
        path = os.path.join(output_dir, PIPELINE_STATE)
        _replace(path, Ranks(self.pipe, self.pipeline_replicas.timeout))
        checkpoints.save(path, self.pipe, _torch_optimizer(self.optimizer), self.lr_scheduler,
                         timeout=self.pipeline_replicas.timeout)

    def _load_from_checkpoint(self, resume_from_checkpoint: str,
                              model: Optional[nn.Module] = None) -> None:
        """``Trainer._load_from_checkpoint`` (private): resuming reads the checkpoint's
        pipeline state, with the optimizer (``_load_optimizer_and_scheduler``); here it is only
        checked, before any work."""
        path = os.path.join(resume_from_checkpoint, PIPELINE_STATE)
        if not is_complete(path):
            raise ValueError(f"resume_from_checkpoint={resume_from_checkpoint!r} holds no "
                             f"complete pipeline state ({PIPELINE_STATE}/): resume from a "
                             f"checkpoint a pipelined Trainer saved without save_only_model")

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        """``Trainer._load_optimizer_and_scheduler`` (private): the pipe's model, optimizer
        and scheduler from the checkpoint, whatever layout saved it."""
        if checkpoint is None:
            return
        checkpoints.load(os.path.join(checkpoint, PIPELINE_STATE), self.pipe,
                         _torch_optimizer(self.optimizer), self.lr_scheduler,
                         timeout=self.pipeline_replicas.timeout)


class PipelineTrainer(PipelineTrainerMixin, Trainer):
    """Hugging Face's ``Trainer``, training its model as a pipe (see
    ``PipelineTrainerMixin``): ``PipelineTrainer(model=..., args=..., train_dataset=...,
    pipeline=PipelineArguments(split_points='auto', chunks=4, devices=['cpu', 'cpu']))``."""


def _check_hooks() -> None:
    """The installed ``Trainer`` calls every method overridden here (its private ones change
    between releases; these are those of transformers 5)."""
    missing = [name for name in HOOKS if not callable(getattr(Trainer, name, None))]
    if missing:
        import transformers
        raise ImportError(f"transformers {transformers.__version__}'s Trainer has no "
                          f"{', '.join(missing)}, which the pipelined Trainer overrides: "
                          f"install transformers 5 (pip install 'fastpipe[transformers]')")


def _show_model(pipe: nn.Module, model: nn.Module) -> None:
    """What ``Trainer`` code reads of ``trainer.model`` besides its parameters: the model's
    config and main input, on the pipe; and Accelerate's mark of a model it has prepared, so
    that it never wraps the pipe (in DDP, or to move it)."""
    for name in ("config", "main_input_name"):
        value = getattr(model, name, None)
        if value is not None:
            object.__setattr__(pipe, name, value)
    object.__setattr__(pipe, "_is_accelerate_prepared", True)


def _save_state_dict(directory: str, pipe: nn.Module, timeout: float) -> None:
    """The whole model's state dict (every rank's share) in ``directory/model.safetensors``,
    written by rank 0, every rank returning once it is."""
    from safetensors.torch import save_file
    ranks = Ranks(pipe, timeout)
    state = full_state_dict(pipe, timeout=timeout)
    problem = None
    if state is not None:
        try:
            os.makedirs(directory, exist_ok=True)
            save_file({k: v.contiguous().clone() for k, v in state.items()},
                      os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
        except OSError as error:
            problem = error
    ranks.agree(problem, "the end of a model save")


def _replace(path: str, ranks: Ranks) -> None:
    """Make room for a checkpoint's pipeline state where a former run left a complete one (the
    ``Trainer`` writes over a checkpoint directory of the same step): rank 0 removes it, every
    rank waits for that."""
    problem = None
    if ranks.rank == 0 and is_complete(path):
        try:
            shutil.rmtree(path)
        except OSError as error:
            problem = error
    ranks.agree(problem, "the removal of a former checkpoint's pipeline state")


def _observed(loss_fn: Any) -> Tuple[Any, "sft.TokenStatistics"]:
    """``loss_fn``, which also adds each micro-batch's logits to the returned statistics."""
    statistics = sft.TokenStatistics()

    def observed(output: Any, context: Any) -> torch.Tensor:
        statistics.add(output["logits"], context[1]["labels"])
        return loss_fn(output, context)

    return observed, statistics


def _torch_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside Accelerate's ``AcceleratedOptimizer`` (whose groups and state
    are the inner optimizer's), or the optimizer itself."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def _check_optimizer(optimizer: torch.optim.Optimizer, pipe: nn.Module, option: str) -> None:
    held = {id(p) for p in pipe.parameters()}
    foreign = [tuple(p.shape) for group in optimizer.param_groups for p in group["params"]
               if id(p) not in held]
    if foreign:
        raise UnsupportedTrainerOption(
            f"the optimizer ({option}) holds {len(foreign)} parameters that are not the pipe's "
            f"(shapes {foreign[:3]}): build it over trainer.pipe.parameters(), or leave it to "
            f"the Trainer (optimizer_cls_and_kwargs=... names a class)")


def _ignored_at_inference(model: nn.Module) -> list:
    """The output keys ``prediction_step`` leaves out, as the ``Trainer`` reads them."""
    config = getattr(model, "config", None)
    return getattr(config, "keys_to_ignore_at_inference", ["cache"]) if config is not None \
        else []


def _split_output(output: Any, with_loss: bool, ignore_keys: list, scale: float
                  ) -> Tuple[Any, Tuple[Any, ...]]:
    """``(loss, logits)`` of a model output, as ``Trainer.prediction_step`` splits it."""
    if isinstance(output, dict):
        skipped = list(ignore_keys) + (["loss"] if with_loss else [])
        logits = tuple(v for k, v in output.items() if k not in skipped)
        loss = output["loss"] if with_loss else None
    else:
        output = tuple(output) if isinstance(output, (tuple, list)) else (output,)
        loss, logits = (output[0], output[1:]) if with_loss else (None, output)
    if loss is not None:
        loss = (loss.detach() * scale).mean()
    return loss, logits


def _to(value: Any, device: torch.device) -> Any:
    return value.to(device) if isinstance(value, torch.Tensor) else value
