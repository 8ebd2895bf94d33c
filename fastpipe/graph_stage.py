"""One stage of a traced module as an ``nn.Module``: its train graph, and its eval graph.

A :class:`GraphStage` runs the graph of the mode its traced module is in. The train graph is
built when the module is split; the eval graph is cut, on first use, from the module's eval
trace (made once for all its stages by the :class:`TraceSource` the stages share) and pointed at
this stage's own tensors and device. Moving a stage also moves the device constants its graphs
were traced with.
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from .graph_cut import Traced, stage_graph
from .model_call import as_call

__all__ = ["GraphStage", "TraceSource", "place_constants"]


class TraceSource(Protocol):
    """What the stages of one traced module share to trace a mode on first use."""

    module: nn.Module

    def locked(self, what: str) -> AbstractContextManager[None]:
        """Hold the source's lock (one trace at a time); ``what`` names the waiter."""

    def traced(self, training: bool) -> Traced:
        """The module traced in ``training`` mode (traced once, then kept)."""


class GraphStage(nn.Module):
    """One stage of a traced module: the graphs (train and eval) of its operations, taking the
    previous stage's carry (the model's inputs for the first stage) and returning its own (the
    model's outputs, in the model's own structure, for the last).

    ``graphs`` holds the train graph (``True``) and, if already traced, the eval one
    (``False``); without it, the eval graph is traced from ``source`` when first needed and
    reads this stage's tensors (those of its train graph)."""

    def __init__(self, graphs: dict[bool, fx.GraphModule], first: bool,
                 in_specs: dict[bool, Any], out_specs: dict[bool, Any] | None,
                 owner: nn.Module, source: TraceSource | None = None, index: int = 0) -> None:
        super().__init__()
        if False not in graphs and source is None:
            raise TypeError("GraphStage needs graphs[False] (the eval graph) or the source to "
                            "trace it from")
        self.train_graph = graphs[True]
        # the eval graph: a module from the start (modes, casts and moves reach it), filled in
        # place when traced, so ``evaluate()``'s restored modes cover it
        self.eval_graph = graphs[False] if False in graphs else _empty_graph(index)
        self._first = first
        self._index = index
        self._in_specs = dict(in_specs)
        self._out_specs = None if out_specs is None else dict(out_specs)
        self._owner = [owner]  # not a submodule: its parameters are the graphs' already
        self._source = source
        self._traced = {True: True, False: False in graphs}
        self._eval_targets: dict[str, str] = {}  # eval graph attribute -> train graph target
        self._placed: torch.device | None = None  # where _apply last put the constants

    def _apply(self, fn: Any, recurse: bool = True) -> GraphStage:
        """Moving the stage (``.to(device)``, ``.cuda()``, ``to_empty``) moves its parameters and
        also the device constants its graphs were traced with (``torch.arange(...,
        device=...)``), so a stage traced on the CPU runs on the device it is placed on. A cast
        leaves the constants where the tensors are."""
        result = super()._apply(fn, recurse)
        self._share_tensors()
        device = self._tensor_device()
        if device is None:  # no tensors: where ``fn`` takes a tensor
            try:
                device = fn(torch.empty(0, device=self._placed or "cpu")).device
            except Exception:  # noqa: BLE001 - a conversion that is not a move leaves constants
                return result
        self._placed = device
        for graph in (self.train_graph, self.eval_graph):
            place_constants(graph, device)
        return result

    def train(self, mode: bool = True) -> GraphStage:
        """Train or eval mode; entering eval mode traces the eval graph if not yet traced (here,
        before any step, rather than inside the first eval-mode step)."""
        super().train(mode)
        if not mode:
            self._graph(False)
        return self

    @property
    def mutated_buffers(self) -> list[torch.Tensor]:
        """The buffers a training forward updates in place (batch-norm running statistics):
        a recomputation must leave them as the first forward left them."""
        return _written_buffers(self.train_graph)

    @property
    def traced_modes(self) -> tuple[bool, ...]:
        """The modes whose graphs are traced already (``True``: train, ``False``: eval)."""
        return tuple(mode for mode, done in self._traced.items() if done)

    def prepare(self) -> None:
        """Trace the graph of the mode the stage runs in now, if not yet traced."""
        self._graph(self._owner[0].training)

    def follow_own_mode(self) -> None:
        """Run the graph of this stage's own train/eval mode, not its traced module's (for a
        front door that does not keep the module as its child)."""
        self._owner = [self]

    def forward(self, carry: Any) -> Any:
        mode = self._owner[0].training  # the traced module's mode (pipe.train()/eval())
        graph = self._graph(mode)
        if self._first:
            call = as_call(carry)
            leaves, spec = pytree.tree_flatten((tuple(call.args), dict(call.kwargs)))
            if spec != self._in_specs[mode]:
                raise TypeError(f"the model was traced with inputs structured as "
                                f"{self._in_specs[mode]}, but got {spec}; pass the same "
                                f"positional and keyword arguments as in the trace")
            values = graph(*leaves)
        else:
            values = graph(*carry)
        if self._out_specs is not None:
            return pytree.tree_unflatten(list(values), self._out_specs[mode])
        return tuple(values)

    # ---------------------------------------------------------------- the eval graph, lazily
    def _graph(self, mode: bool) -> fx.GraphModule:
        if not self._traced[mode]:
            self._trace_eval()
        return self.train_graph if mode else self.eval_graph

    def _trace_eval(self) -> None:
        """Cut this stage's eval graph from the module's eval trace (traced once for all its
        stages) and point it at this stage's tensors and device."""
        source = self._source
        assert source is not None
        with source.locked(f"stage {self._index}'s eval graph"):
            if self._traced[False]:
                return
            traced = source.traced(False)
            built = stage_graph(traced.gm, self._index, traced.stage_of, traced.carries,
                                traced.output)
            self._eval_targets = _fill(self.eval_graph, built,
                                       lambda target: self._tensor_for(target, built))
            device = self._tensor_device() or self._placed
            if device is not None:
                place_constants(self.eval_graph, device)
            self._in_specs[False] = traced.gm._in_spec
            if self._out_specs is not None:
                self._out_specs[False] = traced.gm._out_spec
            self._traced[False] = True

    def _tensor_for(self, target: str, gm: fx.GraphModule) -> Any:
        """What the eval graph reads as ``target``: this stage's own tensor (its train graph's),
        else a tensor of the module, else a constant of the trace (or a submodule: a
        higher-order operation's graph)."""
        if not isinstance(_attr(gm, target), torch.Tensor):
            return _attr(gm, target)
        mine = _attr_or_none(self.train_graph, target)
        if mine is not None:
            return mine
        assert self._source is not None
        theirs = _attr_or_none(self._source.module, target)
        device = self._tensor_device() or self._placed
        if theirs is not None:
            if theirs.is_meta or (device is not None and theirs.device != device):
                raise NotImplementedError(
                    f"the eval graph of stage {self._index} reads {target!r}, which its train "
                    f"graph does not read and which is not on the stage's device "
                    f"({theirs.device}); such a model's eval mode is not supported on this "
                    f"layout: trace it in one process (fastpipe.Pipe on one device)")
            return theirs
        constant = _attr(gm, target)
        return constant if device is None else constant.to(device)

    def _share_tensors(self) -> None:
        """The eval graph reads the very tensors of the train graph (a move replaces buffers,
        each module's on its own)."""
        for name, target in self._eval_targets.items():
            mine = _attr_or_none(self.train_graph, target)
            if mine is not None and getattr(self.eval_graph, name) is not mine:
                _register(self.eval_graph, name, mine)

    def _tensor_device(self) -> torch.device | None:
        for tensor in [*self.train_graph.parameters(), *self.train_graph.buffers()]:
            return tensor.device
        return None


