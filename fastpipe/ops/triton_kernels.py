"""Triton kernels of the fused ops (GPU), with launchers named and shaped like the functions of
``fastpipe.ops.reference``. Importing this module imports Triton (ImportError without it).

Element-wise kernels cover the flattened tensor in blocks; the normalisations cut the rows into
blocks of whole rows. The forward runs one program per row block; the backward runs a bounded
number of programs (a few per SM), each looping over every so-many row blocks and accumulating
its weight- and bias-gradient partial sums in registers, so the partial buffers PyTorch reduces
are (programs x features), not (rows x features). Row offsets are int64 (rows x features passes
2^31 in large activations), and the warps per program grow with the row block so that wide rows
do not spill registers. Arithmetic is in float32; float64 inputs take the reference path. The
dropout hash mirrors ``fastpipe.ops.reference.dropout_keep`` in int64 arithmetic, bit for bit.
Under ``TRITON_INTERPRET=1`` (set before Triton is imported) they run on the CPU, with larger
blocks since the interpreter's cost is per program.
"""
from __future__ import annotations

import functools
import os
from typing import NamedTuple, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import reference

INTERPRETED = os.environ.get("TRITON_INTERPRET", "") == "1"
ELEMENT_BLOCK = 16384 if INTERPRETED else 1024
GPU_TILE_ELEMENTS = 4096  # rows x features of one norm row block on a GPU
TILE_ELEMENTS = 65536 if INTERPRETED else GPU_TILE_ELEMENTS
MAX_FEATURES = 65536  # one row must fit in one block
RESIDENT_WARPS = 32  # warps per SM the norm backward aims for: enough to hide memory latency
HOST_PROGRAMS = 4  # norm backward programs off CUDA (the interpreter): each loops over row blocks


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _keep(idx, offset, key, threshold):
    c = idx.to(tl.int64) + offset
    r = _mix32(_mix32((c & 0xFFFFFFFF) ^ key) ^ (c >> 32))
    return (r >> 8) >= threshold


@triton.jit
def _tanh(z):
    return 1.0 - 2.0 / (tl.exp(2.0 * z) + 1.0)


@triton.jit
def _gelu_and_grad(v, TANH: tl.constexpr):
    if TANH:
        inner = 0.7978845608028654 * (v + 0.044715 * v * v * v)
        t = _tanh(inner)
        y = 0.5 * v * (1.0 + t)
        dy = 0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * 0.7978845608028654 * (
            1.0 + 3.0 * 0.044715 * v * v)
    else:
        e = tl.math.erf(v * 0.7071067811865476)
        y = 0.5 * v * (1.0 + e)
        dy = 0.5 * (1.0 + e) + v * 0.3989422804014327 * tl.exp(-0.5 * v * v)
    return y, dy


@triton.jit
def _bias_gelu_kernel(X, B, G, OUT, numel, n, TANH: tl.constexpr, BACKWARD: tl.constexpr,
                      BLOCK: tl.constexpr):
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < numel
    v = tl.load(X + idx, mask=ok).to(tl.float32) + tl.load(B + idx % n, mask=ok).to(tl.float32)
    y, dy = _gelu_and_grad(v, TANH)
    if BACKWARD:
        y = tl.load(G + idx, mask=ok).to(tl.float32) * dy
    tl.store(OUT + idx, y.to(OUT.dtype.element_ty), mask=ok)


@triton.jit
def _dropout_kernel(X, B, R, OUT, numel, n, scale, key, threshold, offset,
                    BACKWARD: tl.constexpr, BLOCK: tl.constexpr):
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < numel
    keep = _keep(idx, offset, key, threshold)
    v = tl.load(X + idx, mask=ok).to(tl.float32)
    if not BACKWARD:
        v = v + tl.load(B + idx % n, mask=ok).to(tl.float32)
    y = tl.where(keep, v * scale, 0.0)
    if not BACKWARD:
        y = y + tl.load(R + idx, mask=ok).to(tl.float32)
    tl.store(OUT + idx, y.to(OUT.dtype.element_ty), mask=ok)


