"""Triton kernels of the fused ops, run by Triton's CPU interpreter in a child process (the
interpreter must be switched on before Triton is first imported, which other tests may do),
compared with the reference backend: outputs, gradients and the exact dropout mask."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

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
    _assert_matches(name, dtype, triton_results[(name, str(dtype))])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(cases.cases()))
def test_triton_on_cuda_matches_reference(name, dtype):
    _assert_matches(name, dtype, cases.run(name, "triton", dtype, device="cuda"))


def _assert_matches(name, dtype, got):
    expected = cases.run(name, "reference", torch.float32)
    assert all(t.dtype == dtype for t in got)
    for g, e in zip(got, expected):
        scale = max(1.0, e.abs().max().item()) if _relative(name, dtype, e) else 1.0
        torch.testing.assert_close(g.float() / scale, e / scale, **TOLERANCES[dtype])


def _relative(name, dtype, expected):
    """Whether to compare relative to the largest value: bf16 results, and the fp32 weight and
    bias gradients summed over the many-rows cases' 4500 rows, whose rounding (the reference's
    as much as the kernel's) grows with the sum's magnitude, not per element."""
    return dtype == torch.bfloat16 or (name.endswith("_many_rows") and expected.dim() == 1)


def test_triton_dropout_mask_is_bit_identical(triton_results):
    out, grad_x = triton_results[("bias_dropout_add", str(torch.float32))][:2]
    ref_out, ref_grad_x = cases.run("bias_dropout_add", "reference")[:2]
    assert torch.equal(grad_x != 0, ref_grad_x != 0)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-6)



def test_norm_row_offsets_past_2_31_do_not_wrap(triton_results):
    block, _, n, block_rows, block_n = cases.FAR_TILE
    row = torch.arange(block_rows, dtype=torch.int64)[:, None] + block * block_rows
    expected = row * n + torch.arange(block_n, dtype=torch.int64)[None, :]
    assert expected.min() >= 2 ** 31  # int32 offsets would wrap here
    assert torch.equal(triton_results["far_tile_offsets"], expected)


def _launches(triton_results, where):
    """(rows, n) -> the norm launch the kernels chose ``where`` ("cpu" or "cuda")."""
    return {(rows, n): SimpleNamespace(**launch)
            for (place, rows, n), launch in triton_results["launches"].items() if place == where}


def test_norm_backward_programs_loop_over_row_blocks(triton_results):
    launch = _launches(triton_results, "cpu")[cases.MANY_ROWS]
    assert (launch.block_n, launch.block_rows, launch.row_blocks) == (128, 512, 9)
    assert launch.backward_programs < launch.row_blocks  # the many-rows cases loop


def test_norm_backward_partial_sums_scale_with_sms_not_rows(triton_results):
    gpu = _launches(triton_results, "cuda")
    big = gpu[(2 ** 20, 4096)]  # a million rows of 4096: one program per row was 16 GiB
    assert big.row_blocks == 2 ** 20 and big.backward_programs <= cases.SMS * 8
    assert big.backward_programs * big.block_n * 4 <= 32 * 2 ** 20  # now at most 32 MiB
    assert gpu[(8, 64)].backward_programs == 1  # never more programs than row blocks


def test_norm_warps_grow_with_the_row_block(triton_results):
    gpu = _launches(triton_results, "cuda")
    assert gpu[(64, 65536)].num_warps == 32  # not 4 warps for a 65536-wide row (spills)
    for launch in gpu.values():  # at most 64 values per thread per tensor
        assert launch.block_rows * launch.block_n <= 64 * 32 * launch.num_warps



@pytest.mark.cuda
@pytest.mark.parametrize("centre", [False, True], ids=["rms_norm", "layer_norm"])
def test_triton_norm_past_2_31_elements_on_cuda(centre):
    """bf16 rows whose offsets pass 2^31: the last rows' outputs and input gradients, and the
    weight (and bias) gradients summed over every row, against the reference in float32."""
    from fastpipe.ops import reference, triton_kernels

    n, last, eps = 4096, 64, 1e-5
    if torch.cuda.mem_get_info()[0] < 32 * 2 ** 30:
        pytest.skip("needs 32 GiB of free GPU memory")
    g = torch.Generator(device="cuda").manual_seed(0)
    x, d = (torch.randn(2 ** 31 // n + last, n, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2))
    params = [torch.randn(n, device="cuda", generator=g).bfloat16() for _ in range(1 + centre)]
    forward = triton_kernels.layer_norm if centre else triton_kernels.rms_norm
    backward = (triton_kernels.layer_norm_backward if centre
                else triton_kernels.rms_norm_backward)
    out = forward(x, *params, eps)[-last:]
    grads = backward(d, x, params[0], eps)
    f32 = [p.float() for p in params]
    ref_forward = reference.layer_norm if centre else reference.rms_norm
    ref_backward = reference.layer_norm_backward if centre else reference.rms_norm_backward
    _close(out, ref_forward(x[-last:].float(), *f32, eps))
    _close(grads[0][-last:], ref_backward(d[-last:].float(), x[-last:].float(), f32[0], eps)[0])
    sums = [torch.zeros(n, device="cuda") for _ in grads[1:]]
    for rows in zip(d.split(2 ** 15), x.split(2 ** 15)):  # float32 copies a chunk at a time
        for total, part in zip(sums, ref_backward(*(t.float() for t in rows), f32[0], eps)[1:]):
            total += part
    for got, expected in zip(grads[1:], sums):
        _close(got, expected)


def _close(got, expected):
    scale = max(1.0, expected.abs().max().item())
    torch.testing.assert_close(got.float() / scale, expected / scale,
                               **TOLERANCES[torch.bfloat16])
