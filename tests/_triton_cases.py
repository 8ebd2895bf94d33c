"""Runs every fused op with the Triton kernels under the interpreter and saves the results.

Run as a script (``TRITON_INTERPRET=1`` must be set before Triton is imported, so it runs in
its own process): ``python tests/_triton_cases.py OUT.pt``. tests/ops/test_ops_triton.py compares the
saved outputs and gradients against the reference backend.
"""
from __future__ import annotations

import os
import sys
from typing import Callable, Dict, List, Tuple

import torch

from fastpipe import ops
from fastpipe.ops import backend

SHAPE = (48, 384)  # about 18k elements: a few programs per kernel
# rows of 100 features (not a power of two) in 9 row blocks of 512 under the interpreter: its 4
# norm-backward programs each loop over 2 or 3 of them, the last one partly masked
MANY_ROWS = (4500, 100)
# (block, rows, n, ROWS, BLOCK_N) of a norm row block whose offsets pass 2^31 (int32 wraps)
FAR_TILE = (2 ** 20 + 3, 2 ** 33, 1000, 4, 8)
LAUNCH_SHAPES = [MANY_ROWS, (2 ** 20, 4096), (64, 65536), (2 ** 16, 1000), (8, 64)]
SMS = 132  # an H200's


def cases() -> Dict[str, Tuple[Callable[..., torch.Tensor], List[torch.Tensor]]]:
    """Name -> (op, inputs), the inputs made from a fixed seed."""
    g = torch.Generator().manual_seed(0)
    rows, n = SHAPE

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)
    return {
        "bias_gelu": (lambda x, b: ops.bias_gelu(x, b), [rand(rows, n), rand(n)]),
        "bias_gelu_tanh": (lambda x, b: ops.bias_gelu(x, b, "tanh"), [rand(rows, n), rand(n)]),
        "bias_dropout_add": (lambda x, b, r: ops.bias_dropout_add(x, b, r, 0.3, True, seed=2 ** 40 + 7,
                                                                  offset=11),
                             [rand(rows, n), rand(n), rand(rows, n)]),
        "rms_norm": (lambda x, w: ops.rms_norm(x, w), [rand(rows, n) * 2, rand(n)]),
        "layer_norm": (lambda x, w, b: ops.layer_norm(x, w, b),
                       [rand(rows, n) * 2 + 1, rand(n), rand(n)]),
        "layer_norm_odd": (lambda x, w, b: ops.layer_norm(x, w, b),
                           [rand(rows * 3, 100), rand(100), rand(100)]),
        "swiglu": (ops.swiglu, [rand(rows, n), rand(rows, n)]),
        "rms_norm_many_rows": (lambda x, w: ops.rms_norm(x, w),
                               [rand(*MANY_ROWS) * 2, rand(MANY_ROWS[1])]),
        "layer_norm_many_rows": (lambda x, w, b: ops.layer_norm(x, w, b),
                                 [rand(*MANY_ROWS) + 1, rand(MANY_ROWS[1]), rand(MANY_ROWS[1])]),
    }


def run(name: str, which: str, dtype: torch.dtype = torch.float32,
        device: str = "cpu") -> List[torch.Tensor]:
    """The output and input gradients of case ``name`` on backend ``which`` (on the CPU)."""
    fn, inputs = cases()[name]
    leaves = [t.to(device, dtype).requires_grad_(True) for t in inputs]
    grad = torch.randn(fn(*[t.detach().cpu() for t in leaves]).shape,
                       generator=torch.Generator().manual_seed(1)).to(device, dtype)
    with backend.forced(which):
        out = fn(*leaves)
        out.backward(grad)
    return [t.cpu() for t in [out.detach()] + [t.grad for t in leaves]]


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("set TRITON_INTERPRET=1 (before Triton is imported)")
    import _triton_probes as probes  # imports Triton: only here, under the interpreter
    results = {(name, str(dtype)): run(name, "triton", dtype)
               for name in cases() for dtype in (torch.float32, torch.bfloat16)}
    results["far_tile_offsets"] = probes.far_tile_offsets(FAR_TILE)
    results["launches"] = probes.launches(LAUNCH_SHAPES, SMS)
    torch.save(results, sys.argv[1])


if __name__ == "__main__":
    main()
