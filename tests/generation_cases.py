"""Generation cases run by every rank of a gloo group (``dist_launch.launch(...,
script='generation_cases.py')``): ``DistributedPipe.generate`` against ``transformers``'
``generate`` on the plain model (GPT-2 and Llama, greedy and sampled, padded prompts), a
module passing its own cache, prompts refused on the first rank, and a meta-device model."""
from __future__ import annotations

import os
import sys
from typing import Any, Callable, Dict, Tuple

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dist_common import DistributedPipe, main  # noqa: E402

VOCAB = 64


def gpt2(**config: Any) -> nn.Module:
    import transformers
    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=4, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32, use_cache=False,
        initializer_range=0.3, **config)).eval()


def llama(**config: Any) -> nn.Module:
    import transformers
    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32, use_cache=False,
        initializer_range=0.3, **config)).eval()


class CachedLM(nn.Module):
    """A small causal LM passing its own cache: a tuple of (keys, values) per block."""

    def __init__(self, vocab: int = VOCAB, width: int = 16, blocks: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(nn.Linear(width, 3 * width) for _ in range(blocks))
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids: torch.Tensor, past_key_values: Any = None) -> Tuple[Any, Any]:
        x = self.embed(input_ids)
        new = []
        for i, block in enumerate(self.blocks):
            q, k, v = block(x).chunk(3, dim=-1)
            if past_key_values is not None:
                k = torch.cat([past_key_values[i][0], k], dim=1)
                v = torch.cat([past_key_values[i][1], v], dim=1)
            new.append((k, v))
            scores = q @ k.transpose(1, 2) / 4.0
            n, m = q.shape[1], k.shape[1]
            causal = torch.ones(n, m, dtype=torch.bool).tril(m - n)
            x = x + scores.masked_fill(~causal, -1e9).softmax(-1) @ v
        return self.head(x), tuple(new)


def greedy_reference(model: nn.Module, ids: torch.Tensor, new: int) -> torch.Tensor:
    """The plain module's greedy decoding with its own cache (a loop over its forward)."""
    out, past, step = ids, None, ids
    with torch.no_grad():
        for _ in range(new):
            logits, past = model(step, past_key_values=past)
            step = logits[:, -1].argmax(-1, keepdim=True)
            out = torch.cat([out, step], dim=1)
    return out


MODELS: Dict[str, Tuple[Callable[[], nn.Module], list]] = {
    "gpt2": (gpt2, ["transformer.h.2"]),
    "llama": (llama, ["model.layers.2"]),
    "cached": (CachedLM, ["blocks.2"]),
}


def prompts() -> Tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (4, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[2, :1] = 0
    return ids, mask


def _pipe(kind: str, model: nn.Module) -> Any:
    ids, _ = prompts()
    _, points = MODELS[kind]
    return DistributedPipe(model, chunks=2, split_points=points,
                           example_inputs={"input_ids": ids} if kind != "cached" else ids)


def greedy(kind: str, padded: bool = True, chunks: int = 2, eos: bool = False) -> Dict:
    """Greedy generation on every rank equals the plain model's (transformers' generate, or
    the module's own cache loop); the prompt is read on rank 0 only. ``eos``: sequence 0's
    second token ends sequences (finished ones are padded, a finished group stops)."""
    import torch.distributed as dist
    build, _ = MODELS[kind]
    model = build()
    pipe = _pipe(kind, build())
    ids, mask = prompts()
    mask = mask if padded and kind != "cached" else None
    stops: Dict[str, Any] = {}
    if kind == "cached":
        expected = greedy_reference(model, ids, 5)
    else:
        expected = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                                  use_cache=True)
        if eos:
            stops = {"eos_token_id": int(expected[0, ids.shape[1] + 1]), "pad_token_id": 0}
            expected = model.generate(ids, attention_mask=mask, max_new_tokens=5,
                                      do_sample=False, use_cache=True, **stops)
    first = dist.get_rank() == 0
    out = pipe.generate(ids if first else None, 5, attention_mask=mask if first else None,
                        chunks=chunks, **stops)
    again = pipe.generate(ids if first else None, 5, attention_mask=mask if first else None,
                          chunks=chunks, **stops)
    return {"equal": bool(torch.equal(out, expected)), "again": bool(torch.equal(again, out)),
            "tokens": out[:, -5:].tolist()}


