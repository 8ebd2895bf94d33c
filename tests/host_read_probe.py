"""Conversions of tensors to host values that fastpipe's code makes outside ``HostReads``.

On a CPU run every tensor lives on the host, so a read of what would be a device buffer on a
GPU that skips the counter (``pipe.last_step.host_reads``) would go unseen. :func:`raw_reads`
patches ``torch.Tensor``'s conversions to host values while a block runs and records the
fastpipe function that made each one outside ``HostReads``; :func:`unexplained` drops those of
``HOST_TENSORS``, functions whose tensor lives on the host on any device (each with the reason),
so a test can assert that nothing else remains.
"""
from __future__ import annotations

import collections
import contextlib
import os
import traceback
from typing import Counter, Dict, Iterator, Tuple

import torch

import fastpipe

PACKAGE = os.path.dirname(os.path.abspath(fastpipe.__file__)) + os.sep

CONVERSIONS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "cpu", "numpy")
COUNTED = ("read", "number", "values")  # HostReads' own methods (fastpipe/runtime/transport/wire)

Where = Tuple[str, str]  # (file under fastpipe/, function)

HOST_TENSORS: Dict[Where, str] = {
    ("policies/checkpoint.py", "draw_step_seed"): "the step's seed, from the CPU generator",
    ("runtime/gradients/grad_norm.py", "clip_"): "the clip factor, made from the host's norm",
    ("runtime/transport/wire.py", "decode"): "a header already on the host (side channel, or "
                                             "a HostReads copy)",
    ("runtime/drivers/per_rank.py", "gather_reports"): "the reports, gathered as CPU tensors",
}


@contextlib.contextmanager
def raw_reads() -> Iterator[Counter[Where]]:
    """Within the block, count each conversion that fastpipe's code makes itself outside
    ``HostReads``, by the function that makes it."""
    found: Counter[Where] = collections.Counter()
    originals = {name: getattr(torch.Tensor, name) for name in CONVERSIONS}

    def recording(name: str):
        original = originals[name]

        def convert(self, *args, **kwargs):
            stack = traceback.extract_stack()[:-1]
            where = [(os.path.relpath(os.path.abspath(f.filename), PACKAGE).replace(os.sep, "/"),
                      f.name) for f in stack if os.path.abspath(f.filename).startswith(PACKAGE)
                     and not f.name.startswith("<")]  # a comprehension: its function's
            made_here = os.path.abspath(stack[-1].filename).startswith(PACKAGE)  # not a
            # loss_fn's own conversion (the caller's read), though fastpipe called it
            if made_here and not any(w == ("runtime/transport/wire.py", name) for w in where
                                     for name in COUNTED):
                found[where[-1]] += 1
            return original(self, *args, **kwargs)
        return convert

    try:
        for name in CONVERSIONS:
            setattr(torch.Tensor, name, recording(name))
        yield found
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def unexplained(found: Counter[Where]) -> Dict[str, int]:
    """The recorded conversions not of a host tensor (``file:function`` -> count)."""
    return {f"{file}:{name}": n for (file, name), n in found.items()
            if (file, name) not in HOST_TENSORS}
