"""checkpoint='offload': exact gradients on every schedule, what is offloaded, the host pool."""
import copy
import warnings

import pytest
import torch
from torch import nn

import fastpipe
from fastpipe import _native
from fastpipe.policies import offload
from fastpipe.policies.checkpoint import MODES, checkpoint_stop
from fastpipe.ops.pinned_pool import GRANULE, ReferencePool, host_pool
from helpers import assert_cuda_steps_exact, assert_same_grads, grads_of, mlp, reference

with warnings.catch_warnings():
    warnings.simplefilter("ignore", _native.FastpipeNativeWarning)
    NATIVE = _native.load()

CASES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zbv", 2)]


def _offloaders(pipe):
    return [offload.offloader(stage) for stage in pipe._stages]


@pytest.mark.parametrize("batch", [16, 13], ids=["even", "uneven"])
@pytest.mark.parametrize("name,virtual", CASES)
def test_offload_matches_plain_model(name, virtual, batch):
    model = mlp(depth=2 * virtual * 2 + 1)
    plain = copy.deepcopy(model)
    x, y = torch.randn(batch, 8), torch.randn(batch, 4)
    expected_loss, expected = reference(plain, x, y, nn.MSELoss())
    pipe = fastpipe.Pipe(model, chunks=4, devices=["cpu"] * 2, checkpoint="offload",
                         schedule=name, virtual_stages=virtual)
    loss = pipe.train_step(x, y, nn.MSELoss())
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-7)
    assert_same_grads(grads_of(model), expected)
    assert all(o.pending == {} for o in _offloaders(pipe))  # every micro-batch came back


def test_offload_equals_never_bitwise_with_dropout():
    base = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.3), nn.Tanh(), nn.Linear(32, 32),
                         nn.Dropout(0.3), nn.ReLU(), nn.Linear(32, 4))
    x, y = torch.randn(11, 8), torch.randn(11, 4)
    results = []
    for mode in ("never", "offload"):
        model = copy.deepcopy(base)
        pipe = fastpipe.Pipe(model, chunks=3, balance=[3, 4], devices=["cpu"] * 2,
                             checkpoint=mode, schedule="1f1b")
        torch.manual_seed(7)
        results.append((pipe.train_step(x, y, nn.MSELoss()), grads_of(model)))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=0, atol=0)
    assert_same_grads(results[1][1], results[0][1], rtol=0, atol=0)


def test_activations_go_through_the_pool_which_is_reused_across_steps():
    model = mlp(width=16, depth=6)
    pipe = fastpipe.Pipe(model, chunks=4, balance=[3, 3], devices=["cpu"] * 2,
                         checkpoint="offload", schedule="1f1b")
    x, y = torch.randn(32, 16), torch.randn(32, 4)
    pipe.train_step(x, y, nn.MSELoss())
    first = [o.pool_stats() for o in _offloaders(pipe)]
    assert all(reserved > 0 and allocated > 0 for reserved, _, allocated, _ in first)
    for _ in range(2):
        pipe.train_step(x, y, nn.MSELoss())
    again = [o.pool_stats() for o in _offloaders(pipe)]
    assert [s[2] for s in again] == [s[2] for s in first]  # no new host buffers
    assert [s[0] for s in again] == [s[0] for s in first]


def _saved_by(offloader, fn, keep=()):
    with offloader.saving(0, keep):
        out = fn()
    return out, offloader.pending[0]


def test_parameters_and_boundary_inputs_stay_put_activations_move():
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    off = offload.StageOffloader(torch.device("cpu"))
    keep = [*lin.parameters(), x]
    out, packs = _saved_by(off, lambda: torch.tanh(lin(x)), keep)
    assert len(packs) == 1 and packs[0].shape == (4, 8)  # tanh's output only
    off.prefetch(0)
    out.sum().backward()
    expected = torch.autograd.grad(torch.tanh(lin(x)).sum(), x)[0]
    torch.testing.assert_close(x.grad, expected, rtol=0, atol=0)


