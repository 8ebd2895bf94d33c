"""Tiny random-init mixture-of-experts LMs whose own loss adds the router's load-balancing loss
(``output_router_logits=True``), their batches, and the reference the pipes are held to: the
plain model run per micro-batch, its cross-entropy a token mean over the whole batch and its
load-balancing loss averaged over the micro-batches (Megatron-core's semantics)."""
from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import torch

VOCAB, SEQ, COEFFICIENT = 64, 8, 0.1


def build(name: str, seed: int = 0) -> Any:
    """``'mixtral'``, ``'qwen3_moe'`` (load-balancing loss in their own loss) or
    ``'deepseek_v3'`` (balanced without an auxiliary loss: its loss is the causal LM's)."""
    import transformers
    transformers.utils.logging.set_verbosity_error()
    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                  max_position_embeddings=32, use_cache=False, bos_token_id=0, eos_token_id=0,
                  pad_token_id=0)
    if name == "mixtral":
        config = transformers.MixtralConfig(
            **common, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
            router_aux_loss_coef=COEFFICIENT)
        cls = transformers.MixtralForCausalLM
    elif name == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            **common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            decoder_sparse_step=1, output_router_logits=True, router_aux_loss_coef=COEFFICIENT,
            head_dim=8)
        cls = transformers.Qwen3MoeForCausalLM
    else:
        common.update(num_key_value_heads=4)  # multi-head latent attention: one per head
        config = transformers.DeepseekV3Config(
            **common, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
            moe_intermediate_size=16, first_k_dense_replace=1, n_group=1, topk_group=1,
            kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4,
            v_head_dim=8)
        cls = transformers.DeepseekV3ForCausalLM
    torch.manual_seed(seed)
    return cls(config)


def batch(size: int = 7, seed: int = 3) -> Dict[str, torch.Tensor]:
    """Padded sequences and their labels (-100 on the padding)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (size, SEQ), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, SEQ - 3:] = 0
    mask[size - 3, SEQ - 5:] = 0
    return {"input_ids": ids, "attention_mask": mask,
            "labels": ids.masked_fill(mask == 0, -100)}


def pieces(inputs: Dict[str, torch.Tensor], sizes: Sequence[int]) -> List[Dict[str, Any]]:
    """The micro-batches of ``sizes`` samples, in order."""
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [{k: v[s:s + n] for k, v in inputs.items()} for s, n in zip(starts, sizes)]


def reference(model: Any, micro: Sequence[Dict[str, Any]]) -> Tuple[torch.Tensor, Dict]:
    """The plain model run per micro-batch (of every replica): the step's loss (the token mean
    of the cross-entropy over all micro-batches plus the coefficient times the mean of their
    load-balancing losses, or the token mean of the loss without one) backpropagated; the loss
    and the gradients."""
    model.zero_grad(set_to_none=True)
    parts = []
    for one in micro:
        out = model(**one)
        count = (one["labels"][:, 1:] != -100).sum()
        auxiliary = out.get("aux_loss")
        main = out.loss if auxiliary is None else out.loss - COEFFICIENT * auxiliary
        parts.append((main * count, count, auxiliary))
    total = sum(c for _, c, _ in parts)
    loss = sum(s for s, _, _ in parts) / total
    if parts[0][2] is not None:
        loss = loss + COEFFICIENT * sum(a for _, _, a in parts) / len(parts)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None}
