"""The one place that decides which implementation runs a fused op.

Three backends implement every fused op with the same function names and signatures:
``native`` (``torch.ops.fastpipe``, C++ kernels for the CPU), ``triton`` (GPU kernels) and
``reference`` (pure PyTorch). :func:`choose` picks, for the device of an op's input: Triton for
CUDA tensors when Triton imports, the native library for CPU tensors when it loaded, and the
reference otherwise. :func:`forced` overrides the choice on the calling thread (tests and
benchmarks compare backends with it).
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import threading
import warnings
from types import ModuleType
from typing import Any, Callable, Iterator, Optional

import torch
from torch import Tensor

from .. import _native

__all__ = ["BACKENDS", "FastpipeTritonWarning", "call", "choose", "forced", "triton_available"]

BACKENDS = ("native", "triton", "reference")
_local = threading.local()


class FastpipeTritonWarning(UserWarning):
    """Warned (once) when Triton cannot be imported and CUDA tensors fall back to PyTorch."""


@functools.lru_cache(maxsize=None)
def _triton_module() -> Optional[ModuleType]:
    """``fastpipe.ops.triton_kernels`` if Triton imports, else None (warned once)."""
    try:
        return importlib.import_module("fastpipe.ops.triton_kernels")
    except ImportError as exc:
        warnings.warn(f"fastpipe: Triton unavailable ({exc}); fused ops on CUDA tensors fall "
                      "back to pure-PyTorch implementations", FastpipeTritonWarning, stacklevel=3)
        return None


def triton_available() -> bool:
    """Whether the Triton kernels can be used (imports Triton on first call)."""
    return _triton_module() is not None


class _Native:
    """The native backend: attribute access resolves to ``torch.ops.fastpipe.<name>``."""

    def __getattr__(self, name: str) -> Callable[..., Any]:
        return getattr(torch.ops.fastpipe, name)


def _implementation(backend: str) -> Any:
    if backend == "native":
        if not _native.load():
            raise RuntimeError(f"fastpipe: the native backend is unavailable "
                               f"({_native.load_error()})")
        return _Native()
    if backend == "triton":
        module = _triton_module()
        if module is None:
            raise RuntimeError("fastpipe: the triton backend is unavailable (pip install triton)")
        return module
    return importlib.import_module("fastpipe.ops.reference")


def choose(x: Tensor) -> str:
    """The backend for a fused op whose main input is ``x`` (see the module docstring)."""
    override = getattr(_local, "backend", None)
    if override is not None:
        return override
    if x.device.type == "cuda":
        return "triton" if triton_available() else "reference"
    if x.device.type == "cpu" and _native.load():
        return "native"
    return "reference"


def call(backend: str, name: str, *args: Any) -> Any:
    """Runs kernel ``name`` (e.g. ``"rms_norm_backward"``) of ``backend``."""
    return getattr(_implementation(backend), name)(*args)


@contextlib.contextmanager
def forced(backend: str) -> Iterator[None]:
    """Runs every fused op on this thread with ``backend`` inside the block."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not a fused-op backend; use one of "
                         f"{', '.join(BACKENDS)}")
    _implementation(backend)  # fail here, not inside an op, when it is unavailable
    previous = getattr(_local, "backend", None)
    _local.backend = backend
    try:
        yield
    finally:
        _local.backend = previous
