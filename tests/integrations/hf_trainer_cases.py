"""Hugging Face ``Trainer`` runs, plain and pipelined, for the integration tests.

Tiny random-init models built in code (a Llama causal LM, a T5, a BERT classifier; nothing
downloaded), their in-memory data, and one training run with gradient accumulation 2, clipping,
a linear learning-rate schedule with warm-up, an evaluation and a checkpoint every 2 steps, and
optionally a resume from a checkpoint. A run returns its logs and saves its final weights with
``trainer.save_model`` (the Hugging Face format), so a test compares them with another run's.
The same runs go in this process (``Pipe``) or on gloo ranks, one process per rank
(``dist_launch.launch(case, world, script='integrations/hf_trainer_cases.py')``: a
``DistributedPipe``, or the plain ``Trainer`` under DDP).
"""
from __future__ import annotations

import os
import sys
from typing import Any, Dict, List, Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import transformers  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from fastpipe.integrations.transformers import (PipelineArguments,  # noqa: E402
                                                PipelineTrainer)

KINDS = ("llama", "t5", "bert", "lora", "tagger")
# lora: the Llama with LoRA adapters (PEFT); tagger: a model of one's own, not transformers'


class Tagger(torch.nn.Module):
    """A token tagger of one's own: its forward takes no loss keywords (so the ``Trainer``
    divides its loss by the accumulation steps) and returns a mean over the counted tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(100, 16)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(4))
        self.head = torch.nn.Linear(16, 5)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                labels: torch.Tensor) -> Dict[str, torch.Tensor]:
        h = self.embed(input_ids) * attention_mask[..., None]
        for block in self.blocks:
            h = block(h)
        logits = self.head(h)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return {"loss": loss, "logits": logits}
STEPS = 4  # optimizer steps of a run; evaluations and checkpoints every 2
BATCH = 4  # per device (per replica)


def model(kind: str) -> torch.nn.Module:
    """A tiny random-init model, the same for every call (no dropout: pipelined and plain
    runs draw other masks)."""
    torch.manual_seed(0)
    if kind == "lora":
        import peft
        base = model("llama")
        torch.manual_seed(1)  # the adapters' weights random, so both LoRA matrices train
        return peft.get_peft_model(base, peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
            init_lora_weights=False))
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=100, max_position_embeddings=64, use_cache=False))
    if kind == "t5":
        return transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
            num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, use_cache=False))
    if kind == "tagger":
        return Tagger()
    if kind == "bert":
        return transformers.BertForSequenceClassification(transformers.BertConfig(
            vocab_size=100, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
            intermediate_size=64, num_labels=3, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, max_position_embeddings=32))
    raise ValueError(kind)


class Examples(torch.utils.data.Dataset):
    """Padded token sequences of different lengths with the labels the model takes: the
    tokens themselves (a causal LM, -100 on padding), a shorter target sequence (T5, -100
    past its length) or a class (BERT)."""

    def __init__(self, kind: str, count: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.items: List[Dict[str, torch.Tensor]] = []
        for _ in range(count):
            ids = torch.randint(0, 100, (12,), generator=g)
            mask = (torch.arange(12) < int(torch.randint(4, 13, (1,), generator=g))).long()
            if kind in ("llama", "lora"):
                labels = ids.masked_fill(mask == 0, -100)
            elif kind == "tagger":
                labels = (ids % 5).masked_fill(mask == 0, -100)
            elif kind == "t5":
                labels = torch.randint(0, 100, (6,), generator=g)
                labels[int(torch.randint(2, 7, (1,), generator=g)):] = -100
            else:
                labels = torch.randint(0, 3, (), generator=g)
            self.items.append({"input_ids": ids, "attention_mask": mask, "labels": labels})

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        return self.items[index]


def accuracy(prediction: Any) -> Dict[str, float]:
    """``compute_metrics``: the argmax's accuracy on the counted labels, and how many
    predictions the metric saw."""
    logits = prediction.predictions
    logits = logits[0] if isinstance(logits, tuple) else logits
    labels = prediction.label_ids
    counted = labels != -100
    hits = (logits.argmax(-1) == labels) & counted
    return {"accuracy": float(hits.sum() / counted.sum()), "predictions": float(len(logits))}


def arguments(out: str, **changes: Any) -> TrainingArguments:
    """The runs' training arguments: accumulation 2, clipping, warm-up and linear decay,
    logging every step, an evaluation and a checkpoint every 2 steps."""
    options = dict(output_dir=out, per_device_train_batch_size=BATCH,
                   per_device_eval_batch_size=BATCH, gradient_accumulation_steps=2,
                   max_steps=STEPS, learning_rate=1e-2, lr_scheduler_type="linear",
                   warmup_steps=1, max_grad_norm=0.5, logging_steps=1, eval_strategy="steps",
                   eval_steps=2, save_steps=2, save_total_limit=3, report_to=[],
                   disable_tqdm=True, use_cpu=True, seed=0)
    options.update(changes)
    return TrainingArguments(**options)


class StopAfter(TrainerCallback):
    """Ends the training after optimizer step ``step``, as a killed job would after its
    checkpoint there (the learning-rate schedule still planned for every step)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if state.global_step >= self.step:
            control.should_training_stop = True
        return control


def trainer(kind: str, out: str, pipeline: Optional[Dict[str, Any]] = None,
            stop_after: Optional[int] = None, **changes: Any) -> Trainer:
    """A plain ``Trainer`` (``pipeline=None``) or a ``PipelineTrainer`` of ``kind``, stopped
    after step ``stop_after`` when given."""
    common = dict(model=model(kind), args=arguments(out, **changes),
                  train_dataset=Examples(kind, 40, seed=1),
                  eval_dataset=Examples(kind, 10, seed=2), compute_metrics=accuracy,
                  callbacks=[StopAfter(stop_after)] if stop_after else None)
    if pipeline is None:
        return Trainer(**common)
    if kind == "tagger":  # how its loss combines over micro-batches: fastpipe cannot know
        pipeline = {**pipeline, "output_reduction": {"loss": "token_mean"}}
    return PipelineTrainer(pipeline=PipelineArguments(**pipeline), **common)


def train(kind: str, out: str, pipeline: Optional[Dict[str, Any]] = None,
          resume: Optional[str] = None, stop_after: Optional[int] = None,
          **changes: Any) -> Dict[str, Any]:
    """Train (from ``resume``, a checkpoint directory, when given; stopping after step
    ``stop_after``), save the final model to ``out/final``; the run's logs."""
    run = trainer(kind, out, pipeline, stop_after, **changes)
    run.train(resume_from_checkpoint=resume)
    run.save_model(os.path.join(out, "final"))
    return {"logs": [_plain(entry) for entry in run.state.log_history],
            "final": os.path.join(out, "final")}


def _plain(entry: Dict[str, Any]) -> Dict[str, Any]:
    return {k: float(v) for k, v in entry.items() if isinstance(v, (int, float))}


# ------------------------------------------------------------------ distributed cases
def run_on_ranks(kind: str, out: str, pipeline: Optional[Dict[str, Any]] = None,
                 resume_out: Optional[str] = None, **changes: Any) -> Dict[str, Any]:
    """On every rank: a run, then (``resume_out``) a second one resuming from the first's
    checkpoint after 2 steps; rank 0's logs of both."""
    first = train(kind, out, pipeline, **changes)
    result = {"run": first}
    if resume_out is not None:
        result["resumed"] = train(kind, resume_out, pipeline,
                                  resume=os.path.join(out, "checkpoint-2"), **changes)
    return result


if __name__ == "__main__":
    from dist_common import main

    main({"run_on_ranks": run_on_ranks})
