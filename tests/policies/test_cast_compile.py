"""Casting a pipe (``to(dtype)``, moves refused) and compiling its stages (``compile=``, models
and submodules in ``torch.compile``), each against the plain model."""
import copy

import pytest
import torch
from torch import nn

import fastpipe
from dist_launch import assert_all_ok, launch
from helpers import assert_same_grads, grads_of, mlp, reference
from skip_models import model_with_skips
from tied_models import batch as lm_batch, lm, loss_fn as lm_loss

AOT_EAGER = {"backend": "aot_eager"}  # eager kernels through the compiler: exact, quick
FRONT_DOORS = {
    "Pipe": lambda model, **kw: fastpipe.Pipe(model, **kw),
    "GPipe": lambda model, **kw: fastpipe.GPipe(model, kw.pop("balance"), **kw),
}


class Counting:
    """A ``torch.compile`` backend that runs each graph as traced and counts the graphs."""

    __name__ = "counting"

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return gm.forward


def bn_mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 8),
                         nn.ReLU(), nn.Linear(8, 4))


def dropout_mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.ReLU(), nn.Linear(16, 16),
                         nn.Dropout(0.3), nn.Tanh(), nn.Linear(16, 4))


def tensors(pipe: nn.Module) -> list:
    return [*pipe.parameters(), *pipe.buffers()]


def check_steps(pipe, model, plain, steps=2, batches=(13, 8), dtype=torch.float32, **tol):
    """Training steps of ``pipe`` (holding ``model``) against ``plain``: loss and gradients."""
    for step in range(steps):
        x, y = torch.randn(batches[step % len(batches)], 8), torch.randn(
            batches[step % len(batches)], 4)
        x, y = x.to(dtype), y.to(dtype)
        pipe.zero_grad(set_to_none=True)
        expected_loss, expected = reference(plain, x, y, nn.MSELoss())
        loss = pipe.train_step(x, y, nn.MSELoss())
        assert loss.dtype == dtype
        torch.testing.assert_close(loss, expected_loss, **(tol or dict(rtol=1e-5, atol=1e-6)))
        assert_same_grads(grads_of(model), expected, **tol)


# ------------------------------------------------------------------------------------ casting
CASTS = [
    ((torch.float64,), {}, torch.float64),
    ((), {"dtype": torch.bfloat16}, torch.bfloat16),
    (("cpu", torch.float16), {}, torch.float16),
    ((torch.device("cpu"),), {"dtype": torch.float64}, torch.float64),
    ((torch.float64, True), {}, torch.float64),  # non_blocking
]


@pytest.mark.parametrize("door", FRONT_DOORS)
@pytest.mark.parametrize("args,kwargs,dtype", CASTS)
def test_a_cast_applies_to_every_stage_in_place(door, args, kwargs, dtype):
    pipe = FRONT_DOORS[door](bn_mlp(), balance=[2, 2, 2], devices=["cpu"] * 3, chunks=2)
    before = tensors(pipe)
    assert pipe.to(*args, **kwargs) is pipe
    after = tensors(pipe)  # the same tensors: parameters and buffers cast in place
    assert len(after) == len(before) and all(a is b for a, b in zip(after, before))
    floats = [t for t in tensors(pipe) if t.is_floating_point()]
    assert floats and all(t.dtype == dtype for t in floats)
    assert pipe.module[1].num_batches_tracked.dtype == torch.int64  # as nn.Module.to leaves it
    for stage in pipe.partitions:  # the stages hold the very tensors that were cast
        assert all(p.dtype == dtype for p in stage.parameters())


MOVES = {
    "to(meta)": lambda p: p.to("meta"),
    "to(cuda)": lambda p: p.to("cuda"),
    "to(cuda:0, dtype)": lambda p: p.to("cuda:0", torch.float64),
    "to(device=meta, dtype)": lambda p: p.to(device="meta", dtype=torch.float64),
    "to(meta tensor)": lambda p: p.to(torch.ones(1, device="meta", dtype=torch.float64)),
    "to(0)": lambda p: p.to(0),
    "to(device=0)": lambda p: p.to(device=0),
    "to(tensor=meta tensor)": lambda p: p.to(tensor=torch.ones(1, device="meta")),
    "cuda()": lambda p: p.cuda(),
    "cuda(0)": lambda p: p.cuda(0),
    "to_empty(meta)": lambda p: p.to_empty(device="meta"),
    "xpu()": lambda p: p.xpu(),
}


