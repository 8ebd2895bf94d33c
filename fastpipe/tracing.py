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

Every size is left dynamic in the trace but those of image-like inputs (4 or more dimensions:
the batch only). A trace that holds for one input shape only (``torch.export`` specialised a
size, and its guard refuses another) is traced again for a batch of another shape, before the
step that brings it (:func:`prepare`) or at the first stage's forward: one *variant* per shape,
kept, one :class:`RetraceWarning` per module (see :mod:`fastpipe.graph_stage`). A ``forward``
that takes inputs through ``**kwargs`` (a PEFT ``PeftModel``'s) is traced with them spelled out
as parameters.

The pieces live next to this module: the inputs (:mod:`fastpipe.model_call`), the split points
(:mod:`fastpipe.split_points`), the cut of a traced graph into stages (:mod:`fastpipe.graph_cut`)
and the stage module (:mod:`fastpipe.graph_stage`). This module traces, and builds the stages.
"""
from __future__ import annotations

import contextlib
import contextvars
import inspect
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from . import materialise
from .graph_cut import Traced, plan
from .graph_cut import stage_graph as _stage_graph
from .graph_stage import GraphStage, place_constants
from .model_call import Call, as_call
from .split_points import auto_split_points, check_split_points

__all__ = ["Call", "GraphStage", "RetraceWarning", "Split", "SplitPoints", "TraceError",
           "Traced", "as_call", "auto_split_points", "check_split_points", "local_view",
           "place_constants", "prepare", "split", "stage_count", "stages_of", "trace",
           "trace_mode", "wanted"]

SplitPoints = Union[str, Sequence[str]]


class TraceError(TypeError):
    """``torch.export`` could not trace the module; the message names the construct and the fix."""


@dataclass
class Split:
    """A module cut into stages: ``stages`` runs it as a pipeline, ``module`` names its state."""

    module: nn.Module
    stages: nn.Sequential
    split_points: List[str]


# ------------------------------------------------------------------------------ tracing
# A split model's inputs of at least this many dimensions (images, videos: batch, channels,
# height, width...) are traced with their batch size dynamic only: symbolic heights and widths
# through windowed or patched attention cost ``torch.export`` minutes (a tiny Swin: 10 minutes
# against seconds), and an image size rarely changes between steps; another size is traced
# again when met (a variant). Other traces (a decode step's KV cache) keep every size dynamic.
FIXED_SIZES_FROM = 4
_FIXED_SIZES: contextvars.ContextVar[bool] = contextvars.ContextVar("fixed_sizes", default=False)


def _dynamic(value: Any) -> Any:
    """``dynamic_shapes`` for an input pytree: every dimension of every tensor left to export
    (micro-batch sizes and sequence lengths vary), but only the batch of an image-like one when
    a split model is traced."""
    fixed = _FIXED_SIZES.get()

    def dims(x: torch.Tensor) -> Dict[int, Any]:
        kept = 1 if fixed and x.dim() >= FIXED_SIZES_FROM else x.dim()
        return {d: torch.export.Dim.AUTO for d in range(kept)}

    return pytree.tree_map(lambda x: dims(x) if isinstance(x, torch.Tensor) else None, value)


def trace(module: nn.Module, example: Call) -> fx.GraphModule:
    """The module's forward as a graph (``torch.export``, non-strict), in its current mode,
    reading the module's own parameters and buffers."""
    try:
        with _explicit_signature(module, example):
            bound = inspect.signature(module.forward).bind(*example.args, **example.kwargs)
            dynamic = {name: _dynamic(value) for name, value in bound.arguments.items()}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                program = torch.export.export(module, tuple(example.args),
                                              dict(example.kwargs), dynamic_shapes=dynamic,
                                              strict=False)
    except Exception as error:  # noqa: BLE001 - every tracing failure gets the same advice
        raise TraceError(
            f"torch.export could not trace {type(module).__name__}: {type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}. Make the forward traceable: "
            f"no data-dependent Python control flow, no generation caches (e.g. pass "
            f"use_cache=False to a Hugging Face model), or split the model by hand into an "
            f"nn.Sequential") from error
    return program.module()


@contextlib.contextmanager
def _explicit_signature(module: nn.Module, example: Call) -> Iterator[None]:
    """While tracing, a forward that takes keyword inputs through ``**kwargs`` (a
    ``PeftModel``'s ``forward(*args, **kwargs)``, a model's extra inputs) shows them as
    parameters of their own: ``torch.export`` pairs the dynamic shapes of keyword inputs with
    the signature's parameters and cannot pair those a ``**kwargs`` collects. The module is
    the same object (its submodules' names unchanged); only its signature is spelled out."""
    signature = inspect.signature(module.forward)
    params = list(signature.parameters.values())
    named = {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    extra = [name for name in example.kwargs if name not in named]
    if not extra or not any(p.kind is p.VAR_KEYWORD for p in params):
        yield
        return
    forward, own = module.forward, module.__dict__.get("forward")
    spelled = [p for p in params if p.kind is not p.VAR_KEYWORD] + [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None) for name in extra]

    def explicit(*args: Any, **kwargs: Any) -> Any:
        return forward(*args, **kwargs)

    explicit.__signature__ = signature.replace(parameters=spelled)  # type: ignore[attr-defined]
    module.forward = explicit  # type: ignore[method-assign]
    try:
        yield
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own  # type: ignore[method-assign]


class RetraceWarning(UserWarning):
    """A traced model met inputs its graph does not hold for (a size ``torch.export``
    specialised) and is traced again for their shape."""


def _check_guards(gm: fx.GraphModule, leaves: List[Any]) -> None:
    """Run an exported module's input guards on ``leaves`` (its flattened inputs): an
    ``AssertionError`` naming the guard when one fails."""
    guards = getattr(gm, "_guards_fn", None)
    if guards is not None:
        guards(*leaves)


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
        self.calls: List[Call] = [call]  # the inputs each variant (input shape) is traced on
        self.traces: Dict[Tuple[bool, int], Traced] = {}
        self.current: Dict[bool, int] = {}  # per mode, the variant the latest inputs picked

    def __deepcopy__(self, memo: Dict[int, Any]) -> "_Source":
        return self  # a copied stage traces the same module (and reads its own tensors)

    @contextlib.contextmanager
    def locked(self, what: str) -> Iterator[None]:
        """Hold the lock (one trace at a time), at most :data:`TRACE_WAIT` seconds; ``what``
        names the waiter in the timeout's message."""
        if not self.lock.acquire(timeout=TRACE_WAIT):
            raise TimeoutError(f"{what} waited {TRACE_WAIT:.0f}s for another thread tracing "
                               f"{type(self.module).__name__}")
        try:
            yield
        finally:
            self.lock.release()

    def traced(self, training: bool, variant: int = 0) -> Traced:
        """The module traced in ``training`` mode on the inputs of ``variant``, as it was when
        first traced: on meta twins of its tensors if they have moved or changed dtype since
        (stages placed on devices, a meta model materialised in part)."""
        with self.locked(f"the {'train' if training else 'eval'} trace"):
            if (training, variant) not in self.traces:
                moved = materialise.tensor_layout(self.module) != self.layout
                with self._as_when_split(), (materialise.meta_twins(self.module, self.layout)
                                             if moved else contextlib.nullcontext()):
                    self.traces[training, variant] = trace_mode(
                        self.module, self.calls[variant], self.points, training)
            return self.traces[training, variant]

    def variants(self) -> int:
        """How many input shapes the module is traced for."""
        return len(self.calls)

    def variant_for(self, training: bool, leaves: List[Any], spec: Any) -> int:
        """The variant whose ``training``-mode trace accepts the inputs ``leaves`` (its
        guards: the sizes ``torch.export`` specialised), the one picked last tried first; when
        none does, a new variant traced on these inputs (one warning per module). The choice
        is kept in :attr:`current`, for the later stages."""
        with self.locked("the choice of a trace for the inputs' shapes"):
            picked = self.current.get(training, 0)
            refused: Optional[AssertionError] = None
            for variant in [picked] + [v for v in range(len(self.calls)) if v != picked]:
                try:  # the other mode's trace, if made, refuses without a trace of this one
                    for mode in (not training, training):
                        if mode == training or (mode, variant) in self.traces:
                            _check_guards(self.traced(mode, variant).gm, leaves)
                except AssertionError as error:
                    refused = refused or error
                    continue
                self.current[training] = variant
                return variant
            self.calls.append(as_call(Call(*pytree.tree_unflatten(leaves, spec))))
            variant = len(self.calls) - 1
            if variant == 1:
                warnings.warn(RetraceWarning(
                    f"{type(self.module).__name__} was traced for inputs of another shape and "
                    f"its graph holds for that shape only ({refused}); tracing it again for "
                    f"these inputs (each new shape is traced once and kept)"), stacklevel=2)
            self.traced(training, variant)
            self.current[training] = variant
            return variant

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
    fixed = _FIXED_SIZES.set(True)  # an image's sizes, as met (see FIXED_SIZES_FROM)
    try:
        module.train(training)
        gm = trace(module, call)
    except TraceError as error:
        raise TraceError(f"{error} (tracing it in {'train' if training else 'eval'} "
                         f"mode)") from error.__cause__
    finally:
        _FIXED_SIZES.reset(fixed)
        for m, mode in modes:
            m.training = mode
    return Traced(gm, *plan(gm, points))


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
    source.traces[True, 0] = traced
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
            part.follow_own_mode()
    return parts


def prepare(modules: Iterable[Optional[nn.Module]], inputs: Any = None) -> None:
    """Before a step: the traced stages among ``modules`` (or their children) trace the graph of
    the mode they run in, if not yet traced, and given the step's ``inputs`` the graph of
    their shape (the module traced again for a shape its trace does not hold for), so that no
    graph is traced inside the step (where other stages and processes would wait for it)."""
    for module in modules:
        if module is None:
            continue
        for part in (module, *module.children()):
            if isinstance(part, GraphStage):
                part.prepare(inputs)


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
