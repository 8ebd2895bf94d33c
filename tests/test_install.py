"""Installing: under pip's build isolation the build stops at once with the fix spelled out;
the CUDA paths build with g++ against the CUDA runtime a torch wheel brings (no toolkit), or the
build falls back to CPU only with one line saying why; the Makefile installs PyTorch's CPU build
on machines without a GPU and Triton for tests only."""
import json
import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# setup.py run the way an isolated build runs it: torch cannot be imported
HIDDEN_TORCH = ("import runpy, sys; sys.modules['torch'] = None; sys.argv = ['setup.py', "
                "'--name']; runpy.run_path('setup.py', run_name='__main__')")


def _setup(env_extra):
    env = dict(os.environ, **env_extra)
    return subprocess.run([sys.executable, "-c", HIDDEN_TORCH], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


def test_build_without_torch_stops_with_the_fix():
    result = _setup({"FASTPIPE_NO_NATIVE": ""})
    assert result.returncode != 0
    assert "No module named" not in result.stderr
    assert "--no-build-isolation" in result.stderr and "FASTPIPE_NO_NATIVE=1" in result.stderr


def test_pure_python_build_needs_no_torch():
    result = _setup({"FASTPIPE_NO_NATIVE": "1"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "fastpipe"


def _make_dry_run(target, **variables):
    args = ["make", "-n", "-B", target] + [f"{k}={v}" for k, v in variables.items()]
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=60).stdout


def test_make_installs_the_cpu_torch_build_with_a_fallback():
    commands = _make_dry_run("install", VENV="/nonexistent-venv", GPU="")
    assert "--index-url https://download.pytorch.org/whl/cpu" in commands
    assert "from the default index" in commands  # the fallback says what it does
    gpu = _make_dry_run("install", VENV="/nonexistent-venv", GPU="1")
    assert "download.pytorch.org/whl/cpu" not in gpu


def test_make_demo_does_not_install_triton_but_make_test_does():
    assert "install triton" not in _make_dry_run("demo", VENV="/nonexistent-venv")
    assert "install triton" in _make_dry_run("test", VENV="/nonexistent-venv")


# setup.py's CUDA build decided in a child process whose torch claims CUDA ``argv[2]`` ("none":
# a CPU build), with a fake site (``argv[1]``: packages laid out as a CUDA torch wheel's)
# ahead of the real one, no CUDA toolkit (CUDA_HOME names none, nvcc off PATH); prints the
# extension it would build.
CUDA_PROBE = r"""
import json, runpy, sys
sys.path.insert(0, sys.argv[1])
import torch
torch.version.cuda = None if sys.argv[2] == "none" else sys.argv[2]
build = runpy.run_path("setup.py", run_name="setup")["_native_build"]()
ext = build["ext_modules"][0]
print(json.dumps({"sources": ext.sources, "include_dirs": ext.include_dirs,
                  "cxx": ext.extra_compile_args["cxx"], "link": ext.extra_link_args,
                  "macros": ext.define_macros, "libraries": ext.libraries,
                  "note": build["cmdclass"]["build_ext"].note}))
"""


def _fake_file(path, text=""):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _fake_headers(include, version, crt):
    _fake_file(include / "cuda_runtime_api.h", f"#define CUDART_VERSION  {version}\n")
    if crt:
        _fake_file(include / "crt" / "host_config.h")


def _fake_site(tmp_path, wheel_crt=False, triton_version=None):
    """nvidia/cu13 as a CUDA 13.0 torch wheel brings it (runtime headers and libcudart, crt/ only
    when ``wheel_crt``), and a Triton bundling CUDA ``triton_version`` headers with crt/."""
    site = tmp_path / "site"
    _fake_headers(site / "nvidia" / "cu13" / "include", 13000, wheel_crt)
    _fake_file(site / "nvidia" / "cu13" / "lib" / "libcudart.so.13")
    _fake_file(site / "nvidia" / "cudnn" / "include" / "cudnn.h")
    _fake_file(site / "triton" / "__init__.py")  # shadows any real Triton
    if triton_version:
        _fake_headers(site / "triton" / "backends" / "nvidia" / "include", triton_version, True)
    return site


def _cuda_probe(site, torch_cuda, **env):
    base = {k: v for k, v in os.environ.items() if k != "FASTPIPE_BUILD_CUDA"}
    env = dict(base, CUDA_HOME=str(site / "no-toolkit"), PATH="/usr/bin:/bin", **env)
    return subprocess.run([sys.executable, "-c", CUDA_PROBE, str(site), torch_cuda], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)


def test_cuda_paths_build_with_gxx_against_the_wheels_runtime_and_tritons_crt(tmp_path):
    site = _fake_site(tmp_path, triton_version=13010)
    result = _cuda_probe(site, "13.0", FASTPIPE_BUILD_CUDA="1")
    assert result.returncode == 0, result.stderr
    ext = json.loads(result.stdout.splitlines()[-1])
    include = str(site / "nvidia" / "cu13" / "include")
    assert "csrc/cuda/transfer.cpp" in ext["sources"]
    assert not [s for s in ext["sources"] if s.endswith(".cu")]  # nothing for nvcc
    assert ext["include_dirs"][0] == include and ["FASTPIPE_WITH_CUDA", "1"] in ext["macros"]
    triton_include = str(site / "triton" / "backends" / "nvidia" / "include")
    assert ext["cxx"][-2:] == ["-idirafter", triton_include]  # only crt/ comes from Triton
    assert str(site / "nvidia" / "cu13" / "lib" / "libcudart.so.13") in ext["link"]
    assert "c10_cuda" in ext["libraries"]
    assert ext["note"] == (f"with its CUDA paths against CUDA 13.0 from the nvidia packages "
                           f"beside torch ({include}) with crt/ from Triton's bundled headers "
                           f"(CUDA 13, {triton_include})")


def test_a_wheel_with_crt_headers_needs_nothing_else(tmp_path):
    result = _cuda_probe(_fake_site(tmp_path, wheel_crt=True, triton_version=13010), "13.0")
    assert result.returncode == 0, result.stderr
    ext = json.loads(result.stdout.splitlines()[-1])
    assert "-idirafter" not in ext["cxx"] and "csrc/cuda/transfer.cpp" in ext["sources"]


def test_runtime_headers_of_another_major_version_are_not_used(tmp_path):
    site = _fake_site(tmp_path, wheel_crt=True, triton_version=12080)
    result = _cuda_probe(site, "12.8", FASTPIPE_BUILD_CUDA="1")  # the wheel's runtime is 13
    assert result.returncode != 0
    assert "FASTPIPE_BUILD_CUDA=1 but a CUDA build is impossible" in result.stderr
    assert "no CUDA 12 runtime headers" in result.stderr and "nvcc" not in result.stderr


def test_crt_headers_of_another_version_complete_the_runtime_when_none_match(tmp_path):
    site = _fake_site(tmp_path, triton_version=12080)  # as torch 2.11 (CUDA 13) beside Triton 3.6
    result = _cuda_probe(site, "13.0")
    assert result.returncode == 0, result.stderr
    ext = json.loads(result.stdout.splitlines()[-1])
    assert ext["include_dirs"][0] == str(site / "nvidia" / "cu13" / "include")
    assert ext["cxx"][-2:] == ["-idirafter", str(site / "triton" / "backends" / "nvidia" / "include")]
    assert "with crt/ from Triton's bundled headers (CUDA 12," in ext["note"]


def test_wheel_headers_without_crt_fall_back_to_the_cpu_build_with_one_line(tmp_path):
    result = _cuda_probe(_fake_site(tmp_path), "13.0")
    assert result.returncode == 0, result.stderr
    ext = json.loads(result.stdout.splitlines()[-1])
    assert not [s for s in ext["sources"] if "cuda" in s] and "c10_cuda" not in ext["libraries"]
    assert ext["note"].startswith("without its CUDA paths: torch") and "\n" not in ext["note"]
    assert "no CUDA 13 runtime headers (cuda_runtime_api.h, crt/host_config.h)" in ext["note"]


def test_cpu_torch_builds_cpu_only_and_says_so(tmp_path):
    result = _cuda_probe(_fake_site(tmp_path, triton_version=13010), "none")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1])["note"] == (
        f"without its CUDA paths: the installed torch {torch.__version__} was built without CUDA")
