"""Build script for fastpipe's native operator library ``fastpipe._C``.

Environment variables:
  FASTPIPE_NO_NATIVE=1     skip the extension entirely (pure-Python install).
  FASTPIPE_BUILD_CUDA=0|1  force a CPU-only (0) or CUDA (1) build; by default CUDA
                           kernels are built when torch has CUDA and nvcc is found.
Install torch first, then ``pip install -e . --no-build-isolation``; under build isolation
(pip's default) torch is hidden and the build stops at once with that advice.
"""
from __future__ import annotations

import glob
import os

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
CXX_FLAGS = ["-O3", "-g0"]  # BuildExtension appends the -std the installed torch needs.
NVCC_FLAGS = ["-O3"]


def _flag(name: str) -> str | None:
    """Returns the value of env var ``name``, or None when it is unset or empty."""
    value = os.environ.get(name, "").strip()
    return value or None


def _sources(pattern: str) -> list[str]:
    """Returns the repository-relative source files matching ``pattern``, sorted."""
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def _cuda_toolchain_problem() -> str | None:
    """Says why a CUDA build is impossible here, or None when torch has CUDA and nvcc exists."""
    import torch
    from torch.utils.cpp_extension import CUDA_HOME

    if torch.version.cuda is None:
        return f"the installed torch {torch.__version__} was built without CUDA"
    if CUDA_HOME is None:
        return "no CUDA toolkit found (set CUDA_HOME)"
    if not os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc")):
        return f"nvcc not found under CUDA_HOME={CUDA_HOME}"
    return None


def _openmp_flags() -> list[str]:
    """-fopenmp when torch runs intra-op work on OpenMP (Linux): at::parallel_for is inline in
    the headers and, compiled without it, runs every parallel loop on one thread."""
    import sys

    import torch

    if sys.platform.startswith("linux") and "OpenMP" in torch.__config__.parallel_info():
        return ["-fopenmp"]  # links the libgomp torch has already loaded (same soname)
    return []


def _want_cuda() -> bool:
    """Decides between the CPU-only and the CUDA build (see module docstring)."""
    forced = _flag("FASTPIPE_BUILD_CUDA")
    if forced not in (None, "0", "1"):
        raise SystemExit(f"FASTPIPE_BUILD_CUDA must be 0 or 1, not {forced!r}")
    if forced == "0":
        return False
    problem = _cuda_toolchain_problem()
    if forced == "1" and problem is not None:
        raise SystemExit(f"FASTPIPE_BUILD_CUDA=1 but a CUDA build is impossible: {problem}")
    return problem is None


def _native_build() -> dict:
    """Returns the setup() keywords that build fastpipe._C."""
    from torch.utils.cpp_extension import (
        BuildExtension,
        CppExtension,
        CUDAExtension,
        is_ninja_available,
    )

    sources = ["csrc/fastpipe.cpp", *_sources("csrc/cpu/*.cpp")]
    openmp = _openmp_flags()
    if _want_cuda():
        ext = CUDAExtension(
            "fastpipe._C",
            sources + _sources("csrc/cuda/*.cu") + _sources("csrc/cuda/*.cpp"),
            define_macros=[("FASTPIPE_WITH_CUDA", "1")],
            extra_compile_args={"cxx": CXX_FLAGS + openmp, "nvcc": NVCC_FLAGS},
            extra_link_args=openmp,
        )
    else:
        ext = CppExtension(
            "fastpipe._C", sources, extra_compile_args={"cxx": CXX_FLAGS + openmp},
            extra_link_args=openmp)
    build_ext = BuildExtension.with_options(use_ninja=is_ninja_available())
    return {"ext_modules": [ext], "cmdclass": {"build_ext": build_ext}}


NO_TORCH = (
    "fastpipe: building the native library needs the installed torch, and this build "
    "environment has none (pip's build isolation hides the installed packages). Install torch "
    "first, then `pip install . --no-build-isolation` (or `pip wheel . --no-build-isolation`, "
    "`python -m build --no-isolation`); or install pure Python with `FASTPIPE_NO_NATIVE=1 pip "
    "install .` (native ops then fall back to their PyTorch references).")


def _torch_present() -> bool:
    """Whether torch can be imported by this build (build isolation hides an installed one)."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


if _flag("FASTPIPE_NO_NATIVE") == "1":
    setup()
elif not _torch_present():
    raise SystemExit(NO_TORCH)
else:
    setup(**_native_build())
