"""``examples/train_elastic.py`` as ``tests/runtime/test_elastic.py`` runs it under torchrun: the same
training, a failure injected into one rank on the job's first attempt, and each rank's final
state written as a digest.

    python -m torch.distributed.run --standalone --nproc_per_node=2 --max-restarts=1 \\
        tests/elastic_job.py --out DIR --fail sigkill --fail-rank 1 --fail-step 4 -- \\
        --dir DIR/ckpts --steps 8 --save-every 3

``--fail exit|raise|sigkill`` on ``--fail-rank`` during optimizer step ``--fail-step``, in the
middle of a forward (``--fail-where forward``) or of a backward (``backward``), or inside the
first checkpoint saved from that step on, as it writes its data (``save``), on the first
attempt only (``TORCHELASTIC_RESTART_COUNT`` 0). Every rank writes
``DIR/attempt<N>-rank<R>.json`` when its attempt ends: the step it resumed at, and on success
a SHA-256 of its parameters and optimizer state; on a failure, the error it raised and how
long after the injected failure (whose time the victim wrote into ``DIR/injected-at``)."""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))

import train_elastic  # noqa: E402

KINDS = ("exit", "raise", "sigkill")
EXIT_CODE = 21  # what an ``exit`` failure exits with
INJECTED_AT = "injected-at"  # the file that says when the failure was injected (time.time())


class InjectedFailure(RuntimeError):
    """The failure a ``raise`` injection raises inside a layer."""


def parse(argv: List[str]) -> tuple:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--fail", choices=KINDS, default=None)
    parser.add_argument("--fail-rank", type=int, default=0)
    parser.add_argument("--fail-step", type=int, default=0)
    parser.add_argument("--fail-where", choices=("forward", "backward", "save"),
                        default="forward")
    parser.add_argument("--fail-call", type=int, default=3,
                        help="fail at this module call of the step (forward or backward)")
    split = argv.index("--") if "--" in argv else len(argv)
    return parser.parse_args(argv[:split]), argv[split + 1:]


def attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def fail(kind: str, out: str) -> None:
    """The injected failure itself; writes when it happened into ``out`` first."""
    with open(os.path.join(out, INJECTED_AT), "w") as f:
        f.write(repr(time.time()))
    if kind == "exit":
        os._exit(EXIT_CODE)
    if kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise InjectedFailure(f"injected failure on rank {dist.get_rank()}")


def injector(options: argparse.Namespace) -> Optional[Any]:
    """The ``on_step`` callback that arms the failure (or None where none is due)."""
    if options.fail is None or attempt() != 0:
        return None
    calls = [0]

    def hook(*_: Any) -> None:
        calls[0] += 1
        if calls[0] == options.fail_call:
            fail(options.fail, options.out)

    def on_step(step: int) -> None:
        if step != options.fail_step or dist.get_rank() != options.fail_rank:
            return
        if options.fail_where == "forward":
            torch.nn.modules.module.register_module_forward_hook(hook)
        elif options.fail_where == "backward":
            torch.nn.modules.module.register_module_full_backward_hook(hook)
        else:  # inside the next checkpoint's save, as its data are written
            dcp.save = lambda *args, **kwargs: fail(options.fail, options.out)
    return on_step


def raw(tensor: torch.Tensor) -> bytes:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def digest(trained: Any) -> str:
    """SHA-256 of this rank's parameters and buffers and of its optimizer state, bit for bit."""
    h = hashlib.sha256()
    for name, value in sorted(trained.pipe.state_dict().items()):
        h.update(name.encode())
        h.update(raw(value))
    state = trained.optimizer.state_dict()
    for key in sorted(state["state"]):
        for name, value in sorted(state["state"][key].items()):
            h.update(f"{key}.{name}".encode())
            if torch.is_tensor(value):
                h.update(raw(value))
            else:
                h.update(repr(value).encode())
    return h.hexdigest()


def report(out: str, record: Dict[str, Any]) -> None:
    path = os.path.join(out, f"attempt{attempt()}-rank{dist.get_rank()}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)


def injected_at(out: str) -> Optional[float]:
    try:
        with open(os.path.join(out, INJECTED_AT)) as f:
            return float(f.read())
    except (OSError, ValueError):  # no failure injected (or not yet written)
        return None


def main() -> None:
    options, rest = parse(sys.argv[1:])
    args = train_elastic.parse(rest)
    train_elastic.start(args)
    record: Dict[str, Any] = {"attempt": attempt(), "rank": dist.get_rank()}
    try:
        trained = train_elastic.train(args, on_step=injector(options))
    except BaseException as error:
        when = injected_at(options.out)
        record.update(error=type(error).__name__, message=str(error),
                      notes=list(getattr(error, "__notes__", [])),
                      seconds=None if when is None else time.time() - when)
        report(options.out, record)
        raise
    record.update(resumed_at=trained.resumed_at, digest=digest(trained),
                  params=sum(p.numel() for p in trained.pipe.parameters()))
    report(options.out, record)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
