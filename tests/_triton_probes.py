"""Facts about the Triton norm kernels' indexing and launch, gathered in the interpreter's
process by ``tests/_triton_cases.py`` (importing this module imports Triton) and checked by
tests/ops/test_ops_triton.py."""
from __future__ import annotations

from typing import Dict, Sequence, Tuple

import torch
import triton
import triton.language as tl

from fastpipe.ops import triton_kernels
from fastpipe.ops.triton_kernels import NormLaunch, _tile


@triton.jit
def _tile_offsets_kernel(OUT, block, rows, n, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    offs, ok, _ = _tile(block, rows, n, ROWS, BLOCK_N)
    here = tl.arange(0, ROWS)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    tl.store(OUT + here, tl.where(ok, offs, -1))


def far_tile_offsets(tile: Tuple[int, int, int, int, int]) -> torch.Tensor:
    """The offsets the norm kernels' ``_tile`` computes for ``tile`` = (block, rows, n, ROWS,
    BLOCK_N), masked-off positions as -1."""
    block, rows, n, block_rows, block_n = tile
    out = torch.empty(block_rows, block_n, dtype=torch.int64)
    _tile_offsets_kernel[(1,)](out, block, rows, n, ROWS=block_rows, BLOCK_N=block_n)
    return out


def _fields(launch: NormLaunch) -> Dict[str, int]:
    return dict(launch._asdict())  # plain data: the test process loads it without Triton


def launches(shapes: Sequence[Tuple[int, int]], sms: int
             ) -> Dict[Tuple[str, int, int], Dict[str, int]]:
    """``norm_launch`` of each (rows, n) on the host (the interpreter's tile size) and, with the
    GPU's tile size, on a stand-in CUDA device of ``sms`` SMs; each as a dict of its fields."""
    facts = {("cpu", rows, n): _fields(triton_kernels.norm_launch(rows, n, torch.device("cpu")))
             for rows, n in shapes}
    real = triton_kernels._sm_count, triton_kernels.TILE_ELEMENTS
    triton_kernels._sm_count = lambda device: sms
    triton_kernels.TILE_ELEMENTS = triton_kernels.GPU_TILE_ELEMENTS
    try:
        facts.update({("cuda", rows, n): _fields(triton_kernels.norm_launch(
            rows, n, torch.device("cuda", 0))) for rows, n in shapes})
    finally:
        triton_kernels._sm_count, triton_kernels.TILE_ELEMENTS = real
    return facts
