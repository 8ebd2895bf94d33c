"""benchmarks/gpu_check.sh fits the 8 minutes a GPU machine gives it: its parts' limits, the
build's included, add up to no more than its budget, and the budget (with the 5 s a timed-out
part may take to die) to no more than 480 s; it runs with python3 and never stops the CUDA
tests at the first failure."""
import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_check.sh")
TEXT = open(SCRIPT, encoding="utf-8").read()


def _default(variable):
    return int(re.search(r"\$\{" + variable + r":-(\d+)\}", TEXT).group(1))


def test_the_script_parses():
    subprocess.run(["bash", "-n", SCRIPT], check=True, timeout=30)


def test_the_parts_fit_in_eight_minutes():
    limits = [int(x) for x in re.findall(r"^\s*part \S+ (\d+) ", TEXT, flags=re.M)]
    assert len(limits) >= 6  # the parts with fixed limits: loaded, pipelines, benchmarks
    build = _default("GPU_CHECK_BUILD_LIMIT")
    assert re.search(r'^part build "\$BUILD_LIMIT"', TEXT, flags=re.M)
    tests = int(re.search(r"^CUDA_TESTS_LIMIT=(\d+)", TEXT, flags=re.M).group(1))
    budget = _default("GPU_CHECK_BUDGET")
    assert build + tests + sum(limits) <= budget
    assert budget + 5 <= 480


def test_it_runs_with_python3_and_every_cuda_test_file():
    assert 'PY="${PYTHON:-python3}"' in TEXT
    assert " -x" not in TEXT and "--exitfirst" not in TEXT
    assert "--quick" in re.search(r"part bench-ops .*", TEXT).group(0)
