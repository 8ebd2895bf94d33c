"""A traced forward of generation cut into the pipe's stages, each stage keeping its cache.

The forward (placeholders: the model's inputs, then the cache's tensors; outputs: the logits,
then the new cache's tensors) is cut at the pipe's split points by ``fastpipe.tracing``'s rule:
an operation belongs to the stage of the split submodule it runs in. The cache's tensors are not
carried between stages: each belongs to the stage that reads it and writes its new version, so
stage ``k``'s graph takes the carry of stage ``k - 1`` (the model's inputs for stage 0) and its
own cache tensors, and returns its carry (the logits for the last stage) and its new cache
tensors. A shape read from a cache tensor of a later stage (the past length, which every layer's
cache shares) is read instead from a tensor the reading stage holds.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import fx

from ..graph_cut import graph_of_stage, stage_of_nodes

ROOT = "model"  # the StepModule's attribute holding the model: a prefix of every module path


class StepError(TypeError):
    """A traced forward cannot be cut so that each stage keeps its own cache."""


@dataclass
class StageStep:
    """Stage ``index``'s graph of one forward: ``(carry, cache) -> (carry, cache)``."""

    index: int
    graph: fx.GraphModule
    cache_slots: Tuple[int, ...]  # the cache tensors it owns (flat positions)
    traced: Dict[str, Any] = field(default_factory=dict)  # its tensors as traced, by target

    def __call__(self, carry: Sequence[Any], cache: Sequence[torch.Tensor]
                 ) -> Tuple[Tuple[Any, ...], List[torch.Tensor]]:
        out = self.graph(*carry, *cache)
        split = len(out) - len(self.cache_slots)
        return tuple(out[:split]), list(out[split:])


@dataclass
class Cut:
    """A forward cut into stages: one :class:`StageStep` per stage, and each cache tensor's
    stage (``owners[j]`` for the ``j``-th tensor of the flat cache)."""

    stages: List[StageStep]
    owners: Tuple[int, ...]


# ------------------------------------------------------------------------------ the cut
def cut(gm: fx.GraphModule, split_points: Sequence[str], num_inputs: int) -> Cut:
    """Cut a traced step (placeholders: ``num_inputs`` model inputs, then the cache tensors;
    outputs: the logits, then the new cache tensors) into one graph per stage."""
    graph = gm.graph
    _drop_guards(gm)
    last = len(split_points)
    stage_of = stage_of_nodes(graph, split_points, prefix=f"{ROOT}.")
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    inputs, cache_in = placeholders[:num_inputs], placeholders[num_inputs:]
    output = next(n for n in graph.nodes if n.op == "output")
    leaves = list(output.args[0])
    logits, cache_out = leaves[0], leaves[1:]
    for node in inputs:
        stage_of[node] = 0
    owners = _owners(cache_in, cache_out, stage_of)
    for node, owner in zip(cache_in, owners):
        stage_of[node] = owner
    held = {node: stage_of[node] for node in inputs + cache_in}
    for node, owner in zip(cache_in, owners):
        _follow_owner(node, owner, stage_of, held)
    cached = set(cache_in)
    needs = _needs(output, logits, cache_out, owners, last)
    carries = []
    for k in range(last):
        carries.append([n for n in graph.nodes if n in stage_of and n not in cached and
                        stage_of[n] <= k and _needed_after(n, k, stage_of, needs, output)])
    stages = []
    for k in range(last + 1):
        slots = tuple(j for j, owner in enumerate(owners) if owner == k)
        first = inputs if k == 0 else carries[k - 1]
        outs = (carries[k] if k < last else [logits]) + [cache_out[j] for j in slots]
        own = [cache_in[j] for j in slots] if cache_in else []
        stages.append(StageStep(k, graph_of_stage(gm, k, stage_of, first + own, outs,
                                                     f"DecodeStage{k}"), slots))
    return Cut(stages, owners)


def _drop_guards(gm: fx.GraphModule) -> None:
    """Remove the guard check ``torch.export`` inserts (a call reading every input, for its
    shape assumptions): it would read every stage's cache in stage 0. Generation passes the
    inputs the trace assumes."""
    guards = [n for n in gm.graph.nodes if n.op == "call_module" and n.target == "_guards_fn"
              and not n.users]
    for node in guards:
        gm.graph.erase_node(node)
    if guards:
        gm.recompile()