@triton.jit
def _swiglu_kernel(GATE, UP, D, OUT, OUT_UP, numel, BACKWARD: tl.constexpr, BLOCK: tl.constexpr):
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < numel
    g = tl.load(GATE + idx, mask=ok).to(tl.float32)
    u = tl.load(UP + idx, mask=ok).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-g))
    if BACKWARD:
        d = tl.load(D + idx, mask=ok).to(tl.float32)
        tl.store(OUT + idx, (d * u * s * (1.0 + g * (1.0 - s))).to(OUT.dtype.element_ty), mask=ok)
        tl.store(OUT_UP + idx, (d * g * s).to(OUT_UP.dtype.element_ty), mask=ok)
    else:
        tl.store(OUT + idx, (g * s * u).to(OUT.dtype.element_ty), mask=ok)


@triton.jit
def _tile(block, rows, n, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Offsets and mask of row block ``block``: ROWS rows by BLOCK_N columns. The row index is
    int64 before it is multiplied by n, so offsets past 2^31 do not wrap."""
    r = tl.cast(block, tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    ok = (r[:, None] < rows) & (cols[None, :] < n)
    return r[:, None] * n + cols[None, :], ok, cols < n


@triton.jit
def _tile_stats(x, ok, n, eps, CENTRE: tl.constexpr):
    """Per-row mean (0 without CENTRE) and rstd of a tile, as columns."""
    if CENTRE:
        mean = tl.sum(x, axis=1) / n
    else:
        mean = tl.sum(x * 0.0, axis=1)
    d = tl.where(ok, x - mean[:, None], 0.0)
    return mean[:, None], (1.0 / tl.sqrt(tl.sum(d * d, axis=1) / n + eps))[:, None]


@triton.jit
def _norm_forward_kernel(X, W, B, OUT, rows, n, eps, CENTRE: tl.constexpr, ROWS: tl.constexpr,
                         BLOCK_N: tl.constexpr):
    offs, ok, col_ok = _tile(tl.program_id(0), rows, n, ROWS, BLOCK_N)
    cols = tl.arange(0, BLOCK_N)
    x = tl.load(X + offs, mask=ok, other=0.0).to(tl.float32)
    mean, rstd = _tile_stats(x, ok, n, eps, CENTRE)
    y = (x - mean) * rstd * tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if CENTRE:
        y = y + tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(OUT + offs, y.to(OUT.dtype.element_ty), mask=ok)


@triton.jit
def _norm_backward_tile(D, X, W, DX, block, rows, n, eps, CENTRE: tl.constexpr,
                        ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Writes the input gradient of row block ``block``; returns its weight- and bias-gradient
    column sums."""
    offs, ok, col_ok = _tile(block, rows, n, ROWS, BLOCK_N)
    cols = tl.arange(0, BLOCK_N)
    x = tl.load(X + offs, mask=ok, other=0.0).to(tl.float32)
    d = tl.load(D + offs, mask=ok, other=0.0).to(tl.float32)
    mean, rstd = _tile_stats(x, ok, n, eps, CENTRE)
    xhat = tl.where(ok, (x - mean) * rstd, 0.0)
    dy = d * tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    mean_dy_xhat = (tl.sum(dy * xhat, axis=1) / n)[:, None]
    if CENTRE:
        dx = rstd * (dy - (tl.sum(dy, axis=1) / n)[:, None] - xhat * mean_dy_xhat)
    else:
        dx = rstd * (dy - xhat * mean_dy_xhat)
    tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=ok)
    return tl.sum(d * xhat, axis=0), tl.sum(d, axis=0)


