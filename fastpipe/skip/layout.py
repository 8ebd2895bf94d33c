"""Where each skip tensor is produced and consumed: checked once, when a ``Pipe`` is built.

Pure bookkeeping over the layers' declarations and the balance; no tensor moves here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, FrozenSet, List, Sequence, Tuple

from torch import nn

from .api import declared


@dataclass(frozen=True)
class StageSkips:
    """The skip names of one stage (a virtual stage, in model order).

    ``sends``: (name, consumer stage) for tensors it stashes for a later stage; ``receives``:
    (name, producer stage) for tensors it pops from an earlier stage; ``local``: names stashed
    and popped within the stage. Each list is sorted by name, the order of the wire.
    """

    index: int
    sends: Tuple[Tuple[str, int], ...] = ()
    receives: Tuple[Tuple[str, int], ...] = ()
    local: FrozenSet[str] = frozenset()


def layer_declarations(module: nn.Sequential) -> Tuple[Dict[str, List[int]], Dict[str, List[int]]]:
    """For every skip name, the layers (indices in ``module``) that stash it and that pop it."""
    stashes: Dict[str, List[int]] = {}
    pops: Dict[str, List[int]] = {}
    for index, layer in enumerate(module):
        for sub in layer.modules():
            decl = declared(sub)
            if decl is None:
                continue
            for name in decl.stash:
                stashes.setdefault(name, []).append(index)
            for name in decl.pop:
                pops.setdefault(name, []).append(index)
    return stashes, pops


def plan(module: nn.Sequential, balance: Sequence[int]) -> Dict[int, StageSkips]:
    """The stages that take part in skip connections, with their names; ``ValueError`` for
    a pop without a stash, a stash without a pop, a name stashed or popped twice, or a pop in a
    layer before its stash."""
    stashes, pops = layer_declarations(module)
    _check(stashes, pops)
    stage_of = [s for s, count in enumerate(balance) for _ in range(count)]
    sends: Dict[int, List[Tuple[str, int]]] = {}
    receives: Dict[int, List[Tuple[str, int]]] = {}
    local: Dict[int, set] = {}
    for name in sorted(stashes):
        src, dst = stage_of[stashes[name][0]], stage_of[pops[name][0]]
        if src == dst:
            local.setdefault(src, set()).add(name)
        else:
            sends.setdefault(src, []).append((name, dst))
            receives.setdefault(dst, []).append((name, src))
    stages = set(sends) | set(receives) | set(local)
    return {s: StageSkips(s, tuple(sends.get(s, ())), tuple(receives.get(s, ())),
                          frozenset(local.get(s, ()))) for s in sorted(stages)}


def _check(stashes: Dict[str, List[int]], pops: Dict[str, List[int]]) -> None:
    for name, layers in sorted(stashes.items()):
        if len(layers) > 1:
            raise ValueError(f"skip {name!r} is stashed by layers {layers}; each name is stashed "
                             f"by one layer: give the others their own names")
        if name not in pops:
            raise ValueError(f"layer {layers[0]} stashes skip {name!r} but no layer pops it; "
                             f"declare @skippable(pop=[{name!r}]) on the layer that uses it")
    for name, layers in sorted(pops.items()):
        if len(layers) > 1:
            raise ValueError(f"skip {name!r} is popped by layers {layers}; each name is popped "
                             f"by one layer: stash one name per consumer")
        if name not in stashes:
            raise ValueError(f"layer {layers[0]} pops skip {name!r} but no layer stashes it; "
                             f"declare @skippable(stash=[{name!r}]) on an earlier layer")
        if layers[0] < stashes[name][0]:
            raise ValueError(f"layer {layers[0]} pops skip {name!r} before layer "
                             f"{stashes[name][0]} stashes it; a skip goes from an earlier layer "
                             f"to a later one")
