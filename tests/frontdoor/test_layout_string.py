"""``layout=``: Megatron layout strings on the front doors, exact against the plain model (a
traced GPT-2, with virtual stages too; an nn.Sequential; GPipe; DistributedPipe across 2 gloo
ranks), and every wrong layout a typed error before any work."""
import copy

import pytest
import torch
from torch import nn

import fastpipe
from fastpipe import tracing
from fastpipe.frontdoor import OnDevices, OnRanks
from fastpipe.frontdoor.layout_option import resolve_layout
from fastpipe.frontdoor.layout_string import LayoutStringError

from dist_launch import assert_all_ok, launch

TOL = dict(rtol=1e-5, atol=1e-6)
VOCAB, SEQ = 50, 8


def gpt2():
    transformers = pytest.importorskip("transformers")
    transformers.utils.logging.set_verbosity_error()
    config = transformers.GPT2Config(
        n_layer=4, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=16, use_cache=False,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def batch(size=6):
    ids = torch.randint(0, VOCAB, (size, SEQ), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids}, ids


def lm_loss(output, targets):
    return nn.functional.cross_entropy(output.logits.flatten(0, 1), targets.flatten())


def assert_exact(pipe, model, plain, inputs, targets, loss_fn):
    plain.zero_grad(set_to_none=True)
    expected = loss_fn(plain(**inputs) if isinstance(inputs, dict) else plain(inputs), targets)
    expected.backward()
    loss = pipe.train_step(inputs, targets, loss_fn)
    torch.testing.assert_close(loss, expected.detach(), **TOL)
    for (name, p), (_, q) in zip(model.named_parameters(), plain.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL, msg=lambda m: f"{name}: {m}")


def resolve(layout, module, where, **given):
    args = dict(balance=None, split_points=None, virtual_stages=None, schedule="1f1b")
    return resolve_layout(layout, module, where, **{**args, **given})


# ---------------------------------------------------------------- a traced GPT-2
@pytest.mark.parametrize("layout,devices,schedule,points,virtual", [
    # E alone, L alone; four stages on two devices: two virtual stages each, in a loop
    ("E|t*2|t*2|L", 2, "interleaved",
     ["transformer.h.0", "transformer.h.2", "transformer.ln_f"], 2),
    pytest.param("E,t|t*2|t,L", 3, "1f1b", ["transformer.h.1", "transformer.h.3"], 1,
                 marks=pytest.mark.slow),
    pytest.param("Et|t|t|tL", 2, "looped-bfs",
                 ["transformer.h.1", "transformer.h.2", "transformer.h.3"], 2,
                 marks=pytest.mark.slow),
])
def test_a_traced_gpt2_cut_by_a_layout_trains_exactly(layout, devices, schedule, points,
                                                      virtual):
    model, inputs_targets = gpt2(), batch()
    plain = copy.deepcopy(model)
    cut = resolve(layout, model, OnDevices(["cpu"] * devices), schedule=schedule)
    assert (cut.split_points, cut.balance, cut.virtual_stages) == (points, None, virtual)
    pipe = fastpipe.Pipe(model, chunks=2, devices=["cpu"] * devices, schedule=schedule,
                         layout=layout, example_inputs=inputs_targets[0])
    assert pipe.layout.virtual_stages == virtual and len(pipe.partitions) == len(points) + 1
    assert_exact(pipe, model, plain, *inputs_targets, lm_loss)


def test_without_devices_a_layout_takes_one_device_per_stage():
    cut = resolve("E,t*2|t*2,L", gpt2(), OnDevices(None))
    expected = ["cuda:0", "cuda:1"] if torch.cuda.device_count() >= 2 else ["cpu", "cpu"]
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip("one CUDA device: the layout needs two")
    assert cut.where.devices == expected and cut.virtual_stages == 1
    cut = resolve("Et|t|t|tL", gpt2(), OnDevices(None), schedule="zbv")  # zbv: 2 per device
    assert len(cut.where.devices) == 2 and cut.virtual_stages == 2


# ---------------------------------------------------------------- nn.Sequential, GPipe
def sequential():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.ReLU(),
                         nn.Linear(8, 3))


def mse(out, y):
    return nn.functional.mse_loss(out, y)


@pytest.mark.parametrize("layout,devices,schedule,balance", [
    ("t*2|t*3", 2, "1f1b", (2, 3)),
    ("Et|t|t|L", 2, "interleaved", (2, 1, 1, 1)),  # E and L: the first and the last layer
    ("E,t,t|(t|)*1,L", 3, "gpipe", (3, 1, 1)),
])
def test_a_sequential_cut_by_a_layout_trains_exactly(layout, devices, schedule, balance):
    model = sequential()
    plain = copy.deepcopy(model)
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    pipe = fastpipe.Pipe(model, chunks=4, devices=["cpu"] * devices, schedule=schedule,
                         layout=layout)
    assert pipe.balance == balance and pipe.layout.virtual_stages == len(balance) // devices
    assert_exact(pipe, model, plain, x, y, mse)


