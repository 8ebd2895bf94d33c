"""One stage of a traced module as an ``nn.Module``: its train graph, and its eval graph.

A :class:`GraphStage` runs the graph of the mode its traced module is in. The train graph is
built when the module is split; the eval graph is cut, on first use, from the module's eval
trace (made once for all its stages by the :class:`TraceSource` the stages share) and pointed at
this stage's own tensors and device. Moving a stage also moves the device constants its graphs
were traced with.

A trace may hold only for inputs of the shape it was made on (a dimension ``torch.export``
specialised, its guard failing on another size): the source traces the module again for such
inputs, a *variant* kept per shape, and each stage cuts its graphs of that variant the same
way. The first stage picks the variant whose guards accept its inputs; a later stage the one
its source picked for the batch, else the one whose graph takes the shapes of its carry.
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Optional, Protocol

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from .graph_cut import Traced, stage_graph
from .model_call import as_call

__all__ = ["GraphStage", "TraceSource", "place_constants"]


Key = tuple[bool, int]  # (training, variant): one graph of a stage
Shape = Optional[tuple[Optional[int], ...]]  # a traced input's sizes: None where dynamic


class TraceSource(Protocol):
    """What the stages of one traced module share to trace a mode (and a shape) on first use."""

    module: nn.Module
    current: dict[bool, int]  # per mode, the variant the latest inputs picked

    def locked(self, what: str) -> AbstractContextManager[None]:
        """Hold the source's lock (one trace at a time); ``what`` names the waiter."""

    def traced(self, training: bool, variant: int = 0) -> Traced:
        """The module traced in ``training`` mode on the inputs of ``variant`` (traced once,
        then kept)."""

    def variant_for(self, training: bool, leaves: list[Any], spec: Any) -> int:
        """The variant whose trace accepts the inputs ``leaves`` (flattened by ``spec``),
        traced on them when none does."""

    def variants(self) -> int:
        """How many variants (input shapes) the module is traced for."""


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
        self._last = out_specs is not None
        self._out_specs: dict[Key, Any] = {(mode, 0): spec
                                           for mode, spec in (out_specs or {}).items()}
        self._owner = [owner]  # not a submodule: its parameters are the graphs' already
        self._source = source
        # every graph this stage has: (True, 0) the train graph, (False, 0) the eval graph,
        # then those of the shapes traced again (not submodules: they read this stage's tensors)
        self._graphs: dict[Key, fx.GraphModule] = {(True, 0): self.train_graph}
        if False in graphs:
            self._graphs[False, 0] = self.eval_graph
        self._targets: dict[Key, dict[str, str]] = {}  # a graph's attribute -> train target
        self._expects: dict[Key, list[Shape]] = {}  # the input shapes each graph takes
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
        for graph in {id(g): g for g in (self.train_graph, self.eval_graph,
                                          *self._graphs.values())}.values():
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
        """The modes whose graphs are traced already (``True``: train, ``False``: eval), for the
        shape of the example inputs."""
        return tuple(mode for mode in (True, False) if (mode, 0) in self._graphs)

    def prepare(self, inputs: Any = None) -> None:
        """Trace the graph of the mode the stage runs in now, if not yet traced; given the
        model's ``inputs`` (the whole batch), the graph of their shape, traced again when no
        trace takes them (the source picks that variant for the step)."""
        mode = self._owner[0].training
        variant = 0
        if inputs is not None and self._source is not None:
            call = as_call(inputs)
            leaves, spec = pytree.tree_flatten((tuple(call.args), dict(call.kwargs)))
            if spec == self._in_specs.get(mode, spec):
                variant = self._source.variant_for(mode, leaves, spec)
        self._graph(mode, variant)

    def follow_own_mode(self) -> None:
        """Run the graph of this stage's own train/eval mode, not its traced module's (for a
        front door that does not keep the module as its child)."""
        self._owner = [self]

    def forward(self, carry: Any) -> Any:
        mode = self._owner[0].training  # the traced module's mode (pipe.train()/eval())
        if self._first:
            call = as_call(carry)
            leaves, spec = pytree.tree_flatten((tuple(call.args), dict(call.kwargs)))
            self._graph(mode, 0)  # the mode's first graph: its input structure
            if spec != self._in_specs[mode]:
                raise TypeError(f"the model was traced with inputs structured as "
                                f"{self._in_specs[mode]}, but got {spec}; pass the same "
                                f"positional and keyword arguments as in the trace")
            variant = (0 if self._source is None else
                       self._source.variant_for(mode, leaves, spec))
            values = self._graph(mode, variant)(*leaves)
        else:
            variant = self._variant_of(mode, carry)
            values = self._graph(mode, variant)(*carry)
        if self._last:
            return pytree.tree_unflatten(list(values), self._out_specs[mode, variant])
        return tuple(values)

    # ---------------------------------------------------------------- graphs, on first use
    def _graph(self, mode: bool, variant: int = 0) -> fx.GraphModule:
        if (mode, variant) not in self._graphs:
            self._build(mode, variant)
        return self._graphs[mode, variant]

    def _build(self, mode: bool, variant: int) -> None:
        """Cut this stage's graph of ``mode`` and ``variant`` from the module's trace (traced
        once for all its stages) and point it at this stage's tensors and device."""
        source = self._source
        assert source is not None
        with source.locked(f"stage {self._index}'s {'train' if mode else 'eval'} graph"):
            if (mode, variant) in self._graphs:
                return
            traced = source.traced(mode, variant)
            built = stage_graph(traced.gm, self._index, traced.stage_of, traced.carries,
                                traced.output)
            shell = self.eval_graph if (mode, variant) == (False, 0) else \
                _empty_graph(self._index)
            self._targets[mode, variant] = _fill(
                shell, built, lambda target: self._tensor_for(target, built))
            device = self._tensor_device() or self._placed
            if device is not None:
                place_constants(shell, device)
            self._in_specs.setdefault(mode, traced.gm._in_spec)
            if self._last:
                self._out_specs[mode, variant] = traced.gm._out_spec
            self._graphs[mode, variant] = shell

    def _variant_of(self, mode: bool, carry: Any) -> int:
        """The variant a later stage runs for ``carry``: the one its source picked for the
        batch when its graph takes the carry's shapes, else the first whose graph does."""
        source = self._source
        if source is None:
            return 0
        picked = source.current.get(mode, 0)
        order = [picked] + [v for v in range(source.variants()) if v != picked]
        for variant in order:
            if _takes(self._expected(mode, variant), carry):
                return variant
        raise ValueError(
            f"stage {self._index} received a carry of shapes {_shapes(carry)}, which none of "
            f"the graphs traced for this pipe's input shapes takes (the latest expects "
            f"{_shapes(self._expected(mode, picked))}); the model's inputs changed shape and "
            f"this process, given no inputs, could not trace the new shape before the step: "
            f"pass the batch to every process (train_step, forward and evaluate)")

    def _tensor_for(self, target: str, gm: fx.GraphModule) -> Any:
        """What a graph built after the train graph (the eval graph, a variant's) reads as
        ``target``: this stage's own tensor (its train graph's), else a tensor of the module,
        else a constant of the trace (or a submodule: a higher-order operation's graph)."""
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

    def _expected(self, mode: bool, variant: int) -> list[Shape]:
        """The shapes the graph of ``mode`` and ``variant`` was traced to take (kept)."""
        key = (mode, variant)
        if key not in self._expects:
            self._expects[key] = _traced_shapes(self._graph(mode, variant))
        return self._expects[key]

    def _share_tensors(self) -> None:
        """Every other graph reads the very tensors of the train graph (a move replaces
        buffers, each module's on its own)."""
        for key, targets in self._targets.items():
            shell = self._graphs[key]
            for name, target in targets.items():
                mine = _attr_or_none(self.train_graph, target)
                if mine is not None and getattr(shell, name) is not mine:
                    _register(shell, name, mine)

    def _tensor_device(self) -> torch.device | None:
        for tensor in [*self.train_graph.parameters(), *self.train_graph.buffers()]:
            return tensor.device
        return None


