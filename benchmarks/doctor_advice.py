"""Does the doctor's advice pay? For each planted problem, trace several steps, take the advice,
apply it, and time the step before and after.

Problems, on two CPU stages of layers that each multiply by one weight ``reps`` times (work in
proportion to ``reps``): one slow layer (the last, 5x the work; its layer profile from
``fastpipe.layer_costs.profile_times`` is passed to the doctor), too few micro-batches (one), an
input-bound loader (it sleeps about 40% of a step), a checkpoint mode that recomputes with
memory to spare (``checkpoint='always'``, the limit half the machine's memory per stage).
Applied: a new ``Pipe`` with the advised balance, chunks, schedule or checkpoint mode; for the
loader, the next batch loaded while the step runs. Steps before and after are timed
interleaved (``time_interleaved``); the table gives the medians' gain against the predicted
one. The claim to check on a quiet machine: measured / predicted >= 0.5 for every row with
advice (a hardware finding, e.g. a busy machine, withholds the balance advice).

    python benchmarks/doctor_advice.py [--rounds 30 --steps 5 --dim 1024 --batch 64]
    python benchmarks/doctor_advice.py --rounds 2 --steps 3 --dim 32 --batch 16   # smoke run

``--distributed`` asks the same of ``DistributedPipe``: the README's unbalanced model (the demo
GPT, 6 blocks, ``balance=[2, 6]``, 2 micro-batches, 1F1B) on 2 gloo ranks, one thread each,
``--runs`` times from scratch (3 by default): trace ``--steps`` steps, take the doctor's balance
or chunks advice (rank 0 diagnoses the gathered timeline, with each layer's profile, and
sends the advice to the other rank), build the advised pipe and time both interleaved. Each
run gives the advice (or why there is none: the doctor's findings), the predicted and the
measured gain; the claim to check on a quiet machine with a core per rank: measured /
predicted >= 0.5 in every run that gives advice.

    python benchmarks/doctor_advice.py --distributed [--runs 3 --rounds 20 --steps 5]
"""
from __future__ import annotations

import argparse
import copy
import os

# One intra-op thread per stage, as CPU pipelines should run (see overhead.py): with every
# stage's kernels on all cores, the stages cannot overlap, whatever the advice.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Tuple

import torch
from torch import nn

import fastpipe
from fastpipe.diagnosis.findings import Finding, Memory
from fastpipe.layer_costs import first_microbatch, profile_times
from fastpipe.memory import SavedActivationMeter
from _common import machine, median, table, time_interleaved

LAYERS = 8


class Work(nn.Module):
    """``reps`` multiplications by one weight: work in proportion to ``reps``."""

    def __init__(self, dim: int, reps: int) -> None:
        super().__init__()
        self.linear, self.reps = nn.Linear(dim, dim), reps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.reps):
            x = torch.tanh(self.linear(x))
        return x


def model(dim: int, slow: bool) -> nn.Sequential:
    return nn.Sequential(*(Work(dim, 5 if slow and i == LAYERS - 1 else 1)
                           for i in range(LAYERS)))


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


class Problem:
    """A planted problem: the pipe's arguments, the loader's sleep, the finding it expects."""

    def __init__(self, name: str, kind: str, slow: bool = False, sleep: float = 0.0,
                 batches: int = 1, **pipe: Any) -> None:
        self.name, self.kind, self.slow, self.sleep = name, kind, slow, sleep
        self.batches = batches  # the batch is --batch times this
        # a worker thread per stage: the stages overlap, which is what the advice is about
        # (with actions this short, cpu_workers=None would run both stages on one thread)
        self.pipe = {"balance": [4, 4], "chunks": 8, "schedule": "1f1b", "checkpoint": "never",
                     "cpu_workers": 2, **pipe}


PROBLEMS = (
    Problem("one slow layer", "imbalance", slow=True),
    # a batch large enough that a quarter of it is still an efficient matrix product: the
    # doctor assumes an action's time shrinks in proportion to its micro-batch
    Problem("too few micro-batches", "chunks", chunks=1, batches=8),
    Problem("input-bound loader", "input", sleep=-0.4),  # negative: a share of a step
    Problem("recomputation to spare", "memory", checkpoint="always"),
)


def build(module: nn.Sequential, **options: Any) -> fastpipe.Pipe:
    return fastpipe.Pipe(copy.deepcopy(module), devices=["cpu", "cpu"], **options)


