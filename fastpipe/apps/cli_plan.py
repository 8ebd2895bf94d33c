"""``python -m fastpipe plan``: which layout to run, predicted before renting the GPUs.

A model (a Hugging Face ``config.json``, a known name, or ``--layers/--hidden/--heads/--vocab``),
the GPUs (count, type, per node, memory) and the step (global batch, sequence length) in; the
feasible layouts ranked by predicted step time out, with tokens/s per GPU, MFU and peak memory,
the best one's schedule drawn, and ``--json``. ``--calibrate`` measures one layer on this
machine instead of naming a GPU type.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Dict, NoReturn, Optional, Sequence

from ..planning.hardware import GPUS
from ..planning.layout import CHECKPOINT_MODES, ORDERS
from ..planning.model_shape import KNOWN, ModelShape, model_shape
from ..planning.plan import GIB, Plan, plan, write_json
from ..planning.runtime_model import RUNTIMES

__all__ = ["main"]

PROG = "python -m fastpipe plan"
_FIXABLE = {"tensor": int, "pipeline": int, "data": int, "shard": int, "replicas": int,
            "virtual": int, "micro_batch": int, "schedule": str, "checkpoint": str, "order": str}


class UsageError(Exception):
    """A bad argument: one line on stderr, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Rank the layouts of a training run by predicted "
                     "step time, tokens/s per GPU, MFU and peak memory.")
    model = parser.add_argument_group("the model")
    model.add_argument("--model", help=f"a Hugging Face config.json, or one of "
                       f"{', '.join(sorted(KNOWN))}")
    for name in ("layers", "hidden", "heads", "vocab", "ffn", "kv-heads", "experts", "top-k"):
        model.add_argument(f"--{name}", type=int, help="a dimension (instead of --model, or "
                           "overriding it)")
    model.add_argument("--gated", action="store_true", help="SwiGLU MLP (three matrices)")
    hardware = parser.add_argument_group("the hardware")
    hardware.add_argument("--gpus", type=int, required=True, help="GPUs in all")
    hardware.add_argument("--gpu", default="h100", help=f"GPU type: one of "
                          f"{', '.join(sorted(GPUS))} (or a100, h100, h200)")
    hardware.add_argument("--gpus-per-node", type=int, default=None)
    hardware.add_argument("--memory", type=float, default=None,
                          help="GiB per GPU a layout may use (default: the GPU's)")
    hardware.add_argument("--calibrate", action="store_true",
                          help="measure one layer on this machine's CPU and plan for it")
    step = parser.add_argument_group("the step")
    step.add_argument("--global-batch", type=int, required=True, help="sequences per step")
    step.add_argument("--seq", type=int, required=True, help="tokens per sequence")
    step.add_argument("--runtime", default="fastpipe", choices=sorted(RUNTIMES))
    step.add_argument("--schedules", default=None,
                      help="comma-separated schedules to weigh (default: every flush schedule)")
    step.add_argument("--fix", action="append", default=[], metavar="KNOB=VALUE",
                      help=f"hold a knob: {', '.join(_FIXABLE)} (e.g. --fix tensor=8)")
    step.add_argument("--balance", default="even", choices=("even", "lighter-ends"))
    out = parser.add_argument_group("the output")
    out.add_argument("--top", type=int, default=10, help="layouts shown (default 10)")
    out.add_argument("--width", type=int, default=100, help="schedule drawing width")
    out.add_argument("--json", metavar="PATH", help="also write every ranked layout as JSON")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the ``plan`` command on ``argv``; returns the exit code (2 for bad arguments)."""
    try:
        args = _parser().parse_args(sys.argv[1:] if argv is None else list(argv))
        result = _plan(args)
    except UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0
    print(_header(result))
    print(result.table(args.top))
    print()
    print(f"best layout's schedule ({result.best.layout.describe()}), first "
          f"{result.best.simulated_microbatches} micro-batches:")
    print(result.drawing(args.width))
    if args.json:
        write_json(result, args.json)
        print(f"wrote {args.json}")
    return 0


def _plan(args: argparse.Namespace) -> Plan:
    shape = _shape(args)
    fixed = _fixed(args.fix)
    device: Any = args.gpu
    rt = args.runtime
    if args.calibrate:
        from ..planning.calibrate import CPU_RUNTIME, calibrate
        micro = fixed.get("micro_batch", 1)
        device = calibrate(shape, args.seq, micro if isinstance(micro, int) else 1)
        rt = CPU_RUNTIME if rt == "fastpipe" else rt
    schedules = args.schedules.split(",") if args.schedules else None
    try:
        return plan(shape, args.gpus, device, global_batch=args.global_batch, seq=args.seq,
                    gpus_per_node=args.gpus_per_node,
                    memory=None if args.memory is None else args.memory * GIB,
                    runtime=rt, schedules=schedules, fixed=fixed,
                    balance=args.balance, top=max(1, args.top))
    except ValueError as exc:
        raise UsageError(" ".join(str(exc).split())) from None


def _shape(args: argparse.Namespace) -> ModelShape:
    dims = {key: getattr(args, key) for key in ("layers", "hidden", "heads", "vocab", "ffn",
                                                "kv_heads", "experts", "top_k")
            if getattr(args, key) is not None}
    if args.gated:
        dims["gated"] = True
    try:
        if args.model is not None:
            return model_shape(args.model, **dims)
        missing = [k for k in ("layers", "hidden", "heads", "vocab") if k not in dims]
        if missing:
            raise UsageError("give --model (a config.json or a known name) or --layers, "
                             "--hidden, --heads and --vocab")
        return ModelShape(**dims)
    except (OSError, ValueError, TypeError) as exc:
        raise UsageError(" ".join(str(exc).split())) from None


def _fixed(items: Sequence[str]) -> Dict[str, object]:
    fixed: Dict[str, object] = {}
    for item in items:
        key, _, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if key not in _FIXABLE or not value:
            raise UsageError(f"--fix {item!r}: give KNOB=VALUE with KNOB one of "
                             f"{', '.join(_FIXABLE)}")
        try:
            fixed[key] = _FIXABLE[key](value)
        except ValueError:
            raise UsageError(f"--fix {item!r}: {key} takes a whole number") from None
    if fixed.get("checkpoint") not in (None, *CHECKPOINT_MODES):
        raise UsageError(f"--fix checkpoint: one of {', '.join(CHECKPOINT_MODES)}")
    if fixed.get("order") not in (None, *ORDERS):
        raise UsageError(f"--fix order: one of {', '.join(ORDERS)}")
    return fixed


def _header(result: Plan) -> str:
    work, counts = result.work, result.counts
    how = "calibrated" if "efficiency" in result.gpu.calibrated else "stated"
    return (f"{work.model.name}: {work.model.params() / 1e9:.3g}B parameters, "
            f"{work.global_batch} x {work.seq} tokens per step on {result.gpus} x "
            f"{result.gpu.name} ({result.runtime.name}); {counts.get('considered', 0)} layouts "
            f"considered, {counts.get('memory', 0)} over {result.memory / GIB:.0f} GiB, "
            f"{counts.get('simulated', 0)} simulated; efficiency "
            f"{result.gpu.efficiency:.3g} ({how})")
