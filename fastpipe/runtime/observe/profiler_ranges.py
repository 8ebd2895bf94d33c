"""Profiler labels: every action runs inside a ``fastpipe/<action>`` range (``fastpipe/0F3``,
``fastpipe/1B2.1``), so ``torch.profiler``, TensorBoard, Perfetto and Nsight show which stage
ran which micro-batch when.

The range is a ``torch.profiler.record_function`` while a profiler is active, and an NVTX range
on CUDA stages (for Nsight Systems). With neither, an action pays one flag check.

Stage workers are threads. ``torch.profiler.profile()`` records only the thread that entered
it unless ``profile_all_threads`` is set in its experimental config (torch offers no way to add
other threads to a running profiler); :func:`profile` (``fastpipe.profile``) is
``torch.profiler.profile`` with that set, so every stage's ranges appear, and a training step
under a profiler that sees only its caller's thread warns once.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, ContextManager

import torch
from torch.autograd import profiler as _autograd_profiler

from ...schedule import Action

__all__ = ["action_range", "label", "profile", "warn_if_workers_unseen"]

_NOTHING = contextlib.nullcontext()
_thread_profiled = torch._C._autograd._profiler_enabled


def label(action: Action) -> str:
    """The range name of ``action``: ``fastpipe/`` and its compact form."""
    return f"fastpipe/{action}"


def profiling() -> bool:
    """Whether a profiler records this thread's ranges (a profiler of this thread, or one that
    records all threads)."""
    return _autograd_profiler._is_profiler_enabled or _thread_profiled()


def action_range(stage: Any, action: Action) -> ContextManager[Any]:
    """The range to run ``action`` of ``stage`` in: a shared no-op when nothing listens."""
    cuda = stage.stream is not None
    if not cuda and not profiling():
        return _NOTHING
    return _Range(label(action), cuda)


class _Range:
    """A ``record_function`` range (when profiling) and an NVTX range (on CUDA)."""

    __slots__ = ("name", "cuda", "record")

    def __init__(self, name: str, cuda: bool) -> None:
        self.name, self.cuda = name, cuda
        self.record = torch.profiler.record_function(name) if profiling() else None

    def __enter__(self) -> None:
        if self.cuda:
            torch.cuda.nvtx.range_push(self.name)
        if self.record is not None:
            self.record.__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self.record is not None:
            self.record.__exit__(*exc)
        if self.cuda:
            torch.cuda.nvtx.range_pop()


def profile(**kwargs: Any) -> torch.profiler.profile:
    """``torch.profiler.profile(**kwargs)`` recording every thread, so the ranges of all stage
    workers appear (an ``experimental_config`` given must set ``profile_all_threads=True``)."""
    kwargs.setdefault("experimental_config",
                      torch._C._profiler._ExperimentalConfig(profile_all_threads=True))
    return torch.profiler.profile(**kwargs)


def warn_if_workers_unseen() -> None:
    """Warn when the calling thread is profiled by a profiler that records it alone: the stage
    workers' ranges are then missing from its trace (a profiler recording every thread does not
    mark the thread as profiled, so it never warns)."""
    if _thread_profiled():
        warnings.warn("this torch.profiler.profile() records only the thread that entered it, "
                      "and the pipe's stages run on worker threads: their fastpipe/<action> "
                      "ranges are missing from its trace; profile with fastpipe.profile() "
                      "(torch.profiler.profile with profile_all_threads=True) to see them",
                      RuntimeWarning, stacklevel=3)
