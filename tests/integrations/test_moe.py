"""Mixture-of-experts LMs trained on their own loss (``use_model_loss``), whose loss adds the
router's load-balancing loss: Mixtral and Qwen3-MoE on every schedule, against the plain model
run per micro-batch (the cross-entropy a token mean over the batch, the load-balancing loss
averaged over micro-batches); DeepSeek-V3 (balanced without an auxiliary loss) as a causal LM;
the combined output of ``pipe(...)``; the rule itself on numbers; and on 2 pipeline x 2 data
ranks, where the average runs over every replica's micro-batches."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="needs transformers (the MoE models)")

import fastpipe  # noqa: E402
from dist_launch import assert_all_ok, launch  # noqa: E402
from fastpipe import outputs  # noqa: E402
from fastpipe.model_loss import Bound  # noqa: E402

import moe_models as moe  # noqa: E402  (pytest puts this folder on the path)

TOL = dict(rtol=1e-5, atol=1e-6)
SIZES = [2, 2, 2, 1]  # a batch of 7 in 4 micro-batches
EVERY = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("looped-bfs", 2), ("zb-h1", 1),
         ("zbv", 2), ("dualpipev", 2)]


def pipe_of(name: str, schedule: str, virtual: int) -> tuple:
    model = moe.build(name)
    pipe = fastpipe.Pipe(model, chunks=4, devices=["cpu"] * 2, schedule=schedule,
                         virtual_stages=virtual, split_points="auto",
                         example_inputs=moe.batch())
    return model, pipe


def assert_grads(model, expected) -> None:
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, **TOL, msg=lambda m: f"{name}: {m}")


QUICK = {("mixtral", s) for s, _ in EVERY} | {("qwen3_moe", "1f1b"), ("qwen3_moe", "zbv")}
CASES = [pytest.param(name, s, v, marks=() if (name, s) in QUICK else pytest.mark.slow)
         for name in ("mixtral", "qwen3_moe") for s, v in EVERY]


@pytest.mark.parametrize("name, schedule, virtual", CASES)
def test_the_load_balancing_loss_is_averaged_over_micro_batches(name, schedule, virtual):
    model, pipe = pipe_of(name, schedule, virtual)
    loss = pipe.train_step(moe.batch())  # the model's own loss: use_model_loss
    expected_loss, expected = moe.reference(moe.build(name), moe.pieces(moe.batch(), SIZES))
    torch.testing.assert_close(loss, expected_loss, **TOL)
    assert_grads(model, expected)
    assert any("gate" in n for n in expected)  # the routers learn from the balancing loss


def test_one_micro_batch_is_the_plain_model_on_the_whole_batch():
    model = moe.build("mixtral")
    pipe = fastpipe.Pipe(model, chunks=1, devices=["cpu"] * 2, split_points="auto",
                         example_inputs=moe.batch())
    plain = moe.build("mixtral")
    expected = plain(**moe.batch()).loss
    expected.backward()
    torch.testing.assert_close(pipe.train_step(moe.batch()), expected.detach(), **TOL)
    assert_grads(model, {n: p.grad for n, p in plain.named_parameters()
                         if p.grad is not None})


def test_without_router_logits_the_loss_is_the_causal_lms_alone():
    model = moe.build("mixtral")
    model.config.output_router_logits = False
    pipe = fastpipe.Pipe(model, chunks=4, devices=["cpu"] * 2, schedule="zb-h1",
                         split_points="auto", example_inputs=moe.batch())
    plain = moe.build("mixtral")
    plain.config.output_router_logits = False
    expected_loss, expected = moe.reference(plain, moe.pieces(moe.batch(), SIZES))
    torch.testing.assert_close(pipe.train_step(moe.batch()), expected_loss, **TOL)
    assert_grads(model, expected)


@pytest.mark.parametrize("schedule, virtual", [("1f1b", 1), ("zbv", 2)])
def test_deepseek_v3_trains_on_its_own_loss_as_a_causal_lm(schedule, virtual):
    model, pipe = pipe_of("deepseek_v3", schedule, virtual)
    plain = moe.build("deepseek_v3")
    expected = plain(**moe.batch()).loss  # no auxiliary loss: the token mean is exact
    expected.backward()
    torch.testing.assert_close(pipe.train_step(moe.batch()), expected.detach(), **TOL)
    assert_grads(model, {n: p.grad for n, p in plain.named_parameters()
                         if p.grad is not None})


def test_the_output_combines_loss_balancing_loss_and_router_logits():
    _, pipe = pipe_of("mixtral", "1f1b", 1)
    plain = moe.build("mixtral")
    with torch.no_grad():
        got = pipe(**moe.batch())
        whole = plain(**moe.batch())
        micro = [plain(**one) for one in moe.pieces(moe.batch(), SIZES)]
    expected_loss, _ = moe.reference(moe.build("mixtral"), moe.pieces(moe.batch(), SIZES))
    torch.testing.assert_close(got.loss, expected_loss, **TOL)
    torch.testing.assert_close(got.aux_loss, sum(m.aux_loss for m in micro) / len(micro), **TOL)
    assert len(got.router_logits) == len(whole.router_logits)
    for a, b in zip(got.router_logits, whole.router_logits):  # a row per token, in order
        torch.testing.assert_close(a, b, **TOL)
    torch.testing.assert_close(got.logits, whole.logits, **TOL)


def test_the_rule_on_numbers():
    """Three micro-batches: main losses 1, 2, 4 over 1, 3 and 0 tokens, load-balancing losses
    10, 20, 60: the batch's loss is (1*1 + 2*3) / 4 + 0.5 * 30."""
    rule = outputs.WithAuxiliary(outputs.TokenMean(shifted=False), "aux", 0.5)
    labels = [torch.tensor([[1, -100]]), torch.tensor([[1, 2, 3]]), torch.tensor([[-100]])]
    main, aux = [1.0, 2.0, 4.0], [10.0, 20.0, 60.0]
    column = [{"loss": torch.tensor(m + 0.5 * a), "aux": torch.tensor(a)}
              for m, a in zip(main, aux)]
    rules = outputs.OutputRules({}, {"loss": rule, "aux": outputs.MicrobatchMean()})
    combined = outputs.combine(column, [1, 1, 1], rules,
                               lambda: [{"labels": y} for y in labels])
    torch.testing.assert_close(combined["loss"], torch.tensor(7 / 4 + 0.5 * 30))
    torch.testing.assert_close(combined["aux"], torch.tensor(30.0))
    # training: each micro-batch backpropagates main * count + aux * scale, and the step
    # divides by the total count (4): scale = count / micro-batches
    bound = Bound("loss", rule, counted=True, batch_weight=4.0).for_step(3, lambda v: v)
    assert bound.scale == pytest.approx(4 / 3)
    sent = [bound(out, (torch.empty(1, 0), {"labels": y})) for out, y in zip(column, labels)]
    total = sum(float(s) for s, _ in sent) / sum(c for _, c in sent)
    assert total == pytest.approx(7 / 4 + 0.5 * 30)
    replicas = bound.for_step(3, lambda values: [2 * v for v in values])  # two alike
    assert replicas.scale == pytest.approx(8 / 6)


@pytest.mark.slow
def test_on_data_parallel_replicas_the_average_runs_over_every_micro_batch():
    results = assert_all_ok(launch("moe", 4, limit=400.0, script="integrations/moe_cases.py"))
    assert sorted(r["replica"] for r in results) == [0, 0, 1, 1]
