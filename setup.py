"""Build script for fastpipe's native operator library ``fastpipe._C``.

Environment variables:
  FASTPIPE_NO_NATIVE=1     skip the extension entirely (pure-Python install).
  FASTPIPE_BUILD_CUDA=0|1  force a CPU-only (0) or CUDA (1) build; by default the CUDA paths are
                           built when torch has CUDA and the CUDA runtime's headers and library
                           are found, else the CPU-only library is built and one line says why.
The CUDA paths are host C++ calling the CUDA runtime through c10, so g++ builds them: no nvcc or
CUDA toolkit is needed. The runtime's headers and ``libcudart`` come from the ``nvidia-*``
packages a CUDA torch wheel installs beside it (``nvidia/cu13``, ``nvidia/cuda_runtime``), else
from a CUDA toolkit (``CUDA_HOME``, nvcc on PATH, /usr/local/cuda), of torch's CUDA major
version; the ``crt/`` headers they include, which a wheel lacks, from Triton's bundled CUDA
headers when no toolkit has them. Only ``.cu`` sources (none today) would need nvcc.
Install torch first, then ``pip install -e . --no-build-isolation``; under build isolation
(pip's default) torch is hidden and the build stops at once with that advice.
"""
from __future__ import annotations

import glob
import importlib.util
import os
import re
import sys
from typing import NamedTuple

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


class CudaRuntime(NamedTuple):
    """The CUDA runtime the CUDA paths compile and link against."""

    include: str  # cuda_runtime_api.h and the rest of the runtime's headers
    compiler_include: str  # crt/host_config.h, which cuda_runtime.h includes (nvcc's headers)
    library: str  # the shared libcudart to link
    origin: str  # where the headers were found, for messages


def _header_major(include: str) -> int | None:
    """The CUDA major version of the runtime headers in ``include`` (CUDART_VERSION), or None."""
    try:
        with open(os.path.join(include, "cuda_runtime_api.h"), encoding="utf-8") as f:
            found = re.search(r"#define\s+CUDART_VERSION\s+(\d+)", f.read())
    except OSError:
        return None
    return int(found.group(1)) // 1000 if found else None


def _libcudart(include: str) -> str | None:
    """The shared CUDA runtime library beside the headers in ``include``, or None."""
    root = os.path.dirname(include)
    for lib in ("lib", "lib64", os.path.join("targets", "x86_64-linux", "lib")):
        found = sorted(glob.glob(os.path.join(root, lib, "libcudart.so*")), key=len)
        if found:
            return found[0]
    return None


def _package_dir(name: str) -> list[str]:
    """The folders of an installed (namespace) package, without importing it."""
    spec = importlib.util.find_spec(name)
    return list(spec.submodule_search_locations or []) if spec is not None else []


def _header_dirs() -> list[tuple[str, str]]:
    """Folders that may hold CUDA headers, each with where it comes from, best first: the
    ``nvidia-*`` packages a CUDA torch wheel installs, the headers Triton bundles for its
    launcher (runtime and crt/, no library), a CUDA toolkit's."""
    from torch.utils.cpp_extension import CUDA_HOME

    dirs = [(d, "the nvidia packages beside torch") for base in _package_dir("nvidia")
            for d in sorted(glob.glob(os.path.join(base, "*", "include")))]
    dirs += [(os.path.join(base, "backends", "nvidia", "include"), "Triton's bundled headers")
             for base in _package_dir("triton")]
    if CUDA_HOME:
        dirs.append((os.path.join(CUDA_HOME, "include"), f"the CUDA toolkit at {CUDA_HOME}"))
    return dirs


def _has_crt(include: str) -> bool:
    return os.path.exists(os.path.join(include, "crt", "host_config.h"))


def _cuda_runtime(major: int) -> CudaRuntime | None:
    """The CUDA ``major`` runtime to build against, or None: the first headers of that version
    with a libcudart beside them, completed by the first crt/ headers, of that version if any.
    crt/ (nvcc's host_config.h and host_defines.h, which the runtime headers include) holds
    compiler checks and qualifier macros only, so for g++ another version's serves: a torch
    wheel's runtime package lacks it, and a Triton may bundle an older CUDA's."""
    dirs = _header_dirs()
    same = [(d, origin) for d, origin in dirs if _header_major(d) == major]
    runtime = next(((d, origin) for d, origin in same if _libcudart(d)), None)
    if runtime is None:
        return None
    crt = next(((d, origin) for d, origin in [runtime] + same + dirs if _has_crt(d)), None)
    if crt is None:
        return None
    (include, origin), (crt_include, crt_origin) = runtime, crt
    origin = f"{origin} ({include})"
    if crt_include != include:
        origin += f" with crt/ from {crt_origin} (CUDA {_header_major(crt_include)}, {crt_include})"
    return CudaRuntime(include, crt_include, _libcudart(include), origin)