@pytest.mark.parametrize("door", FRONT_DOORS)
@pytest.mark.parametrize("move", MOVES)
def test_a_move_to_another_device_is_refused_and_changes_nothing(door, move):
    pipe = FRONT_DOORS[door](mlp(), balance=[3, 3], devices=["cpu"] * 2, chunks=2)
    before = [(t, t.dtype, t.device, t.clone()) for t in tensors(pipe)]
    with pytest.raises(TypeError, match=r"stages live on their own devices \(cpu, cpu\) and "
                                        r"cannot be moved as one.*Pipe\(devices=\.\.\.\)"):
        MOVES[move](pipe)
    for (t, dtype, device, value), now in zip(before, tensors(pipe)):
        assert now is t and now.dtype == dtype and now.device == device
        assert torch.equal(now, value)


def test_torchgpipes_casts_run_on_gpipe():
    """torchgpipe's own deny-moving test, its casts: ``half``, ``to(torch.double)``,
    ``to(dtype=torch.float)`` (its moves are in the test above)."""
    a, b = nn.Linear(1, 1), nn.Linear(1, 1)
    model = fastpipe.GPipe(nn.Sequential(a, b), [1, 1], devices=["cpu", "cpu"])
    model.half()
    assert a.weight.dtype == torch.float16
    model.to(torch.double)
    assert a.weight.dtype == b.weight.dtype == torch.float64
    model.to(dtype=torch.float)
    assert a.weight.dtype == torch.float32
    assert model(torch.randn(4, 1)).dtype == torch.float32


@pytest.mark.parametrize("door", FRONT_DOORS)
def test_a_move_is_refused_even_to_where_every_stage_is(door):
    """torchgpipe's deny-moving semantics: ``cpu()``, ``to('cpu')`` and ``to(tensor)`` are
    moves, refused even on an all-CPU pipe; ``to('cpu', dtype)`` is a cast."""
    pipe = FRONT_DOORS[door](mlp(), balance=[3, 3], devices=["cpu"] * 2, chunks=2)
    before = tensors(pipe)
    for move in (pipe.cpu, lambda: pipe.to("cpu"), lambda: pipe.to(torch.ones(1)),
                 lambda: pipe.to(tensor=torch.ones(1)), lambda: pipe.to(device="cpu")):
        with pytest.raises(TypeError, match="cannot be moved"):
            move()
    assert pipe.to_empty(device="cpu") is pipe
    assert pipe.to("cpu", torch.float64) is pipe
    assert all(a is b for a, b in zip(tensors(pipe), before))
    assert all(t.dtype == torch.float64 for t in tensors(pipe) if t.is_floating_point())


def test_integer_dtypes_and_replaced_parameters_are_refused_before_any_change():
    pipe = fastpipe.Pipe(mlp(), balance=[3, 3], devices=["cpu"] * 2)
    with pytest.raises(TypeError, match="floating point or complex"):
        pipe.to(torch.int64)
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        with pytest.raises(RuntimeError, match="replace every Parameter"):
            pipe.to(torch.float64)
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)
    assert all(p.dtype == torch.float32 for p in pipe.parameters())


@pytest.mark.parametrize("door", FRONT_DOORS)
@pytest.mark.parametrize("dtype,schedule,checkpoint", [
    (torch.float64, "gpipe", "except_last"), (torch.float64, "zb-h1", "always"),
    (torch.bfloat16, "1f1b", "never")])
