"""Triton kernels of the fused ops, run by Triton's CPU interpreter in a child process (the
interpreter must be switched on before Triton is first imported, which other tests may do),
compared with the reference backend: outputs, gradients and the exact dropout mask."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import _triton_cases as cases

pytestmark = pytest.mark.triton
SCRIPT = Path(__file__).resolve().parents[1] / "_triton_cases.py"
TOLERANCES = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


@pytest.fixture(scope="module")
def triton_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("triton") / "results.pt"
    root = str(SCRIPT.parent.parent)  # the package's tree, whether or not it is installed
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, str(SCRIPT), str(out)], env=env, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(cases.cases()))
def test_triton_matches_reference(triton_results, name, dtype):
    got = triton_results[(name, str(dtype))]
    expected = cases.run(name, "reference", torch.float32)
    assert all(t.dtype == dtype for t in got)
    for g, e in zip(got, expected):
        scale = max(1.0, e.abs().max().item()) if dtype == torch.bfloat16 else 1.0
        torch.testing.assert_close(g.float() / scale, e / scale, **TOLERANCES[dtype])


def test_triton_dropout_mask_is_bit_identical(triton_results):
    out, grad_x = triton_results[("bias_dropout_add", str(torch.float32))][:2]
    ref_out, ref_grad_x = cases.run("bias_dropout_add", "reference")[:2]
    assert torch.equal(grad_x != 0, ref_grad_x != 0)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-6)
