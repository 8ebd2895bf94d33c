"""TRL's ``SFTTrainer``, plain and pipelined through ``PipelineTrainerMixin``, for the tests: a
tiny random-init Llama, a word-level tokenizer and a small in-memory text dataset built in code
(nothing downloaded), trained as ``hf_trainer_cases`` trains (accumulation 2, clipping, a
schedule, evaluations and checkpoints every 2 steps, optionally stopped or resumed). Runs in
this process or on gloo ranks (``script='integrations/sft_cases.py'``)."""
from __future__ import annotations

import os
import sys
from typing import Any, Dict, Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import transformers  # noqa: E402
from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

from fastpipe.integrations.transformers import (PipelineArguments,  # noqa: E402
                                                PipelineTrainerMixin)
from hf_trainer_cases import StopAfter, _plain  # noqa: E402

WORDS = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(61)]


class PipelineSFTTrainer(PipelineTrainerMixin, SFTTrainer):
    """``SFTTrainer`` training its model as a pipe."""


def tokenizer() -> Any:
    words = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>",
                                                eos_token="<eos>", unk_token="<unk>")


def texts(count: int, seed: int) -> Dataset:
    g = torch.Generator().manual_seed(seed)
    lines = []
    for _ in range(count):
        length = int(torch.randint(3, 12, (1,), generator=g))
        lines.append(" ".join(f"w{int(i)}" for i in torch.randint(0, 61, (length,), generator=g)))
    return Dataset.from_dict({"text": lines})


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=len(WORDS), max_position_embeddings=64,
        use_cache=False, pad_token_id=0, eos_token_id=1, bos_token_id=None))


def config(out: str, **changes: Any) -> SFTConfig:
    options = dict(output_dir=out, per_device_train_batch_size=4, per_device_eval_batch_size=4,
                   gradient_accumulation_steps=2, max_steps=4, learning_rate=1e-2,
                   lr_scheduler_type="linear", warmup_steps=1, max_grad_norm=0.5,
                   logging_steps=1, eval_strategy="steps", eval_steps=2, save_steps=2,
                   report_to=[], disable_tqdm=True, use_cpu=True, seed=0, bf16=False,
                   activation_checkpointing=False, gradient_checkpointing=None, max_length=16)
    options.update(changes)
    return SFTConfig(**options)


def train(out: str, pipeline: Optional[Dict[str, Any]] = None, resume: Optional[str] = None,
          stop_after: Optional[int] = None, **changes: Any) -> Dict[str, Any]:
    """A plain (``pipeline=None``) or pipelined SFT run; its logs, its final model saved."""
    cls = SFTTrainer if pipeline is None else PipelineSFTTrainer
    extra = {} if pipeline is None else {"pipeline": PipelineArguments(**pipeline)}
    run = cls(model=model(), args=config(out, **changes), train_dataset=texts(32, 1),
              eval_dataset=texts(8, 2), processing_class=tokenizer(),
              callbacks=[StopAfter(stop_after)] if stop_after else None, **extra)
    run.train(resume_from_checkpoint=resume)
    run.save_model(os.path.join(out, "final"))
    return {"logs": [_plain(entry) for entry in run.state.log_history],
            "final": os.path.join(out, "final")}


def run_on_ranks(out: str, pipeline: Optional[Dict[str, Any]] = None,
                 resume_out: Optional[str] = None) -> Dict[str, Any]:
    """On every rank: a run, then (``resume_out``) one resuming after step 2 of the first."""
    result = {"run": train(out, pipeline)}
    if resume_out is not None:
        result["resumed"] = train(resume_out, pipeline, resume=os.path.join(out, "checkpoint-2"))
    return result


if __name__ == "__main__":
    from dist_common import main

    main({"run_on_ranks": run_on_ranks})
