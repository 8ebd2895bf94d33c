"""fastpipe.ops.transfer and the fastpipe::transfer op: values, aliasing, gradients, devices."""
from __future__ import annotations

import importlib
import warnings

import pytest
import torch

from fastpipe import _native
from fastpipe.ops import reference_transfer, transfer

transfer_mod = importlib.import_module("fastpipe.ops.transfer")

with warnings.catch_warnings():
    warnings.simplefilter("ignore", _native.FastpipeNativeWarning)
    NATIVE = _native.load()

needs_native = pytest.mark.skipif(
    not NATIVE, reason=f"native library not loaded: {_native.load_error()}")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
needs_cuda_kernel = pytest.mark.skipif(
    not (NATIVE and torch._C._dispatch_has_kernel_for_dispatch_key("fastpipe::transfer", "CUDA")),
    reason="native library built without its CUDA kernel")
CPU = torch.device("cpu")


def _samples() -> list[torch.Tensor]:
    """One tensor per interesting case: dtypes, a transposed view, a strided slice, a scalar."""
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(3, 5, generator=g),
        torch.randint(-(2**40), 2**40, (7,), generator=g, dtype=torch.int64),
        torch.rand(4, 4, generator=g) > 0.5,
        torch.randn(2, 3, generator=g).to(torch.bfloat16),
        torch.randn(4, 6, generator=g, dtype=torch.float64).t(),
        torch.arange(20, dtype=torch.float32)[::3],
        torch.tensor(2.5),
        torch.empty(0, 3),
    ]


def _op(tensors, device, non_blocking=False):
    return torch.ops.fastpipe.transfer(tensors, torch.device(device), non_blocking)


def _assert_copies(out, inputs, device) -> None:
    """Each output equals its input, on ``device``, and owns new memory."""
    assert len(out) == len(inputs)
    for o, t in zip(out, inputs):
        assert o.device.type == torch.device(device).type
        assert o.dtype == t.dtype and o.shape == t.shape
        assert torch.equal(o.cpu(), t.cpu())
        assert o is not t
        if t.numel():
            assert o.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()


# --- the wrapper --------------------------------------------------------------------------------


def test_empty_list():
    assert transfer([], "cpu") == []
    assert transfer((), CPU, use_native=True) == []
    assert reference_transfer([], CPU) == []


@pytest.mark.parametrize("use_native", [None, False])
def test_same_device_tensors_are_returned_as_is(use_native):
    xs = _samples()
    out = transfer(xs, "cpu", use_native=use_native)
    assert all(o is x for o, x in zip(out, xs))
    assert isinstance(out, list)


def test_meta_target_moves_and_keeps_order():
    a, b = torch.randn(2, 3), torch.empty(4, device="meta")
    c = torch.arange(5)
    out = transfer([a, b, c], "meta")
    assert out[1] is b
    assert [o.device.type for o in out] == ["meta"] * 3
    assert [o.shape for o in out] == [a.shape, b.shape, c.shape]
    assert out[2].dtype == torch.int64


def test_groups_by_source_device_type(monkeypatch):
    calls = []

    def fake_move(group, kind, target, non_blocking, native):
        calls.append((kind, len(group), target))
        return [t.clone() for t in group]

    monkeypatch.setattr(transfer_mod, "_move_group", fake_move)
    xs = [torch.zeros(1), torch.empty(2, device="meta"), torch.ones(3)]
    out = transfer(xs, torch.device("cuda", 0))
    target = torch.device("cuda", 0)
    assert calls == [("cpu", 2, target), ("meta", 1, target)]
    assert [o.shape[0] for o in out] == [1, 2, 3]


def test_rejects_non_tensors():
    with pytest.raises(TypeError, match="item 1"):
        transfer([torch.zeros(1), 3.0], "meta")


def test_reference_transfer_always_copies():
    xs = _samples()
    _assert_copies(reference_transfer(xs, CPU), xs, CPU)


def test_reference_path_is_differentiable():
    x = torch.randn(3, requires_grad=True)
    (y,) = transfer([x], "meta", use_native=False)
    assert type(y.grad_fn).__name__ == "ToCopyBackward0"