def loader(args: argparse.Namespace, sleep: float) -> Callable[[], Tuple[torch.Tensor, ...]]:
    """A data loader that takes ``sleep`` seconds per batch."""
    def load() -> Tuple[torch.Tensor, ...]:
        time.sleep(sleep)
        return torch.randn(args.batch, args.dim), torch.randn(args.batch, args.dim)
    return load


def prefetching(load: Callable[[], Any]) -> Callable[[], Any]:
    """The same loader, the next batch loaded on a thread while the caller works."""
    pool = ThreadPoolExecutor(1)
    pending = [pool.submit(load)]

    def next_batch() -> Any:
        batch = pending.pop().result(timeout=60)
        pending.append(pool.submit(load))
        return batch
    return next_batch


def diagnose(pipe: fastpipe.Pipe, load: Callable[[], Any], args: argparse.Namespace,
             problem: Problem, module: nn.Sequential) -> fastpipe.Diagnosis:
    """Trace ``args.steps`` steps (after two warm-ups, the second one's saved activations
    counted) and ask the doctor."""
    pipe.train_step(*load(), mse)
    with SavedActivationMeter.of_stages(pipe) as meter:
        pipe.train_step(*load(), mse)
    with pipe.trace() as t:
        for _ in range(args.steps):
            pipe.train_step(*load(), mse)
    memory = Memory(tuple(float(b) for b in meter.peak_bytes),
                    (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2.0,) * 2)
    sample = first_microbatch(load()[0], pipe.chunks)
    profile = profile_times(module, sample) if problem.slow else None
    return fastpipe.doctor(t, memory=memory, layer_costs=profile)


def applied(problem: Problem, finding: Finding, module: nn.Sequential,
            load: Callable[[], Any]) -> Tuple[fastpipe.Pipe, Callable[[], Any]]:
    """The pipe and loader with the finding's advice applied."""
    options = dict(problem.pipe)
    if finding.balance is not None:
        options["balance"] = list(finding.balance)
    if finding.chunks is not None:
        options["chunks"] = finding.chunks
    if finding.schedule is not None:
        options["schedule"] = finding.schedule
    mode = re.search(r"checkpoint='(\w+)'", finding.fix or "")
    if finding.kind == "memory" and mode:
        options["checkpoint"] = mode.group(1)
    return build(module, **options), prefetching(load) if finding.kind == "input" else load


def run(problem: Problem, args: argparse.Namespace) -> List[str]:
    """One row of the table: the advice, its confidence, predicted and measured gains."""
    module = model(args.dim, problem.slow)
    args = argparse.Namespace(**{**vars(args), "batch": args.batch * problem.batches})
    before = build(module, **problem.pipe)
    sleep = problem.sleep
    if sleep < 0:  # a share of a step without it
        sleep = -sleep * _step_time(before, loader(args, 0.0))
    load = loader(args, sleep)
    diagnosis = diagnose(before, load, args, problem, module)
    finding = diagnosis.finding(problem.kind)
    if finding is None or finding.gain <= 0:
        other = "; ".join(f.kind for f in diagnosis.findings) or "none"
        return [problem.name, f"no {problem.kind} advice (found: {other})", "-", "-", "-", "-"]
    after, after_load = applied(problem, finding, module, load)
    times = time_interleaved({"before": lambda: before.train_step(*load(), mse),
                              "after": lambda: after.train_step(*after_load(), mse)},
                             rounds=args.rounds)
    predicted = finding.gain / diagnosis.step_time
    measured = 1.0 - median(times["after"]) / median(times["before"])
    advice = _advice(finding)
    return [problem.name, advice, f"{finding.confidence} ({diagnosis.noise.describe()})",
            f"{predicted:.0%}", f"{measured:.0%}", f"{measured / predicted:.2f}"]


def _advice(finding: Finding) -> str:
    for name in ("balance", "chunks", "schedule"):
        value = getattr(finding, name)
        if value is not None:
            return f"{name}={list(value) if name == 'balance' else value!r}"
    return (finding.fix or finding.kind).split(";")[0][:40]


def _step_time(pipe: fastpipe.Pipe, load: Callable[[], Any]) -> float:
    times = []
    for _ in range(3):
        batch = load()
        start = time.perf_counter()
        pipe.train_step(*batch, mse)
        times.append(time.perf_counter() - start)
    return median(times)


README_MODEL = dict(vocab=64, dim=128, layers=6, max_len=32)
README_PIPE = dict(balance=[2, 6], chunks=2, schedule="1f1b", checkpoint="never")


