"""Outputs of any shape: per-sample leaves are gathered along the batch, a loss inside the output
combines exactly (by the rule of what its mean is over), and models that compute their own loss
from ``labels`` train exactly through the pipeline (``train_step(batch)``), against the plain
model: GPT-2, BART, T5 and BERT with a classification head, uneven micro-batches, -100 labels."""
import functools
import importlib.util

import pytest
import torch
from torch import nn

import fastpipe
from fastpipe import outputs
from fastpipe.outputs import OutputReductionError, OutputRules
from dist_launch import assert_all_ok, launch
from outputs_cases import MODELS, TOL, Tagger, batch, build, plain_results, tagger_batch

# ------------------------------------------------------------------------------ combining


def _rules(**given):
    return OutputRules(outputs.check_output_reduction(given), {})


def _split(value, sizes):
    return list(torch.split(value, sizes))


def test_per_sample_leaves_are_gathered_and_a_loss_combines_by_its_rule():
    """Micro-batch means of a (7, 5) batch: each rule gives the whole batch's value."""
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(7, 5, generator=generator)
    labels = torch.randint(0, 4, (7, 5), generator=generator)
    labels[2, 1:] = -100
    labels[6] = -100  # the last micro-batch counts no token
    sizes = [2, 2, 2, 1]
    parts = [{"loss": v.sum(), "mean": v.mean(1).mean(), "tokens": v[y != -100].mean(),
              "shifted": v[:, 1:][y[:, 1:] != -100].mean(), "first": v[:, 0].mean(),
              "logits": v, "aux": (v.sum(), v.sum() * 2)}
             for v, y in zip(_split(values, sizes), _split(labels, sizes))]
    named = [{"labels": y} for y in _split(labels, sizes)]
    rules = _rules(loss="sum", mean="mean", tokens="token_mean", shifted="shifted_token_mean",
                   aux="sum", first=lambda inputs: inputs["labels"].shape[0])  # samples
    whole = outputs.combine(parts, sizes, rules, lambda: named)
    torch.testing.assert_close(whole["logits"], values)
    torch.testing.assert_close(whole["loss"], values.sum())
    torch.testing.assert_close(whole["mean"], values.mean())
    torch.testing.assert_close(whole["tokens"], values[labels != -100].mean())
    torch.testing.assert_close(whole["shifted"], values[:, 1:][labels[:, 1:] != -100].mean())
    torch.testing.assert_close(whole["first"], values[:, 0].mean())
    torch.testing.assert_close(whole["aux"][1], values.sum() * 2)  # a rule for 'aux' reaches it


def test_a_leaf_without_a_rule_names_itself_and_the_option():
    parts = [{"loss": torch.tensor(1.0), "logits": torch.zeros(2, 3)},
             {"loss": torch.tensor(2.0), "logits": torch.zeros(1, 3)}]
    with pytest.raises(OutputReductionError, match=r"output leaf 'loss' is a 0-dim tensor"
                       r".*output_reduction=\{'loss': \.\.\.\}"):
        outputs.combine(parts, [2, 1])
    with pytest.raises(ValueError, match="'output' is a 0-dim tensor"):
        fastpipe.microbatch.gather([torch.tensor(1.0), torch.tensor(2.0)], [1, 1])
    # a leaf with dim 0 that is not the micro-batch's sample count is not gathered either
    with pytest.raises(OutputReductionError, match=r"'\[1\]'.*micro-batches of \[2, 1\] "
                       r"samples gave dim 0 of \[4, 4\]"):
        outputs.combine([(torch.zeros(2), torch.zeros(4)), (torch.zeros(1), torch.zeros(4))],
                        [2, 1])
    # unless a rule says how it combines
    stats = outputs.combine([(torch.zeros(2), torch.ones(4)), (torch.zeros(1), torch.ones(4))],
                            [2, 1], _rules(**{"[1]": "sum"}))
    torch.testing.assert_close(stats[1], torch.full((4,), 2.0))