@needs_native
def test_native_path_is_used_for_cross_device_hops():
    x = torch.randn(3, requires_grad=True)
    (y,) = transfer([x], "meta")
    assert "fastpipe_transfer" in type(y.grad_fn).__name__


# --- the op -------------------------------------------------------------------------------------


@needs_native
@pytest.mark.parametrize("non_blocking", [False, True])
def test_op_copies_exactly(non_blocking):
    xs = _samples()
    out = _op(xs, "cpu", non_blocking)
    _assert_copies(out, xs, CPU)
    for o, r in zip(out, reference_transfer(xs, CPU)):
        assert o.stride() == r.stride()


@needs_native
def test_op_strides_follow_tensor_to():
    transposed = torch.randn(4, 6).t()
    stepped = torch.arange(20.0)[::3]
    out_t, out_s = _op([transposed, stepped], "cpu")
    assert out_t.stride() == transposed.stride()  # dense: layout kept
    assert out_s.is_contiguous()  # gaps: compacted


@needs_native
def test_op_gradients_flow_back():
    a = torch.randn(3, 4, requires_grad=True)
    b = torch.randn(5, dtype=torch.float64, requires_grad=True)
    c = torch.randn(2, requires_grad=True)  # its output is unused: its grad stays None
    idx = torch.arange(3)  # integer inputs take part without gradients
    oa, ob, oc, oi = _op([a, b, c, idx], "cpu")
    assert oi.grad_fn is None or not oi.requires_grad
    (oa * 2).sum().add((ob**2).sum()).backward()
    assert torch.equal(a.grad, torch.full_like(a, 2.0))
    assert torch.allclose(b.grad, 2 * b.detach())
    assert c.grad is None


@needs_native
def test_op_backward_without_a_kernel_for_the_gradients_uses_reference(monkeypatch):
    x = torch.randn(3, requires_grad=True)
    (y,) = _op([x], "cpu")
    monkeypatch.setattr(transfer_mod, "_has_kernel", lambda kind: False)  # e.g. CPU-only build
    (y * 5).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 5.0))


@needs_native
def test_op_gradient_with_non_blocking_and_double_backward():
    x = torch.randn(4, requires_grad=True)
    (y,) = _op([x], "cpu", True)
    (g,) = torch.autograd.grad((y**3).sum(), x, create_graph=True)
    g.sum().backward()
    assert torch.allclose(x.grad, 6 * x.detach())


@needs_native
def test_op_bf16_gradient():
    x = torch.randn(3, dtype=torch.bfloat16, requires_grad=True)
    (y,) = _op([x], "cpu")
    y.float().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and torch.equal(x.grad, torch.ones_like(x))


@needs_native
def test_op_rejects_mixed_device_types():
    with pytest.raises(RuntimeError, match="device type"):
        _op([torch.zeros(1), torch.empty(1, device="meta")], "cpu")


@needs_native
def test_op_fake_tensor_metadata_matches_eager():
    xs = [torch.randn(4, 6).t(), torch.arange(10)[::2], torch.ones(2, dtype=torch.bool)]
    eager = _op(xs, "cpu")
    with torch._subclasses.FakeTensorMode() as mode:
        fakes = [mode.from_tensor(t) for t in xs]
        out = _op(fakes, "cpu")
    for f, e in zip(out, eager):
        assert (f.shape, f.stride(), f.dtype, f.device) == (e.shape, e.stride(), e.dtype, e.device)


@needs_native
@pytest.mark.parametrize("non_blocking", [False, True])
def test_opcheck(non_blocking):
    args = (
        [torch.randn(3, requires_grad=True), torch.randn(4, 6).t().requires_grad_(),
         torch.arange(6)[::2], torch.rand(3) > 0.5, torch.randn(2, dtype=torch.bfloat16)],
        CPU,
        non_blocking,
    )
    torch.library.opcheck(torch.ops.fastpipe.transfer.default, args)


@needs_native
def test_torch_compile_fullgraph():
    fn = torch.compile(lambda x: [t * 2 for t in _op([x], "cpu")], fullgraph=True,
                       backend="aot_eager")
    x = torch.arange(4.0)
    assert torch.equal(fn(x)[0], x * 2)


# --- CUDA ---------------------------------------------------------------------------------------


