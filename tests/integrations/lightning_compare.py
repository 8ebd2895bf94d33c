"""The comparisons every layout's Lightning test makes: logged rows and weights against
Lightning's own run, and a resumed run against the uninterrupted one."""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch

TOL = 1e-5

Rows = List[Tuple[int, Dict[str, float]]]


def assert_rows_close(got: Rows, expected: Rows, where: str, tol: float = TOL) -> None:
    """The same rows (steps, names) with every value within ``tol``: every logged training
    loss, every validation metric."""
    assert [(s, sorted(m)) for s, m in got] == [(s, sorted(m)) for s, m in expected], \
        f"{where}: other rows were logged:\n{got}\nexpected\n{expected}"
    for (step, mine), (_, theirs) in zip(got, expected):
        for name, value in theirs.items():
            assert abs(mine[name] - value) <= tol, \
                f"{where}: {name} at step {step}: {mine[name]!r} against {value!r}"


def assert_weights_close(got: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor],
                         where: str, tol: float = TOL) -> None:
    """Every weight ``got`` holds (a rank's share, or all) within ``tol`` of the plain run's."""
    assert got, f"{where}: no weights"
    for name, value in got.items():
        worst = (value - expected[name]).abs().max().item()
        assert worst <= tol, f"{where}: {name} differs by {worst:.3g}"


def assert_weights_equal(got: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor],
                         where: str) -> None:
    assert sorted(got) == sorted(expected), f"{where}: other weights"
    for name, value in got.items():
        assert torch.equal(value, expected[name]), \
            f"{where}: {name} differs by {(value - expected[name]).abs().max().item():.3g}"


def after_epoch(rows: Rows, epoch: int) -> Rows:
    """The rows logged from ``epoch`` on (what a run resumed there logs)."""
    return [(s, m) for s, m in rows if m.get("epoch", -1) >= epoch]
