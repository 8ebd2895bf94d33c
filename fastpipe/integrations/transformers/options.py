"""The ``Trainer`` options a pipelined ``Trainer`` cannot honour, refused at construction.

Every option the pipelined ``Trainer`` accepts keeps its meaning; the ones below would change
the computation, or be silently ignored, once the model runs as a pipe, so each raises
``UnsupportedTrainerOption`` naming the option and what to do instead. The checks read the
arguments only; :func:`refuse_state` reads what the ``Trainer`` and Accelerate made of them
(an ``accelerate launch`` configuration can turn DeepSpeed, FSDP, mixed precision or
``torch.compile`` on).
"""
from __future__ import annotations

from typing import Any, Callable, List, Mapping, Optional, Tuple


class UnsupportedTrainerOption(ValueError):
    """A ``Trainer`` option that the pipelined ``Trainer`` cannot honour."""


_Check = Tuple[str, Callable[[Any], bool], str]

# (option, is it set in a way that cannot be honoured, why and what instead)
_ARGUMENTS: List[_Check] = [
    ("deepspeed", lambda a: bool(a.deepspeed),
     "DeepSpeed partitions the model its own way; the pipe's stages are fastpipe's"),
    ("fsdp", lambda a: bool(a.fsdp),
     "FSDP wraps the whole model; shard a DistributedPipe's stages with fastpipe.init_mesh "
     "(shard=...) and data_parallel='fsdp' instead"),
    ("fp16", lambda a: bool(a.fp16), "mixed precision through Accelerate is not wired to the "
     "pipe's steps yet: train in float32"),
    ("bf16", lambda a: bool(a.bf16), "mixed precision through Accelerate is not wired to the "
     "pipe's steps yet: train in float32"),
    ("fp16_full_eval", lambda a: bool(a.fp16_full_eval), "the pipe's stages stay in their dtype"),
    ("bf16_full_eval", lambda a: bool(a.bf16_full_eval), "the pipe's stages stay in their dtype"),
    ("torch_compile", lambda a: bool(a.torch_compile),
     "compile the stages with PipelineArguments(compile=True) instead"),
    ("activation_checkpointing", lambda a: bool(a.activation_checkpointing),
     "the pipe recomputes activations per stage: use PipelineArguments(checkpoint=...) "
     "('except_last' by default) and set activation_checkpointing=False "
     "(gradient_checkpointing=False)"),
    ("use_liger_kernel", lambda a: bool(a.use_liger_kernel),
     "Liger patches the model's forward after the pipe traced it"),
    ("neftune_noise_alpha", lambda a: a.neftune_noise_alpha is not None,
     "NEFTune's embedding hook does not reach the traced stages"),
    ("label_smoothing_factor", lambda a: a.label_smoothing_factor != 0,
     "the pipe trains on the model's own loss; put the smoothing in the model's loss"),
    ("load_best_model_at_end", lambda a: bool(a.load_best_model_at_end),
     "load the best checkpoint's pipeline state with fastpipe.checkpoint.load instead"),
    ("push_to_hub", lambda a: bool(a.push_to_hub),
     "push the directory trainer.save_model() wrote with huggingface_hub instead"),
    ("auto_find_batch_size", lambda a: bool(a.auto_find_batch_size),
     "its restarts rebuild the model's wrapping, which would drop the pipe"),
    ("parallelism_config", lambda a: a.parallelism_config is not None,
     "Accelerate's parallelism does not compose with the pipe's: use fastpipe.init_mesh's "
     "layouts"),
    ("ddp_find_unused_parameters", lambda a: a.ddp_find_unused_parameters is not None,
     "the pipe's replicas do not run DDP: leave it unset"),
    ("ddp_bucket_cap_mb", lambda a: a.ddp_bucket_cap_mb is not None,
     "the pipe's replicas do not run DDP: leave it unset"),
    ("ddp_broadcast_buffers", lambda a: a.ddp_broadcast_buffers is not None,
     "the pipe's replicas do not run DDP: leave it unset"),
    ("ddp_static_graph", lambda a: a.ddp_static_graph is not None,
     "the pipe's replicas do not run DDP: leave it unset"),
    ("debug", lambda a: "underflow_overflow" in [str(getattr(d, "value", d)) for d in a.debug],
     "its forward hooks do not reach the traced stages"),
    ("optim", lambda a: str(getattr(a.optim, "value", a.optim)) in ("lomo", "adalomo"),
     "LOMO fuses the update into the backward, which the pipe runs itself"),
    ("eval_use_gather_object", lambda a: bool(a.eval_use_gather_object),
     "the pipe's evaluation gathers tensors only"),
    # TRL's SFTConfig
    ("loss_type", lambda a: getattr(a, "loss_type", "nll") != "nll",
     "the pipe trains on the model's own loss (the negative log-likelihood)"),
    ("padding_free", lambda a: bool(getattr(a, "padding_free", False)),
     "padding-free batches (and packing with 'bfd') pass flash-attention keyword inputs that "
     "the traced model does not take"),
    ("activation_offloading", lambda a: bool(getattr(a, "activation_offloading", False)),
     "use PipelineArguments(checkpoint='offload') instead"),
]

