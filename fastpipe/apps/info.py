"""Environment report: versions, native library, accelerators (``python -m fastpipe info``)."""
from __future__ import annotations

import importlib
import importlib.util
import platform
import warnings
from typing import Any, Dict, List, Optional

import torch

from .. import _native
from ..version import __version__

__all__ = ["format_info", "info"]


def info() -> Dict[str, Any]:
    """Collects what matters when reporting a problem: versions, native build, devices."""
    return {
        "fastpipe": _fastpipe_version(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "native": _native_info(),
        "cuda": _cuda_info(),
        "triton": _triton_info(),
        "cpu_threads": torch.get_num_threads(),
    }


def format_info() -> str:
    """``info()`` as human-readable lines, one fact per line."""
    facts = info()
    native, cuda, triton = facts["native"], facts["cuda"], facts["triton"]
    lines = [
        f"fastpipe:        {facts['fastpipe']}",
        f"torch:           {facts['torch']}",
        f"python:          {facts['python']}",
        f"native library:  {_describe_native(native)}",
        f"CUDA:            {_describe_cuda(cuda)}",
    ]
    lines += [f"  cuda:{i}:        {name}" for i, name in enumerate(cuda["devices"])]
    lines += [
        f"triton:          {_describe_triton(triton)}",
        f"CPU threads:     {facts['cpu_threads']}",
    ]
    return "\n".join(lines)


def _fastpipe_version() -> str:
    """The package version."""
    return __version__


def _native_info() -> Dict[str, Any]:
    """Whether ``fastpipe._C`` loaded (without the fallback warning: the reason is reported)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", _native.FastpipeNativeWarning)
        module = _native.module()
    if module is None:
        return {"loaded": False, "error": _native.load_error(), "built_with_cuda": None,
                "cuda_version": None, "built_against_torch": None}
    return {
        "loaded": True,
        "error": None,
        "built_with_cuda": bool(getattr(module, "built_with_cuda", False)),
        "cuda_version": _cuda_version_string(getattr(module, "cuda_version", 0)),
        "built_against_torch": getattr(module, "torch_version", None),
    }


def _cuda_version_string(version: int) -> Optional[str]:
    """Turns CUDART_VERSION (e.g. 12040) into "12.4"; None for a CPU-only build."""
    return f"{version // 1000}.{version % 1000 // 10}" if version else None


def _cuda_info() -> Dict[str, Any]:
    """CUDA as torch sees it: build version, availability, device names."""
    available = torch.cuda.is_available()
    devices: List[str] = []
    if available:
        devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {"torch_cuda": torch.version.cuda, "available": available,
            "device_count": len(devices), "devices": devices}


def _triton_info() -> Dict[str, Any]:
    """Whether Triton imports, and its version (it is an optional dependency)."""
    if importlib.util.find_spec("triton") is None:
        return {"available": False, "version": None, "error": "not installed"}
    try:
        triton = importlib.import_module("triton")
    except Exception as exc:  # installed but broken (e.g. no matching driver/compiler)
        return {"available": False, "version": None, "error": f"{type(exc).__name__}: {exc}"}
    return {"available": True, "version": getattr(triton, "__version__", "unknown"), "error": None}


def _describe_native(native: Dict[str, Any]) -> str:
    """One line for the native library: loaded with which build, or why not."""
    if not native["loaded"]:
        return f"not loaded ({native['error']})"
    build = f"CUDA {native['cuda_version']}" if native["built_with_cuda"] else "CPU only"
    return f"loaded ({build}, built against torch {native['built_against_torch']})"


def _describe_triton(triton: Dict[str, Any]) -> str:
    """One line for Triton: its version, or why it cannot be used."""
    return triton["version"] if triton["available"] else f"not available ({triton['error']})"


def _describe_cuda(cuda: Dict[str, Any]) -> str:
    """One line for CUDA: torch's CUDA build and the visible device count."""
    if cuda["torch_cuda"] is None:
        return "torch built without CUDA"
    if not cuda["available"]:
        return f"torch built with CUDA {cuda['torch_cuda']}, no device available"
    return f"CUDA {cuda['torch_cuda']}, {cuda['device_count']} device(s)"
