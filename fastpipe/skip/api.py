"""The user-facing half of skip connections: declarations and ``stash`` / ``pop``.

``stash`` and ``pop`` talk to the frame of the stage forward running on this thread (set by the
pipeline, see :mod:`fastpipe.skip.exchange`); outside a pipeline they use a per-thread
dictionary, so the same modules run unsplit with the same results.

torchgpipe's generator form works too: a ``forward`` written as a generator
(``yield stash('x', x)``, ``x = yield pop('x')``) is driven by the decorated class, and
``layer.isolate(Namespace())`` gives an instance its own copy of the names, so one skippable
class can be used twice in a model.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import threading
from dataclasses import dataclass
from typing import (Any, Callable, Dict, Iterable, Iterator, List, Optional, Protocol, Tuple,
                    Type, TypeVar)

import torch
from torch import nn

M = TypeVar("M", bound=Type[nn.Module])

_local = threading.local()


class SkipError(RuntimeError):
    """A layer stashed or popped a skip tensor against its declarations."""


@dataclass(frozen=True)
class Declaration:
    """The skip names a layer class stashes and pops (set by :func:`skippable`)."""

    stash: Tuple[str, ...] = ()
    pop: Tuple[str, ...] = ()


def skippable(stash: Iterable[str] = (), pop: Iterable[str] = ()) -> Callable[[M], M]:
    """Class decorator declaring the skip names a layer stashes and pops in its forward.

    A ``Pipe`` reads the declarations of every module inside its layers to learn which stage
    produces and which consumes each name.
    """
    decl = Declaration(_names(stash, "stash"), _names(pop, "pop"))

    def decorate(cls: M) -> M:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"@skippable decorates nn.Module classes, got {cls!r}")
        cls._fastpipe_skip = decl  # type: ignore[attr-defined]
        cls.forward = _framed_forward(cls.forward)  # type: ignore[attr-defined]
        cls.__repr__ = _skippable_repr(cls.__repr__)  # type: ignore[method-assign]
        if "isolate" not in vars(cls):
            cls.isolate = isolate  # type: ignore[attr-defined]
        return cls

    return decorate


class Namespace:
    """A namespace for skip names (torchgpipe's): ``layer.isolate(ns)`` makes the names of that
    layer instance distinct from the same names of other instances.

    Each namespace gets a label from a process-wide counter, so processes that build the same
    model (the ranks of a ``DistributedPipe``) agree on the names.
    """

    _count = itertools.count()

    def __init__(self) -> None:
        self.label = next(Namespace._count)

    def __repr__(self) -> str:
        return f"Namespace({self.label})"

    # A copy (copy.copy, deepcopy, a pickle round trip) is the same namespace, as in torchgpipe.
    def __eq__(self, other: object) -> bool:
        return isinstance(other, Namespace) and other.label == self.label

    def __hash__(self) -> int:
        return hash((Namespace, self.label))

    def __lt__(self, other: object) -> bool:
        """Namespaces sort (by label), as torchgpipe's do."""
        if not isinstance(other, Namespace):
            return NotImplemented
        return self.label < other.label


def isolate(self: nn.Module, ns: Namespace, *, only: Optional[Iterable[str]] = None
            ) -> nn.Module:
    """Put this layer's skip names (or only those in ``only``) in namespace ``ns``; returns the
    layer, so ``nn.Sequential(Stash().isolate(ns), ..., Pop().isolate(ns))`` reads in order."""
    if not isinstance(ns, Namespace):
        raise TypeError(f"isolate() takes a fastpipe.skip.Namespace, got {ns!r}")
    decl = declaration(self)
    assert decl is not None  # isolate is set on @skippable classes only
    names = set(decl.stash) | set(decl.pop)
    chosen = names if only is None else set(only)
    if not chosen <= names:
        raise ValueError(f"isolate(only={sorted(chosen)}) names skips {sorted(chosen - names)} "
                         f"that {type(self).__name__} does not declare (it declares "
                         f"{sorted(names)})")
    spaces = dict(getattr(self, "_fastpipe_namespaces", {}))
    spaces.update({name: ns for name in chosen})
    object.__setattr__(self, "_fastpipe_namespaces", spaces)
    return self


def qualified(module: nn.Module, name: str) -> str:
    """``name`` as the pipeline knows it: with the namespace ``module`` put it in, if any."""
    ns = getattr(module, "_fastpipe_namespaces", {}).get(name)
    return name if ns is None else f"{name}@{ns.label}"


def declaration(module: nn.Module) -> Optional[Declaration]:
    """The skip declaration of ``module``'s class, if any (names as declared)."""
    return getattr(type(module), "_fastpipe_skip", None)


def declared(module: nn.Module) -> Optional[Declaration]:
    """The skip names of this instance: its class's declaration, names in their namespaces."""
    decl = declaration(module)
    if decl is None:
        return None
    return Declaration(tuple(qualified(module, n) for n in decl.stash),
                       tuple(qualified(module, n) for n in decl.pop))


def _framed_forward(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` run with its layer as the one whose namespaces ``stash``/``pop`` use; a
    generator forward (torchgpipe's form) is driven to its return value."""
    if getattr(forward, "_fastpipe_framed", False):
        return forward

    @functools.wraps(forward)
    def run(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        layers = _layers()
        layers.append(self)
        try:
            result = forward(self, *args, **kwargs)
            return _drive(result) if inspect.isgenerator(result) else result
        finally:
            layers.pop()

    run._fastpipe_framed = True  # type: ignore[attr-defined]
    return run


def _skippable_repr(plain: Callable[[nn.Module], str]) -> Callable[[nn.Module], str]:
    """``repr`` of a skippable layer as torchgpipe shows it: ``@skippable(<the layer>)``."""
    if getattr(plain, "_fastpipe_skippable", False):
        return plain

    @functools.wraps(plain)
    def show(self: nn.Module) -> str:
        return f"@skippable({plain(self)})"

    show._fastpipe_skippable = True  # type: ignore[attr-defined]
    return show


def _drive(generator: Any) -> Any:
    """Run a generator forward: what ``yield stash(...)`` / ``yield pop(...)`` yields (nothing,
    or the popped tensor) is sent back as the value of the ``yield``."""
    try:
        value = next(generator)
        while True:
            value = generator.send(value)
    except StopIteration as stop:
        return stop.value


def _layers() -> List[nn.Module]:
    if not hasattr(_local, "layers"):
        _local.layers = []
    return _local.layers


def _name_here(name: str) -> str:
    layers = _layers()
    return qualified(layers[-1], name) if layers else name


def _names(names: Iterable[str], argument: str) -> Tuple[str, ...]:
    if isinstance(names, str):
        raise TypeError(f"skippable({argument}=...) takes a list of names, e.g. "
                        f"{argument}=[{names!r}], got the string {names!r}")
    out = tuple(names)
    if any(not isinstance(n, str) or not n for n in out) or len(set(out)) != len(out):
        raise ValueError(f"skippable({argument}={list(out)!r}) must list distinct non-empty "
                         f"names")
    return out


class Frame(Protocol):
    """Where ``stash`` and ``pop`` go while a pipeline stage runs a forward pass."""

    def stash(self, name: str, tensor: Optional[torch.Tensor]) -> None: ...

    def pop(self, name: str) -> Optional[torch.Tensor]: ...


class _PlainFrame:
    """Outside a pipeline: a per-thread dictionary (a stash waits for its pop)."""

    def __init__(self) -> None:
        self.tensors: Dict[str, Optional[torch.Tensor]] = {}

    def stash(self, name: str, tensor: Optional[torch.Tensor]) -> None:
        self.tensors[name] = tensor

    def pop(self, name: str) -> Optional[torch.Tensor]:
        if name not in self.tensors:
            raise SkipError(f"pop({name!r}) ran before any stash({name!r}) in this forward; "
                            f"stash it in an earlier layer")
        return self.tensors.pop(name)


class LayerwiseFrame:
    """While a profiler runs layers one at a time, each several times (``fastpipe.balance``):
    a stash keeps a detached copy, and a pop returns it without taking it, so a layer that
    pops can run again; its gradient stops at the layer, as its input's does."""

    def __init__(self) -> None:
        self.tensors: Dict[str, Optional[torch.Tensor]] = {}

    def stash(self, name: str, tensor: Optional[torch.Tensor]) -> None:
        self.tensors[name] = None if tensor is None else \
            tensor.detach().requires_grad_(tensor.requires_grad)

    def pop(self, name: str) -> Optional[torch.Tensor]:
        if name not in self.tensors:
            raise SkipError(f"pop({name!r}) ran before any stash({name!r}); stash it in an "
                            f"earlier layer")
        return self.tensors[name]


@contextlib.contextmanager
def layerwise() -> Iterator[None]:
    """Run the block's layers with a :class:`LayerwiseFrame` (for profilers)."""
    previous = enter(LayerwiseFrame())
    try:
        yield
    finally:
        enter(previous)


def current() -> Frame:
    """The frame of this thread: the running stage's, or the plain per-thread dictionary."""
    frame = getattr(_local, "frame", None)
    if frame is None:
        frame = _local.plain = getattr(_local, "plain", None) or _PlainFrame()
    return frame


def enter(frame: Optional[Frame]) -> Optional[Frame]:
    """Make ``frame`` this thread's frame; returns the previous one (to restore)."""
    previous = getattr(_local, "frame", None)
    _local.frame = frame
    return previous


def stash(name: str, tensor: Optional[torch.Tensor]) -> None:
    """Keep ``tensor`` (or ``None``) under ``name`` for a later layer, which takes it with
    :func:`pop`. In a generator forward, write ``yield stash(name, tensor)``."""
    if tensor is not None and not isinstance(tensor, torch.Tensor):
        raise TypeError(f"stash({name!r}, ...) takes a tensor or None, got "
                        f"{type(tensor).__name__}")
    current().stash(_name_here(name), tensor)


def pop(name: str) -> Optional[torch.Tensor]:
    """The tensor an earlier layer stashed under ``name`` in this forward pass. In a generator
    forward, write ``x = yield pop(name)``."""
    return current().pop(_name_here(name))


def verify_skippables(module: nn.Sequential) -> None:
    """torchgpipe's check of a model's skip declarations: ``TypeError`` listing every stash
    without a pop, pop without an earlier stash, name declared twice outside a namespace, and
    name both stashed and popped by one layer. (A ``Pipe`` checks the same when built.)"""
    stashed: set = set()
    popped: set = set()
    problems: List[str] = []
    for layer_name, layer in module.named_children():
        decl, own = declared(layer), declaration(layer)
        if decl is None or own is None:
            continue
        for name in sorted(set(own.stash) & set(own.pop)):
            problems.append(f"'{layer_name}' declared '{name}' both as stashable and as poppable")
        for name, full in zip(own.stash, decl.stash):
            if name in own.pop:
                continue
            if full in stashed:
                problems.append(f"'{layer_name}' redeclared '{name}' as stashable but not "
                                f"isolated by namespace")
                continue
            stashed.add(full)
        for name, full in zip(own.pop, decl.pop):
            if name in own.stash:
                continue
            if full in popped:
                problems.append(f"'{layer_name}' redeclared '{name}' as poppable but not "
                                f"isolated by namespace")
            elif full not in stashed:
                problems.append(f"'{layer_name}' declared '{name}' as poppable but it was not "
                                f"stashed")
            else:
                popped.add(full)
    for full in sorted(stashed - popped):
        problems.append(f"no module declared '{full.split('@')[0]}' as poppable but stashed")
    if problems:
        raise TypeError("one or more pairs of stash and pop do not match:\n\n"
                        + "\n".join(f"* {p}" for p in problems))
