"""The user-facing half of skip connections: declarations and ``stash`` / ``pop``.

``stash`` and ``pop`` talk to the frame of the stage forward running on this thread (set by the
pipeline, see :mod:`fastpipe.skip.exchange`); outside a pipeline they use a per-thread
dictionary, so the same modules run unsplit with the same results.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, Optional, Protocol, Tuple, Type, TypeVar

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
        return cls

    return decorate


def declaration(module: nn.Module) -> Optional[Declaration]:
    """The skip declaration of ``module``'s class, if any."""
    return getattr(type(module), "_fastpipe_skip", None)


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

    def stash(self, name: str, tensor: torch.Tensor) -> None: ...

    def pop(self, name: str) -> torch.Tensor: ...


class _PlainFrame:
    """Outside a pipeline: a per-thread dictionary (a stash waits for its pop)."""

    def __init__(self) -> None:
        self.tensors: Dict[str, torch.Tensor] = {}

    def stash(self, name: str, tensor: torch.Tensor) -> None:
        self.tensors[name] = tensor

    def pop(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise SkipError(f"pop({name!r}) ran before any stash({name!r}) in this forward; "
                            f"stash it in an earlier layer")
        return self.tensors.pop(name)


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


def stash(name: str, tensor: torch.Tensor) -> None:
    """Keep ``tensor`` under ``name`` for a later layer, which takes it with :func:`pop`."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"stash({name!r}, ...) takes a tensor, got {type(tensor).__name__}")
    current().stash(name, tensor)


def pop(name: str) -> torch.Tensor:
    """The tensor an earlier layer stashed under ``name`` in this forward pass."""
    return current().pop(name)