def test_training_after_a_cast_matches_the_plain_model_cast_alike(door, dtype, schedule,
                                                                   checkpoint):
    model = mlp(depth=6)
    plain = copy.deepcopy(model)
    pipe = FRONT_DOORS[door](model, balance=[2, 2, 2], devices=["cpu"] * 3, chunks=4,
                             checkpoint=checkpoint, schedule=schedule)
    check_steps(pipe, model, plain, steps=1)  # float32 first
    pipe.to(dtype)
    plain.to(dtype)
    tol = {} if dtype == torch.float64 else dict(rtol=2e-2, atol=2e-2)
    check_steps(pipe, model, plain, steps=2, batches=(12, 8), dtype=dtype, **tol)


class BNNet(nn.Module):
    """Not a Sequential (traced and cut), with batch norms on both sides of the cut."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
        self.b = nn.Linear(8, 8)
        self.c = nn.Sequential(nn.BatchNorm1d(8), nn.Linear(8, 4))

    def forward(self, x):
        return self.c(torch.tanh(self.b(self.a(x))))


def test_a_traced_pipe_casts_the_buffers_its_stages_hold():
    """Traced stages hold the model's buffers themselves: a cast reaches them (``half()`` too),
    and the cast pipe trains as a pipe of the model cast before."""
    torch.manual_seed(0)
    model = BNNet()
    other = copy.deepcopy(model).half().double()  # the same roundings
    kwargs = dict(chunks=2, devices=["cpu"] * 2, split_points=["b"], checkpoint="always")
    pipe = fastpipe.Pipe(model, example_inputs=torch.randn(4, 8), **kwargs)
    pipe.half()
    assert all(b.dtype == torch.float16 for s in pipe._stages for b in s.module.buffers()
               if b.is_floating_point())
    pipe.to(torch.float64)
    assert all(b.dtype == torch.float64 for s in pipe._stages for b in s.module.buffers()
               if b.is_floating_point())
    reference_pipe = fastpipe.Pipe(other, example_inputs=torch.randn(4, 8, dtype=torch.float64),
                                   **kwargs)
    x, y = torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    for _ in range(2):
        torch.testing.assert_close(pipe.train_step(x, y, nn.MSELoss()),
                                   reference_pipe.train_step(x, y, nn.MSELoss()), rtol=0, atol=0)
    for (name, mine), theirs in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(mine, theirs), name


def test_recomputation_after_a_cast_counts_batch_norm_statistics_once():
    """A cast replaces the running-statistics buffers; a recomputed forward must still leave
    them as the first forward did."""
    stats = {}
    for mode in ("never", "always"):
        torch.manual_seed(0)
        model = bn_mlp()
        pipe = fastpipe.Pipe(model, chunks=3, balance=[3, 3], devices=["cpu"] * 2,
                             checkpoint=mode, schedule="1f1b")
        pipe.to(torch.float64)
        for _ in range(2):
            pipe.train_step(torch.randn(12, 8, dtype=torch.float64),
                            torch.randn(12, 4, dtype=torch.float64), nn.MSELoss())
        stats[mode] = {k: v.clone() for k, v in model.state_dict().items() if "1." in k}
    assert stats["always"]["1.num_batches_tracked"].item() == 6
    for name, value in stats["never"].items():
        torch.testing.assert_close(stats["always"][name], value, rtol=0, atol=0, msg=name)


def test_tied_weights_keep_one_parameter_after_a_cast():
    model = lm()
    plain = copy.deepcopy(model).double()
    pipe = fastpipe.Pipe(model, chunks=4, balance=[2, 2, 2], devices=["cpu"] * 3,
                         schedule="1f1b", checkpoint="always")
    pipe.to(torch.float64)
    assert model[5].weight is model[0].weight and model[0].weight.dtype == torch.float64
    x, y = lm_batch()
    expected_loss, expected = reference(plain, x, y, lm_loss)
    loss = pipe.train_step(x, y, lm_loss)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
    assert_same_grads(grads_of(model), expected)


@pytest.mark.cuda
def test_tied_weights_across_devices_after_a_cast():
    model = lm()
    plain = copy.deepcopy(model).double()
    pipe = fastpipe.Pipe(model, chunks=4, balance=[2, 2, 2], devices=["cuda:0", "cpu", "cpu"],
                         schedule="1f1b")
    with pytest.raises(TypeError, match="cannot be moved"):
        pipe.cpu()  # one stage is on the GPU
    pipe.to(torch.float64)
    assert model[0].weight.device.type == "cuda" and model[0].weight.dtype == torch.float64
    x, y = lm_batch()
    expected_loss, expected = reference(plain, x, y, lm_loss)
    loss = pipe.train_step(x.cuda(), y, lm_loss)
    torch.testing.assert_close(loss.cpu(), expected_loss, rtol=1e-5, atol=1e-6)
    assert_same_grads(grads_of(model), expected, rtol=1e-4, atol=1e-5)


def test_a_compiled_pipe_recompiles_after_a_cast():
    model = mlp(depth=6)
    plain = copy.deepcopy(model).double()
    pipe = fastpipe.Pipe(model, chunks=2, balance=[3, 3], devices=["cpu"] * 2,
                         compile=AOT_EAGER)
    check_steps(pipe, model, copy.deepcopy(plain).float(), steps=1)
    pipe.to(torch.float64)
    check_steps(pipe, model, plain, steps=1, dtype=torch.float64)


# ------------------------------------------------------------------------ compiled models
def round_trip(pipe: nn.Module, model_fn) -> None:
    """The pipe's state dict loads into the plain (uncompiled) model, and the plain model's
    into the pipe, both strictly, under the same names."""
    plain = model_fn()
    names = [n for n, _ in plain.named_parameters()]
    assert [n for n, _ in pipe.named_parameters()] == names
    assert list(pipe.state_dict()) == list(plain.state_dict())
    plain.load_state_dict(pipe.state_dict())
    for (name, mine), theirs in zip(pipe.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(mine, theirs), name
    other = model_fn()
    pipe.load_state_dict(other.state_dict())
    for (name, mine), theirs in zip(pipe.state_dict().items(), other.state_dict().values()):
        assert torch.equal(mine, theirs), name


@pytest.mark.parametrize("door", FRONT_DOORS)
def test_a_model_in_torch_compile_is_compiled_stage_by_stage_with_its_options(door):
    counting = Counting()
    model = mlp(depth=6)
    plain = copy.deepcopy(model)
    compiled = torch.compile(model, backend=counting)
    pipe = FRONT_DOORS[door](compiled, balance=[3, 3], devices=["cpu"] * 2, chunks=2,
                             checkpoint="never")
    assert pipe.module is model and [s.compiled for s in pipe._stages] == [True, True]
    round_trip(pipe, lambda: mlp(depth=6))
    pipe.load_state_dict(plain.state_dict())
    check_steps(pipe, model, plain, steps=1, batches=(8,))
    assert counting.graphs == 2  # one graph per stage, by the model's own backend
    assert isinstance(compiled._orig_mod, nn.Sequential)  # the user's wrapper is untouched


def nested_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(),
                         nn.Sequential(nn.Linear(8, 8), nn.ReLU()), nn.Linear(8, 4))


@pytest.mark.parametrize("stages_compiled", [False, True])
def test_compiled_submodules_keep_plain_names_and_their_compilation(stages_compiled):
    own, piped = Counting(), Counting()
    model = nested_model()
    plain = copy.deepcopy(model)
    model[0] = torch.compile(model[0], backend=own)
    model[2][0] = torch.compile(model[2][0], backend=own)
    assert "0._orig_mod.weight" in model.state_dict()
    pipe = fastpipe.Pipe(model, balance=[2, 2], devices=["cpu"] * 2, chunks=2,
                         checkpoint="never",
                         compile={"backend": piped} if stages_compiled else False)
    assert type(model[0]) is nn.Linear and type(model[2][0]) is nn.Linear
    round_trip(pipe, nested_model)
    pipe.load_state_dict(plain.state_dict())
    check_steps(pipe, model, plain, steps=1, batches=(8,))
    if stages_compiled:  # compiled as part of their stages, by the pipe's compiler
        assert (own.graphs, piped.graphs) == (0, 2)
        assert model[0]._compiled_call_impl is None
    else:  # compiled in place, alone, by their own compiler
        assert (own.graphs, piped.graphs) == (2, 0)
        assert [s.compiled for s in pipe._stages] == [False, False]


def test_the_wrappers_are_put_back_when_construction_fails():
    model = nested_model()
    wrapper = torch.compile(model[2], backend="eager")
    model[2] = wrapper
    names = list(model.state_dict())
    with pytest.raises(ValueError, match="balance"):
        fastpipe.Pipe(model, balance=[9], devices=["cpu"], compile=AOT_EAGER)
    assert model[2] is wrapper and list(model.state_dict()) == names


@pytest.mark.parametrize("value,error,match", [
    (1, TypeError, "compile must be True, False or a dict of torch.compile options"),
    ("inductor", TypeError, "compile must be True, False or a dict"),
    ({"bakend": "eager"}, TypeError, "compile=.*'bakend', which is not an option of "
                                     "torch.compile; use .*backend"),
    ({"backend": "no-such-backend"}, ValueError, "compile=.*refused by torch.compile.*"
                                                 "no-such-backend"),
    ({"mode": "fastest"}, ValueError, "compile=.*refused by torch.compile.*fastest"),
    ({"mode": "max-autotune", "options": {"trace.enabled": True}}, ValueError,
     "compile=.*refused by torch.compile.*mode or options"),
])
def test_a_bad_compile_value_is_refused_before_any_work(value, error, match):
    model = mlp()
    state = copy.deepcopy(model.state_dict())
    with pytest.raises(error, match=match):
        fastpipe.Pipe(model, balance=[3, 3], devices=["cpu"] * 2, compile=value)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("kwargs,match", [
    (dict(checkpoint="selective"), "compile with checkpoint='selective' is not supported"),
    (dict(cuda_graphs=True), "compile with cuda_graphs=True is not supported.*reduce-overhead"),
])
def test_modes_that_cannot_run_compiled_are_refused_at_construction(kwargs, match):
    with pytest.raises(NotImplementedError, match=match):
        fastpipe.Pipe(mlp(), balance=[3, 3], devices=["cpu"] * 2, compile=True, **kwargs)


# ------------------------------------------------------------------------ compile=True exact
EXACT = [("gpipe", 1, "except_last"), ("1f1b", 1, "always"), ("1f1b", 1, "offload"),
         ("interleaved", 2, "except_last"), ("zb-h1", 1, "always"), ("zbv", 2, "offload")]
ALL_SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("looped-bfs", 2),
                 ("zb-h1", 1), ("zbv", 2), ("dualpipev", 2)]
ALL_MODES = ["never", "except_last", "always", "offload"]


def check_compiled_schedule(schedule, virtual, checkpoint):
    model = mlp(depth=8)
    plain = copy.deepcopy(model)
    pipe = fastpipe.Pipe(model, chunks=4, devices=["cpu"] * 2, schedule=schedule,
                         checkpoint=checkpoint, virtual_stages=virtual, compile=AOT_EAGER)
    assert all(s.compiled for s in pipe._stages)
    check_steps(pipe, model, plain)  # uneven micro-batches, then even ones (a recompile)


@pytest.mark.parametrize("schedule,virtual,checkpoint", EXACT)
def test_compiled_stages_give_the_plain_models_loss_and_gradients(schedule, virtual,
                                                                   checkpoint):
    check_compiled_schedule(schedule, virtual, checkpoint)


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint", ALL_MODES)
@pytest.mark.parametrize("schedule,virtual", ALL_SCHEDULES)
def test_compiled_stages_are_exact_on_every_schedule_and_mode(schedule, virtual, checkpoint):
    check_compiled_schedule(schedule, virtual, checkpoint)


def test_compiled_forward_backward_and_evaluate():
    model = mlp(depth=6)
    plain = copy.deepcopy(model)
    pipe = fastpipe.Pipe(model, chunks=4, balance=[3, 3], devices=["cpu"] * 2,
                         checkpoint="always", compile=AOT_EAGER)
    x, y = torch.randn(12, 8), torch.randn(12, 4)
    nn.MSELoss()(pipe(x), y).backward()
    _, expected = reference(plain, x, y, nn.MSELoss())
    assert_same_grads(grads_of(model), expected)
    torch.testing.assert_close(pipe.evaluate(x), plain.eval()(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", ["tied", "skips", "deferred_batch_norm", "pipedream",
                                  "traced"])
def test_compiled_stages_with_other_policies(case):
    if case == "tied":  # the stages' taps and copies call the compiled module
        model = lm()
        plain = copy.deepcopy(model)
        pipe = fastpipe.Pipe(model, chunks=4, balance=[2, 2, 2], devices=["cpu"] * 3,
                             schedule="zb-h1", checkpoint="except_last", compile=AOT_EAGER)
        x, y = lm_batch()
        expected_loss, expected = reference(plain, x, y, lm_loss)
        torch.testing.assert_close(pipe.train_step(x, y, lm_loss), expected_loss,
                                   rtol=1e-5, atol=1e-6)
        assert_same_grads(grads_of(model), expected)
    elif case == "skips":
        model = model_with_skips()
        pipe = fastpipe.Pipe(model, chunks=3, balance=[2, 3, 3], devices=["cpu"] * 3,
                             schedule="zb-h1", checkpoint="always", compile=AOT_EAGER)
        check_steps(pipe, model, copy.deepcopy(model))
    elif case in ("deferred_batch_norm", "pipedream"):  # compiled pipe == eager pipe
        results = []
        for compile in (False, AOT_EAGER):
            torch.manual_seed(0)
            model = bn_mlp()
            if case == "pipedream":
                pipe = fastpipe.Pipe(model, chunks=4, balance=[2, 2, 2], devices=["cpu"] * 3,
                                     schedule="pipedream", checkpoint="never", compile=compile)
                optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
            else:
                pipe = fastpipe.Pipe(model, chunks=3, balance=[3, 3], devices=["cpu"] * 2,
                                     checkpoint="always", deferred_batch_norm=True,
                                     compile=compile)
                optimizer = None
            for _ in range(2):
                pipe.train_step(torch.randn(12, 8), torch.randn(12, 4), nn.MSELoss(),
                                optimizer=optimizer)
            results.append((model.state_dict(), grads_of(model)))
        for name, value in results[0][0].items():
            torch.testing.assert_close(results[1][0][name], value, msg=name)
        assert_same_grads(results[1][1], results[0][1])
    else:  # any module, traced and cut; names are the module's own
        model = Net()
        plain = copy.deepcopy(model)
        pipe = fastpipe.Pipe(torch.compile(model, backend="aot_eager"), chunks=2,
                             devices=["cpu"] * 2, split_points=["blocks.2"],
                             example_inputs=torch.randn(4, 8))
        assert [n for n, _ in pipe.named_parameters()] == [n for n, _ in
                                                            plain.named_parameters()]
        check_steps(pipe, model, plain, steps=1, batches=(8,))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def test_every_stage_compiles_its_own_code():
    """Ten stages of different layers: ten graphs, none left eager by a shared limit."""
    counting = Counting()
    widths = [8 + i for i in range(11)]
    model = nn.Sequential(*[nn.Linear(widths[i], widths[i + 1]) for i in range(10)])
    pipe = fastpipe.Pipe(model, chunks=2, balance=[1] * 10, devices=["cpu"] * 10,
                         checkpoint="never", compile={"backend": counting})
    pipe.train_step(torch.randn(4, 8), torch.randn(4, 18), nn.MSELoss())
    assert counting.graphs == 10


# ------------------------------------------------------------------------ random numbers
def dropout_runs(compile, modes, seed=1234):
    torch.manual_seed(0)  # the same model and batch in every call
    base = dropout_mlp()
    x, y = torch.randn(12, 8), torch.randn(12, 4)
    out = {}
    for mode in modes:
        model = copy.deepcopy(base)
        pipe = fastpipe.Pipe(model, chunks=4, balance=[2, 3, 2], devices=["cpu"] * 3,
                             checkpoint=mode, schedule="1f1b", compile=compile)
        torch.manual_seed(seed)
        loss = pipe.train_step(x, y, nn.MSELoss())
        assert [s.rng.stochastic for s in pipe._stages] == [True, True, False]
        out[mode] = (loss, grads_of(model))
    return out


def assert_same_run(a, b):
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=0)
    assert_same_grads(a[1], b[1], rtol=1e-6, atol=1e-7)


def test_compiled_dropout_is_replayed_in_recomputation_and_draws_eagers_numbers():
    """aot_eager runs eager's random ops: the same masks as the eager pipe, and recomputed
    forwards replay them."""
    compiled = dropout_runs(AOT_EAGER, ["never", "except_last"])
    eager = dropout_runs(False, ["never"])
    for mode, run in compiled.items():
        assert_same_run(run, compiled["never"])
    assert_same_run(compiled["never"], eager["never"])


def test_compiling_leaves_the_global_generator_as_an_eager_step_does():
    """A compile saves and restores the global generator; stages replaying their random numbers
    seed it meanwhile on other threads: neither may undo the other's work."""
    after = []
    for compile in (False, AOT_EAGER, AOT_EAGER):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8), nn.Tanh(),
                              nn.Dropout(0.5), nn.Linear(8, 8), nn.Linear(8, 4))
        pipe = fastpipe.Pipe(model, chunks=4, balance=[2, 2, 2, 1], devices=["cpu"] * 4,
                             checkpoint="always", compile=compile, cpu_workers=4)
        torch.manual_seed(1)
        losses = [pipe.train_step(torch.randn(12, 8), torch.randn(12, 4), nn.MSELoss())
                  for _ in range(2)]
        after.append((losses, torch.randn(3)))
    for losses, draw in after[1:]:
        torch.testing.assert_close(losses, after[0][0], rtol=0, atol=0)
        assert torch.equal(draw, after[0][1])


