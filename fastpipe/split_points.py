"""Where a traced model is cut: split points named by the user, checked, or found for it.

A split point is the name of a submodule that begins a stage. :func:`check_split_points` checks
given names; :func:`auto_split_points` cuts the model's list of blocks (its longest list of
same-type blocks, else a hybrid model's list of mixed blocks) into stages of about equal
parameter count (with the partition solver of :mod:`fastpipe.balance`).
A layout string's letters name the same list (:func:`repeated_blocks`) and what runs after it
(:func:`module_after`).
"""
from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from .balance import solve

__all__ = ["auto_split_points", "check_split_points", "module_after", "repeated_blocks"]


def check_split_points(module: nn.Module, split_points: Sequence[str]) -> list[str]:
    """Each split point must name a submodule; returns them as a list."""
    if isinstance(split_points, str) or not all(isinstance(p, str) for p in split_points):
        raise TypeError(f"split_points must be a list of submodule names (e.g. "
                        f"['transformer.h.4']) or 'auto', got {split_points!r}")
    names = dict(module.named_modules())
    points = list(split_points)
    for point in points:
        if point not in names or point == "":
            close = [n for n in names if n and n.split(".")[-1] == point.split(".")[-1]][:3]
            hint = f"; did you mean {close}?" if close else ""
            raise ValueError(f"split_points names {point!r}, which is not a submodule of "
                             f"{type(module).__name__}{hint} (see module.named_modules())")
    if len(set(points)) != len(points):
        raise ValueError(f"split_points={points} names a submodule twice")
    return points


def repeated_blocks(module: nn.Module) -> tuple[str, list[nn.Module]] | None:
    """The module's list of blocks (a ``ModuleList`` or ``Sequential`` of more than one): its
    longest list of same-type blocks; without one, its longest list of blocks of mixed types
    that lies in no other list (a hybrid model's layers: Mamba and attention blocks). Its name
    and its blocks (the first found of equal lengths: the outermost); ``None`` when it has
    none."""
    lists = [(name, list(sub)) for name, sub in module.named_modules()
             if isinstance(sub, (nn.ModuleList, nn.Sequential)) and len(sub) > 1]
    same = [(name, blocks) for name, blocks in lists if len({type(c) for c in blocks}) == 1]
    if same:
        return max(same, key=lambda found: len(found[1]))  # max keeps the first of a tie
    outer = [(name, blocks) for name, blocks in lists
             if not any(_within(name, other) for other, _ in lists)]
    return max(outer, key=lambda found: len(found[1])) if outer else None


def _within(name: str, other: str) -> bool:
    """Whether the submodule ``name`` lies inside the submodule ``other`` ('' is the root)."""
    return name != other and (other == "" or name.startswith(other + "."))


def auto_split_points(module: nn.Module, stages: int) -> list[str]:
    """Split points that cut the module's list of blocks (:func:`repeated_blocks`) into
    ``stages`` parts of about equal parameter count."""
    best = repeated_blocks(module)
    if best is None:
        raise ValueError(f"split_points='auto' found no list of repeated blocks (an "
                         f"nn.ModuleList or nn.Sequential of more than one module) in "
                         f"{type(module).__name__}; give split_points=[...] by name")
    prefix, blocks = best
    if stages > len(blocks):
        raise ValueError(f"split_points='auto' needs at least {stages} blocks for {stages} "
                         f"stages, but {prefix or 'the module'} has {len(blocks)}; use fewer "
                         f"devices or give split_points=[...] by name")
    costs = [1.0 + sum(p.numel() for p in b.parameters()) for b in blocks]
    sizes = solve(costs, stages)
    starts = [sum(sizes[:k]) for k in range(1, stages)]
    return [f"{prefix}.{i}" if prefix else str(i) for i in starts]


def module_after(module: nn.Module, prefix: str) -> str | None:
    """The first submodule registered after ``prefix`` and everything in it (a transformer's
    final norm after its blocks); ``None`` when there is none."""
    inside = False
    for name, _ in module.named_modules():
        if prefix and (name == prefix or name.startswith(prefix + ".")):
            inside = True
        elif inside:
            return name  # pre-order: the first name past prefix's subtree
    return None