@pytest.mark.cuda
@needs_cuda
def test_cuda_round_trip_values():
    xs = _samples()
    on_gpu = transfer(xs, "cuda")
    _assert_copies(on_gpu, xs, "cuda")
    back = transfer(on_gpu, "cpu")
    _assert_copies(back, xs, CPU)
    assert transfer(on_gpu, "cuda")[0] is on_gpu[0]  # bare "cuda" means the current device


@pytest.mark.cuda
@needs_cuda
@needs_cuda_kernel
def test_cuda_op_both_directions():
    xs = _samples()
    gpu = _op(xs, "cuda", True)
    cpu = _op(gpu, "cpu")
    torch.cuda.synchronize()
    _assert_copies(cpu, xs, CPU)
    torch.library.opcheck(torch.ops.fastpipe.transfer.default,
                          ([torch.randn(3, device="cuda", requires_grad=True)], CPU, False))


@pytest.mark.cuda
@needs_cuda
def test_cuda_gradients_return_to_source_device():
    a = torch.randn(8, 8, requires_grad=True)
    b = torch.randn(4, requires_grad=True)
    ga, gb = transfer([a, b], "cuda", non_blocking=True)
    assert ga.is_cuda and gb.is_cuda
    (ga @ ga).sum().backward()
    assert b.grad is None
    expected = torch.ones(8, 8) @ a.detach().t() + a.detach().t() @ torch.ones(8, 8)
    assert a.grad.device == CPU
    assert torch.allclose(a.grad, expected, atol=1e-4)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_cuda_peer_transfer_and_gradient():
    x = torch.randn(64, device="cuda:0", requires_grad=True)
    (y,) = transfer([x], "cuda:1")
    assert y.device == torch.device("cuda", 1)
    (y * 3).sum().backward()
    assert x.grad.device == x.device and torch.equal(x.grad, torch.full_like(x, 3.0))


@pytest.mark.cuda
@needs_cuda
def test_cuda_stress_round_trips():
    g = torch.Generator().manual_seed(1)
    dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool]
    for i in range(200):
        n = int(torch.randint(1, 1 << 16, (1,), generator=g))
        host = torch.randn(n, generator=g).to(dtypes[i % len(dtypes)])
        (dev,) = transfer([host], "cuda", non_blocking=True)
        (back,) = transfer([dev], "cpu")
        assert torch.equal(back, host), f"iteration {i}"


@pytest.mark.cuda
@needs_cuda
@needs_cuda_kernel
def test_cuda_source_freed_during_copy_is_not_reused():
    """A source read on a side stream and freed at once must not be handed out early."""
    side = torch.cuda.Stream()
    n = 1 << 20
    for i in range(50):
        src = torch.full((n,), float(i), device="cuda")  # allocated on the default stream
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(10_000_000)  # keep the copy below pending for a while
            (dst,) = _op([src], "cpu", True)  # device-to-host on `side`, reading `src`
        del src
        junk = torch.full((n,), -1.0, device="cuda")  # would reuse src's block if unrecorded
        side.synchronize()
        assert torch.equal(dst, torch.full((n,), float(i))), f"iteration {i}"
        del junk


@pytest.mark.cuda
@needs_cuda
@needs_cuda_kernel
def test_cuda_side_stream_stress_many_microbatches():
    """Hops on the copy streams, with consumers on other streams and every tensor freed at once
    and its memory reallocated: each micro-batch still arrives intact, both ways."""
    g = torch.Generator().manual_seed(2)
    consumers = [torch.cuda.Stream() for _ in range(2)]
    results = []
    for i in range(300):
        n = int(torch.randint(1, 1 << 18, (1,), generator=g))
        host = torch.full((n,), float(i)).pin_memory()
        with torch.cuda.stream(consumers[i % 2]):
            (dev,) = transfer([host], "cuda", non_blocking=True)
            doubled = dev * 2  # runs on the consumer stream, after the copy
            del dev
            junk = torch.full((n,), -1.0, device="cuda")  # would reuse dev's block if unrecorded
            (back,) = transfer([doubled], "cpu", non_blocking=True)
            del doubled, junk
        results.append((i, n, back, consumers[i % 2]))
    for i, n, back, stream in results:
        stream.synchronize()
        assert torch.equal(back, torch.full((n,), 2.0 * i)), f"micro-batch {i}"