def _empty_graph(index: int) -> fx.GraphModule:
    return fx.GraphModule(nn.Module(), fx.Graph(), class_name=f"Stage{index}Eval")


def _traced_shapes(graph: fx.GraphModule) -> list[Shape]:
    """The shapes a graph's inputs had when traced: each dimension's size where the trace
    specialised it, ``None`` where it is dynamic (``None`` for an input that is no tensor)."""
    found: list[Shape] = []
    for node in graph.graph.nodes:
        if node.op == "placeholder":
            value = node.meta.get("val")
            found.append(tuple(d if isinstance(d, int) else None for d in value.shape)
                         if isinstance(value, torch.Tensor) else None)
    return found


def _takes(traced: list[Shape], values: Any) -> bool:
    """Whether ``values`` fit a graph's inputs (``traced``: their shapes when traced): as
    many, each tensor of the traced rank with every specialised dimension the traced size."""
    values = list(values)
    if len(traced) != len(values):
        return False
    for want, got in zip(traced, values):
        if want is not None and isinstance(got, torch.Tensor):
            if len(want) != got.dim() or any(w is not None and w != g
                                             for w, g in zip(want, got.shape)):
                return False
    return True


def _shapes(values: Any) -> list[Any]:
    return [tuple(v.shape) if isinstance(v, torch.Tensor) else v for v in values]


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
