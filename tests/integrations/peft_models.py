"""The LoRA test model every PEFT test shares: a tiny random-init Llama (embedding tied to
the LM head) with LoRA adapters on its attention projections, its batches, and the plain
PeftModel's training loop the pipes are compared against."""
from __future__ import annotations

from typing import Any, Dict, List

import torch

VOCAB, SEQ = 64, 8
SPLIT = "base_model.model.model.layers.2"  # two stages: layers 0-1 and 2-3 with the head
STEPS, ACCUMULATE, MAX_NORM = 2, 2, 0.2  # optimizer steps, batches per step, the clip


def lora_llama(seed: int = 0) -> Any:
    """A 4-layer Llama with LoRA (r=4) on ``q_proj`` and ``v_proj``, the adapters' weights
    random (PEFT's test initialisation: both LoRA matrices get gradients from the first step)."""
    import peft
    import transformers
    transformers.utils.logging.set_verbosity_error()
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32, use_cache=False,
        tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(seed)
    base = transformers.LlamaForCausalLM(config)
    torch.manual_seed(seed + 1)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                           lora_dropout=0.0, init_lora_weights=False)
    return peft.get_peft_model(base, lora)


def batch(step: int, size: int = 6) -> Dict[str, torch.Tensor]:
    """A padded batch with its labels (-100 on the padding)."""
    generator = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (size, SEQ), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, SEQ - 3:] = 0
    mask[size - 2, SEQ - 5:] = 0
    return {"input_ids": ids, "attention_mask": mask,
            "labels": ids.masked_fill(mask == 0, -100)}


def optimizer_and_schedule(parameters: Any) -> tuple:
    """AdamW and a linear warm-down, as a fine-tuning script sets them up."""
    optimizer = torch.optim.AdamW(parameters, lr=1e-2, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - 0.25 * step)
    return optimizer, schedule


def plain_run(model: Any, steps: int, accumulate: int, max_norm: float) -> List[float]:
    """The plain PeftModel's loop: ``accumulate`` batches per optimizer step, their gradients
    added, clipped to ``max_norm``, AdamW, the schedule stepped; the loss of every batch."""
    optimizer, schedule = optimizer_and_schedule(model.parameters())
    losses = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        for k in range(accumulate):
            loss = model(**batch(step * accumulate + k)).loss
            loss.backward()
            losses.append(float(loss.detach()))
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        schedule.step()
    return losses


def pipe_run(pipe: Any, steps: int, accumulate: int, max_norm: float, replicas: int = 1,
             replica: int = 0) -> List[float]:
    """The same loop on a pipe: the first ``accumulate - 1`` batches of a step inside
    ``no_sync()``, the last with the optimizer and ``max_grad_norm``; with data-parallel
    ``replicas``, this replica's rows of each batch. The loss of every batch."""
    optimizer, schedule = optimizer_and_schedule(pipe.parameters())
    losses = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        for k in range(accumulate):
            whole = batch(step * accumulate + k)
            rows = len(whole["input_ids"]) // replicas
            mine = {key: v[replica * rows:(replica + 1) * rows] for key, v in whole.items()}
            if k < accumulate - 1:
                with pipe.no_sync():
                    losses.append(float(pipe.train_step(mine)))
            else:
                losses.append(float(pipe.train_step(mine, optimizer=optimizer,
                                                    max_grad_norm=max_norm)))
        schedule.step()
    return losses


def adapter_state(model: Any) -> Dict[str, torch.Tensor]:
    """The trainable (adapter) tensors of a PeftModel, by name."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