def test_a_tensor_saved_twice_is_copied_once():
    w = torch.randn(8, 8, requires_grad=True)
    off = offload.StageOffloader(torch.device("cpu"))
    x = torch.randn(4, 8)

    def run():
        h = torch.sin(x @ w)  # sin saves its input; matmul saves x and w (both kept)
        return h @ w + h * h  # h saved by matmul and twice by mul
    out, packs = _saved_by(off, run, keep=[w, x])
    assert len(packs) == 2  # x @ w and h, each once
    out.sum().backward()
    grad = w.grad.clone()
    w.grad = None
    run().sum().backward()
    torch.testing.assert_close(grad, w.grad, rtol=0, atol=0)


def test_prefetch_brings_back_this_and_the_next_microbatch():
    off = offload.StageOffloader(torch.device("cpu"))
    w = torch.randn(8, 8, requires_grad=True)
    outs = {}
    for mb in (0, 1, 2):
        with off.saving(mb, [w]):
            outs[mb] = torch.tanh(torch.randn(4, 8) @ w).sum()
    packs = {mb: list(off.pending[mb]) for mb in (0, 1, 2)}
    off.prefetch(0)
    assert all(p.value is not None for p in packs[0] + packs[1])
    assert all(p.value is None for p in packs[2])
    assert sorted(off.pending) == [1, 2]
    for mb in (0, 1, 2):
        off.prefetch(mb)
        outs[mb].backward()
    assert off.pending == {}


def test_retained_graph_unpacks_twice():
    off = offload.StageOffloader(torch.device("cpu"))
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    with off.saving(0, [w, x]):
        out = torch.tanh(x @ w).sum()
    off.prefetch(0)
    (gx,) = torch.autograd.grad(out, [x], retain_graph=True)
    (gw,) = torch.autograd.grad(out, [w])
    ex, ew = torch.autograd.grad(torch.tanh(x @ w).sum(), [x, w])
    assert torch.equal(gx, ex) and torch.equal(gw, ew)


def test_offload_is_a_listed_mode():
    assert "offload" in MODES and checkpoint_stop("offload", 4) == 0  # nothing recomputed
    with pytest.raises(ValueError, match="offload"):
        fastpipe.Pipe(mlp(), checkpoint="offlaod")


# --- the host pool ------------------------------------------------------------------------------

POOLS = [pytest.param(False, id="reference"),
         pytest.param(True, id="native", marks=pytest.mark.skipif(
             not NATIVE, reason=f"native library not loaded: {_native.load_error()}"))]


@pytest.mark.parametrize("native", POOLS)
def test_pool_rounds_reuses_and_counts(native):
    pool = host_pool(pinned=False, use_native=native)
    assert isinstance(pool, ReferencePool) != native
    a = pool.acquire(1000)
    assert a.dtype == torch.uint8 and a.numel() == 2 * GRANULE
    assert pool.stats() == (2 * GRANULE, 2 * GRANULE, 1, 0)
    pool.release(a)
    b = pool.acquire(600)  # fits in a's buffer (at most twice the size): reused
    assert b.data_ptr() == a.data_ptr() and pool.stats()[2] == 1
    c = pool.acquire(100)  # a's buffer would be over twice too large: a new one
    assert c.data_ptr() != a.data_ptr() and pool.stats() == (3 * GRANULE, 3 * GRANULE, 2, 0)
    pool.release(b)
    pool.release(c)
    assert pool.stats() == (3 * GRANULE, 0, 2, 2)
    pool.empty_cache()
    assert pool.stats() == (0, 0, 2, 0)
    assert pool.acquire(0).numel() == GRANULE
    assert not pool.pinned()


@pytest.mark.parametrize("native", POOLS)
def test_pool_rejects_foreign_and_double_release(native):
    pool = host_pool(pinned=False, use_native=native)
    with pytest.raises(RuntimeError, match="not in use"):
        pool.release(torch.empty(512, dtype=torch.uint8))
    a = pool.acquire(10)
    pool.release(a)
    with pytest.raises(RuntimeError, match="not in use"):
        pool.release(a)
    with pytest.raises(RuntimeError, match="nbytes"):
        pool.acquire(-1)


