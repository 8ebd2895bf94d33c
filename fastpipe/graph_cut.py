"""Cutting a traced graph into stages: which stage runs each node, what each stage carries.

Every operation of a module's ``torch.export`` graph belongs to the stage of the submodule it
runs in (each split point begins a new stage). A stage's *carry* is every value computed so far
that a later stage still reads; :func:`stage_graph` builds one stage's graph module, taking the
previous carry and returning its own (the model's outputs for the last stage), reading the
module's own parameters and buffers.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

from torch import fx

__all__ = ["Traced", "plan", "stage_graph"]


class Traced(NamedTuple):
    """A module traced in one mode, and its plan (the stage of every node, the carries)."""

    gm: fx.GraphModule
    stage_of: dict[fx.Node, int]
    carries: list[list[fx.Node]]
    output: fx.Node


def stage_of_nodes(graph: fx.Graph, split_points: Sequence[str],
                   prefix: str = "") -> dict[fx.Node, int]:
    """Stage of every computing node: split point ``k`` begins stage ``k + 1``; nodes between
    blocks stay in the current stage; a node of an earlier split module after a later one is
    an error (split points out of execution order). ``prefix``: what the graph's module paths
    start with before the model's own names (a wrapper's attribute)."""
    index = {f"{prefix}{p}": k + 1 for k, p in enumerate(split_points)}
    stage_of: dict[fx.Node, int] = {}
    current = 0
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        found = split_stages_of(node, index)
        if found:
            stage = max(found)
            if stage < current:
                raise ValueError(
                    f"split_points are out of execution order: {split_points[stage - 1]!r} "
                    f"runs after {split_points[current - 1]!r}; list them in the order the "
                    f"forward runs them")
            current = stage
        stage_of[node] = current
    seen = set(stage_of.values())
    missing = [p for p, k in index.items() if k not in seen]
    if missing:
        raise ValueError(f"split_points names {missing}, which the traced forward never runs "
                         f"(or runs no operation in); choose submodules the forward calls")
    return stage_of


def split_stages_of(node: fx.Node, index: Mapping[str, int]) -> list[int]:
    """The stages of the split points (``index``: module path -> the stage it begins) whose
    modules ``node`` runs inside, read from its ``nn_module_stack``."""
    paths = [path for path, _ in (node.meta.get("nn_module_stack") or {}).values()]
    return [index[p] for path in paths for p in _prefixes(path) if p in index]


def _prefixes(path: str) -> list[str]:
    parts = path.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def plan(gm: fx.GraphModule, split_points: Sequence[str]
         ) -> tuple[dict[fx.Node, int], list[list[fx.Node]], fx.Node]:
    """Stages of the nodes, and the carries: ``carries[k]`` lists (in graph order) the values
    defined up to stage ``k`` that a later stage reads; ``carries[-1]`` are the outputs."""
    graph = gm.graph
    stage_of = stage_of_nodes(graph, split_points)
    for node in graph.nodes:
        if node.op == "placeholder":
            stage_of[node] = 0
    output = next(n for n in graph.nodes if n.op == "output")
    last = len(split_points)
    carries: list[list[fx.Node]] = []
    for k in range(last):
        live = [n for n in graph.nodes if n in stage_of and stage_of[n] <= k and
                any(stage_of.get(u, last) > k for u in n.users)]
        carries.append(live)
    return stage_of, carries, output


def stage_graph(gm: fx.GraphModule, stage: int, stage_of: dict[fx.Node, int],
                carries: list[list[fx.Node]], output: fx.Node) -> fx.GraphModule:
    """One stage's graph as a module reading ``gm``'s tensors under their own names: the
    model's inputs for stage 0, the previous carry otherwise; its carry (or the model's
    outputs) as output."""
    inputs = ([n for n in gm.graph.nodes if n.op == "placeholder"] if stage == 0
              else carries[stage - 1])
    outs = list(output.args[0]) if stage == len(carries) else carries[stage]
    return graph_of_stage(gm, stage, stage_of, inputs, outs, f"Stage{stage}")


def graph_of_stage(gm: fx.GraphModule, stage: int, stage_of: Mapping[fx.Node, int],
                   inputs: Sequence[fx.Node], outs: Sequence[object],
                   class_name: str) -> fx.GraphModule:
    """The module of ``gm``'s nodes in ``stage`` (and the parameters they read): placeholders
    for ``inputs``, ``outs`` as its output, dead code eliminated."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, node in enumerate(inputs):
        env[node] = graph.placeholder(f"in_{i}_{node.name}")
        env[node].meta = dict(node.meta)

    def lookup(node: fx.Node) -> fx.Node:
        if node not in env:
            if node.op != "get_attr":
                raise RuntimeError(f"internal: {node} is neither an input of stage {stage} "
                                   f"nor computed there")
            env[node] = graph.node_copy(node, lookup)
        return env[node]

    for node in gm.graph.nodes:
        if stage_of.get(node) == stage and node.op not in ("placeholder", "output"):
            env[node] = graph.node_copy(node, lookup)
    graph.output(tuple(fx.map_arg(o, lookup) if isinstance(o, fx.Node) else o for o in outs))
    result = fx.GraphModule(gm, graph, class_name=class_name)
    result.graph.eliminate_dead_code()
    result.recompile()
    return result