def distributed_worker() -> None:
    """One rank of a ``--distributed`` run: trace, diagnose on rank 0, apply, time both."""
    import json
    import torch.distributed as dist
    from fastpipe.apps.models import counting_task, gpt, lm_loss
    from fastpipe.distributed import DistributedPipe
    args = argparse.Namespace(**json.loads(os.environ["ADVICE_ARGS"]))
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    data = torch.Generator().manual_seed(0)

    def build(**options: Any) -> DistributedPipe:
        torch.manual_seed(0)
        return DistributedPipe(gpt(**README_MODEL), **{**README_PIPE, **options})

    def load() -> Tuple[torch.Tensor, torch.Tensor]:
        return counting_task(32, 32, README_MODEL["vocab"], data)

    before = build()
    before.train_step(*load(), lm_loss)  # warm-up
    with before.trace() as t:
        for _ in range(args.steps):
            before.train_step(*load(), lm_loss)
    advice: List[Any] = [None]
    if rank == 0:
        torch.manual_seed(0)
        whole = gpt(**README_MODEL)
        profile = profile_times(whole, first_microbatch(load()[0], README_PIPE["chunks"]))
        diagnosis = fastpipe.doctor(t, layer_costs=profile)
        found = diagnosis.finding("imbalance") or diagnosis.finding("chunks")
        advice[0] = ({"kind": found.kind, "balance": found.balance, "chunks": found.chunks,
                      "gain": found.gain / diagnosis.step_time,
                      "confidence": f"{found.confidence} ({diagnosis.noise.describe()})"}
                     if found is not None and found.gain > 0 else
                     {"why": "; ".join(f"{f.kind}: {f.message}" for f in diagnosis.findings)
                      or "no finding", "noise": diagnosis.noise.describe()})
    dist.broadcast_object_list(advice, src=0)
    result = dict(advice[0])
    if "kind" in result:
        options: Dict[str, Any] = {}
        if result["balance"] is not None:
            options["balance"] = list(result["balance"])
        if result["chunks"] is not None:
            options["chunks"] = result["chunks"]
        after = build(**options)
        times: Dict[str, List[float]] = {"before": [], "after": []}
        for step in range(args.rounds + 2):
            for name, pipe in (("before", before), ("after", after)):
                batch = load()
                dist.barrier()
                start = time.perf_counter()
                pipe.train_step(*batch, lm_loss)
                if step >= 2:
                    times[name].append(time.perf_counter() - start)
        result["measured"] = 1.0 - median(times["after"]) / median(times["before"])
    if rank == 0:
        print("ADVICE " + json.dumps(result), flush=True)
    dist.destroy_process_group()


def run_distributed(args: argparse.Namespace) -> None:
    """``--runs`` independent 2-rank runs; one table row each."""
    import json
    from _common import run_ranks
    rows = []
    for run in range(1, args.runs + 1):
        out = run_ranks(os.path.abspath(__file__), 2,
                        {"ADVICE_WORKER": "1", "ADVICE_ARGS": json.dumps(vars(args))},
                        limit=1800)
        result = json.loads(next(x for x in out.splitlines() if x.startswith("ADVICE "))[7:])
        if "kind" not in result:
            rows.append([run, f"no advice ({result['noise']}): {result['why'][:120]}", "-",
                         "-", "-", "-"])
            continue
        change = (f"balance={list(result['balance'])}" if result["balance"] is not None
                  else f"chunks={result['chunks']}")
        rows.append([run, change, result["confidence"], f"{result['gain']:.0%}",
                     f"{result['measured']:.0%}", f"{result['measured'] / result['gain']:.2f}"])
    print(machine())
    print("DistributedPipe, 2 gloo ranks, the README's model with balance=[2, 6]")
    print(table(["run", "advice", "confidence", "predicted gain", "measured gain",
                 "measured/predicted"], rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30, help="timed steps before and after")
    parser.add_argument("--steps", type=int, default=5, help="steps traced for the doctor")
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--distributed", action="store_true",
                        help="the README's unbalanced model on 2 DistributedPipe ranks instead")
    parser.add_argument("--runs", type=int, default=3, help="with --distributed: runs")
    args = parser.parse_args()
    if args.distributed:
        run_distributed(args)
        return
    torch.manual_seed(0)
    torch.set_num_threads(1)
    rows = [run(problem, args) for problem in PROBLEMS]
    print(machine())
    print(table(["problem", "advice", "confidence", "predicted gain", "measured gain",
                 "measured/predicted"], rows))


if __name__ == "__main__":
    if os.environ.get("ADVICE_WORKER"):
        distributed_worker()
    else:
        main()
