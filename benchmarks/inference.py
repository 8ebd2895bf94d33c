"""Generation with a KV cache: ``pipe.generate`` at 2 CPU stages against the plain model's
``generate`` with its cache, at 1, 4 and 8 sequences in flight.

A Hugging Face GPT-2 (``--layers`` blocks of width ``--width``), prompts of ``--prompt`` tokens,
``--new`` greedy tokens each. Competitors, interleaved round by round in one run:

* plain: ``model.generate(do_sample=False, use_cache=True)`` on the whole batch;
* pipe, 1 stage: ``Pipe(devices=['cpu'])``: the traced forwards and the runtime, no overlap;
* pipe, 2 stages, 1 group: ``Pipe(devices=['cpu', 'cpu'])``, the whole batch one group
  (``chunks=1``): the stages take turns, nothing overlaps;
* pipe, 2 stages: the default groups (one per stage): one stage decodes one group while the
  other group's token travels;
* pipe, 2 stages, 1 per group: every sequence its own group (``chunks=batch``);
* with ``--distributed``: ``DistributedPipe`` on 2 gloo processes (1 thread each), the default
  groups, timed on rank 0 after a barrier.

Every pipe's tokens are checked equal to the plain model's before anything is timed (the first
call of each pipe also traces its forwards: it is not timed). Prints medians of tokens per
second (new tokens of the whole batch / wall time) and a table. On CPU threads, groups overlap
only when their forwards are long enough to release the GIL and the cores (``--batches 32 64``);
a few sequences of a small model are bound by per-operation dispatch, which the stages' threads
share.

    python benchmarks/inference.py [--rounds 5] [--layers 8] [--width 512] [--new 64]
    python benchmarks/inference.py --distributed   # adds the DistributedPipe column
    python benchmarks/inference.py --quick         # a tiny configuration: checks that it runs
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Callable, Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import machine, median, run_ranks, table, time_interleaved  # noqa: E402

import fastpipe  # noqa: E402

COLUMNS = ["plain", "pipe, 1 stage", "pipe, 2 stages, 1 group", "pipe, 2 stages",
           "pipe, 2 stages, 1 per group"]


def build(args: argparse.Namespace) -> torch.nn.Module:
    import transformers
    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=args.heads,
                                     vocab_size=args.vocab, n_positions=args.prompt + args.new,
                                     use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config).eval()


def prompt(args: argparse.Namespace, batch: int) -> torch.Tensor:
    return torch.randint(0, args.vocab, (batch, args.prompt),
                         generator=torch.Generator().manual_seed(batch))


def in_process(args: argparse.Namespace, model: torch.nn.Module) -> Dict[int, Dict[str, float]]:
    """Tokens per second of the plain model and the single-process pipes, per batch size."""
    example = {"input_ids": prompt(args, 2)}
    one = fastpipe.Pipe(model, devices=["cpu"], split_points=[], example_inputs=example)
    two = fastpipe.Pipe(model, devices=["cpu", "cpu"],
                        split_points=[f"transformer.h.{args.layers // 2}"],
                        example_inputs=example)
    rates = {}
    for batch in args.batches:
        ids = prompt(args, batch)
        runs: Dict[str, Callable[[], torch.Tensor]] = {
            "plain": lambda: model.generate(ids, max_new_tokens=args.new, do_sample=False,
                                            use_cache=True),
            "pipe, 1 stage": lambda: one.generate(ids, args.new),
            "pipe, 2 stages, 1 group": lambda: two.generate(ids, args.new, chunks=1),
            "pipe, 2 stages": lambda: two.generate(ids, args.new),
            "pipe, 2 stages, 1 per group": lambda: two.generate(ids, args.new, chunks=batch),
        }
        expected = runs["plain"]()
        for name, run in runs.items():
            if not torch.equal(run(), expected):
                raise SystemExit(f"{name} generated other tokens than the plain model")
        times = time_interleaved(dict(runs), args.rounds, warmup=1)
        rates[batch] = {name: batch * args.new / median(t) for name, t in times.items()}
        print(f"batch {batch}: " + ", ".join(f"{n} {r:.0f} tok/s"
                                             for n, r in rates[batch].items()), flush=True)
    return rates


def worker() -> None:
    """One rank of the ``--distributed`` run: times ``DistributedPipe.generate`` per batch size
    (rank 0 prints the times)."""
    import torch.distributed as dist
    args = argparse.Namespace(**json.loads(os.environ["BENCH_ARGS"]))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = build(args)
    pipe = fastpipe.DistributedPipe(model, split_points=[f"transformer.h.{args.layers // 2}"],
                                    example_inputs={"input_ids": prompt(args, 2)})
    found: Dict[int, List[float]] = {}
    for batch in args.batches:
        ids = prompt(args, batch)
        expected = model.generate(ids, max_new_tokens=args.new, do_sample=False, use_cache=True)
        if not torch.equal(pipe.generate(ids, args.new), expected):
            raise SystemExit("DistributedPipe generated other tokens than the plain model")
        found[batch] = []
        for _ in range(args.rounds):
            dist.barrier()
            start = time.perf_counter()
            pipe.generate(ids, args.new)
            found[batch].append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        print("TIMES " + json.dumps(found), flush=True)
    dist.destroy_process_group()


def distributed(args: argparse.Namespace) -> Dict[int, float]:
    """Tokens per second of ``DistributedPipe`` on 2 gloo processes, per batch size."""
    out = run_ranks(__file__, 2, {"BENCH_WORKER": "1", "BENCH_ARGS": json.dumps(vars(args))},
                    limit=3600)
    line = next(line for line in out.splitlines() if line.startswith("TIMES "))
    times = json.loads(line[len("TIMES "):])
    return {int(batch): int(batch) * args.new / median(t) for batch, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of this process (the plain model uses them; each "
                             "stage of a pipe runs on its own worker thread)")
    parser.add_argument("--distributed", action="store_true",
                        help="also DistributedPipe on 2 gloo processes")
    parser.add_argument("--quick", action="store_true", help="a tiny configuration, 1 round")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.layers, args.width, args.heads = 1, 2, 32, 2
        args.vocab, args.prompt, args.new, args.batches = 64, 4, 4, [1, 4]
    torch.set_num_threads(args.threads)
    print(f"# generation: GPT-2 {args.layers} x {args.width}, vocab {args.vocab}, prompt "
          f"{args.prompt}, {args.new} new tokens, greedy, {args.rounds} rounds (medians); "
          f"{args.threads} torch thread(s); {machine()}")
    rates = in_process(args, build(args))
    header = ["sequences"] + [f"{name} tok/s" for name in COLUMNS]
    if args.distributed:
        ranks = distributed(args)
        header.append("DistributedPipe, 2 ranks tok/s")
        for batch in args.batches:
            rates[batch]["distributed"] = ranks[batch]
    header.append("pipe 2 stages / plain")
    rows = []
    for batch in args.batches:
        found = rates[batch]
        cells = [f"{found[name]:.0f}" for name in COLUMNS]
        if args.distributed:
            cells.append(f"{found['distributed']:.0f}")
        rows.append([batch, *cells, f"{found['pipe, 2 stages'] / found['plain']:.2f}"])
    print()
    print(table(header, rows))


if __name__ == "__main__":
    if os.environ.get("BENCH_WORKER") == "1":
        worker()
    else:
        main()
