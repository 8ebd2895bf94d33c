"""Command line: ``python -m fastpipe info`` and ``python -m fastpipe demo``."""
from __future__ import annotations

import sys
from typing import List, Optional

USAGE = """usage: python -m fastpipe COMMAND [options]

commands:
  info      versions, native library status, CUDA and Triton availability
  demo      train a small GPT through a pipeline (python -m fastpipe demo --help)
  schedule  print a schedule as a table of actions, with its validation report
            (python -m fastpipe schedule 1f1b --stages 4 --chunks 8); with --from-csv FILE,
            a schedule of PyTorch's pipelining or torchtitan, checked, drawn and simulated
  simulate  time a schedule under given costs, draw its timeline, compare with closed forms
            (python -m fastpipe simulate --schedule 1f1b --stages 4 --chunks 8 --costs 1,2,0)
  doctor    where a traced step's time went and what to change
            (python -m fastpipe doctor trace.json; write it with Trace.write in pipe.trace())
  hf-export a fastpipe.checkpoint directory written in the Hugging Face format
            (python -m fastpipe hf-export CHECKPOINT OUTPUT --config CONFIG_DIR)
  plan      rank the layouts of a training run by predicted step time and memory
            (python -m fastpipe plan --model llama-3-70b --gpus 512 --gpu h100
             --global-batch 1024 --seq 8192)
"""


def main(argv: Optional[List[str]] = None) -> int:
    """Dispatch to a sub-command; returns the process exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "info":
        return _info(rest)
    if command == "schedule":
        return _schedule(rest)
    if command == "simulate":
        from .apps.cli_simulate import main as simulate
        return simulate(rest)
    if command == "doctor":
        from .apps.doctor_cli import main as diagnose
        return diagnose(rest)
    if command == "plan":
        from .apps.cli_plan import main as plan
        return plan(rest)
    if command == "hf-export":
        from .apps.cli_hf import main as export
        return export(rest)
    if command == "demo":
        from .apps.demo import main as demo
        demo(rest)
        return 0
    print(f"unknown command {command!r}\n{USAGE}", end="", file=sys.stderr)
    return 2


def _info(argv: List[str]) -> int:
    """Print the versions, the native library's status and the accelerators found."""
    import argparse

    from .apps.info import format_info
    argparse.ArgumentParser(prog="python -m fastpipe info",
                            description="Print the versions of Python, torch and fastpipe, "
                                        "the native library's status, and the CUDA devices "
                                        "and Triton found.").parse_args(argv)
    print(format_info())
    return 0


def _schedule(argv: List[str]) -> int:
    """Print a schedule's action table, its peak in-flight micro-batches and unit-cost bubble."""
    import argparse

    from .schedule import SCHEDULES, get_schedule
    from .apps.cli_schedule import show_csv, validation_lines
    parser = argparse.ArgumentParser(prog="python -m fastpipe schedule")
    parser.add_argument("name", nargs="?", choices=sorted(SCHEDULES))
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--chunks", type=int, default=8, help="micro-batches")
    parser.add_argument("--virtual", type=int, default=None,
                        help="model chunks per stage (default: the schedule's own)")
    parser.add_argument("--from-csv", metavar="FILE", help="instead of a name: a schedule in "
                        "PyTorch pipelining's / torchtitan's CSV layout, drawn and simulated")
    parser.add_argument("--costs", default="1,1,1", metavar="F,B,W[,P2P]",
                        help="with --from-csv: per-stage costs of the simulation (default 1,1,1)")
    parser.add_argument("--width", type=int, default=None, help="with --from-csv: timeline width")
    args = parser.parse_args(argv)
    if (args.name is None) == (args.from_csv is None):
        parser.error("give either a schedule name or --from-csv FILE")
    if args.from_csv is not None:
        return show_csv(args.from_csv, args.costs, args.width)
    kwargs = {} if args.virtual is None else {"virtual_stages": args.virtual}
    try:
        schedule = get_schedule(args.name, args.stages, args.chunks, **kwargs)
        report = schedule.validate(comm="buffered")
    except (TypeError, ValueError, NotImplementedError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(schedule.format_table())
    print("\n".join(validation_lines(report)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