def sampled(kind: str) -> Dict:
    """Sampling from a seed equals transformers' generate under the same seed."""
    import torch.distributed as dist
    build, _ = MODELS[kind]
    model = build()
    pipe = _pipe(kind, build())
    ids, mask = prompts()
    torch.manual_seed(7)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=True,
                              temperature=0.8, top_k=20, top_p=0.9, use_cache=True)
    first = dist.get_rank() == 0
    out = pipe.generate(ids if first else None, 5, attention_mask=mask if first else None,
                        do_sample=True, temperature=0.8, top_k=20, top_p=0.9, seed=7)
    return {"equal": bool(torch.equal(out, expected))}


def refused() -> Dict:
    """A bad prompt on the first rank raises there and on every other rank, before any
    forward; the pipe then generates as usual."""
    import torch.distributed as dist
    pipe = _pipe("gpt2", gpt2())
    ids, _ = prompts()
    first = dist.get_rank() == 0
    errors = []
    for bad in (ids.float(), torch.randint(0, VOCAB, (2, 40))):
        try:
            pipe.generate(bad if first else None, 3)
        except (TypeError, ValueError) as error:
            errors.append(f"{type(error).__name__}: {error}")
    out = pipe.generate(ids if first else None, 3)
    return {"errors": errors, "then": list(out.shape)}


def mismatched() -> Dict:
    """Ranks that ask for different generations all raise, naming each other; the pipe then
    generates as usual."""
    import torch.distributed as dist
    pipe = _pipe("gpt2", gpt2())
    ids, _ = prompts()
    rank = dist.get_rank()
    try:
        pipe.generate(ids if rank == 0 else None, 3 + rank)
        error = None
    except ValueError as refused:
        error = str(refused)
    return {"error": error, "then": list(pipe.generate(ids if rank == 0 else None, 3).shape)}


def meta_model() -> Dict:
    """A model built on the meta device: each rank materialises its own layers, loads the
    weights, and generates as the plain model does."""
    import torch.distributed as dist
    plain = gpt2()
    with torch.device("meta"):
        model = gpt2()
    ids, mask = prompts()
    pipe = DistributedPipe(model, chunks=2, split_points=["transformer.h.2"],
                           example_inputs={"input_ids": ids}, init_weights=model._init_weights)
    pipe.load_state_dict(plain.state_dict())
    expected = plain.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                              use_cache=True)
    first = dist.get_rank() == 0
    out = pipe.generate(ids if first else None, 4, attention_mask=mask if first else None)
    return {"equal": bool(torch.equal(out, expected))}


def failing() -> Dict:
    """A forward that fails during generation (a token outside the vocabulary, on rank 0):
    rank 0 raises the error located at its action, rank 1 stops naming rank 0."""
    import torch.distributed as dist
    pipe = _pipe("gpt2", gpt2())
    ids, _ = prompts()
    ids[3, 2] = VOCAB + 5
    try:
        pipe.generate(ids if dist.get_rank() == 0 else None, 3)
    except Exception as error:  # noqa: BLE001 - the case reports what each rank raised
        return {"type": type(error).__name__, "message": str(error)[:300],
                "location": getattr(error, "pipeline_location", None)}
    return {"type": None}


def suite() -> Dict:
    """In one launch: greedy generation of every model kind (padded prompts, 2 groups),
    refused prompts, and ranks asking for different generations."""
    return {**{kind: greedy(kind) for kind in MODELS}, "refused": refused(),
            "mismatched": mismatched()}


CASES = {"greedy": greedy, "sampled": sampled, "refused": refused, "meta_model": meta_model,
         "failing": failing, "suite": suite}

if __name__ == "__main__":
    main(CASES)
