"""``python -m fastpipe simulate``: time a schedule, draw it, and compare with closed forms.

Costs on the command line are per physical stage and split evenly across the
stage's chunks (see :mod:`fastpipe.schedule.recommend`), so runs with different
``--virtual`` do the same total work.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn, Sequence

from ..schedule import SCHEDULES
from ..schedule import render
from ..schedule.recommend import make_schedule, per_chunk_costs
from ..schedule.simulator import Costs, SimulationResult, simulate

__all__ = ["main", "closed_form", "report"]

PROG = "python -m fastpipe simulate"


class UsageError(Exception):
    """A bad command-line argument; reported as one line on stderr with exit code 2."""


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors raise ``UsageError`` (one line, exit status 2)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``simulate`` command on ``argv``; returns the exit code (2 for bad arguments)."""
    try:
        args = _parser().parse_args(sys.argv[1:] if argv is None else list(argv))
        costs = _costs(args.costs)
        result = _simulate(args, costs)
    except UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0
    print(render.ascii(result.timeline, args.width))
    print()
    print(report(result, args.schedule.lower(), costs))
    return _write_pictures(result, args)


DEFAULT_VIRTUAL = {"interleaved": 2, "looped-bfs": 2, "zbv": 2, "dualpipev": 2}
"""Chunks per stage when ``--virtual`` is not given: what each schedule is usually run with."""


def _parser() -> argparse.ArgumentParser:
    parser = Parser(prog=PROG, description="Simulate a pipeline schedule and draw its timeline.")
    names = ", ".join(sorted(SCHEDULES))
    parser.add_argument("--schedule", default="1f1b",
                        help=f"registered schedule name (default 1f1b): {names}")
    parser.add_argument("--stages", type=int, default=4, help="physical stages (default 4)")
    parser.add_argument("--chunks", type=int, default=8, help="micro-batches (default 8)")
    parser.add_argument("--virtual", type=int, default=None,
                        help="model chunks per stage (default: the schedule's own, 2 for "
                             "interleaved, looped-bfs, zbv and dualpipev, else 1)")
    parser.add_argument("--costs", default="1,1,1", metavar="F,B,W[,P2P]",
                        help="per-stage forward, input-gradient and weight-gradient costs and "
                             "optional transfer latency; each chunk gets 1/virtual of the "
                             "compute (default 1,1,1)")
    parser.add_argument("--width", type=int, default=None,
                        help="text timeline width in columns, in one band (default: wide enough "
                             "for the labels, wrapped in bands of 100 columns)")
    parser.add_argument("--png", metavar="PATH", help="also draw the timeline as a PNG")
    parser.add_argument("--trace", metavar="PATH", help="also write a Chrome/Perfetto trace")
    return parser


def _costs(text: str) -> Costs:
    try:
        return Costs.parse(text)
    except ValueError as exc:
        raise UsageError(f"--costs: {exc}") from None


def _simulate(args: argparse.Namespace, costs: Costs) -> SimulationResult:
    """Check the sizes and name, generate the schedule and simulate it with per-chunk costs."""
    if args.virtual is None:
        args.virtual = DEFAULT_VIRTUAL.get(args.schedule.lower(), 1)
    for name in ("stages", "chunks", "virtual", "width"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UsageError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.schedule.lower() not in SCHEDULES:
        raise UsageError(f"unknown schedule {args.schedule!r}; "
                         f"known: {', '.join(sorted(SCHEDULES))}")
    try:
        schedule = make_schedule(args.schedule, args.stages, args.chunks, args.virtual)
    except (ValueError, TypeError, NotImplementedError) as exc:
        raise UsageError(_one_line(exc)) from None
    return simulate(schedule, per_chunk_costs(costs, schedule))


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def _write_pictures(result: SimulationResult, args: argparse.Namespace) -> int:
    try:
        if args.trace:
            render.write_chrome_trace(result.timeline, args.trace)
            print(f"wrote Chrome trace to {args.trace}")
        if args.png:
            render.png(result.timeline, args.png)
            print(f"wrote PNG to {args.png}")
    except (ImportError, OSError) as exc:
        print(f"{PROG}: error: {_one_line(exc)}", file=sys.stderr)
        return 1
    return 0


# -- the summary table ------------------------------------------------------------------


def report(result: SimulationResult, name: str, stage_costs: Costs) -> str:
    """The summary table: makespan and bubble, simulated and closed form (from the
    per-stage ``stage_costs``), then per stage busy time, peak in-flight (chunk,
    micro-batch) pairs and peak activation memory."""
    schedule = result.schedule
    expected = closed_form(name, schedule.num_stages, schedule.num_microbatches,
                           schedule.num_chunks, stage_costs if stage_costs.is_uniform else None)
    known = ("-", "-") if expected is None else (f"{expected[0]:.6g}", f"{expected[1]:.2%}")
    lines = [
        f"{name}: {schedule.num_stages} stages, {schedule.num_microbatches} micro-batches, "
        f"{schedule.num_chunks} chunk(s) per stage",
        f"{'':<16}{'simulated':>12}{'closed form':>14}",
        f"{'makespan':<16}{result.makespan:>12.6g}{known[0]:>14}",
        f"{'bubble fraction':<16}{result.bubble_fraction:>12.2%}{known[1]:>14}",
        "",
        f"{'stage':<8}{'busy':>12}{'peak in-flight':>16}{'peak memory':>14}",
    ]
    for stage in range(schedule.num_stages):
        lines.append(f"{stage:<8}{result.busy[stage]:>12.6g}"
                     f"{result.peak_inflight[stage]:>16}{result.peak_memory[stage]:>14.4g}")
    return "\n".join(lines)


def closed_form(
    name: str, stages: int, microbatches: int, virtual: int, costs: Costs | None
) -> tuple[float, float] | None:
    """Closed-form (makespan, bubble fraction) where one is known, else ``None``.

    With per-stage costs ``f``, ``b`` (here ``backward + weight``: these
    schedules run no separate ``W``), latency ``c``, ``p`` stages, ``m``
    micro-batches and ``v`` chunks per stage:

    * gpipe: ``(m+p-1)(f+b) + 2(p-1)c``;
    * 1f1b: ``(m+p-1)(f+b) + 2c(p-1 + floor((m-1)(p-1)/p))``;
    * interleaved, ``c = 0`` and ``m`` a multiple of ``p``: ``m(f+b) + (p-1)(f+b)/v``.

    Every stage is busy ``m(f+b)``, so the bubble is ``1 - m(f+b)/makespan``;
    with ``c = 0`` that is ``(p-1)/(m+p-1)`` and ``(p-1)/(vm+p-1)``.
    """
    if costs is None:
        return None
    p, m, v, c = stages, microbatches, virtual, costs.p2p
    work = costs.forward + costs.backward + costs.weight
    key = name.lower()
    if key == "gpipe" and v == 1:
        makespan = (m + p - 1) * work + 2 * (p - 1) * c
    elif key == "1f1b" and v == 1:
        makespan = (m + p - 1) * work + 2 * c * (p - 1 + (m - 1) * (p - 1) // p)
    elif key == "interleaved" and c == 0 and m % p == 0:
        makespan = m * work + (p - 1) * work / v
    else:
        return None
    return (makespan, 1 - m * work / makespan) if makespan > 0 else None