def test_inductor_stages_give_the_plain_models_loss_and_gradients():
    """The one test of the default compiler (inductor compiles C++ on the CPU: seconds)."""
    model = mlp(depth=4)
    plain = copy.deepcopy(model)
    pipe = fastpipe.Pipe(model, chunks=2, balance=[2, 2], devices=["cpu"] * 2,
                         checkpoint="never", compile=True)
    check_steps(pipe, model, plain, steps=1, batches=(8,))


@pytest.mark.slow
def test_inductor_dropout_is_replayed_and_fallback_random_draws_eagers_numbers():
    """Inductor draws its own random numbers (not eager's), replayed exactly in
    recomputation; with its fallback_random option it draws eager's."""
    compiled = dropout_runs(True, ["never", "always"])
    assert_same_run(compiled["always"], compiled["never"])
    eager = dropout_runs(False, ["never"])
    assert not torch.equal(compiled["never"][0], eager["never"][0])
    fallback = dropout_runs({"options": {"fallback_random": True}}, ["always"])
    assert_same_run(fallback["always"], eager["never"])


# ------------------------------------------------------------------------ DistributedPipe
def test_distributed_pipe_casts_and_compiles_on_two_ranks():
    results = assert_all_ok(launch("several", 2, limit=180, script="cast_compile_cases.py",
                                   args={"cases": [
                                       ["casting", {}],
                                       ["compiling", {"schedules": [["zb-h1", "always"]]}],
                                       ["compile_errors", {}]]}))
    for rank, result in enumerate(results):
        assert result["casting"]["refused"] == ["TypeError"] * 8
        assert result["compile_errors"]["errors"] == ["TypeError", "TypeError", "ValueError",
                                                      "NotImplementedError"]
        names = result["compiling"]["names"]
        assert names and all("_orig_mod" not in n for n in names)
    assert results[0]["compiling"]["names"][0] == "0.0.weight"


@pytest.mark.slow
@pytest.mark.parametrize("p2p", ["tagged", "grouped"])
def test_distributed_pipe_compiled_on_more_schedules(p2p):
    assert_all_ok(launch("several", 2, limit=300, script="cast_compile_cases.py", p2p=p2p,
                         args={"cases": [
                             ["casting", {"schedule": "gpipe"}],
                             ["compiling", {"schedules": [["1f1b", "except_last"],
                                                          ["gpipe", "offload"],
                                                          ["zb-h1", "never"]]}]]}))