# checked when several processes run the pipeline ranks of one replica
_SEVERAL_RANKS: List[_Check] = [
    ("include_num_input_tokens_seen", lambda a: a.include_num_input_tokens_seen not in
     ("no", False), "the Trainer would count each replica's tokens once per pipeline rank"),
    ("train_sampling_strategy", lambda a: str(a.train_sampling_strategy) == "batch_rebalance",
     "its sampler shards the data by process, not by pipeline replica"),
    ("accelerator_config.dispatch_batches",
     lambda a: a.accelerator_config.dispatch_batches is True,
     "dispatching sends each process its own batch; a replica's pipeline ranks read the same"),
    ("save_on_each_node", lambda a: bool(a.save_on_each_node),
     "the pipe's checkpoint is written once, by rank 0, from every rank's share"),
]

# Trainer.__init__ keyword arguments
_KEYWORDS: List[Tuple[str, str]] = [
    ("model_init", "the pipe is built once from model=...; pass the model (hyperparameter "
                   "search, which needs model_init, is not supported)"),
    ("compute_loss_func", "the pipe trains on the model's own loss: compute the loss in the "
                          "model's forward (from labels), or train with fastpipe's train_step"),
]


def refuse_arguments(args: Any, keywords: Mapping[str, Any], pipeline_ranks: int) -> None:
    """Raise ``UnsupportedTrainerOption`` for the first option of ``TrainingArguments`` (or a
    subclass such as TRL's ``SFTConfig``) and of the ``Trainer``'s keywords that cannot be
    honoured; ``pipeline_ranks``: processes per replica."""
    for name, why in _KEYWORDS:
        if keywords.get(name) is not None:
            raise UnsupportedTrainerOption(f"{name}= is not supported by a pipelined Trainer: "
                                           f"{why}")
    checks = _ARGUMENTS + (_SEVERAL_RANKS if pipeline_ranks > 1 else [])
    for name, is_set, why in checks:
        if is_set(args):
            raise UnsupportedTrainerOption(
                f"TrainingArguments.{name}={_value(args, name)!r} is not supported by a "
                f"pipelined Trainer: {why}")
    if args.n_gpu > 1:
        raise UnsupportedTrainerOption(
            f"{args.n_gpu} GPUs visible to one process: the Trainer would run nn.DataParallel "
            f"over them; launch one process per pipeline rank (torchrun, accelerate launch) "
            f"or give one process a Pipe over its devices with CUDA_VISIBLE_DEVICES showing one")


def refuse_state(trainer: Any) -> None:
    """What Accelerate and the ``Trainer`` (TRL's included) made of the options: DeepSpeed,
    FSDP, mixed precision or ``torch.compile`` from an ``accelerate launch`` configuration,
    and TRL's model-specific losses."""
    accelerator = trainer.accelerator
    found: Optional[Tuple[str, str]] = None
    if trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled:
        found = ("the DeepSpeed or FSDP plugin of the Accelerate configuration",
                 "run accelerate launch with a configuration without them")
    elif str(accelerator.mixed_precision) != "no":
        found = (f"mixed_precision={accelerator.mixed_precision!r} of the Accelerate "
                 f"configuration", "train in float32 (--mixed_precision no)")
    elif str(getattr(accelerator.state.dynamo_plugin, "backend", "NO")).upper() \
            not in ("NO", "DYNAMOBACKEND.NO"):
        found = ("the dynamo backend of the Accelerate configuration",
                 "compile the stages with PipelineArguments(compile=True) instead")
    elif getattr(trainer, "padding_free", False):
        found = ("padding-free batches (SFTConfig packing with the 'bfd' strategy)",
                 "set packing=False, or packing_strategy='wrapped'")
    elif getattr(trainer, "aux_loss_enabled", False):
        found = ("TRL's router auxiliary loss (router_aux_loss_coef)",
                 "mixture-of-experts auxiliary losses are not wired to the pipelined Trainer")
    if found is not None:
        raise UnsupportedTrainerOption(f"{found[0]} is not supported by a pipelined Trainer: "
                                       f"{found[1]}")


def _value(args: Any, name: str) -> Any:
    value: Any = args
    for part in name.split("."):
        value = getattr(value, part)
    return value
