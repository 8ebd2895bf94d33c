"""Fused recompute ops: kernels against PyTorch eager, forward and forward+backward.

CPU (default): each C++ kernel (``fastpipe._C``) against the same maths in PyTorch eager, on a
transformer-sized activation (8 x 512 x 1024), interleaved rounds, median milliseconds and the
ratio eager / fused (above 1: the kernel is faster).

GPU (``--gpu``): the Triton kernels' effective bandwidth (bytes each must move / time) against a
measured device copy, eager and torch.compile; then one transformer stage (fused blocks) trained
with checkpoint never / always / selective: step time and peak activation memory. ``--quick``:
small shapes, 3 rounds, no torch.compile column (its cold compiles take most of a minute) and a
small stage: a check that every kernel runs, in seconds.

    python benchmarks/ops.py [--quick] [--rounds 20] [--gpu]
"""
from __future__ import annotations

import argparse
from typing import Callable, Dict, List, Tuple

import torch
import torch.nn.functional as F
from torch import nn

import fastpipe
from fastpipe import ops
from fastpipe.ops import backend
from _common import machine, median, table, time_interleaved

Op = Tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor], List[torch.Tensor], int]


def cases(shape: Tuple[int, ...], device: str, dtype: torch.dtype) -> Dict[str, Op]:
    """Name -> (fused, eager, inputs, bytes the forward must move at least)."""
    n = shape[-1]

    def t(*s: int) -> torch.Tensor:
        return torch.randn(*s, device=device, dtype=dtype, requires_grad=True)
    x, r, v = t(*shape), t(*shape), t(n)
    size = x.numel() * x.element_size()
    return {
        "bias_gelu": (lambda: ops.bias_gelu(x, v), lambda: F.gelu(x + v), [x, v], 2 * size),
        "bias_gelu tanh": (lambda: ops.bias_gelu(x, v, "tanh"),
                           lambda: F.gelu(x + v, approximate="tanh"), [x, v], 2 * size),
        "bias_dropout_add": (lambda: ops.bias_dropout_add(x, v, r, 0.1, True),
                             lambda: F.dropout(x + v, 0.1) + r, [x, v, r], 3 * size),
        "rms_norm": (lambda: ops.rms_norm(x, v),
                     lambda: F.rms_norm(x, (n,), v, 1e-6), [x, v], 2 * size),
        "layer_norm": (lambda: ops.layer_norm(x, v, v),
                       lambda: F.layer_norm(x, (n,), v, v), [x, v], 2 * size),
        "swiglu": (lambda: ops.swiglu(x, r), lambda: F.silu(x) * r, [x, r], 3 * size),
    }


