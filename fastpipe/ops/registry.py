"""Python-side registrations of the C++ operators: every fake (meta) implementation is
registered from this module, the one named by ``set_python_module`` in csrc/fastpipe.cpp, and
the fused ops' autograd formulas are attached here too."""
from __future__ import annotations

import importlib
import threading
from typing import Callable

import torch

__all__ = ["register_all", "register_fake"]

FUSED_MODULES = ("gelu", "dropout", "norms", "swiglu")
_lock = threading.Lock()
_fused_registered = False


def register_fake(op_name: str, fn: Callable) -> None:
    """``torch.library.register_fake`` called from this module (the declared fake module)."""
    torch.library.register_fake(op_name, fn)


def _register_fused() -> None:
    """Fake impls and autograd formulas of the fused ops, once, if the library defines them."""
    global _fused_registered
    with _lock:
        if _fused_registered or not hasattr(torch.ops.fastpipe, "bias_gelu"):
            return
        for name in FUSED_MODULES:
            module = importlib.import_module(f"fastpipe.ops.{name}")
            for op, fn in module.FAKES.items():
                register_fake(f"fastpipe::{op}", fn)
            for op, (backward, setup) in module.AUTOGRAD.items():
                torch.library.register_autograd(f"fastpipe::{op}", backward, setup_context=setup)
        _fused_registered = True


def register_all() -> None:
    """Registers the Python side of the fused C++ operators (called once the library loaded;
    the transfer op registers its own, see ``fastpipe.ops.transfer``)."""
    _register_fused()