def test_constant_leaves_pass_and_differing_ones_are_refused():
    same = outputs.combine([{"x": torch.zeros(2), "name": "a", "none": None},
                            {"x": torch.zeros(1), "name": "a", "none": None}], [2, 1])
    assert same["name"] == "a" and same["none"] is None
    with pytest.raises(OutputReductionError, match="'step' is a int that differs"):
        outputs.combine([{"x": torch.zeros(2), "step": 1}, {"x": torch.zeros(1), "step": 2}],
                        [2, 1])


def test_a_mean_over_nothing_is_nan_as_in_the_plain_model():
    parts = [torch.tensor(float("nan")), torch.tensor(float("nan"))]
    named = [{"labels": torch.full((1, 3), -100)}, {"labels": torch.full((1, 3), -100)}]
    assert torch.isnan(outputs.combine(parts, [1, 1], _rules(output="token_mean"), lambda: named))


def test_bad_output_reduction_is_refused_before_any_work():
    with pytest.raises(TypeError, match="output_reduction must be a dict"):
        outputs.check_output_reduction("mean")
    with pytest.raises(ValueError, match=r"output_reduction\['loss'\]='average'; use one of"):
        outputs.check_output_reduction({"loss": "average"})
    with pytest.raises(TypeError, match="output_reduction's keys are output leaf names"):
        outputs.check_output_reduction({0: "mean"})
    with pytest.raises(ValueError, match="output_reduction"):
        fastpipe.Pipe(nn.Sequential(nn.Linear(2, 2)), output_reduction={"loss": "avg"})


def test_a_count_that_is_not_a_number_is_refused():
    with pytest.raises(OutputReductionError, match="returned 'many'"):
        outputs.combine([torch.tensor(1.0), torch.tensor(2.0)], [1, 1],
                        _rules(output=lambda inputs: "many"), lambda: [{}, {}])


# ----------------------------------------------------------------------- a model of its own
@functools.lru_cache(maxsize=None)
def _tagger_pipe(reduction):
    inputs = tagger_batch()
    return fastpipe.Pipe(Tagger(), chunks=3, devices=["cpu"] * 2, split_points=["blocks.2"],
                         example_inputs=inputs,
                         output_reduction=None if reduction is None else {"loss": reduction})


def test_an_unknown_models_loss_needs_output_reduction_and_is_refused_before_any_work():
    pipe = _tagger_pipe(None)
    inputs = tagger_batch()
    with pytest.raises(OutputReductionError, match=r"'loss'.*output_reduction=\{'loss'"):
        pipe(**inputs)
    pipe.zero_grad(set_to_none=True)
    with pytest.raises(OutputReductionError, match=r"'loss'.*for Tagger.*output_reduction="):
        pipe.train_step(inputs)
    assert all(p.grad is None for p in pipe.parameters())  # nothing ran


@pytest.mark.parametrize("reduction", ["token_mean", "callable"])
def test_output_reduction_makes_a_models_own_loss_exact(reduction):
    spec = "token_mean" if reduction == "token_mean" else _count_labels
    pipe = _tagger_pipe(spec)
    inputs = tagger_batch()
    plain = Tagger()
    expected = plain(**inputs)
    expected["loss"].backward()
    torch.testing.assert_close(pipe(**inputs)["loss"], expected["loss"], **TOL)
    pipe.zero_grad(set_to_none=True)
    loss = pipe.train_step(inputs, None, fastpipe.use_model_loss)
    torch.testing.assert_close(loss, expected["loss"].detach(), **TOL)
    for (name, p), q in zip(pipe.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL, msg=name)


def test_positional_labels_are_named_by_the_models_signature():
    inputs = tagger_batch()
    positional = (inputs["ids"], inputs["labels"])
    pipe = fastpipe.Pipe(Tagger(), chunks=3, devices=["cpu"] * 2, split_points=["blocks.2"],
                         example_inputs=positional, output_reduction={"loss": "token_mean"})
    assert pipe.output_rules.named(positional)["labels"] is inputs["labels"]
    plain = Tagger()
    expected = plain(**inputs)["loss"]
    expected.backward()
    torch.testing.assert_close(pipe(*positional)["loss"], expected, **TOL)
    loss = pipe.train_step(positional)  # a tuple: the traced model's positional inputs
    torch.testing.assert_close(loss, expected.detach(), **TOL)
    for (name, p), q in zip(pipe.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL, msg=name)