def _cuda_problem() -> str | None:
    """Says why the CUDA paths cannot be built here, or None when they can."""
    import torch

    if torch.version.cuda is None:
        return f"the installed torch {torch.__version__} was built without CUDA"
    if _sources("csrc/cuda/*.cu"):
        return _nvcc_problem()
    major = int(torch.version.cuda.split(".")[0])
    if _cuda_runtime(major) is None:
        return (f"torch {torch.__version__} has CUDA {torch.version.cuda}, but no CUDA {major} "
                "runtime headers (cuda_runtime_api.h, crt/host_config.h) with libcudart were "
                "found in the nvidia packages beside torch, Triton's bundled headers or a CUDA "
                f"toolkit; set CUDA_HOME to a CUDA {major} toolkit to build them")
    return None


def _nvcc_problem() -> str | None:
    """Says why the .cu sources cannot be compiled (no toolkit with nvcc), or None."""
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None or not os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc")):
        return (f"csrc/cuda has .cu sources, which need nvcc, and no CUDA toolkit with nvcc "
                f"was found (CUDA_HOME={CUDA_HOME})")
    return None


def _openmp_flags() -> list[str]:
    """-fopenmp when torch runs intra-op work on OpenMP (Linux): at::parallel_for is inline in
    the headers and, compiled without it, runs every parallel loop on one thread."""
    import torch

    if sys.platform.startswith("linux") and "OpenMP" in torch.__config__.parallel_info():
        return ["-fopenmp"]  # links the libgomp torch has already loaded (same soname)
    return []


def _cuda_choice() -> str | None:
    """Why the build leaves the CUDA paths out (see module docstring), or None to build them;
    stops when FASTPIPE_BUILD_CUDA=1 asks for what cannot be built."""
    forced = _flag("FASTPIPE_BUILD_CUDA")
    if forced not in (None, "0", "1"):
        raise SystemExit(f"FASTPIPE_BUILD_CUDA must be 0 or 1, not {forced!r}")
    if forced == "0":
        return "FASTPIPE_BUILD_CUDA=0"
    problem = _cuda_problem()
    if forced == "1" and problem is not None:
        raise SystemExit(f"FASTPIPE_BUILD_CUDA=1 but a CUDA build is impossible: {problem}")
    return problem


def _cuda_extension(sources: list[str], openmp: list[str]) -> tuple[object, str]:
    """fastpipe._C with its CUDA paths (g++ against the CUDA runtime found; nvcc only for .cu
    sources) and the line that says what it builds against."""
    import torch
    from torch.utils.cpp_extension import CppExtension, CUDAExtension

    if _sources("csrc/cuda/*.cu"):
        return CUDAExtension(
            "fastpipe._C", sources + _sources("csrc/cuda/*.cu") + _sources("csrc/cuda/*.cpp"),
            define_macros=[("FASTPIPE_WITH_CUDA", "1")],
            extra_compile_args={"cxx": CXX_FLAGS + openmp, "nvcc": NVCC_FLAGS},
            extra_link_args=openmp), "with its CUDA paths (nvcc for the .cu sources)"
    runtime = _cuda_runtime(int(torch.version.cuda.split(".")[0]))
    after = [] if runtime.compiler_include == runtime.include else [
        "-idirafter", runtime.compiler_include]  # only what the runtime's own folder lacks
    ext = CppExtension(
        "fastpipe._C", sources + _sources("csrc/cuda/*.cpp"),
        define_macros=[("FASTPIPE_WITH_CUDA", "1")], include_dirs=[runtime.include],
        libraries=["c10_cuda"], extra_compile_args={"cxx": CXX_FLAGS + openmp + after},
        extra_link_args=openmp + [runtime.library])
    return ext, f"with its CUDA paths against CUDA {torch.version.cuda} from {runtime.origin}"


def _build_command(note: str) -> type:
    """torch's build_ext, saying ``note`` once as the build starts (not when pip only asks for
    the package's metadata)."""
    from torch.utils.cpp_extension import BuildExtension, is_ninja_available

    class BuildNative(BuildExtension.with_options(use_ninja=is_ninja_available())):
        def run(self) -> None:
            print(f"fastpipe: building fastpipe._C {note}", file=sys.stderr)
            super().run()

    BuildNative.note = note
    return BuildNative


def _native_build() -> dict:
    """Returns the setup() keywords that build fastpipe._C."""
    from torch.utils.cpp_extension import CppExtension

    sources = ["csrc/fastpipe.cpp", *_sources("csrc/cpu/*.cpp")]
    openmp = _openmp_flags()
    without = _cuda_choice()
    if without is None:
        ext, note = _cuda_extension(sources, openmp)
    else:
        ext = CppExtension(
            "fastpipe._C", sources, extra_compile_args={"cxx": CXX_FLAGS + openmp},
            extra_link_args=openmp)
        note = f"without its CUDA paths: {without}"
    return {"ext_modules": [ext], "cmdclass": {"build_ext": _build_command(note)}}


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


def main() -> None:
    """Builds pure Python, or with the native library against the installed torch."""
    if _flag("FASTPIPE_NO_NATIVE") == "1":
        setup()
    elif not _torch_present():
        raise SystemExit(NO_TORCH)
    else:
        setup(**_native_build())


if __name__ == "__main__":  # pip and setuptools run this file as __main__; tests import it
    main()