def test_gpipe_takes_a_layout_as_its_balance():
    model = sequential()
    plain = copy.deepcopy(model)
    pipe = fastpipe.GPipe(model, devices=["cpu", "cpu"], chunks=2, layout="t,t|t*3")
    assert pipe.balance == [2, 3]  # a list, as torchgpipe's
    x, y = torch.randn(4, 6), torch.randn(4, 3)
    assert_exact(pipe, model, plain, x, y, mse)


# ---------------------------------------------------------------- errors, before any work
@pytest.fixture
def no_tracing(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("traced before the arguments were checked")
    monkeypatch.setattr(tracing, "trace", refuse)


@pytest.mark.parametrize("layout,kwargs,error,match", [
    ("E,t*2|t*2,L", dict(balance=[1, 1]), ValueError, "layout= and balance="),
    ("E,t*2|t*2,L", dict(split_points=["transformer.h.2"]), ValueError,
     "layout= and split_points="),
    ("E,t*2|t*3,L", {}, LayoutStringError, "column 7 \\(stage 1\\): t number 5, but "
                                            "transformer.h has 4 blocks"),
    ("E,t*2|t,L", {}, LayoutStringError, "column 9 \\(stage 1\\): L after 3 t"),
    ("E,t*2|x,L", {}, LayoutStringError, "column 7 \\(stage 1\\): unknown letter 'x'"),
    ("E,t*2||t*2,L", {}, NotImplementedError, "does not support empty stages"),
    ("E,t*4|m|L", {}, NotImplementedError, "'m'"),
    ("E,t|t|t*2,L", {}, ValueError, "has 3 stages but the pipeline has 2 devices"),
    ("E,t|t|t|t,L", dict(virtual_stages=1), ValueError, "2 per device, but virtual_stages=1"),
    ("E,t*2|t*2,L", dict(devices="cpu"), TypeError, "devices must be a list"),
    (["E", "t"], {}, TypeError, "layout must be a string"),
])
def test_a_wrong_layout_is_a_typed_error_before_any_work(no_tracing, layout, kwargs, error,
                                                         match):
    model = gpt2()
    before = copy.deepcopy(model.state_dict())
    options = {"devices": ["cpu", "cpu"], "schedule": "interleaved", **kwargs}
    with pytest.raises(error, match=match):
        fastpipe.Pipe(model, layout=layout, example_inputs=batch()[0], **options)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_sequential_layout_of_the_wrong_length_names_the_column():
    with pytest.raises(LayoutStringError, match="column 7 \\(stage 1\\): letter number 6"):
        fastpipe.Pipe(sequential(), devices=["cpu", "cpu"], layout="t*3|ttt")
    with pytest.raises(LayoutStringError, match="ends after 4 letters") as info:
        fastpipe.Pipe(sequential(), devices=["cpu", "cpu"], layout="t*2|tt")
    assert (info.value.column, info.value.stage) == (7, 1)


def test_l_alone_needs_a_module_after_the_blocks():
    class Blocks(nn.Module):  # nothing registered after the blocks: L cannot begin a stage
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(4, 4)
            self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

        def forward(self, x):
            x = self.embed(x)
            for block in self.blocks:
                x = block(x)
            return x.sum(dim=1)

    with pytest.raises(LayoutStringError, match="no submodule after blocks"):
        resolve("Et*2|L", Blocks(), OnDevices(["cpu"] * 2))
    assert resolve("Et|tL", Blocks(), OnDevices(["cpu"] * 2)).split_points == ["blocks.1"]


# ---------------------------------------------------------------- DistributedPipe
def test_distributed_layout_arguments_follow_the_ranks():
    cut = resolve("E,t|t|t|t,L", gpt2(), OnRanks([0, 1]), schedule="interleaved")
    assert cut.virtual_stages == 2 and cut.where.ranks == (0, 1)
    assert cut.split_points == ["transformer.h.1", "transformer.h.2", "transformer.h.3"]
    factories = [lambda: nn.Linear(4, 4)] * 5
    assert resolve("t*2|t*3", factories, OnRanks([0, 1])).balance == [2, 3]
    with pytest.raises(ValueError, match="has 3 stages but the pipeline has 2 ranks"):
        resolve("t|t*2|t*2", factories, OnRanks([0, 1]))
    with pytest.raises(ValueError, match="layout= and balance="):
        resolve("t*2|t*3", factories, OnRanks([0, 1]), balance=[2, 3])


@pytest.mark.slow
def test_distributed_pipes_cut_by_layouts_train_exactly_across_two_ranks():
    pytest.importorskip("transformers")
    results = assert_all_ok(launch("layouts", 2, limit=240, script="layout_string_cases.py"))
    assert [r["balance"] for r in results] == [[2, 2, 2, 2], [2, 2, 2, 2]]
    first, last = (r["names"] for r in results)
    assert "transformer.h.0.attn.c_attn.weight" in first and "transformer.ln_f.weight" in last
    assert "transformer.h.3.attn.c_attn.weight" in last  # the fourth stage: on rank 1
