"""Models whose trace holds for one input shape (a Mamba: ``torch.export`` specialises its
sequence length), hybrid layer lists (a Jamba: Mamba and attention blocks) and image inputs
(traced with their sizes fixed): a new shape is traced again once, with one warning, and runs
exactly; ``split_points='auto'`` cuts a list of mixed blocks; a stage given a shape no trace
of its process takes says what to do."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import fastpipe
from dist_launch import assert_all_ok, launch
from fastpipe import tracing
from fastpipe.split_points import auto_split_points, repeated_blocks

transformers = pytest.importorskip("transformers")
transformers.utils.logging.set_verbosity_error()

TOL = dict(rtol=1e-5, atol=1e-6)
VOCAB = 64


def mamba() -> nn.Module:
    config = transformers.MambaConfig(hidden_size=32, state_size=8, num_hidden_layers=4,
                                      vocab_size=VOCAB, use_cache=False, expand=2, conv_kernel=4)
    torch.manual_seed(0)
    return transformers.MambaForCausalLM(config)


def jamba() -> nn.Module:
    config = transformers.JambaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, use_cache=False, num_experts=4,
        num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1,
        attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8, mamba_d_conv=4,
        mamba_expand=2, mamba_dt_rank=4, use_mamba_kernels=False, output_router_logits=True,
        router_aux_loss_coef=0.1)
    torch.manual_seed(0)
    return transformers.JambaForCausalLM(config)


def batch(seq: int, size: int = 4, seed: int = 1) -> dict:
    generator = torch.Generator().manual_seed(seed + seq)
    ids = torch.randint(0, VOCAB, (size, seq), generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


@pytest.fixture
def traces(monkeypatch):
    """Every trace of a module, counted."""
    found = []
    real = tracing.trace

    def counted(module, example):
        found.append(example)
        return real(module, example)

    monkeypatch.setattr(tracing, "trace", counted)
    return found


def plain_step(model: nn.Module, inputs: dict) -> tuple:
    model.zero_grad(set_to_none=True)
    loss = model(**inputs).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_grads(model: nn.Module, expected: dict) -> None:
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], **TOL, msg=lambda m: f"{name}: {m}")


def test_a_mamba_batch_of_another_length_is_traced_again_once_and_trains_exactly(traces):
    model, plain = mamba(), mamba()
    pipe = fastpipe.Pipe(model, chunks=2, devices=["cpu"] * 2, split_points="auto",
                         example_inputs=batch(16))
    assert len(traces) == 1
    with pytest.warns(tracing.RetraceWarning, match=r"attention_mask.size\(\)\[1\] == 16"):
        loss = pipe.train_step(batch(12))
    expected_loss, expected = plain_step(plain, batch(12))
    torch.testing.assert_close(loss, expected_loss, **TOL)
    assert_grads(model, expected)
    assert len(traces) == 2 and traces[-1].kwargs["input_ids"].shape[1] == 12
    with warnings.catch_warnings():
        warnings.simplefilter("error", tracing.RetraceWarning)  # kept: no new trace, no warning
        for seq in (12, 16, 12):
            model.zero_grad(set_to_none=True)
            loss = pipe.train_step(batch(seq, seed=seq))
            expected_loss, expected = plain_step(plain, batch(seq, seed=seq))
            torch.testing.assert_close(loss, expected_loss, **TOL)
            assert_grads(model, expected)
    assert len(traces) == 2
    got = pipe.evaluate(**batch(9))  # eval mode (warned once already): entering it traces
    lengths = [t.kwargs["input_ids"].shape[1] for t in traces]  # the example's, then this one
    assert lengths == [16, 12, 16, 9]
    with torch.no_grad():
        torch.testing.assert_close(got.logits, plain.eval()(**batch(9)).logits, **TOL)


def test_a_stage_given_a_shape_no_trace_of_its_process_takes_says_to_pass_the_batch():
    """As on a rank given no inputs: the first stage's process traced the new length, this
    one did not (its own split of the model), and a carry of that length reaches it."""
    model = mamba()
    here = tracing.split(model, ["backbone.layers.2"], batch(16)).stages
    there = tracing.split(model, ["backbone.layers.2"], batch(16)).stages
    with pytest.warns(tracing.RetraceWarning):
        carry = there[0](batch(12))
    with pytest.raises(ValueError, match="stage 1 received a carry.*pass the batch to every"):
        here[1](carry)
    torch.testing.assert_close(there[1](carry).logits, model(**batch(12)).logits, **TOL)


def test_split_points_auto_cuts_a_hybrid_list_of_mamba_and_attention_blocks():
    model = jamba()
    kinds = {type(block).__name__ for block in model.model.layers}
    assert kinds == {"JambaMambaDecoderLayer", "JambaAttentionDecoderLayer"}
    name, blocks = repeated_blocks(model)
    assert name == "model.layers" and len(blocks) == 4
    assert auto_split_points(model, 2) == ["model.layers.2"]


def test_a_jamba_trains_on_its_own_loss_with_an_automatic_split():
    model, plain = jamba(), jamba()
    pipe = fastpipe.Pipe(model, chunks=1, devices=["cpu"] * 2, split_points="auto",
                         example_inputs=batch(8))
    loss = pipe.train_step(batch(8))
    expected_loss, expected = plain_step(plain, batch(8))
    torch.testing.assert_close(loss, expected_loss, **TOL)
    assert_grads(model, expected)


def test_a_list_of_same_type_blocks_still_wins_over_a_mixed_one():
    model = nn.Module()
    model.stem = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))  # mixed, longer
    model.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
    assert repeated_blocks(model)[0] == "blocks"
    assert repeated_blocks(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))[0] == ""


class Convs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Conv2d(3, 3, 3, padding=1) for _ in range(4))
        self.head = nn.Linear(3, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x.mean((2, 3)))


def test_images_are_traced_with_their_sizes_and_another_size_is_traced_again(traces):
    model = Convs()
    plain = copy.deepcopy(model)
    pipe = fastpipe.Pipe(model, chunks=2, devices=["cpu"] * 2, split_points="auto",
                         example_inputs=torch.randn(4, 3, 8, 8))
    first = pipe._stages[0].module[0].train_graph
    shape = next(n.meta["val"].shape for n in first.graph.nodes if n.op == "placeholder")
    assert not isinstance(shape[0], int) and list(shape[1:]) == [3, 8, 8]  # batch dynamic
    x, y = torch.randn(6, 3, 8, 8), torch.randn(6, 5)
    pipe.train_step(x, y, nn.functional.mse_loss)
    assert len(traces) == 1  # another batch size: the same graph
    with pytest.warns(tracing.RetraceWarning, match="size"):
        got = pipe.evaluate(torch.randn(5, 3, 6, 10))
    assert got.shape == (5, 5) and len(traces) == 3  # its eval graph, at 8 x 8 and 6 x 10
    x = torch.randn(4, 3, 6, 10)
    plain.eval()
    torch.testing.assert_close(pipe.evaluate(x), plain(x), **TOL)


def test_on_ranks_given_the_batch_each_traces_a_new_length_before_the_step():
    results = assert_all_ok(launch("retraced_per_shape", 2, limit=300,
                                   script="tracing_cases.py"))
    assert [r["traces"] for r in results] == [2, 2]  # 16 when built, 12 once
