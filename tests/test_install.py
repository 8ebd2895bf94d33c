"""Installing: under pip's build isolation the build stops at once with the fix spelled out;
the Makefile installs PyTorch's CPU build on machines without a GPU and Triton for tests only."""
import os
import subprocess
import sys

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
