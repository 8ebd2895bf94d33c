"""Fused recompute ops: every backend against the pure-PyTorch reference, forward and backward,
registered-op checks, exact dropout-mask replay and the memory they save for backward."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from fastpipe import _native, ops
from fastpipe.ops import backend, reference

needs_native = pytest.mark.skipif(not _native.load(), reason="native library unavailable")
SHAPES = [(7,), (3, 5, 17), (2, 130)]


def _inputs(name, shape, dtype, seed=0):
    """Inputs of op ``name`` (tensors first) and the reference function computing it."""
    g = torch.Generator().manual_seed(seed)
    rand = functools.partial(torch.randn, generator=g, dtype=dtype)
    n = shape[-1]
    if name == "bias_gelu":
        return (rand(shape), rand(n)), lambda x, b: ops.bias_gelu(x, b), reference.bias_gelu
    if name == "bias_gelu_tanh":
        return ((rand(shape), rand(n)), lambda x, b: ops.bias_gelu(x, b, "tanh"),
                lambda x, b: reference.bias_gelu(x, b, "tanh"))
    if name == "bias_dropout_add":
        return ((rand(shape), rand(n), rand(shape)),
                lambda x, b, r: ops.bias_dropout_add(x, b, r, 0.3, True, seed=11, offset=5),
                lambda x, b, r: reference.bias_dropout_add(x, b, r, 0.3, 11, 5))
    if name == "rms_norm":
        return ((rand(shape) * 3, 1 + rand(n)), lambda x, w: ops.rms_norm(x, w, 1e-6),
                lambda x, w: reference.rms_norm(x, w, 1e-6))
    if name == "layer_norm":
        return ((rand(shape) * 3 + 1, 1 + rand(n), rand(n)),
                lambda x, w, b: ops.layer_norm(x, w, b, 1e-5),
                lambda x, w, b: reference.layer_norm(x, w, b, 1e-5))
    if name == "swiglu":
        return (rand(shape), rand(shape)), ops.swiglu, reference.swiglu
    raise KeyError(name)


OPS = ["bias_gelu", "bias_gelu_tanh", "bias_dropout_add", "rms_norm", "layer_norm", "swiglu"]
TOLERANCES = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _run(fn, inputs, grad):
    leaves = [t.clone().requires_grad_(True) for t in inputs]
    out = fn(*leaves)
    out.backward(grad)
    return out.detach(), [t.grad for t in leaves]


def _backends():
    names = ["reference"]
    if _native.load():
        names.append("native")
    return names


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("which", _backends())
def test_backend_matches_reference(which, name, shape, dtype):
    inputs, fused, plain = _inputs(name, shape, dtype)
    grad = torch.randn(shape, dtype=dtype)
    # the oracle runs in float32 (bf16 kernels compute in float32 as well)
    expected, expected_grads = _run(plain, [t.float() for t in inputs], grad.float())
    with backend.forced(which):
        out, grads = _run(fused, inputs, grad)
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
    torch.testing.assert_close(out.float(), expected, **TOLERANCES[dtype])
    for got, want in zip(grads, expected_grads):
        scale = max(1.0, want.abs().max().item()) if dtype == torch.bfloat16 else 1.0
        torch.testing.assert_close(got.float() / scale, want / scale, **TOLERANCES[dtype])


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("which", _backends())
def test_gradcheck_float64(which, name):
    inputs, fused, _ = _inputs(name, (3, 6), torch.float64)
    leaves = [t.requires_grad_(True) for t in inputs]
    with backend.forced(which):
        assert torch.autograd.gradcheck(fused, leaves, eps=1e-6, atol=1e-5)


def _op_samples():
    g = torch.Generator().manual_seed(1)
    x, b, w = (torch.randn(4, 9, generator=g), torch.randn(9, generator=g),
               torch.randn(9, generator=g))
    t = x.t().contiguous().t()  # a non-contiguous input of the same values
    return {
        "bias_gelu": [(x, b, "none"), (t, b, "tanh")],
        "bias_gelu_backward": [(x, x, b, "none"), (x, t, b, "tanh")],
        "bias_dropout_add": [(x, b, x, 0.2, 3, 0), (t, b, x, 0.5, 9, 77)],
        "bias_dropout_add_backward": [(x, 0.2, 3, 0), (t, 0.5, 9, 77)],
        "rms_norm": [(x, w, 1e-6), (t, w, 1e-3)],
        "rms_norm_backward": [(x, x, w, 1e-6)],
        "layer_norm": [(x, w, b, 1e-5), (t, w, b, 1e-3)],
        "layer_norm_backward": [(x, x, w, 1e-5)],
        "swiglu": [(x, x.flip(0)), (t, x)],
        "swiglu_backward": [(x, t, x)],
    }


@needs_native
@pytest.mark.parametrize("op", list(_op_samples()))
def test_registered_op_passes_opcheck(op):
    differentiable = not op.endswith("_backward")
    for args in _op_samples()[op]:
        args = tuple(a.clone().requires_grad_(differentiable and i < 3 and a.dim() > 0)
                     if isinstance(a, torch.Tensor) else a for i, a in enumerate(args))
        torch.library.opcheck(getattr(torch.ops.fastpipe, op), args)


@needs_native
def test_registered_op_autograd_matches_reference():
    x = torch.randn(5, 8, requires_grad=True)
    w = torch.randn(8, requires_grad=True)
    torch.ops.fastpipe.rms_norm(x, w, 1e-6).sum().backward()
    expected = torch.autograd.grad(reference.rms_norm(x, w, 1e-6).sum(), [x, w])
    torch.testing.assert_close(x.grad, expected[0])
    torch.testing.assert_close(w.grad, expected[1])


# --- dropout mask ---------------------------------------------------------------------------


def _mask(which, shape, p, seed, offset):
    """The kept elements, read back from the op's output on x=1, bias=0, residual=0."""
    with backend.forced(which):
        out = ops.bias_dropout_add(torch.ones(shape), torch.zeros(shape[-1]), torch.zeros(shape),
                                   p, True, seed=seed, offset=offset)
    return out != 0