_METADATA = ("sym_size", "sym_stride", "sym_numel", "sym_storage_offset")


def _metadata(node: fx.Node) -> bool:
    """Whether ``node`` only reads a tensor's shape (``aten.sym_size`` and the like)."""
    name = getattr(getattr(node.target, "_schema", None), "name", "")
    return node.op == "call_function" and name.split("::")[-1] in _METADATA


def _follow_owner(cached: fx.Node, owner: int, stage_of: Dict[fx.Node, int],
                  held: Dict[fx.Node, int]) -> None:
    """Shape reads of a cache tensor run on the stage that holds it. A stage before it that
    needs one (the trace may read the past length from any layer's cache: they share one
    size) reads the same size from a tensor it holds (``held``: placeholder -> stage)."""
    for user in list(cached.users):
        if not _metadata(user):
            continue
        need = min((stage_of[u] for u in user.users if u in stage_of), default=owner)
        if need >= owner:
            stage_of[user] = owner
            continue
        size = user.meta.get("val")
        for node, stage in held.items():
            dim = _dim_of(node, size) if stage <= need else None
            if dim is not None:
                user.args = (node, dim)
                stage_of[user] = stage
                break
        else:
            raise StepError(f"stage {need} reads the shape of a cached tensor that stage "
                            f"{owner} holds; generation cannot cut this model at these split "
                            f"points (pass use_cache=False)")


def _dim_of(node: fx.Node, size: Any) -> Optional[int]:
    """The dimension of placeholder ``node`` whose (symbolic) size is ``size``, if any."""
    value = node.meta.get("val")
    expr = getattr(getattr(size, "node", None), "expr", None)
    if not isinstance(value, torch.Tensor) or expr is None:
        return None
    for dim, n in enumerate(value.shape):
        if getattr(getattr(n, "node", None), "expr", None) == expr:
            return dim
    return None


def _owners(cache_in: List[fx.Node], cache_out: List[Any],
            stage_of: Dict[fx.Node, int]) -> Tuple[int, ...]:
    """Each cache tensor's stage: the stage that reads it, the same that writes its new
    version (a prefill only writes)."""
    if cache_in and len(cache_in) != len(cache_out):
        raise StepError(f"the model takes {len(cache_in)} cached tensors but returns "
                        f"{len(cache_out)}; it must return its whole cache")
    owners = []
    for j, out in enumerate(cache_out):
        writer = stage_of.get(out) if isinstance(out, fx.Node) else None
        readers = ({stage_of[u] for u in cache_in[j].users if u in stage_of and
                    not _metadata(u)} if cache_in else set())
        if len(readers) > 1:
            raise StepError(f"cached tensor {j} is read by stages {sorted(readers)}; each "
                            f"cached tensor must be used by one stage (cut the model between "
                            f"its layers, not inside one)")
        if readers and writer is not None and writer not in readers and out is not cache_in[j]:
            raise StepError(f"cached tensor {j} is read by stage {readers.pop()} but its new "
                            f"version is made by stage {writer}; cut the model between its "
                            f"layers, not inside one")
        owner = next(iter(readers)) if readers else writer
        if owner is None:
            raise StepError(f"cached tensor {j} is neither read nor computed by any stage")
        owners.append(owner)
    return tuple(owners)


def _needs(output: fx.Node, logits: Any, cache_out: List[Any], owners: Sequence[int],
           last: int) -> Dict[fx.Node, int]:
    """For each node the output returns, the latest stage that returns it."""
    needs: Dict[fx.Node, int] = {}
    for node, stage in [(logits, last), *zip(cache_out, owners)]:
        if isinstance(node, fx.Node):
            needs[node] = max(needs.get(node, 0), stage)
    return needs


def _needed_after(node: fx.Node, k: int, stage_of: Dict[fx.Node, int],
                  needs: Dict[fx.Node, int], output: fx.Node) -> bool:
    if needs.get(node, -1) > k:
        return True
    return any(stage_of.get(u, -1) > k for u in node.users if u is not output)
