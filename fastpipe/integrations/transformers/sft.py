"""TRL's ``SFTTrainer``'s own metrics through a pipe: the mean entropy of the next-token
distribution and the top-1 accuracy over the counted positions, and the tokens trained on.

``SFTTrainer`` computes them in its ``compute_loss`` from its fused LM head, which a pipe does
not run. Here each micro-batch's logits give them on the last stage (not again when a
checkpointed forward is recomputed); the last stage's sums reach its pipeline's other ranks and
are added over the replicas, as ``SFTTrainer`` adds them over DDP's processes; each batch of
the window appends its values, as ``compute_loss`` appends them.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from ...policies.checkpoint import is_recomputing

IGNORE_INDEX = -100


def is_sft(trainer: Any) -> bool:
    """Whether the trainer is TRL's ``SFTTrainer`` (or a subclass)."""
    return any(cls.__name__ == "SFTTrainer" and cls.__module__.startswith("trl.")
               for cls in type(trainer).__mro__)


class TokenStatistics:
    """The counted next-token positions of a batch, their entropies' sum and how many the
    model's top-1 prediction gets right."""

    def __init__(self) -> None:
        self.sums = torch.zeros(3, dtype=torch.float64)

    def add(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """One micro-batch's logits (batch, length, vocabulary) and labels (batch, length)."""
        if is_recomputing():
            return
        with torch.no_grad():
            logits = logits[:, :-1].float()
            labels = labels[:, 1:].to(logits.device)
            counted = labels != IGNORE_INDEX
            log_p = torch.log_softmax(logits, dim=-1)
            entropy = -(log_p.exp() * log_p).sum(-1)
            right = (logits.argmax(-1) == labels) & counted
            found = torch.stack([counted.sum(), entropy[counted].sum(), right.sum()])
        self.sums += found.double().cpu()


def record(trainer: Any, statistics: TokenStatistics, mode: str,
           inputs: Mapping[str, Any]) -> None:
    """Append one batch's entropy and token accuracy (over the replicas) to the trainer's
    metrics; in training also count its tokens (``attention_mask``'s ones, or a padding-free
    batch's positions)."""
    replicas, device = trainer.pipeline_replicas, trainer.args.device
    sums = replicas.share_from_last_stage(statistics.sums, device, "the metrics of a batch")
    counted, entropy, right = (
        replicas.sum_over_replicas(float(v), device, "the metrics of a batch") for v in sums)
    metrics = trainer._metrics[mode]
    metrics["entropy"].append(_ratio(torch.tensor(entropy, dtype=torch.float32), counted))
    metrics["mean_token_accuracy"].append(_ratio(torch.tensor(int(right)), counted))
    if mode == "train":
        mask = inputs.get("attention_mask")
        tokens = float(mask.sum()) if mask is not None else float(inputs["position_ids"].size(1))
        tokens = replicas.sum_over_replicas(tokens, device, "the token count of a batch")
        trainer._total_train_tokens += int(tokens) // getattr(trainer, "_tp_size", 1)
    metrics["num_tokens"] = [trainer._total_train_tokens]


def record_evaluation(trainer: Any, output: Any, inputs: Mapping[str, Any]) -> None:
    """An evaluation batch's metrics, from the model's output (``None`` off the last stage)."""
    statistics = TokenStatistics()
    if output is not None:
        statistics.add(output["logits"], inputs["labels"])
    record(trainer, statistics, "eval", inputs)


def _ratio(total: torch.Tensor, counted: float) -> float:
    """``total / counted`` as ``SFTTrainer`` divides its gathered sums (a float32 quotient of
    tensors), 0 when nothing was counted."""
    return (total / torch.tensor(int(counted))).item() if counted > 0 else 0.0
