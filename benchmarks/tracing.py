"""Trace and construction time of a traced pipe against torch's own ``pipeline()``.

For a GPT-2, a Llama and a T5 from ``transformers`` (tiny random configurations, built from
their configs), cut into 2 stages at the same split point, side by side in one run:

- ``torch pipeline()``: ``torch.distributed.pipelining.pipeline(model, mb_kwargs=batch,
  split_spec={point: SplitPoint.BEGINNING})`` (``pipe_split`` at the point; one static-shape
  ``torch.export`` and the split);
- ``fastpipe split()``: ``fastpipe.tracing.split`` (the trace, every dimension dynamic, and the
  cut into stage graphs);
- ``fastpipe Pipe()``: ``fastpipe.Pipe(model, split_points=[point], example_inputs=batch)``,
  the whole construction;
- ``first eval()``: what the first ``pipe.eval()`` costs afterwards (the eval graph, traced on
  first use).

Each round builds fresh models (not timed) and times every candidate once, in turn, after one
untimed round (imports, first-call costs); the table gives medians over the rounds and the
ratios to torch's ``pipeline()``. With ``--cold``, each candidate is also timed once in a fresh
process (what a job pays once, one-time costs included). Every fastpipe pipe is checked once
against the plain model before anything is timed.

    python benchmarks/tracing.py [--quick] [--rounds 5] [--cold]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from typing import Any, Callable, Dict, List, Tuple

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fastpipe  # noqa: E402
from _common import machine, median, table  # noqa: E402
from fastpipe import tracing  # noqa: E402

VOCAB = 128
MODELS = ("gpt2", "llama", "t5")
CANDIDATES = ("torch pipeline()", "fastpipe split()", "fastpipe Pipe()")


def build(name: str, layers: int, width: int) -> Tuple[nn.Module, str]:
    """A tiny random model of ``name`` (no dropout, no generation cache) and its split point:
    the first block of its second half."""
    import transformers
    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    if name == "gpt2":
        config = transformers.GPT2Config(
            n_layer=layers, n_embd=width, n_head=2, vocab_size=VOCAB, n_positions=64,
            use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(config), f"transformer.h.{layers // 2}"
    if name == "llama":
        config = transformers.LlamaConfig(
            hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers,
            num_attention_heads=2, num_key_value_heads=1, vocab_size=VOCAB,
            max_position_embeddings=64, use_cache=False)
        return transformers.LlamaForCausalLM(config), f"model.layers.{layers // 2}"
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=width, d_kv=width // 2, d_ff=2 * width,
        num_layers=layers // 2, num_decoder_layers=layers // 2, num_heads=2, use_cache=False,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    return transformers.T5ForConditionalGeneration(config), "decoder.block.0"


def batch(name: str, size: int = 4, seq: int = 16) -> Dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (size, seq), generator=generator)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if name == "t5":
        inputs["decoder_input_ids"] = ids.clone()
    return inputs


def candidate(which: str, name: str, layers: int, width: int) -> Callable[[], float]:
    """A function that builds a fresh model (not timed) and returns the seconds ``which``
    takes on it."""
    def run() -> float:
        model, point = build(name, layers, width)
        inputs = batch(name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            start = time.perf_counter()
            if which == "torch pipeline()":
                from torch.distributed.pipelining import SplitPoint, pipeline
                pipeline(model, mb_args=(), mb_kwargs=inputs,
                         split_spec={point: SplitPoint.BEGINNING})
            elif which == "fastpipe split()":
                tracing.split(model, [point], inputs)
            else:
                fastpipe.Pipe(model, chunks=2, devices=["cpu"] * 2, split_points=[point],
                              example_inputs=inputs)
            return time.perf_counter() - start
    return run


def first_eval(name: str, layers: int, width: int) -> float:
    """Seconds of the first ``pipe.eval()`` of a fresh pipe (the eval graph's trace)."""
    model, point = build(name, layers, width)
    pipe = fastpipe.Pipe(model, chunks=2, devices=["cpu"] * 2, split_points=[point],
                         example_inputs=batch(name))
    start = time.perf_counter()
    pipe.eval()
    return time.perf_counter() - start


def check(name: str, layers: int, width: int) -> None:
    """The pipe's output equals the plain model's, in train and eval mode, at another batch
    size and sequence length than the example's."""
    model, point = build(name, layers, width)
    pipe = fastpipe.Pipe(model, chunks=2, devices=["cpu"] * 2, split_points=[point],
                         example_inputs=batch(name))
    inputs = batch(name, size=3, seq=9)
    with torch.no_grad():
        for mode in (True, False):
            pipe.train(mode)
            torch.testing.assert_close(pipe(**inputs).logits, model(**inputs).logits,
                                       rtol=1e-5, atol=1e-6)


def warm(models: List[str], layers: int, width: int, rounds: int) -> Dict[str, Dict[str, Any]]:
    """Median seconds of each candidate on each model, interleaved round by round."""
    results: Dict[str, Dict[str, Any]] = {}
    for name in models:
        runs = {which: candidate(which, name, layers, width) for which in CANDIDATES}
        for run in runs.values():  # untimed: imports and first-call costs
            run()
        times: Dict[str, List[float]] = {which: [] for which in runs}
        evals: List[float] = []
        for _ in range(rounds):
            for which, run in runs.items():
                times[which].append(run())
            evals.append(first_eval(name, layers, width))
        results[name] = {which: median(t) for which, t in times.items()}
        results[name]["first eval()"] = median(evals)
    return results


def cold(models: List[str], layers: int, width: int) -> Dict[str, Dict[str, float]]:
    """Seconds of each candidate run once in a fresh process."""
    found: Dict[str, Dict[str, float]] = {}
    for name in models:
        found[name] = {}
        for which in CANDIDATES:
            spec = json.dumps([which, name, layers, width])
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", spec],
                                 capture_output=True, text=True, timeout=600, check=True)
            found[name][which] = float(out.stdout.strip().splitlines()[-1])
    return found


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny check: 1 round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--cold", action="store_true",
                        help="also time each candidate once in a fresh process")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a fresh process's single run
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.one:
        which, name, layers, width = json.loads(args.one)
        print(candidate(which, name, layers, width)())
        return
    rounds = 1 if args.quick else args.rounds
    layers, width = (2, 16) if args.quick else (args.layers, args.width)
    models = list(MODELS)
    for name in models:
        check(name, layers, width)
    print(machine())
    print(f"{layers} layers, width {width}, 2 stages, batch 4 x 16 tokens; medians of "
          f"{rounds} round(s), seconds\n")
    found = warm(models, layers, width, rounds)
    rows = [[name, *(f"{found[name][c]:.3f}" for c in CANDIDATES),
             ratio(found[name]["fastpipe split()"], found[name]["torch pipeline()"]),
             ratio(found[name]["fastpipe Pipe()"], found[name]["torch pipeline()"]),
             f"{found[name]['first eval()']:.3f}"] for name in models]
    print(table(["model", *CANDIDATES, "split / torch", "Pipe / torch", "first eval()"], rows))
    if args.cold:
        first = cold(models, layers, width)
        rows = [[name, *(f"{first[name][c]:.3f}" for c in CANDIDATES),
                 ratio(first[name]["fastpipe Pipe()"], first[name]["torch pipeline()"])]
                for name in models]
        print("\nonce in a fresh process (one-time costs included), seconds\n")
        print(table(["model", *CANDIDATES, "Pipe / torch"], rows))


if __name__ == "__main__":
    main()
