"""What keeps a traced pipe's construction short: the module is traced once (train mode), for
every stage; the eval graph is traced on first use, once for all the stages, outside the step,
and then equals the plain model in eval mode, at any batch size and sequence length, on every
layout (meta-device models materialised after the trace included)."""
import copy
import threading

import pytest
import torch
from torch import nn

import fastpipe
from dist_launch import assert_all_ok, launch
from fastpipe import materialise, tracing

transformers = pytest.importorskip("transformers")
transformers.utils.logging.set_verbosity_error()

VOCAB, SEQ = 50, 8
CONFIG = dict(n_layer=4, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=16, use_cache=False,
              bos_token_id=0, eos_token_id=0, resid_pdrop=0.2, embd_pdrop=0.2, attn_pdrop=0.2)


def gpt2(device: str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(**CONFIG))


def batch(size: int = 6, seq: int = SEQ, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (size, seq), generator=generator)
    mask = torch.ones(size, seq, dtype=torch.long)
    mask[0, seq - 3:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def close(got: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def plain_eval(model: nn.Module, inputs) -> torch.Tensor:
    model = copy.deepcopy(model).eval()
    with torch.no_grad():
        return model(**inputs).logits


@pytest.fixture
def traces(monkeypatch):
    """Every trace of a module: the name of the thread that ran it."""
    threads = []
    real = tracing.trace

    def counted(module, example):
        threads.append(threading.current_thread().name)
        return real(module, example)

    monkeypatch.setattr(tracing, "trace", counted)
    return threads


def traced_modes(pipe):
    return [part.traced_modes for stage in pipe._stages for part in stage.module
            if isinstance(part, tracing.GraphStage)]


def test_construction_traces_once_and_the_first_eval_once_more(traces):
    model = gpt2()
    expected = plain_eval(model, batch())
    pipe = fastpipe.Pipe(model, chunks=2, devices=["cpu"] * 3, split_points="auto",
                         example_inputs=batch())
    assert len(traces) == 1  # train mode, for the three stages
    assert traced_modes(pipe) == [(True,)] * 3
    pipe.eval()  # the eval graph: here, on the caller's thread, before any step
    assert len(traces) == 2 and traces[-1] == threading.current_thread().name
    assert traced_modes(pipe) == [(True, False)] * 3
    with torch.no_grad():
        close(pipe(**batch()).logits, expected)
    close(pipe.evaluate(**batch()).logits, expected)
    pipe.train()
    pipe.evaluate(**batch())
    assert len(traces) == 2  # never again


def test_evaluate_traces_the_eval_graph_and_restores_every_mode(traces):
    model = gpt2()
    pipe = fastpipe.Pipe(model, chunks=3, devices=["cpu"] * 2, split_points="auto",
                         example_inputs=batch())
    out = pipe.evaluate(**batch(size=5, seq=6))  # another batch size and sequence length
    close(out.logits, plain_eval(model, batch(size=5, seq=6)))
    assert len(traces) == 2
    assert all(m.training for stage in pipe._stages for m in stage.module.modules())
    pipe.eval()
    assert not any(m.training for stage in pipe._stages for m in stage.module.modules())


def test_a_module_switched_to_eval_by_itself_gets_its_graph_before_the_step(traces):
    """``model.eval()`` (not ``pipe.eval()``) reaches the stages only through their owner: the
    graph is traced when the step begins, on the caller's thread, not in a stage's worker."""
    model = gpt2()
    pipe = fastpipe.Pipe(model, chunks=2, devices=["cpu"] * 2, split_points="auto",
                         example_inputs=batch(), schedule="1f1b")
    model.eval()
    with torch.no_grad():
        out = pipe(**batch(size=4))
    assert traces == [threading.current_thread().name] * 2
    close(out.logits, plain_eval(model, batch(size=4)))


def test_training_after_evaluating_stays_exact_and_shares_the_tensors():
    model, plain = gpt2(), gpt2()
    for m in (model, plain):
        for module in m.modules():
            if isinstance(module, nn.Dropout):
                module.p = 0.0
    pipe = fastpipe.Pipe(model, chunks=2, devices=["cpu"] * 2, split_points="auto",
                         example_inputs=batch())
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.5)
    pipe.evaluate(**batch())
    inputs, targets = batch(), batch()["input_ids"]

    def lm_loss(out, y):
        return nn.functional.cross_entropy(out.logits.flatten(0, 1), y.flatten())

    pipe.train_step(inputs, targets, lm_loss, optimizer=optimizer)
    loss = lm_loss(plain(**inputs), targets)
    loss.backward()
    torch.optim.SGD(plain.parameters(), lr=0.5).step()
    # the eval graph reads the updated weights: the same tensors as the train graph
    close(pipe.evaluate(**inputs).logits, plain_eval(plain, inputs))
    for stage in pipe._stages:
        part = stage.module[0]
        train = {id(t) for t in [*part.train_graph.parameters(), *part.train_graph.buffers()]}
        assert {id(t) for t in part.eval_graph.parameters()} <= train


def test_split_stages_run_eval_mode_on_their_first_forward(traces):
    model = gpt2()
    stages = tracing.split(model, ["transformer.h.2"], batch()).stages
    model.eval()  # the stages follow the module's mode
    with torch.no_grad():
        out = stages(batch(size=3))
    assert len(traces) == 2
    close(out.logits, plain_eval(model, batch(size=3)))


def test_a_meta_model_materialised_in_part_traces_eval_on_meta_twins(traces):
    """The module's tensors changed since the trace (one stage's materialised from the meta
    device, as on a rank): the eval graph is traced as the train graph was, on meta, and reads
    the stage's real tensors."""
    plain = gpt2().eval()
    expected = tracing.split(plain, ["transformer.h.2"], batch()).stages[0]
    model = gpt2("meta")
    stages = tracing.split(model, ["transformer.h.2"], batch()).stages
    materialise.materialise_used(model, [stages[0]], torch.device("cpu"), model._init_weights)
    tracing.local_view(model, stages[0]).load_state_dict(plain.state_dict(), strict=False)
    assert any(t.is_meta for t in model.parameters())  # the other stage's
    model.eval()  # the stages follow the module's mode
    stages[0].eval()  # traces the eval graph
    assert len(traces) == 3  # the plain model's split, the meta model's, its eval graph
    assert not any(t.is_meta for t in stages[0].eval_graph.parameters())
    with torch.no_grad():
        got, want = stages[0](batch(size=4, seq=5)), expected(batch(size=4, seq=5))
    assert len(got) == len(want)
    for a, b in zip(got, want):  # the carry: hidden states, masks, positions
        if isinstance(a, torch.Tensor):
            close(a, b)
        else:
            assert a == b


def test_stages_moved_after_the_trace_evaluate_where_they_are(traces):
    """Stages moved after the trace (here to the meta device): their eval graph, traced then,
    reads the stages' tensors and creates its constants on their device."""
    model = gpt2()
    stages = tracing.split(model, ["transformer.h.2"], batch()).stages
    stages.to("meta")
    model.eval()
    stages.eval()
    assert len(traces) == 2
    assert "device(type='cpu')" not in stages[0].eval_graph.code
    assert all(t.is_meta for t in stages[0].eval_graph.parameters())
    out = stages({k: v.to("meta") for k, v in batch(size=3).items()})
    assert out.logits.device.type == "meta" and out.logits.shape == (3, SEQ, VOCAB)


class TrainOnly(nn.Module):
    """Traceable in train mode; its eval mode branches on data."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        if not self.training and x.sum() > 0:
            return self.b(self.a(x))
        return self.b(self.a(x) + 1)


def test_an_eval_mode_that_cannot_be_traced_fails_when_first_used_and_training_goes_on():
    pipe = fastpipe.Pipe(TrainOnly(), chunks=2, devices=["cpu"] * 2, split_points=["b"],
                         example_inputs=torch.randn(4, 4))
    with pytest.raises(tracing.TraceError, match="could not trace TrainOnly.*in eval mode"):
        pipe.eval()
    pipe.train()
    pipe.train_step(torch.randn(4, 4), torch.randn(4, 4), nn.functional.mse_loss)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))

    def forward(self, x):
        return self.body(x)


def test_a_batch_norm_model_evaluates_with_the_statistics_training_left():
    net = Net()
    pipe = fastpipe.Pipe(net, chunks=2, devices=["cpu"] * 2, split_points=["body.2"],
                         example_inputs=torch.randn(6, 4))
    x = torch.randn(6, 4)
    pipe.train_step(x, torch.randn(6, 2), nn.functional.mse_loss)
    assert not torch.equal(net.body[1].running_mean, torch.zeros(8))
    plain = copy.deepcopy(net).eval()  # the statistics the step left
    with torch.no_grad():
        close(pipe.evaluate(x), plain(x))


def test_a_cast_after_the_eval_trace_leaves_both_graphs_reading_the_same_buffers():
    """A cast replaces every module's buffers on its own: the eval graph is pointed back at the
    train graph's, so the statistics training updates are those evaluation reads."""
    net = Net()
    stages = tracing.split(net, ["body.2"], torch.randn(6, 4)).stages
    stages.eval()
    stages.double()
    evaluated = {id(b) for b in stages[0].eval_graph.buffers()}  # the batch norm's statistics
    assert evaluated and evaluated <= {id(b) for b in stages[0].train_graph.buffers()}


@pytest.mark.filterwarnings("ignore::FutureWarning")  # torch's pytree, copying graphs
def test_a_copied_stage_traces_its_own_eval_graph_on_its_own_tensors():
    model = gpt2()
    stages = tracing.split(model, ["transformer.h.2"], batch()).stages
    copied = copy.deepcopy(stages)
    copied.eval()
    first = next(copied[0].eval_graph.parameters())
    assert any(first is p for p in copied[0].train_graph.parameters())
    assert not any(first is p for p in model.parameters())


def test_a_stage_needs_its_eval_graph_or_where_to_trace_it_from():
    gm = tracing._stage_graph(*_traced_first_stage())
    with pytest.raises(TypeError, match="eval graph"):
        tracing.GraphStage({True: gm}, first=True, in_specs={}, out_specs=None,
                           owner=nn.Module())


def _traced_first_stage():
    traced = tracing.trace_mode(gpt2(), tracing.as_call(batch()), ["transformer.h.2"], True)
    return traced.gm, 0, traced.stage_of, traced.carries, traced.output


@pytest.mark.parametrize("meta", [False, True])
def test_every_rank_traces_its_eval_graph_before_the_step(meta):
    results = assert_all_ok(launch("eval_traced_lazily", 2, limit=240, args={"meta": meta},
                                   script="tracing_cases.py"))
    assert all(r["construction"] == 1 and r["after_eval"] == 2 for r in results)
    assert results[1]["evaluate"] <= 1e-6  # the last stage's rank holds the output