def _fwd(fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
    def run() -> None:
        with torch.no_grad():
            fn()
    return run


def _fwd_bwd(fn: Callable[[], torch.Tensor], inputs: List[torch.Tensor]) -> Callable[[], None]:
    def run() -> None:
        out = fn()
        torch.autograd.grad(out, inputs, torch.ones_like(out))
    return run


def _synced(fn: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        fn()
        torch.cuda.synchronize()
    return run


def cpu(shape: Tuple[int, ...], rounds: int) -> None:
    if backend.choose(torch.empty(1)) != "native":
        raise SystemExit("the native library is not loaded: build it first "
                         "(python setup.py build_ext --inplace)")
    rows = []
    for name, (fused, eager, inputs, _) in cases(shape, "cpu", torch.float32).items():
        for label, make in (("fwd", lambda f: _fwd(f)), ("fwd+bwd", lambda f: _fwd_bwd(f, inputs))):
            times = time_interleaved({"fused": make(fused), "eager": make(eager)}, rounds)
            f_ms, e_ms = median(times["fused"]) * 1e3, median(times["eager"]) * 1e3
            rows.append([name, label, f"{f_ms:.2f}", f"{e_ms:.2f}", f"{e_ms / f_ms:.2f}"])
    print(f"machine: {machine()}; {torch.get_num_threads()} threads; shape {shape} float32; "
          f"median of {rounds} interleaved rounds")
    print(table(["op", "pass", "C++ kernel ms", "eager ms", "eager / kernel"], rows))


def gpu_ops(shape: Tuple[int, ...], rounds: int, compiled: bool = True) -> None:
    rows = []
    probe = torch.empty(shape, device="cuda", dtype=torch.bfloat16)
    copy_t = median(time_interleaved({"copy": _synced(lambda: probe.clone())}, rounds)["copy"])
    copy_bw = 2 * probe.numel() * probe.element_size() / copy_t / 1e9
    for name, (fused, eager, inputs, nbytes) in cases(shape, "cuda", torch.bfloat16).items():
        candidates = {"triton": _synced(_fwd(fused)), "eager": _synced(_fwd(eager))}
        if compiled:
            candidates["compile"] = _synced(_fwd(torch.compile(eager)))
        times = time_interleaved(candidates, rounds)
        t_ms, e_ms = (median(times[k]) * 1e3 for k in ("triton", "eager"))
        c_ms = f"{median(times['compile']) * 1e3:.3f}" if compiled else "not run (--quick)"
        bw = nbytes / (t_ms / 1e3) / 1e9
        rows.append([name, f"{t_ms:.3f}", f"{bw:.0f}", f"{bw / copy_bw:.2f}", f"{e_ms:.3f}", c_ms])
    print(f"GPU {torch.cuda.get_device_name()}; shape {shape} bfloat16, forward; copy bandwidth "
          f"{copy_bw:.0f} GB/s; median of {rounds} interleaved rounds")
    print(table(["op", "triton ms", "triton GB/s", "of copy bw", "eager ms", "compile ms"], rows))


# blocks, dim, heads, batch, sequence of the stage gpu_stage trains
STAGE = {"full": (4, 1024, 16, 16, 512), "quick": (2, 256, 4, 4, 128)}


def gpu_stage(rounds: int, size: str = "full") -> None:
    """One pipeline stage of fused transformer blocks: step time and peak memory per mode."""
    from fastpipe.apps.models import Block
    blocks, dim, heads, batch, seq = STAGE[size]
    rows = []
    x, y = torch.randn(batch, seq, dim, device="cuda"), torch.randn(batch, seq, dim, device="cuda")
    for mode in ("never", "always", "selective"):
        torch.manual_seed(0)
        model = nn.Sequential(*[Block(dim, heads, 0.1, fused=True) for _ in range(blocks)])
        pipe = fastpipe.Pipe(model, chunks=4, devices=["cuda"], checkpoint=mode)
        step = _synced(lambda pipe=pipe: pipe.train_step(x, y, nn.MSELoss()))
        step()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        times = time_interleaved({mode: step}, rounds, warmup=1)[mode]
        peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
        rows.append([mode, f"{median(times) * 1e3:.1f}", f"{peak:.0f}"])
        del pipe, model
    print(f"{blocks} fused blocks (dim {dim}, {heads} heads), batch {batch} x {seq}, "
          "4 micro-batches, fp32")
    print(table(["checkpoint", "step ms", "peak memory above weights MiB"], rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="small sizes, few rounds")
    parser.add_argument("--gpu", action="store_true", help="Triton kernels and a stage on CUDA")
    args = parser.parse_args()
    shape = (2, 128, 1024) if args.quick else (8, 512, 1024)
    rounds = 3 if args.quick else args.rounds
    if not args.gpu:
        cpu(shape, rounds)
        return
    if not torch.cuda.is_available() or not backend.triton_available():
        raise SystemExit("--gpu needs a CUDA device and Triton")
    gpu_ops(shape, rounds, compiled=not args.quick)
    gpu_stage(max(3, rounds // 4), "quick" if args.quick else "full")


if __name__ == "__main__":
    main()