def _count_labels(inputs):
    return (inputs["labels"] != -100).sum()


def test_model_loss_arguments_are_checked_before_any_work():
    pipe = _tagger_pipe("token_mean")
    inputs = tagger_batch()
    pipe.zero_grad(set_to_none=True)
    with pytest.raises(TypeError, match="targets but no loss_fn"):
        pipe.train_step(inputs, inputs["labels"])
    with pytest.raises(ValueError, match="targets must be None with loss_fn=fastpipe.use_mo"):
        pipe.train_step(inputs, inputs["labels"], fastpipe.use_model_loss)
    with pytest.raises(ValueError, match="loss_reduction='sum' with loss_fn"):
        pipe.train_step(inputs, loss_reduction="sum")
    unlabelled = {"ids": inputs["ids"], "labels": None}
    with pytest.raises(OutputReductionError, match="'labels' input, but the batch has none"):
        pipe.train_step(unlabelled)
    assert all(p.grad is None for p in pipe.parameters())
    assert fastpipe.use_model_loss({"loss": 3}) == 3 and "loss" in repr(fastpipe.use_model_loss)


def test_a_missing_loss_leaf_names_the_leaves_there_are():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    pipe = fastpipe.Pipe(model, chunks=2, devices=["cpu"] * 2, output_reduction={"loss": "mean"})
    with pytest.raises(fastpipe.LossFunctionError, match=r"no 'loss' leaf \(its leaves: "
                       r"\['output'\]\)"):
        pipe.train_step(torch.randn(4, 4))


# ------------------------------------------------------------------------------ Hugging Face
hf = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                        reason="needs transformers")
FAST = ["gpt2", "bart", "bert"]
KINDS = FAST + [pytest.param("t5", marks=pytest.mark.slow)]


@functools.lru_cache(maxsize=None)
def _hf(kind):
    """A pipe of the model (traced once per test run), the batch and the plain results."""
    _, split, schedule, checkpoint = MODELS[kind]
    inputs = batch(kind)
    pipe = fastpipe.Pipe(build(kind), chunks=4, devices=["cpu"] * 2, schedule=schedule,
                         checkpoint=checkpoint, split_points=[split], example_inputs=inputs)
    return pipe, inputs, plain_results(kind, inputs)


@hf
@pytest.mark.parametrize("kind", KINDS)
def test_forward_and_evaluate_return_the_plain_models_loss(kind):
    pipe, inputs, expected = _hf(kind)
    with torch.no_grad():
        out = pipe(**inputs)
    assert type(out) is type(expected["output"])
    torch.testing.assert_close(out.loss, expected["output"].loss.detach(), **TOL)
    torch.testing.assert_close(out.logits, expected["output"].logits.detach(), **TOL)
    evaluated = pipe.evaluate(**inputs)
    torch.testing.assert_close(evaluated.loss, expected["eval"].loss, **TOL)


@hf
@pytest.mark.parametrize("kind", KINDS)
def test_train_step_on_the_models_own_loss_is_exact(kind):
    pipe, inputs, expected = _hf(kind)
    pipe.zero_grad(set_to_none=True)
    loss = pipe.train_step(inputs)  # no targets, no loss_fn: the model's loss from its labels
    torch.testing.assert_close(loss, expected["output"].loss.detach(), **TOL)
    grads = {n: p.grad for n, p in pipe.named_parameters()}
    assert grads.keys() == expected["grads"].keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected["grads"][name], **TOL, msg=name)


@hf
def test_the_combined_loss_backpropagates_through_every_stage():
    pipe, inputs, expected = _hf("gpt2")
    pipe.zero_grad(set_to_none=True)
    pipe(**inputs).loss.backward()  # autograd through the weighted micro-batch losses
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.grad, expected["grads"][name], **TOL, msg=name)


