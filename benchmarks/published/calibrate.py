"""Fit the one calibrated number per GPU type, the achieved share of peak on matrix products
(``GPU.efficiency`` in ``fastpipe/planning/hardware.py``), to the published runs of that type,
and print every row's error at the fitted value.

The fit minimises the mean |log(predicted / published step time)| over all of a GPU type's
rows together (golden-section search); every other number is stated, nothing is fitted per
row. Copy the printed values into ``hardware.py``; ``tests/planning/test_published.py``
checks the goals at the values stored there.

    python benchmarks/published/calibrate.py            # fit, then the table
    python benchmarks/published/calibrate.py --check    # the table at the stored values
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from fastpipe.planning import published  # noqa: E402
from fastpipe.planning.hardware import GPU, gpu as gpu_type  # noqa: E402

GOLDEN = (math.sqrt(5) - 1) / 2


def loss(rows: List[published.Row], device: GPU) -> float:
    """Mean |log(predicted / published)| of ``rows`` on ``device``."""
    found = published.errors(rows, lambda row: device)
    return statistics.fmean(abs(math.log1p(e["error"])) for e in found)


def fit(rows: List[published.Row], device: GPU, low: float = 0.3, high: float = 1.0,
        steps: int = 14) -> float:
    """The efficiency in [low, high] of least :func:`loss` (golden-section search)."""
    a, b = low, high
    c, d = b - GOLDEN * (b - a), a + GOLDEN * (b - a)
    fc = loss(rows, device.with_changes(efficiency=c))
    fd = loss(rows, device.with_changes(efficiency=d))
    for _ in range(steps):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - GOLDEN * (b - a)
            fc = loss(rows, device.with_changes(efficiency=c))
        else:
            a, c, fc = c, d, fd
            d = a + GOLDEN * (b - a)
            fd = loss(rows, device.with_changes(efficiency=d))
    return round((a + b) / 2, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="no fit: the stored values")
    args = parser.parse_args()
    rows = published.rows_in(HERE)
    by_gpu: Dict[str, List[published.Row]] = {}
    for row in rows:
        by_gpu.setdefault(gpu_type(row.data["gpu"]).name, []).append(row)
    devices = {name: gpu_type(group[0].data["gpu"]) for name, group in by_gpu.items()}
    if not args.check:
        for name, group in by_gpu.items():
            value = fit(group, devices[name])
            print(f"{name}: efficiency {value} (fitted to {len(group)} rows)")
            devices[name] = devices[name].with_changes(efficiency=value)
    found = published.errors(rows, lambda row: devices[gpu_type(row.data["gpu"]).name])
    for e in found:
        memory = (f"  memory {e['memory_predicted']:.1f} / {e['memory_measured']:.0f} GiB"
                  if "memory_measured" in e else "")
        print(f"{e['id']:<34} {e['measured']:9.3f} s {e['predicted']:9.3f} s "
              f"{e['error']:+7.1%}{memory}  {e['layout']}")
    errs = [abs(e["error"]) for e in found]
    print(f"{len(found)} rows: mean |error| {statistics.fmean(errs):.1%}, "
          f"max {max(errs):.1%}")


if __name__ == "__main__":
    main()
