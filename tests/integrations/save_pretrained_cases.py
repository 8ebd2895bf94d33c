"""``fastpipe.checkpoint.save_pretrained`` on gloo ranks (``dist_launch.launch(...,
script='integrations/save_pretrained_cases.py')``): a Llama whose embedding and LM head are one
weight, tied across the first and last ranks, trained two steps as a ``DistributedPipe``, then
written in the Hugging Face format and as a ``fastpipe.checkpoint``; each rank loads the
written model with ``from_pretrained`` and compares its own trained parameters with it."""
from __future__ import annotations

import os
import sys
from typing import Any, Dict

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import fastpipe  # noqa: E402
from fastpipe.distributed import DistributedPipe  # noqa: E402


def tied_llama() -> torch.nn.Module:
    import transformers
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, max_position_embeddings=64, use_cache=False,
        tie_word_embeddings=True))


def batch(seed: int) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 100, (4, 10), generator=g)
    return {"input_ids": ids, "labels": ids}


def trained_pipe(data: int = 1) -> Any:
    model = tied_llama()
    mesh = fastpipe.init_mesh(pipeline=dist.get_world_size() // data, data=data, timeout=60)
    pipe = DistributedPipe(model, chunks=2, split_points="auto", example_inputs=batch(0),
                           mesh=mesh, timeout=60)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    for step in range(2):
        optimizer.zero_grad()
        pipe.train_step(batch(step + 1), optimizer=optimizer)
    return model, pipe


def save_and_load(out: str, data: int = 1) -> Dict[str, Any]:
    """Every rank: save; then the written model against this rank's trained parameters."""
    import transformers
    model, pipe = trained_pipe(data)
    try:  # a DistributedPipe keeps its own layers only: model= names the format
        fastpipe.checkpoint.save_pretrained(os.path.join(out, "unwritten"), pipe)
        refused = None
    except TypeError as error:
        refused = str(error)
    path = fastpipe.checkpoint.save_pretrained(os.path.join(out, "hf"), pipe, model)
    fastpipe.checkpoint.save(os.path.join(out, "pipeline"), pipe)
    loaded = transformers.LlamaForCausalLM.from_pretrained(path)
    theirs = dict(loaded.named_parameters(remove_duplicate=False))
    worst = max((p.detach() - theirs[name]).abs().max().item()
                for name, p in pipe.named_parameters())
    untouched = max((p.detach() - q.detach()).abs().max().item()
                    for p, q in zip(tied_llama().parameters(), loaded.parameters()))
    return {"rank": dist.get_rank(), "names": sorted(n for n, _ in pipe.named_parameters()),
            "worst": worst, "moved": untouched, "tied": loaded.lm_head.weight is
            loaded.model.embed_tokens.weight, "path": path, "refused": refused}


if __name__ == "__main__":
    from dist_common import main

    main({"save_and_load": save_and_load})