def _empty_graph(index: int) -> fx.GraphModule:
    return fx.GraphModule(nn.Module(), fx.Graph(), class_name=f"Stage{index}Eval")


def _fill(shell: fx.GraphModule, built: fx.GraphModule, value_for: Any) -> dict[str, str]:
    """Make ``shell`` (in place, so modes and references to it hold) run ``built``'s graph,
    each attribute it reads registered flat on ``shell`` as ``value_for(target)``. Returns the
    attribute names and their targets."""
    names: dict[str, str] = {}  # target -> attribute
    graph = built.graph
    for node in graph.nodes:
        if node.op not in ("get_attr", "call_module"):
            continue
        target = str(node.target)
        if target not in names:
            names[target] = f"{target.replace('.', '_')}_{len(names)}"
            _register(shell, names[target], value_for(target))
        node.target = names[target]
    shell.graph = graph  # recompiles
    return {name: target for target, name in names.items()}


def _register(module: nn.Module, name: str, value: Any) -> None:
    module._parameters.pop(name, None)
    module._buffers.pop(name, None)
    if isinstance(value, nn.Parameter):
        module.register_parameter(name, value)
    elif isinstance(value, torch.Tensor):
        module.register_buffer(name, value)
    else:
        module.add_module(name, value)


def _attr_or_none(root: Any, target: str) -> torch.Tensor | None:
    value: Any = root
    for part in target.split("."):
        value = getattr(value, part, None)
        if value is None:
            return None
    return value if isinstance(value, torch.Tensor) else None


def place_constants(gm: fx.GraphModule, device: torch.device) -> None:
    """Make the devices a traced graph names (``device=`` arguments, ``.to(device)`` targets)
    ``device``."""
    def moved(value: Any) -> Any:
        return device if isinstance(value, torch.device) and value != device else value

    changed = False
    for node in gm.graph.nodes:
        args = tuple(moved(a) for a in node.args)
        kwargs = {k: moved(v) for k, v in node.kwargs.items()}
        if args != node.args or kwargs != node.kwargs:
            node.args, node.kwargs, changed = args, kwargs, True
    if changed:
        gm.recompile()


# Operations that update their running-statistics arguments in place without saying so in their
# schemas (``aten::batch_norm`` and friends).
_RUNNING_STATS_OPS = ("batch_norm", "instance_norm")


def _written_buffers(gm: fx.GraphModule) -> list[torch.Tensor]:
    """The buffers that operations of ``gm`` write in place: arguments their schemas mark as
    written, and the running statistics of batch norms."""
    found: dict[int, torch.Tensor] = {}
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None:
            continue
        stats = any(op in schema.name for op in _RUNNING_STATS_OPS)
        for arg, value in zip(schema.arguments, node.args):
            written = arg.alias_info is not None and arg.alias_info.is_write
            if (written or (stats and arg.name.startswith("running_"))) and \
                    isinstance(value, fx.Node) and value.op == "get_attr":
                tensor = _attr(gm, value.target)
                found[id(tensor)] = tensor
    return list(found.values())


def _attr(gm: fx.GraphModule, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value
