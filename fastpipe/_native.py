"""Guarded loader for ``fastpipe._C``, the compiled operator library.

Importing ``fastpipe._C`` registers the ``torch.ops.fastpipe`` operators. The import is attempted
once, on the first :func:`load` call; if it fails (pure-Python install, ABI mismatch with the
installed torch, ...) fastpipe warns once and its callers fall back to pure-PyTorch code.
Set ``FASTPIPE_DISABLE_NATIVE=1`` to skip the library on purpose.
"""
from __future__ import annotations

import importlib
import os
import threading
import warnings
from types import ModuleType
from typing import Callable, List, Optional

__all__ = ["FastpipeNativeWarning", "available", "load", "load_error", "module"]

DISABLE_ENV = "FASTPIPE_DISABLE_NATIVE"
_MODULE_NAME = "fastpipe._C"


class FastpipeNativeWarning(UserWarning):
    """Warned (once) when the native library cannot be used and fastpipe falls back to PyTorch."""


_lock = threading.RLock()
_attempted = False  # set when the attempt starts (guards re-entry from the same thread)
_done = False  # set when the attempt, including Python-side registration, has finished
_module: Optional[ModuleType] = None
_error: Optional[str] = None
_hooks: List[Callable[[], None]] = []  # run once the library has loaded (see when_loaded)


def _disabled() -> bool:
    """True when the user switched the native library off through the environment."""
    return os.environ.get(DISABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _import() -> ModuleType:
    """Imports the extension (torch first, since the library links against its shared objects)."""
    import torch  # noqa: F401

    return importlib.import_module(_MODULE_NAME)


def _attempt() -> None:
    """Tries the import once and records either the module or why it failed."""
    global _module, _error
    if _disabled():
        _error = f"disabled by {DISABLE_ENV}=1"
        return
    try:
        _module = _import()
    except Exception as exc:  # ImportError, OSError (bad .so), undefined symbols, ...
        _error = f"{type(exc).__name__}: {exc}"
        warnings.warn(
            f"fastpipe: native library {_MODULE_NAME} unavailable ({_error}); "
            "falling back to pure-PyTorch implementations",
            FastpipeNativeWarning,
            stacklevel=3,
        )
        return
    _register_python_side()
    _warn_without_cuda_paths(_module)


def _warn_without_cuda_paths(module: ModuleType) -> None:
    """Warns once when torch sees a GPU but the library was built without its CUDA paths (the
    build said why in one line): transfers to and from CUDA devices then use PyTorch's copies."""
    import torch

    if getattr(module, "built_with_cuda", True) or not torch.cuda.is_available():
        return
    warnings.warn(
        f"fastpipe: {_MODULE_NAME} was built without its CUDA paths (built beside a torch "
        "without CUDA, or without the CUDA runtime's headers; `pip install -e . "
        "--no-build-isolation -v` prints why); CUDA transfers use PyTorch's copies",
        FastpipeNativeWarning,
        stacklevel=4,
    )


def _register_python_side() -> None:
    """Runs the registrations waiting for the library (the ops' fake and autograd
    implementations, which live in Python: ``fastpipe.ops`` adds them with ``when_loaded``)."""
    for hook in _hooks:
        hook()


def when_loaded(hook: Callable[[], None]) -> None:
    """Run ``hook`` once the native library has loaded: at once if it already has, else right
    after it loads. Keeps this loader free of imports of the packages that use it."""
    with _lock:
        _hooks.append(hook)
        ready = _done and _module is not None
    if ready:
        hook()


def load() -> bool:
    """Loads the native library on first call and says whether it is usable; never retries."""
    global _attempted, _done
    if not _done:
        with _lock:
            if not _attempted:
                _attempted = True
                try:
                    _attempt()
                finally:
                    _done = True
    return _module is not None


def available() -> bool:
    """Whether the native operators can be used (loads the library if not tried yet)."""
    return load()


def load_error() -> Optional[str]:
    """Why the native library is unusable, or None when it loaded (or was not tried yet)."""
    return _error


def module() -> Optional[ModuleType]:
    """The loaded ``fastpipe._C`` module, or None when it is unavailable."""
    return _module if load() else None
