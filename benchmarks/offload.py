"""Activation memory and step time for checkpoint = never / always / offload on a transformer stage.

Two stages of transformer encoder layers on one device, 1F1B, 8 micro-batches; the modes are timed
interleaved (medians). GPU: peak memory of a step above what the model holds
(``torch.cuda.max_memory_allocated``). CPU: bytes of the tensors saved for backward per
micro-batch, counted with ``saved_tensors_hooks`` (parameters excluded) and, for offload, how many
of them leave the device (on a CPU stage they are copied, so host memory is not saved there).

    python benchmarks/offload.py [--quick] [--rounds 10]
"""
from __future__ import annotations

import argparse
import copy
from typing import Dict, List, Tuple

import torch
from torch import nn

import fastpipe
from _common import machine, median, table, time_interleaved
from fastpipe.policies import offload

MODES = ("never", "always", "offload")


def model(width: int, layers: int) -> nn.Sequential:
    return nn.Sequential(*[nn.TransformerEncoderLayer(width, 8, 4 * width, dropout=0.0,
                                                      batch_first=True)
                           for _ in range(layers)], nn.Linear(width, 8))


def _saved_bytes(stage: nn.Module, x: torch.Tensor) -> Tuple[int, int]:
    """(bytes saved for backward by one micro-batch's forward, bytes offload would move)."""
    params = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    seen: Dict[tuple, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t._version)
            seen[key] = t.numel() * t.element_size()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        stage(x)
    off = offload.StageOffloader(torch.device("cuda") if x.is_cuda else torch.device("cpu"))
    with off.saving(0, [*stage.parameters(), x]):
        stage(x)
    moved = sum(p.host.numel() * p.host.element_size() for p in off.pending[0])
    off.prefetch(0)
    return sum(seen.values()), moved


def _pipes(base: nn.Sequential, chunks: int, device: str) -> Dict[str, fastpipe.Pipe]:
    half = len(base) // 2
    return {mode: fastpipe.Pipe(copy.deepcopy(base), chunks=chunks,
                                balance=[half, len(base) - half], devices=[device] * 2,
                                checkpoint=mode, schedule="1f1b") for mode in MODES}


def _peak(pipe: fastpipe.Pipe, x: torch.Tensor, y: torch.Tensor) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    pipe.train_step(x, y, nn.MSELoss())
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    gpu = torch.cuda.is_available()
    device = "cuda:0" if gpu else "cpu"
    width, layers, batch, seq = ((1024, 8, 32, 512) if gpu else (128, 4, 32, 64))
    if args.quick:
        width, layers, batch, seq = width // 2, layers // 2, batch // 2, seq // 2
    rounds = 3 if args.quick else args.rounds
    print(machine())
    print(f"{layers} encoder layers of width {width}, batch {batch} x {seq} tokens, 8 micro-batches,"
          f" 2 stages on {device}, 1F1B")
    base = model(width, layers)
    x, y = torch.randn(batch, seq, width), torch.randn(batch, seq, 8)
    pipes = _pipes(base, 8, device)
    times = time_interleaved({m: (lambda p=p: p.train_step(x, y, nn.MSELoss()))
                              for m, p in pipes.items()}, rounds, warmup=2)
    never = median(times["never"])
    rows: List[list] = []
    if gpu:
        peaks = {m: _peak(p, x, y) for m, p in pipes.items()}
        for m in MODES:
            rows.append([m, f"{median(times[m]) * 1e3:.1f}", f"{median(times[m]) / never:.2f}",
                         f"{peaks[m]:.0f}", f"{peaks[m] / peaks['never']:.2f}"])
        print(table(["checkpoint", "step ms", "vs never", "peak MiB above model",
                     "vs never"], rows))
        return
    stage = pipes["never"].partitions[0]
    saved, moved = _saved_bytes(stage, x[: batch // 8])
    for m in MODES:
        rows.append([m, f"{median(times[m]) * 1e3:.1f}", f"{median(times[m]) / never:.2f}"])
    print(table(["checkpoint", "step ms", "vs never"], rows))
    print(f"\nstage 0, one micro-batch: {saved / 2**20:.2f} MiB saved for backward "
          f"(parameters excluded); offload moves {moved / 2**20:.2f} MiB of it to host buffers "
          f"(on a GPU those leave device memory); 'always' keeps only the input "
          f"({x[: batch // 8].numel() * 4 / 2**20:.2f} MiB).")
    print("Peak GPU memory needs a CUDA GPU: not measured on this machine.")


if __name__ == "__main__":
    main()