@triton.jit
def _norm_backward_kernel(D, X, W, DX, DW, DB, rows, n, eps, row_blocks, CENTRE: tl.constexpr,
                          ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    program = tl.program_id(0)
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    db = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for block in range(program, row_blocks, tl.num_programs(0)):
        block_dw, block_db = _norm_backward_tile(D, X, W, DX, block, rows, n, eps, CENTRE, ROWS,
                                                 BLOCK_N)
        dw += block_dw
        db += block_db
    cols = tl.arange(0, BLOCK_N)
    out = program.to(tl.int64) * n + cols
    tl.store(DW + out, dw, mask=cols < n)
    if CENTRE:
        tl.store(DB + out, db, mask=cols < n)


# --- launchers (the signatures of fastpipe.ops.reference) ----------------------------------------


def _grid(numel: int, block: int) -> Tuple[int]:
    return (triton.cdiv(numel, block),)


def _features(x: Tensor) -> int:
    return x.shape[-1]


def bias_gelu(x: Tensor, bias: Tensor, approximate: str = "none") -> Tensor:
    if x.dtype == torch.float64:
        return reference.bias_gelu(x, bias, approximate)
    x, out = x.contiguous(), torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _bias_gelu_kernel[_grid(x.numel(), ELEMENT_BLOCK)](
        x, bias.contiguous(), x, out, x.numel(), _features(x), TANH=approximate == "tanh",
        BACKWARD=False, BLOCK=ELEMENT_BLOCK)
    return out


def bias_gelu_backward(grad: Tensor, x: Tensor, bias: Tensor, approximate: str = "none") -> Tensor:
    if x.dtype == torch.float64:
        return reference.bias_gelu_backward(grad, x, bias, approximate)
    x, out = x.contiguous(), torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _bias_gelu_kernel[_grid(x.numel(), ELEMENT_BLOCK)](
        x, bias.contiguous(), grad.contiguous(), out, x.numel(), _features(x),
        TANH=approximate == "tanh", BACKWARD=True, BLOCK=ELEMENT_BLOCK)
    return out


def bias_dropout_add(x: Tensor, bias: Tensor, residual: Tensor, p: float, seed: int,
                     offset: int = 0) -> Tensor:
    if x.dtype == torch.float64:
        return reference.bias_dropout_add(x, bias, residual, p, seed, offset)
    x, out = x.contiguous(), torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _dropout_kernel[_grid(x.numel(), ELEMENT_BLOCK)](
        x, bias.contiguous(), residual.contiguous(), out, x.numel(), _features(x), 1.0 / (1.0 - p),
        reference.seed_key(seed), reference.drop_threshold(p), offset, BACKWARD=False,
        BLOCK=ELEMENT_BLOCK)
    return out


def bias_dropout_add_backward(grad: Tensor, p: float, seed: int, offset: int = 0) -> Tensor:
    if grad.dtype == torch.float64:
        return reference.bias_dropout_add_backward(grad, p, seed, offset)
    grad, out = grad.contiguous(), torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)
    _dropout_kernel[_grid(grad.numel(), ELEMENT_BLOCK)](
        grad, grad, grad, out, grad.numel(), 1, 1.0 / (1.0 - p), reference.seed_key(seed),
        reference.drop_threshold(p), offset, BACKWARD=True, BLOCK=ELEMENT_BLOCK)
    return out


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    if gate.dtype == torch.float64:
        return reference.swiglu(gate, up)
    gate, out = gate.contiguous(), torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    _swiglu_kernel[_grid(gate.numel(), ELEMENT_BLOCK)](
        gate, up.contiguous(), gate, out, out, gate.numel(), BACKWARD=False, BLOCK=ELEMENT_BLOCK)
    return out


def swiglu_backward(grad: Tensor, gate: Tensor, up: Tensor) -> Tuple[Tensor, Tensor]:
    if gate.dtype == torch.float64:
        return reference.swiglu_backward(grad, gate, up)
    gate = gate.contiguous()
    grad_gate, grad_up = torch.empty_like(gate), torch.empty_like(gate)
    _swiglu_kernel[_grid(gate.numel(), ELEMENT_BLOCK)](
        gate, up.contiguous(), grad.contiguous(), grad_gate, grad_up, gate.numel(),
        BACKWARD=True, BLOCK=ELEMENT_BLOCK)
    return grad_gate, grad_up


class NormLaunch(NamedTuple):
    """How a normalisation over ``rows`` rows of ``n`` features is cut and launched: row blocks
    of ``block_rows`` x ``block_n``, ``num_warps`` per program, the forward's one program per
    row block, the backward's ``backward_programs`` (the rows of its partial-sum buffers)."""

    block_n: int
    block_rows: int
    row_blocks: int
    backward_programs: int
    num_warps: int


