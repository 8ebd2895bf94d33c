"""Transfer bandwidth and overlap: fastpipe's transfer vs ``Tensor.to`` vs a hand-written copy stream.

GPU (when one is present): host-to-device and device-to-host GB/s from pinned host memory for one
tensor of 1 KB to 256 MB and for a list of 64 small tensors, each variant timed interleaved with
the others (medians); then how much of a host-to-device transfer stays hidden behind compute
already queued on the consumer stream: hidden = (compute + transfer - both) / transfer.
Goals: fastpipe >= 90% of ``Tensor.to``'s bandwidth, >= 90% hidden.
CPU: the same copies host to host (the native op's CPU path); the rest needs a GPU and says so.

    python benchmarks/transfer.py [--quick] [--rounds 20]
"""
from __future__ import annotations

import argparse
from typing import Callable, Dict, List, Sequence

import torch

from _common import machine, median, table, time_interleaved
from fastpipe import _native
from fastpipe.ops import transfer

SIZES = [1 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20]
QUICK_SIZES = [1 << 10, 1 << 20, 16 << 20]
SMALL_LIST = (64, 16 << 10)  # 64 tensors of 16 KB


def _label(nbytes: int) -> str:
    return f"{nbytes >> 20} MB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KB"


def _tensors(nbytes: int, count: int, device: str, pinned: bool) -> List[torch.Tensor]:
    return [torch.empty(nbytes // 4, dtype=torch.float32, device=device,
                        pin_memory=pinned).fill_(1.0) for _ in range(count)]


def hand_written(tensors: Sequence[torch.Tensor], device: torch.device,
                 stream: "torch.cuda.Stream") -> List[torch.Tensor]:
    """The textbook copy-stream transfer: side stream waits, copies, consumer waits, records."""
    current = torch.cuda.current_stream(device)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = [t.to(device, non_blocking=True) for t in tensors]
    current.wait_stream(stream)
    for o in out:
        o.record_stream(current)
    return out


def _variants(tensors: List[torch.Tensor], device: torch.device, sync: Callable[[], None],
              stream) -> Dict[str, Callable[[], None]]:
    variants = {
        "fastpipe transfer": lambda: (transfer(tensors, device, non_blocking=True), sync()),
        "Tensor.to": lambda: ([t.to(device, non_blocking=True, copy=True) for t in tensors],
                              sync()),
    }
    if stream is not None:
        variants["copy stream (by hand)"] = lambda: (hand_written(tensors, device, stream), sync())
    return variants


def bandwidth_rows(source: str, target: str, sizes: Sequence[int], rounds: int) -> List[list]:
    """GB/s of each variant for every size and for the list of small tensors."""
    device = torch.device(target)
    gpu = "cuda" in (source, target)
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    stream = torch.cuda.Stream() if gpu else None
    cases = [(_label(n), n, 1) for n in sizes] + [
        (f"{SMALL_LIST[0]} x {_label(SMALL_LIST[1])}", SMALL_LIST[1], SMALL_LIST[0])]
    rows = []
    for label, nbytes, count in cases:
        tensors = _tensors(nbytes, count, source, pinned=gpu and source == "cpu")
        if not gpu:  # transfer() hands same-device tensors back: time the op itself
            op = torch.ops.fastpipe.transfer if _native.load() else None
            variants = {"fastpipe op": lambda: op(tensors, device, False)} if op else {}
            variants["Tensor.to"] = lambda: [t.to(device, copy=True) for t in tensors]
        else:
            variants = _variants(tensors, device, sync, stream)
        reps = max(3, min(rounds, int(2e9 // (nbytes * count))))
        times = time_interleaved(variants, reps)
        gbps = {name: nbytes * count / median(t) / 1e9 for name, t in times.items()}
        best = gbps["Tensor.to"]
        for name, value in gbps.items():
            rows.append([f"{source}->{target}", label, name, f"{value:.2f}",
                         f"{value / best:.2f}"])
    return rows


def overlap_rows(nbytes: int, rounds: int) -> List[list]:
    """Share of a host-to-device copy hidden behind compute queued before it on the consumer."""
    device = torch.device("cuda", torch.cuda.current_device())
    host = _tensors(nbytes, 1, "cpu", pinned=True)
    a = torch.randn(2048, 2048, device=device)
    stream = torch.cuda.Stream()
    copy_time = median(time_interleaved({"c": lambda: (
        transfer(host, device, non_blocking=True), torch.cuda.synchronize())}, rounds)["c"])
    reps = 1
    while True:  # compute about as long as the copy
        t = median(time_interleaved({"m": lambda: (_matmuls(a, reps), torch.cuda.synchronize())},
                                    3, warmup=1)["m"])
        if t >= copy_time or reps > 4096:
            break
        reps *= 2
    movers = {"fastpipe transfer": lambda: transfer(host, device, non_blocking=True),
              "Tensor.to": lambda: [h.to(device, non_blocking=True) for h in host],
              "copy stream (by hand)": lambda: hand_written(host, device, stream)}
    rows = []
    for name, move in movers.items():
        def both(move=move) -> None:
            _matmuls(a, reps)
            move()
            torch.cuda.synchronize()
        times = time_interleaved({
            "compute": lambda: (_matmuls(a, reps), torch.cuda.synchronize()),
            "transfer": lambda move=move: (move(), torch.cuda.synchronize()),
            "both": both}, rounds)
        c, x, b = (median(times[k]) for k in ("compute", "transfer", "both"))
        hidden = max(0.0, min(1.0, (c + x - b) / x))
        rows.append([name, _label(nbytes), f"{c * 1e3:.2f}", f"{x * 1e3:.2f}", f"{b * 1e3:.2f}",
                     f"{hidden:.0%}"])
    return rows


def _matmuls(a: torch.Tensor, reps: int) -> None:
    for _ in range(reps):
        a @ a


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer sizes and rounds")
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    rounds = 5 if args.quick else args.rounds
    sizes = QUICK_SIZES if args.quick else SIZES
    print(machine())
    header = ["direction", "size", "variant", "GB/s", "vs Tensor.to"]
    if not torch.cuda.is_available():
        print(table(header, bandwidth_rows("cpu", "cpu", sizes, rounds)))
        print("\nHost<->GPU bandwidth and overlap need a CUDA GPU: not measured on this machine.")
        return
    rows = bandwidth_rows("cpu", "cuda", sizes, rounds) + bandwidth_rows("cuda", "cpu", sizes,
                                                                         rounds)
    print(table(header, rows))
    print("\nHost-to-device copy behind compute already queued on the consumer stream:")
    print(table(["variant", "size", "compute ms", "transfer ms", "both ms", "hidden"],
                overlap_rows(64 << 20 if args.quick else 256 << 20, rounds)))
    if torch.cuda.device_count() < 2:
        print("\nDevice-to-device (peer) copies need two GPUs: not measured.")


if __name__ == "__main__":
    main()