@needs_native
def test_dropout_mask_is_identical_across_backends_and_a_function_of_its_counters():
    native = _mask("native", (100, 1000), 0.25, 2 ** 40 + 17, 3)
    assert torch.equal(native, _mask("reference", (100, 1000), 0.25, 2 ** 40 + 17, 3))
    assert torch.equal(native, reference.dropout_keep(torch.Size((100, 1000)), 0.25, 2 ** 40 + 17,
                                                      3, torch.device("cpu")))
    assert abs(1 - native.float().mean().item() - 0.25) < 0.01
    # the offset shifts the element counter: the same stream, read further on
    shifted = _mask("native", (100, 1000), 0.25, 2 ** 40 + 17, 1003)
    assert torch.equal(shifted.flatten()[:-1000], native.flatten()[1000:])
    assert not torch.equal(_mask("native", (100, 1000), 0.25, 2 ** 40 + 18, 3), native)


@pytest.mark.parametrize("which", _backends())
def test_dropout_backward_regenerates_the_forward_mask(which):
    x, b, r = torch.randn(6, 50, requires_grad=True), torch.randn(50), torch.randn(6, 50)
    with backend.forced(which):
        out = ops.bias_dropout_add(x, b, r, 0.4, True, seed=123)
    out.backward(torch.ones_like(out))
    kept = (out - r).detach() != 0
    assert torch.equal(x.grad != 0, kept)
    torch.testing.assert_close(x.grad[kept], torch.full_like(x.grad[kept], 1 / 0.6))


@pytest.mark.parametrize("which", _backends())
def test_dropout_recompute_under_checkpoint_replays_the_mask(which):
    """torch.utils.checkpoint restores the CPU generator, so the drawn seed and mask repeat."""
    x, b, r = torch.randn(6, 50, requires_grad=True), torch.randn(50), torch.randn(6, 50)
    fn = lambda t: ops.bias_dropout_add(F.gelu(t), b, r, 0.5, True)  # noqa: E731
    with backend.forced(which):
        torch.manual_seed(5)
        fn(x).sum().backward()
        expected, x.grad = x.grad, None
        torch.manual_seed(5)
        torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=False).sum().backward()
    torch.testing.assert_close(x.grad, expected, rtol=0, atol=0)


