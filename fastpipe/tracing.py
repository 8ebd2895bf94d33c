"""Any ``nn.Module`` as a pipeline: traced with ``torch.export``, cut at named submodules.

``split(module, split_points, example)`` traces the module on example inputs (keyword inputs and
any pytree included), assigns every operation of the graph to a stage by the submodule it runs
in (each split point begins a new stage), and builds one :class:`GraphStage` per stage. Stages
hand each other a *carry*: the tuple of every value computed so far that a later stage still
needs (a hidden state, an attention mask, a position index...), so skips across several stages
and inputs read by every block travel without any rewriting of the model. Parameters and buffers
are not carried: each stage's graph reads the module's own tensors (the same objects), so names,
ties and state dicts stay the module's. The result is an ``nn.Sequential`` of stages that the
pipeline runs as it runs any other: every schedule, checkpoint mode and executor.

Train and eval modes are traced separately (``torch.export`` records dropout and batch norm in
the mode of the trace), with the same split; a stage runs the graph of its current mode. The
module is traced once when it is split, in train mode (the graph a training step runs, and the
one that says which tensors a stage uses and updates); the eval graph is traced on first use,
once for all the stages of the module: when they enter eval mode (``pipe.eval()``,
``pipe.evaluate(...)``), else before the first step that runs them in eval mode
(:func:`prepare`), else at their first eval-mode forward.
"""
from __future__ import annotations

import contextlib
import inspect
import threading
import warnings
from dataclasses import dataclass
from typing import (Any, Dict, Iterable, Iterator, List, NamedTuple, Optional, Sequence, Tuple,
                    Union)

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from . import materialise
from .balance import solve

SplitPoints = Union[str, Sequence[str]]


class Call(NamedTuple):
    """Positional and keyword inputs of a model, as one pytree (micro-batched like any input)."""

    args: Tuple[Any, ...]
    kwargs: Dict[str, Any]


class TraceError(TypeError):
    """``torch.export`` could not trace the module; the message names the construct and the fix."""


@dataclass
class Split:
    """A module cut into stages: ``stages`` runs it as a pipeline, ``module`` names its state."""

    module: nn.Module
    stages: nn.Sequential
    split_points: List[str]


def as_call(inputs: Any) -> Call:
    """A model's inputs as ``Call``: a ``Call`` as is, a dict as keyword inputs, a tuple as
    positional inputs, anything else as the one positional input."""
    if isinstance(inputs, Call):
        return inputs
    if isinstance(inputs, dict):
        return Call((), dict(inputs))
    if isinstance(inputs, tuple):
        return Call(tuple(inputs), {})
    return Call((inputs,), {})


# ------------------------------------------------------------------------------ split points
def check_split_points(module: nn.Module, split_points: Sequence[str]) -> List[str]:
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


