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
from typing import Any, Callable, List, Tuple

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30, help="timed steps before and after")
    parser.add_argument("--steps", type=int, default=5, help="steps traced for the doctor")
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    rows = [run(problem, args) for problem in PROBLEMS]
    print(machine())
    print(table(["problem", "advice", "confidence", "predicted gain", "measured gain",
                 "measured/predicted"], rows))


if __name__ == "__main__":
    main()
