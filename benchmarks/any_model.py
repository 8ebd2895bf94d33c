"""A Hugging Face GPT-2 (small config), traced and split as it is, against the same model
rewritten by hand as an nn.Sequential: step time side by side, and the time to trace.

Both pipes run 2 CPU stages (the first six blocks and the last six), 1F1B, 4 micro-batches, on
the same weights and batch; rounds alternate between the two so that machine noise hits both.
The hand-written model is checked to give the traced model's loss before anything is timed.

    python benchmarks/any_model.py [--rounds 8] [--batch 8] [--seq 64] [--layers 12]
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Callable, Dict, List

import torch
from torch import nn

import fastpipe


class Embed(nn.Module):
    """Token and position embeddings of a GPT-2 (what its ``transformer`` does first)."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = transformer.wte, transformer.wpe, transformer.drop

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)[None]
        return self.drop(self.wte(ids) + self.wpe(positions))


class Block(nn.Module):
    """One GPT-2 block on hidden states alone (causal attention, no padding mask)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.block(hidden)
        return out[0] if isinstance(out, tuple) else out


class Head(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.ln_f, self.lm_head = model.transformer.ln_f, model.lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(hidden))


def by_hand(model: nn.Module) -> nn.Sequential:
    """The rewriting a user does today: embedding, blocks and head as layers of a Sequential."""
    t = model.transformer
    return nn.Sequential(Embed(t), *[Block(b) for b in t.h], Head(model))


def timed(step: Callable[[], None]) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--layers", type=int, default=12)
    args = parser.parse_args()
    import transformers
    transformers.utils.logging.set_verbosity_error()
    torch.set_num_threads(1)
    config = transformers.GPT2Config(n_layer=args.layers, use_cache=False, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq))
    half = args.layers // 2

    start = time.perf_counter()
    traced = fastpipe.Pipe(model, chunks=4, devices=["cpu"] * 2, schedule="1f1b",
                           split_points=[f"transformer.h.{half}"], example_inputs=(ids,))
    trace_seconds = time.perf_counter() - start
    sequential = by_hand(copy.deepcopy(model))
    hand = fastpipe.Pipe(sequential, chunks=4, devices=["cpu"] * 2, schedule="1f1b",
                         balance=[1 + half, args.layers - half + 1])

    def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())

    steps: Dict[str, Callable[[], None]] = {
        "traced (split_points)": lambda: traced.train_step(
            ids, ids, lambda out, y: lm_loss(out.logits, y)),
        "hand-written Sequential": lambda: hand.train_step(ids, ids, lm_loss),
    }
    a = traced.train_step(ids, ids, lambda out, y: lm_loss(out.logits, y))
    b = hand.train_step(ids, ids, lm_loss)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)  # the same model, the same loss
    times: Dict[str, List[float]] = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            times[name].append(timed(step))
    base = statistics.median(times["hand-written Sequential"])
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"GPT-2 {args.layers} layers ({params:.0f}M parameters), batch {args.batch} x "
          f"{args.seq} tokens, 2 CPU stages, 1F1B, 4 micro-batches, {args.rounds} rounds")
    print(f"trace and split (torch.export, train and eval graphs): {trace_seconds:.1f} s")
    print("| pipe | median step s | vs hand-written |")
    print("|---|---|---|")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.3f} | {median / base:.3f} |")


if __name__ == "__main__":
    main()
