"""``python -m fastpipe doctor trace.json``: diagnose a step saved by ``Trace.write``.

Bad input (a missing, truncated or foreign file, a one-stage timeline, a bad option) is one line
on stderr and exit status 2, no traceback.
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence, Tuple

from .cli_simulate import UsageError, Parser
from ..diagnosis.findings import Memory
from ..schedule.trace_file import StepContext, TraceFileError, load_trace
from ..diagnosis.report import doctor

__all__ = ["main"]

PROG = "python -m fastpipe doctor"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the ``doctor`` command on ``argv``; returns the exit code (2 for bad input)."""
    try:
        args = _parser().parse_args(sys.argv[1:] if argv is None else list(argv))
        override = StepContext(balance=_numbers("--balance", args.balance, int),
                               samples=args.samples,
                               layer_costs=_numbers("--layer-costs", args.layer_costs, float))
        memory = _memory(args)
        timeline, context = load_trace(args.trace)
        diagnosis = doctor((timeline, context), context=override, memory=memory)
    except (UsageError, TraceFileError) as error:
        print(f"{PROG}: error: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0
    print(diagnosis.report())
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = Parser(prog=PROG, description="Say where a pipeline step's time went and what to "
                     "change, from a trace written by Trace.write(path).")
    parser.add_argument("trace", help="Chrome/Perfetto trace JSON written inside pipe.trace()")
    parser.add_argument("--balance", metavar="N,N,...",
                        help="layers per stage, when the trace does not record it")
    parser.add_argument("--samples", type=int, help="batch size, when the trace does not "
                        "record it")
    parser.add_argument("--layer-costs", metavar="X,X,...", help="a per-layer cost profile in "
                        "model order (any unit), to split each stage's time over its layers")
    parser.add_argument("--memory", metavar="BYTES,...", help="peak bytes per stage (CUDA "
                        "max_memory_allocated, or saved-activation bytes)")
    parser.add_argument("--memory-limit", metavar="BYTES,...", help="bytes each stage may use")
    return parser


def _numbers(option: str, text: Optional[str], kind: type) -> Optional[Tuple[float, ...]]:
    if text is None:
        return None
    try:
        values = tuple(kind(float(x)) for x in text.split(","))
    except ValueError:
        raise UsageError(f"{option} takes comma-separated numbers, got {text!r}") from None
    if any(v < 0 for v in values):
        raise UsageError(f"{option} takes numbers >= 0, got {text!r}")
    return values


def _memory(args: argparse.Namespace) -> Optional[Memory]:
    peak = _numbers("--memory", args.memory, float)
    limit = _numbers("--memory-limit", args.memory_limit, float)
    if peak is None:
        if limit is not None:
            raise UsageError("--memory-limit needs --memory (the peak bytes per stage)")
        return None
    if limit is not None and len(limit) != len(peak):
        raise UsageError(f"--memory-limit has {len(limit)} entries, --memory {len(peak)}; "
                         f"give one per stage to both")
    return Memory(peak, limit)