def test_a_causal_lms_loss_is_summed_when_num_items_in_batch_is_given():
    """transformers' causal-LM loss: a mean over the labels after each row's first, or the sum
    over them divided by ``num_items_in_batch`` when it is given (then the losses add up)."""
    from fastpipe.hf_losses import CausalLoss
    labels = torch.tensor([[1, 2, -100], [-100, 3, 4]])
    assert CausalLoss().weight({"labels": labels}, 2) == (3.0, True)  # 2, 3, 4
    assert CausalLoss().weight({"labels": labels, "shift_labels": labels}, 2) == (4.0, True)
    assert CausalLoss().weight({"labels": labels, "num_items_in_batch": 9}, 2) == (1.0, False)
    summed = outputs.combine([torch.tensor(1.0), torch.tensor(2.0)], [1, 1],
                             OutputRules({}, {"output": CausalLoss()}),
                             lambda: [{"num_items_in_batch": 9}] * 2)
    assert summed.item() == 3.0


@hf
def test_num_items_in_batch_makes_the_micro_batch_losses_add_up():
    """Given ``num_items_in_batch``, a causal LM divides its summed loss by it: the pipe adds the
    micro-batch losses (a sum rule), on a trace that takes the count as an input (it reaches
    the model through its ``**kwargs``, which the trace spells out as parameters)."""
    inputs = batch("gpt2")
    inputs["num_items_in_batch"] = (inputs["labels"][:, 1:] != -100).sum()
    pipe = fastpipe.Pipe(build("gpt2"), chunks=3, devices=["cpu"] * 2,
                         split_points=[MODELS["gpt2"][1]], example_inputs=inputs)
    plain = build("gpt2")
    expected = plain(**inputs).loss
    expected.backward()
    without = build("gpt2")(**{k: v for k, v in inputs.items() if k != "num_items_in_batch"})
    torch.testing.assert_close(expected, without.loss)  # the same loss, another normaliser
    with torch.no_grad():
        torch.testing.assert_close(pipe(**inputs).loss, expected.detach(), **TOL)
    loss = pipe.train_step(inputs)
    torch.testing.assert_close(loss, expected.detach(), **TOL)
    for (name, p), q in zip(pipe.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL, msg=name)


@hf
def test_a_replaced_loss_function_is_not_guessed():
    model = build("gpt2")
    model.loss_function = lambda logits, labels, **kwargs: logits.sum() * 0  # not the default
    inputs = batch("gpt2")
    pipe = fastpipe.Pipe(model, chunks=2, devices=["cpu"] * 2,
                         split_points=[MODELS["gpt2"][1]], example_inputs=inputs)
    with pytest.raises(OutputReductionError, match="for GPT2LMHeadModel"):
        pipe.train_step(inputs)


@hf
def test_distributed_pipes_return_and_train_on_the_models_own_loss():
    """On 2 gloo ranks: GPT-2, BART and BERT give the plain model's loss from ``pipe(...)``,
    ``evaluate`` and ``train_step(batch)``, and its gradients; a loss nothing says how to
    combine is refused (``train_step`` on every rank before any work, ``pipe(...)`` on the last
    stage's rank) and the pipe goes on; ``output_reduction`` makes it exact on ``'zbv'``."""
    results = assert_all_ok(launch("both", 2, limit=240, args={"kinds": FAST},
                                   script="outputs_cases.py"))
    last = results[1]["found"]
    assert set(last) == set(FAST) and all("evaluate" in last[k] for k in FAST)
    assert all("train_step" in r["found"][k] and "grads" in r["found"][k]
               for r in results for k in FAST)
    assert results[0]["refused"] == ["train_step"]
    assert results[1]["refused"] == ["train_step", "forward"]


@hf
@pytest.mark.slow
def test_a_distributed_t5_trains_on_its_own_loss():
    assert_all_ok(launch("model_loss", 2, limit=240, args={"kinds": ["t5"]},
                         script="outputs_cases.py"))