def _row_block(n: int) -> int:
    if n > MAX_FEATURES:
        raise NotImplementedError(f"fastpipe triton norms: {n} features exceed {MAX_FEATURES}")
    return triton.next_power_of_2(n)


def _num_warps(tile_elements: int) -> int:
    """Warps for a tile, growing with it so that each thread holds at most a few dozen values
    per tensor (4 warps for a 65536-wide row would spill registers)."""
    if tile_elements >= 32768:
        return 32
    if tile_elements >= 8192:
        return 16
    if tile_elements >= 2048:
        return 8
    return 4


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _backward_programs(row_blocks: int, num_warps: int, device: torch.device) -> int:
    """The norm backward's programs: a few per SM on CUDA (``RESIDENT_WARPS`` warps each),
    ``HOST_PROGRAMS`` elsewhere, never more than there are row blocks."""
    if device.type == "cuda":
        cap = _sm_count(device) * max(1, RESIDENT_WARPS // num_warps)
    else:
        cap = HOST_PROGRAMS
    return max(1, min(row_blocks, cap))


def norm_launch(rows: int, n: int, device: torch.device) -> NormLaunch:
    """The launch of a normalisation over ``rows`` x ``n`` on ``device``."""
    block_n = _row_block(n)
    block_rows = max(1, TILE_ELEMENTS // block_n)  # a power of two, as block_n is
    row_blocks = triton.cdiv(rows, block_rows)
    num_warps = _num_warps(block_rows * block_n)
    return NormLaunch(block_n, block_rows, row_blocks,
                      _backward_programs(row_blocks, num_warps, device), num_warps)


def _norm_forward(x: Tensor, weight: Tensor, bias: Tensor, eps: float, centre: bool) -> Tensor:
    x, out = x.contiguous(), torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n = _features(x)
    rows = x.numel() // max(n, 1)
    launch = norm_launch(rows, n, x.device)
    _norm_forward_kernel[(launch.row_blocks,)](
        x, weight.contiguous(), bias.contiguous(), out, rows, n, eps, CENTRE=centre,
        ROWS=launch.block_rows, BLOCK_N=launch.block_n, num_warps=launch.num_warps)
    return out


def _norm_backward(grad: Tensor, x: Tensor, weight: Tensor, eps: float, centre: bool
                   ) -> Tuple[Tensor, Tensor, Tensor]:
    x, n = x.contiguous(), _features(x)
    rows = x.numel() // max(n, 1)
    launch = norm_launch(rows, n, x.device)
    programs = launch.backward_programs
    grad_x = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    partial_w = torch.empty(programs, n, dtype=torch.float32, device=x.device)
    partial_b = torch.empty(programs if centre else 1, n, dtype=torch.float32, device=x.device)
    _norm_backward_kernel[(programs,)](
        grad.contiguous(), x, weight.contiguous(), grad_x, partial_w, partial_b, rows, n, eps,
        launch.row_blocks, CENTRE=centre, ROWS=launch.block_rows, BLOCK_N=launch.block_n,
        num_warps=launch.num_warps)
    return grad_x, partial_w.sum(0).to(weight.dtype), partial_b.sum(0).to(weight.dtype)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    if x.dtype == torch.float64:
        return reference.rms_norm(x, weight, eps)
    return _norm_forward(x, weight, weight, eps, centre=False)


def rms_norm_backward(grad: Tensor, x: Tensor, weight: Tensor, eps: float
                      ) -> Tuple[Tensor, Tensor]:
    if x.dtype == torch.float64:
        return reference.rms_norm_backward(grad, x, weight, eps)
    grad_x, grad_w, _ = _norm_backward(grad, x, weight, eps, centre=False)
    return grad_x, grad_w


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    if x.dtype == torch.float64:
        return reference.layer_norm(x, weight, bias, eps)
    return _norm_forward(x, weight, bias, eps, centre=True)


def layer_norm_backward(grad: Tensor, x: Tensor, weight: Tensor, eps: float
                        ) -> Tuple[Tensor, Tensor, Tensor]:
    if x.dtype == torch.float64:
        return reference.layer_norm_backward(grad, x, weight, eps)
    return _norm_backward(grad, x, weight, eps, centre=True)