def auto_split_points(module: nn.Module, stages: int) -> List[str]:
    """Split points that cut the module's largest list of same-type blocks (a ``ModuleList`` or
    ``Sequential``) into ``stages`` parts of about equal parameter count."""
    best: Optional[Tuple[str, List[nn.Module]]] = None
    for name, sub in module.named_modules():
        if isinstance(sub, (nn.ModuleList, nn.Sequential)) and len(sub) > 1:
            children = list(sub)
            if len({type(c) for c in children}) == 1 and (best is None or
                                                          len(children) > len(best[1])):
                best = (name, children)
    if best is None:
        raise ValueError(f"split_points='auto' found no list of repeated blocks (an "
                         f"nn.ModuleList or nn.Sequential of same-type modules) in "
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


# ------------------------------------------------------------------------------ tracing
def _dynamic(value: Any) -> Any:
    """``dynamic_shapes`` for an input pytree: every dimension of every tensor left to export."""
    return pytree.tree_map(lambda x: {d: torch.export.Dim.AUTO for d in range(x.dim())}
                           if isinstance(x, torch.Tensor) else None, value)


def trace(module: nn.Module, example: Call) -> fx.GraphModule:
    """The module's forward as a graph (``torch.export``, non-strict), in its current mode,
    reading the module's own parameters and buffers."""
    try:
        bound = inspect.signature(module.forward).bind(*example.args, **example.kwargs)
        dynamic = {name: _dynamic(value) for name, value in bound.arguments.items()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program = torch.export.export(module, tuple(example.args), dict(example.kwargs),
                                          dynamic_shapes=dynamic, strict=False)
    except Exception as error:  # noqa: BLE001 - every tracing failure gets the same advice
        raise TraceError(
            f"torch.export could not trace {type(module).__name__}: {type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}. Make the forward traceable: "
            f"no data-dependent Python control flow, no generation caches (e.g. pass "
            f"use_cache=False to a Hugging Face model), or split the model by hand into an "
            f"nn.Sequential") from error
    return program.module()


# ------------------------------------------------------------------------------ splitting
def _stage_of_nodes(graph: fx.Graph, split_points: Sequence[str]) -> Dict[fx.Node, int]:
    """Stage of every computing node: split point ``k`` begins stage ``k + 1``; nodes between
    blocks stay in the current stage; a node of an earlier split module after a later one is
    an error (split points out of execution order)."""
    index = {p: k + 1 for k, p in enumerate(split_points)}
    stage_of: Dict[fx.Node, int] = {}
    current = 0
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        paths = [path for path, _ in (node.meta.get("nn_module_stack") or {}).values()]
        found = [index[p] for path in paths for p in _prefixes(path) if p in index]
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


def _prefixes(path: str) -> List[str]:
    parts = path.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _plan(gm: fx.GraphModule, split_points: Sequence[str]
          ) -> Tuple[Dict[fx.Node, int], List[List[fx.Node]], fx.Node]:
    """Stages of the nodes, and the carries: ``carries[k]`` lists (in graph order) the values
    defined up to stage ``k`` that a later stage reads; ``carries[-1]`` are the outputs."""
    graph = gm.graph
    stage_of = _stage_of_nodes(graph, split_points)
    for node in graph.nodes:
        if node.op == "placeholder":
            stage_of[node] = 0
    output = next(n for n in graph.nodes if n.op == "output")
    last = len(split_points)
    carries: List[List[fx.Node]] = []
    for k in range(last):
        live = [n for n in graph.nodes if n in stage_of and stage_of[n] <= k and
                any(stage_of.get(u, last) > k for u in n.users)]
        carries.append(live)
    return stage_of, carries, output


class GraphStage(nn.Module):
    """One stage of a traced module: the graphs (train and eval) of its operations, taking the
    previous stage's carry (the model's inputs for the first stage) and returning its own (the
    model's outputs, in the model's own structure, for the last).

    ``graphs`` holds the train graph (``True``) and, if already traced, the eval one
    (``False``); without it, the eval graph is traced from ``source`` when first needed and
    reads this stage's tensors (those of its train graph)."""

    def __init__(self, graphs: Dict[bool, fx.GraphModule], first: bool,
                 in_specs: Dict[bool, Any], out_specs: Optional[Dict[bool, Any]],
                 owner: nn.Module, source: Optional["_Source"] = None, index: int = 0) -> None:
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
        self._eval_targets: Dict[str, str] = {}  # eval graph attribute -> train graph target
        self._placed: Optional[torch.device] = None  # where _apply last put the constants

    def _apply(self, fn: Any, recurse: bool = True) -> "GraphStage":
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

    def train(self, mode: bool = True) -> "GraphStage":
        """Train or eval mode; entering eval mode traces the eval graph if not yet traced (here,
        before any step, rather than inside the first eval-mode step)."""
        super().train(mode)
        if not mode:
            self._graph(False)
        return self

    @property
    def mutated_buffers(self) -> List[torch.Tensor]:
        """The buffers a training forward updates in place (batch-norm running statistics):
        a recomputation must leave them as the first forward left them."""
        return _written_buffers(self.train_graph)

    @property
    def traced_modes(self) -> Tuple[bool, ...]:
        """The modes whose graphs are traced already (``True``: train, ``False``: eval)."""
        return tuple(mode for mode, done in self._traced.items() if done)

    def prepare(self) -> None:
        """Trace the graph of the mode the stage runs in now, if not yet traced."""
        self._graph(self._owner[0].training)

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
            built = _stage_graph(traced.gm, self._index, traced.stage_of, traced.carries,
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

    def _tensor_device(self) -> Optional[torch.device]:
        for tensor in [*self.train_graph.parameters(), *self.train_graph.buffers()]:
            return tensor.device
        return None


def prepare(modules: Iterable[Optional[nn.Module]]) -> None:
    """Before a step: the traced stages among ``modules`` (or their children) trace the graph of
    the mode they run in, if not yet traced, so that no graph is traced inside the step (where
    other stages and processes would wait for it)."""
    for module in modules:
        if module is None:
            continue
        for part in (module, *module.children()):
            if isinstance(part, GraphStage):
                part.prepare()


def _empty_graph(index: int) -> fx.GraphModule:
    return fx.GraphModule(nn.Module(), fx.Graph(), class_name=f"Stage{index}Eval")


def _fill(shell: fx.GraphModule, built: fx.GraphModule, value_for: Any) -> Dict[str, str]:
    """Make ``shell`` (in place, so modes and references to it hold) run ``built``'s graph,
    each attribute it reads registered flat on ``shell`` as ``value_for(target)``. Returns the
    attribute names and their targets."""
    names: Dict[str, str] = {}  # target -> attribute
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


def _attr_or_none(root: Any, target: str) -> Optional[torch.Tensor]:
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


def _written_buffers(gm: fx.GraphModule) -> List[torch.Tensor]:
    """The buffers that operations of ``gm`` write in place: arguments their schemas mark as
    written, and the running statistics of batch norms."""
    found: Dict[int, torch.Tensor] = {}
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


def _stage_fx_graph(gm: fx.GraphModule, stage: int, stage_of: Dict[fx.Node, int],
                    carries: List[List[fx.Node]], output: fx.Node) -> fx.Graph:
    """The graph of one stage, dead code left in: placeholders for its inputs (the model's
    inputs for stage 0, the previous carry otherwise), its own operations and the parameters
    they read, and its carry (or the model's outputs) as output."""
    graph = fx.Graph()
    env: Dict[fx.Node, fx.Node] = {}
    inputs = ([n for n in gm.graph.nodes if n.op == "placeholder"] if stage == 0
              else carries[stage - 1])
    for i, node in enumerate(inputs):
        env[node] = graph.placeholder(f"in_{i}_{node.name}")
        env[node].meta = dict(node.meta)

    def lookup(node: fx.Node) -> fx.Node:
        if node not in env:
            if node.op != "get_attr":
                raise RuntimeError(f"internal: {node} is neither carried nor local")
            env[node] = graph.node_copy(node, lookup)
        return env[node]

    for node in gm.graph.nodes:
        if stage_of.get(node) == stage and node.op not in ("placeholder", "output"):
            env[node] = graph.node_copy(node, lookup)
    last = stage == len(carries)
    outs = list(output.args[0]) if last else carries[stage]
    graph.output(tuple(fx.map_arg(o, lookup) if isinstance(o, fx.Node) else o for o in outs))
    return graph


def _stage_graph(gm: fx.GraphModule, stage: int, stage_of: Dict[fx.Node, int],
                 carries: List[List[fx.Node]], output: fx.Node) -> fx.GraphModule:
    """One stage's graph as a module reading ``gm``'s tensors under their own names."""
    graph = _stage_fx_graph(gm, stage, stage_of, carries, output)
    result = fx.GraphModule(gm, graph, class_name=f"Stage{stage}")
    result.graph.eliminate_dead_code()
    result.recompile()
    return result


class Traced(NamedTuple):
    """A module traced in one mode, and its plan (the stage of every node, the carries)."""

    gm: fx.GraphModule
    stage_of: Dict[fx.Node, int]
    carries: List[List[fx.Node]]
    output: fx.Node


# How long a stage waits for another thread tracing the module it needs (tracing a very large
# model takes minutes, not hours).
TRACE_WAIT = 3600.0


class _Source:
    """What the stages of one traced module share to trace a mode on first use: the module,
    its example inputs and split points, its tensors' devices and dtypes when first traced, and
    each mode's trace (made once, under a lock: ``torch.export`` patches ``nn.Module`` for
    every thread while it traces)."""

    def __init__(self, module: nn.Module, call: Call, points: Sequence[str]) -> None:
        self.module, self.call, self.points = module, call, list(points)
        self.grad = torch.is_grad_enabled()
        self.layout = materialise.tensor_layout(module)
        self.lock = threading.RLock()
        self.traces: Dict[bool, Traced] = {}

    def __deepcopy__(self, memo: Dict[int, Any]) -> "_Source":
        return self  # a copied stage traces the same module (and reads its own tensors)

    @contextlib.contextmanager
    def locked(self, what: str) -> Iterator[None]:
        if not self.lock.acquire(timeout=TRACE_WAIT):
            raise TimeoutError(f"{what} waited {TRACE_WAIT:.0f}s for another thread tracing "
                               f"{type(self.module).__name__}")
        try:
            yield
        finally:
            self.lock.release()

    def traced(self, training: bool) -> Traced:
        """The module traced in ``training`` mode, as it was when first traced: on meta twins of
        its tensors if they have moved or changed dtype since (stages placed on devices, a
        meta model materialised in part)."""
        with self.locked(f"the {'train' if training else 'eval'} trace"):
            if training not in self.traces:
                moved = materialise.tensor_layout(self.module) != self.layout
                with self._as_when_split(), (materialise.meta_twins(self.module, self.layout)
                                             if moved else contextlib.nullcontext()):
                    self.traces[training] = trace_mode(self.module, self.call, self.points,
                                                       training)
            return self.traces[training]

    @contextlib.contextmanager
    def _as_when_split(self) -> Iterator[None]:
        """Grad mode as when the module was split, no inference mode and no autocast (a step's
        context must not end up in the graph)."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.inference_mode(False))
            stack.enter_context(torch.set_grad_enabled(self.grad))
            for device in ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",):
                stack.enter_context(torch.autocast(device, enabled=False))
            yield


def trace_mode(module: nn.Module, call: Call, points: Sequence[str], training: bool) -> Traced:
    """``module`` traced in ``training`` mode (every submodule's own mode restored after) and
    planned at ``points``."""
    modes = [(m, m.training) for m in module.modules()]
    try:
        module.train(training)
        gm = trace(module, call)
    except TraceError as error:
        raise TraceError(f"{error} (tracing it in {'train' if training else 'eval'} "
                         f"mode)") from error.__cause__
    finally:
        for m, mode in modes:
            m.training = mode
    return Traced(gm, *_plan(gm, points))


def _set_mode(module: nn.Module, training: bool) -> None:
    """Every submodule's flag, without ``train()`` (which would trace the eval graph now)."""
    for m in module.modules():
        m.training = training


def split(module: nn.Module, split_points: SplitPoints, example: Any,
          stages: Optional[int] = None) -> Split:
    """Cut ``module`` into stages at ``split_points`` (submodule names, each beginning a stage,
    or ``'auto'`` with ``stages``), tracing it on ``example`` (its inputs: a ``Call``, a dict of
    keyword inputs, a tuple of positional ones, or the single input). The module is traced once
    here, in train mode; the eval graph when the stages first need it (see the module's
    docstring)."""
    if split_points == "auto":
        if stages is None:
            raise ValueError("split_points='auto' needs the number of stages")
        points = auto_split_points(module, stages)
    else:
        points = check_split_points(module, split_points)
    source = _Source(module, as_call(example), points)
    traced = trace_mode(module, source.call, points, True)
    in_specs = {True: traced.gm._in_spec}
    out_specs = {True: traced.gm._out_spec}
    count = len(points) + 1
    parts = [GraphStage({True: _stage_graph(traced.gm, k, traced.stage_of, traced.carries,
                                            traced.output)},
                        first=k == 0, in_specs=in_specs,
                        out_specs=out_specs if k == count - 1 else None, owner=module,
                        source=source, index=k)
             for k in range(count)]
    stages_module = nn.Sequential(*parts)
    _set_mode(stages_module, module.training)
    return Split(module, stages_module, points)


def wanted(module: Any, split_points: Any) -> bool:
    """Whether a front door traces ``module``: split points given, or a module other than an
    ``nn.Sequential``."""
    return split_points is not None or (isinstance(module, nn.Module) and
                                        not isinstance(module, nn.Sequential))


def stage_count(devices: Any, virtual_stages: int) -> int:
    """Stages of a traced pipe: devices (listed, else the CUDA devices, else one CPU) x chunks."""
    count = len(devices) if devices is not None else (torch.cuda.device_count() or 1)
    return count * virtual_stages


def stages_of(module: nn.Module, split_points: Any, example_inputs: Any,
              stages: int, follow: bool = True,
              deferred_batch_norm: Any = False) -> nn.Sequential:
    """The front doors' entry: ``module`` as an ``nn.Sequential`` of traced stages (checked
    arguments, clear errors before any work). ``follow``: the stages take their train/eval mode
    from ``module`` (a front door that keeps ``module`` as its child); else from their own."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    if example_inputs is None:
        raise TypeError(f"module must be an nn.Sequential, or come with example_inputs= to be "
                        f"traced with torch.export: {type(module).__name__} is not a Sequential, "
                        f"so pass a batch as the model takes it (a tensor, a tuple of positional "
                        f"inputs, or a dict of keyword inputs such as {{'input_ids': ids, "
                        f"'attention_mask': mask}}), or wrap its layers in an nn.Sequential")
    points = "auto" if split_points is None else split_points
    if points != "auto":
        points = check_split_points(module, points)
        if len(points) + 1 != stages:
            raise ValueError(f"split_points={points} makes {len(points) + 1} stages but the "
                             f"pipeline has {stages} (devices x virtual_stages); give "
                             f"{stages - 1} split points, or split_points='auto'")
    parts = split(module, points, example_inputs, stages).stages
    if deferred_batch_norm is True and any(part.mutated_buffers for part in parts):
        raise NotImplementedError(
            f"deferred_batch_norm=True does not reach the batch norms of a traced "
            f"{type(module).__name__} (their running statistics would update per micro-batch); "
            f"pass deferred_batch_norm=False, or the model as an nn.Sequential of its layers")
    if not follow:
        for part in parts:
            part._owner = [part]
    return parts


def local_view(module: nn.Module, kept: nn.Module) -> nn.Module:
    """A module holding, under ``module``'s own names, those of its parameters and buffers that
    ``kept`` (this process's stages) uses: what a rank's ``named_parameters`` and state dicts
    show, so checkpoints move between the plain module and any layout. A buffer the module
    keeps out of its state dict (``persistent=False``) stays out of it."""
    mine = {id(t) for t in [*kept.parameters(), *kept.buffers()]}
    view = nn.Module()
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in mine:
            _place(view, name, param, parameter=True)
    for name, buffer in module.named_buffers(remove_duplicate=False):
        if id(buffer) in mine:
            _place(view, name, buffer, parameter=False, persistent=_persistent(module, name))
    return view


def _persistent(module: nn.Module, name: str) -> bool:
    """Whether the buffer ``name`` is in ``module``'s state dict (registered
    ``persistent=True``): ``rotary_emb.inv_freq`` of a Llama is not."""
    path, _, attr = name.rpartition(".")
    owner = module.get_submodule(path) if path else module
    return attr not in owner._non_persistent_buffers_set


def _place(root: nn.Module, name: str, tensor: torch.Tensor, parameter: bool,
           persistent: bool = True) -> None:
    *path, attr = name.split(".")
    holder = root
    for part in path:
        if part not in holder._modules:
            holder.add_module(part, nn.Module())
        holder = holder._modules[part]
    if parameter:
        holder.register_parameter(attr, tensor)
    else:
        holder.register_buffer(attr, tensor, persistent=persistent)