# --- CUDA ---------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_cuda_offload_exact_and_saves_memory(name):
    torch.backends.cuda.matmul.allow_tf32 = False
    model = nn.Sequential(*[nn.Sequential(nn.Linear(1024, 1024), nn.GELU()) for _ in range(8)],
                          nn.Linear(1024, 4))
    x, y = torch.randn(256, 1024), torch.randn(256, 4)
    peaks, grads = {}, {}
    for mode in ("never", "offload"):
        m = copy.deepcopy(model)
        pipe = fastpipe.Pipe(m, chunks=8, balance=[5, 4], devices=["cuda:0"] * 2,
                             checkpoint=mode, schedule=name)
        torch.manual_seed(1)
        pipe.train_step(x, y, nn.MSELoss())  # warm-up: pools, streams, the gradients
        # zeroed in place, not freed: the gradients (about 32 MiB, twice the activations of
        # 'never') are allocated before the window opens, so it measures what a step holds
        # for backward (and its transient buffers), not the gradients it creates
        m.zero_grad(set_to_none=False)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        pipe.train_step(x, y, nn.MSELoss())
        torch.cuda.synchronize()
        peaks[mode] = torch.cuda.max_memory_allocated() - base
        grads[mode] = grads_of(m)
    assert_same_grads(grads["offload"], grads["never"], rtol=0, atol=0)
    if name == "gpipe":  # all 8 micro-batches in flight (1F1B holds about 2 per stage)
        assert peaks["offload"] < 0.7 * peaks["never"], peaks


@pytest.mark.cuda
def test_cuda_offload_stress_many_steps():
    assert_cuda_steps_exact("offload", width=512, steps=10)

def test_a_new_tensor_at_a_freed_tensors_address_is_not_taken_for_it():
    """Two storages over the same memory (as when the allocator hands a freed tensor's address
    to the next one): the second is copied on its own, not mistaken for the first."""
    w = torch.randn(1, 5, requires_grad=True)
    memory = bytearray(20)
    off = offload.StageOffloader(torch.device("cpu"))
    first_values, second_values = torch.randn(1, 5), torch.randn(1, 5)

    def over_memory(values):
        memory[:] = values.numpy().tobytes()
        return torch.frombuffer(memory, dtype=torch.float32).view(1, 5)

    with off.saving(0, [w]):
        first = over_memory(first_values)
        out = (w * first).sum()  # mul saves `first`
        del first
        second = over_memory(second_values)  # same address, shape, dtype and version 0
        out = out + (w * w * second).sum()
    off.prefetch(0)
    out.backward()
    expected = first_values + 2 * w.detach() * second_values
    torch.testing.assert_close(w.grad, expected, rtol=0, atol=0)


def _norm_tanh_model(width=5, blocks=3):
    return nn.Sequential(*[layer for _ in range(blocks)
                           for layer in (nn.Linear(width, width), nn.LayerNorm(width), nn.Tanh())])


def test_offload_exact_over_many_steps_and_allocation_patterns():
    """Small saved tensors (a layer norm's per-row statistics) are freed and their addresses
    reused within a forward; 50 steps with batches of changing sizes stay exact."""
    model = _norm_tanh_model()
    plain = copy.deepcopy(model)
    pipe = fastpipe.Pipe(model, chunks=4, balance=[9], devices=["cpu"], checkpoint="offload")
    generator = torch.Generator().manual_seed(3)
    for step in range(50):
        batch = 4 + step % 5
        x = torch.randn(batch, 5, generator=generator)
        y = torch.randn(batch, 5, generator=generator)
        garbage = [torch.empty(int(n)) for n in torch.randint(1, 64, (step % 7,))]
        expected_loss, expected = reference(plain, x, y, nn.MSELoss())
        pipe.zero_grad(set_to_none=True)
        loss = pipe.train_step(x, y, nn.MSELoss())
        del garbage
        torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=1e-7)
        assert_same_grads(grads_of(model), expected, rtol=1e-5, atol=1e-6)