def test_dropout_in_eval_or_with_zero_p_is_a_plain_sum():
    x, b, r = torch.randn(3, 4), torch.randn(4), torch.randn(3, 4)
    for p, training in ((0.5, False), (0.0, True)):
        torch.testing.assert_close(ops.bias_dropout_add(x, b, r, p, training), x + b + r)


# --- memory saved for backward ------------------------------------------------------------------


def _saved_bytes(fn, *inputs) -> int:
    """Bytes of the distinct storages autograd saves for backward while ``fn`` runs."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs)
    return sum(storages.values())


def _unfused_rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


# bias_gelu keeps its input as F.gelu does (same activation bytes, plus the bias vector): its
# saving shows at the module level, see tests/ops/test_nn_fused.py.
@pytest.mark.parametrize("name,fused,unfused", [
    ("bias_dropout_add", lambda x, b, r: ops.bias_dropout_add(x, b, r, 0.1, True),
     lambda x, b, r: F.dropout(x + b, 0.1) + r),
    ("rms_norm", lambda x, b, r: ops.rms_norm(x, b), lambda x, b, r: _unfused_rms(x, b)),
    ("layer_norm", lambda x, b, r: ops.layer_norm(x, b, b),
     lambda x, b, r: F.layer_norm(x, (x.shape[-1],), b, b)),
    ("swiglu", lambda x, b, r: ops.swiglu(x, r), lambda x, b, r: F.silu(x) * r),
])
def test_fused_op_saves_less_for_backward(name, fused, unfused):
    x, b, r = (torch.randn(64, 256, requires_grad=True), torch.randn(256, requires_grad=True),
               torch.randn(64, 256, requires_grad=True))
    x_in = x * 1  # an activation (not a leaf), as inside a model
    fused_bytes, unfused_bytes = _saved_bytes(fused, x_in, b, r), _saved_bytes(unfused, x_in, b, r)
    assert fused_bytes < unfused_bytes


# --- argument checks and dispatch ------------------------------------------------------------


def test_bad_arguments_raise_typed_errors_naming_the_argument():
    x = torch.randn(3, 4)
    with pytest.raises(ValueError, match="bias has shape \\(5,\\)"):
        ops.bias_gelu(x, torch.randn(5))
    with pytest.raises(ValueError, match="approximate"):
        ops.bias_gelu(x, torch.randn(4), "fast")
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        ops.rms_norm([1.0], torch.randn(4))
    with pytest.raises(TypeError, match="floating-point"):
        ops.swiglu(torch.ones(3, dtype=torch.int64), torch.ones(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="p must be a float in \\[0, 1\\)"):
        ops.bias_dropout_add(x, torch.randn(4), x, 1.0, True)
    with pytest.raises(ValueError, match="residual has shape"):
        ops.bias_dropout_add(x, torch.randn(4), torch.randn(4), 0.1, True)
    with pytest.raises(ValueError, match="seed must be an int"):
        ops.bias_dropout_add(x, torch.randn(4), x, 0.1, True, seed=-1)
    with pytest.raises(ValueError, match="eps must be a non-negative"):
        ops.layer_norm(x, torch.ones(4), torch.zeros(4), eps=-1.0)
    with pytest.raises(ValueError, match="use one of native, triton, reference"):
        with backend.forced("fortran"):
            pass


def test_dispatch_falls_back_to_the_reference_without_the_native_library(monkeypatch):
    monkeypatch.setattr(_native, "load", lambda: False)
    assert backend.choose(torch.randn(2)) == "reference"
    torch.testing.assert_close(ops.rms_norm(torch.randn(2, 3), torch.ones(3)).shape,
                               torch.Size((2, 3)))


@needs_native
def test_dispatch_picks_the_native_kernels_on_the_cpu():
    assert backend.choose(torch.randn(2)) == "native"


def test_mixed_precision_weight_gets_a_gradient_in_its_own_dtype():
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    w = torch.ones(8, requires_grad=True)
    ops.rms_norm(x, w).float().sum().backward()
    assert w.grad.dtype == torch.float32
